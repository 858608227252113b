"""PickScore v1: transformers' CLIPModel with the PickScore_v1 weights and laion's CLIP-ViT-H-14 processor.

Loaded from ``<hps_dir>/pickscore`` (``layout.pickscore_dir``). The score is the official scorer's:
``logit_scale.exp() * cosine(text_embeds, image_embeds)`` (about 100 × the cosine for the real weights), each image
against its own prompt. DanceGRPO's version left out ``logit_scale`` and scored every image against the batch's
first caption; neither is reproduced. Preprocessing is the CLIP image processor's, done on the tensors in training:
shortest side to 224 (bicubic, antialiased), centre crop 224, the processor's mean and std; from PIL (``score``)
it is the processor itself. Text is CLIPTokenizer padded to 77.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fluxgrpo.errors import FluxgrpoError, not_usable
from fluxgrpo.rewards.base import TextFeatureCache, check_batch, check_pil_batch, load_pretrained, resize_like_pil
from fluxgrpo.rewards.registry import RewardRecord, WeightsPart
from fluxgrpo.runtime.device import autocast
from fluxgrpo.tiny_tokenizers import build_tiny_clip_tokenizer
from fluxgrpo.weights.hub_parts import REWARD_HUB_PARTS
from fluxgrpo.weights.layout import (
    PICKSCORE_BPE_FILES,
    PICKSCORE_MODEL_DIR,
    PICKSCORE_PROCESSOR_DIR,
    check_pickscore_dir,
    pickscore_dir,
)
from fluxgrpo.weights.tiny_writing import fresh_subfolders, write_subfolder_manifests

if TYPE_CHECKING:
    import torch
    from PIL import Image

_RESAMPLE_MODES = {2: "bilinear", 3: "bicubic"}  # PIL's resampling codes, as CLIP processor configs store them
PICKSCORE_MAX_LENGTH = 77


def _size_field(size: Any, key: str) -> int | None:
    """A field of a processor size (a dict in transformers 4, a SizeDict in 5), or None."""
    value = size.get(key) if hasattr(size, "get") else getattr(size, key, None)
    return None if value is None else int(value)


@dataclass(frozen=True)
class ClipImageSpec:
    """What a CLIP image processor does to an image, for ``clip_preprocess`` to do the same on tensors."""

    shortest_edge: int | None  # resize so the shorter side is this; None: no resize
    crop: tuple[int, int] | None  # (height, width) of the centre crop; None: no crop
    mean: tuple[float, float, float] | None  # per channel, of pixels in [0, 1]; None: no normalisation
    std: tuple[float, float, float] | None
    mode: str = "bicubic"  # interpolation of the resize

    @classmethod
    def from_processor(cls, processor: Any) -> ClipImageSpec:
        """Read a CLIPImageProcessor's settings; FluxgrpoError for settings this tensor path does not reproduce."""
        if getattr(processor, "do_rescale", True) is False or getattr(processor, "do_convert_rgb", True) is False:
            raise FluxgrpoError(
                "the PickScore image processor must rescale to [0, 1] and convert to RGB: re-run "
                "`fluxgrpo fetch-weights --only pickscore`"
            )
        shortest = _size_field(processor.size, "shortest_edge") if processor.do_resize else None
        if processor.do_resize and shortest is None:
            raise FluxgrpoError(
                f"the PickScore image processor resizes to {processor.size}, not by the shortest edge: "
                "re-run `fluxgrpo fetch-weights --only pickscore`"
            )
        crop = None
        if processor.do_center_crop:
            crop = (_size_field(processor.crop_size, "height"), _size_field(processor.crop_size, "width"))
        mode = _RESAMPLE_MODES.get(int(processor.resample))
        if mode is None:
            raise FluxgrpoError(
                f"the PickScore image processor resamples with PIL mode {processor.resample}; only "
                "bicubic (3) and bilinear (2) are supported"
            )
        normalize = bool(processor.do_normalize)
        return cls(
            shortest_edge=shortest,
            crop=crop,  # type: ignore[arg-type]
            mean=tuple(float(v) for v in processor.image_mean) if normalize else None,  # type: ignore[arg-type]
            std=tuple(float(v) for v in processor.image_std) if normalize else None,  # type: ignore[arg-type]
            mode=mode,
        )


def resize_shortest_edge(images: torch.Tensor, size: int, mode: str = "bicubic") -> torch.Tensor:
    """[B, 3, H, W] in [0, 1] → shorter side ``size``, longer side ``int(size * long / short)`` (truncated, as
    transformers computes it), antialiased in PIL's two clamped passes (``base.resize_like_pil``)."""
    height, width = images.shape[-2:]
    if height <= width:
        new_height, new_width = size, int(size * width / height)
    else:
        new_height, new_width = int(size * height / width), size
    return resize_like_pil(images, new_height, new_width, mode)


def center_crop(images: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The centre ``height`` x ``width`` window; the offsets round down, as the processor's do."""
    image_height, image_width = images.shape[-2:]
    if height > image_height or width > image_width:
        raise ValueError(f"cannot crop {height}x{width} from {image_height}x{image_width} images")
    top, left = (image_height - height) // 2, (image_width - width) // 2
    return images[..., top : top + height, left : left + width]


def clip_preprocess(images: torch.Tensor, spec: ClipImageSpec) -> torch.Tensor:
    """Images [B, 3, H, W] in [0, 1] → the pixel_values the CLIP image processor makes of them (float32)."""
    import torch

    pixels = images.to(torch.float32)
    if spec.shortest_edge is not None:
        pixels = resize_shortest_edge(pixels, spec.shortest_edge, spec.mode)
    if spec.crop is not None:
        pixels = center_crop(pixels, *spec.crop)
    if spec.mean is not None and spec.std is not None:
        mean = torch.tensor(spec.mean, dtype=pixels.dtype, device=pixels.device).view(1, 3, 1, 1)
        std = torch.tensor(spec.std, dtype=pixels.dtype, device=pixels.device).view(1, 3, 1, 1)
        pixels = (pixels - mean) / std
    return pixels


def _projected(output: Any) -> torch.Tensor:
    """CLIPModel.get_*_features returns the projected embeddings (transformers 4) or an output holding them (5)."""
    return output.pooler_output if hasattr(output, "pooler_output") else output


class PickScoreReward:
    """PickScore v1, batched on ``device``; see the module docstring for the exact computation.

    ``folder`` is the PickScore folder (``pickscore_dir(hps_dir)``: ``model/`` + ``processor/``). Scores are
    ``logit_scale.exp() * cosine`` in float32, one per image against its own prompt. Text features are cached per
    prompt (bounded), since GRPO scores every prompt G times per iteration.
    """

    name = "pickscore"

    def __init__(
        self,
        folder: str | Path,
        device: torch.device | str = "cpu",
        batch_size: int = 32,
        text_cache_size: int = 4096,
        compute_dtype: torch.dtype | None = None,
    ):
        import torch
        from transformers import CLIPImageProcessor, CLIPModel, CLIPTokenizer

        folder = Path(folder)
        status = check_pickscore_dir(folder)
        if not status.complete:
            raise not_usable(f"PickScore weights in {folder}", status.problems, status.fix)
        fix = f"re-run `fluxgrpo fetch-weights --only pickscore --hps-dir {folder.parent}`"
        model = load_pretrained(
            lambda: CLIPModel.from_pretrained(folder / PICKSCORE_MODEL_DIR, dtype=torch.float32),
            folder / PICKSCORE_MODEL_DIR,
            "PickScore",
            fix,
        )
        self.tokenizer = load_pretrained(
            lambda: CLIPTokenizer.from_pretrained(folder / PICKSCORE_PROCESSOR_DIR), folder, "PickScore", fix
        )
        self.processor = load_pretrained(
            lambda: CLIPImageProcessor.from_pretrained(folder / PICKSCORE_PROCESSOR_DIR), folder, "PickScore", fix
        )
        self.device = torch.device(device)
        self.model = model.eval().requires_grad_(False).to(self.device)
        self.image_spec = ClipImageSpec.from_processor(self.processor)
        self.batch_size = batch_size
        self.compute_dtype = torch.float32 if compute_dtype is None else compute_dtype
        self._text_embeds = TextFeatureCache(self._encode_text, text_cache_size)

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """images [B, 3, H, W] in [0, 1], len(prompts) == B → scores [B] float32."""
        check_batch(images, prompts)
        return self.score_pixels(clip_preprocess(images.to(self.device), self.image_spec), prompts)

    def score_pil(self, images: list[Image.Image], prompts: list[str]) -> torch.Tensor:
        """The official scorer's input path: the CLIP image processor on RGB PIL images."""
        check_pil_batch(images, prompts)
        pixel_values = self.processor(images=[image.convert("RGB") for image in images], return_tensors="pt")
        return self.score_pixels(pixel_values["pixel_values"], prompts)

    def score_pixels(self, pixel_values: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """Preprocessed pixel_values [B, 3, S, S] (the image processor's output) → scores [B] float32."""
        import torch
        import torch.nn.functional as F

        if len(prompts) != pixel_values.shape[0]:
            raise ValueError(f"{pixel_values.shape[0]} images but {len(prompts)} prompts: one prompt per image")
        text_embeds = self._text_embeds(prompts)
        pixel_values = pixel_values.to(self.device, torch.float32)
        scores = []
        with torch.no_grad():
            scale = self.model.logit_scale.detach().float().exp()
            for start in range(0, pixel_values.shape[0], self.batch_size):
                with autocast(self.device.type, dtype=self.compute_dtype):
                    output = self.model.get_image_features(pixel_values=pixel_values[start : start + self.batch_size])
                image_embeds = F.normalize(_projected(output).float(), dim=-1)
                cosine = (image_embeds * text_embeds[start : start + self.batch_size]).sum(dim=-1)
                scores.append(scale * cosine)
        return torch.cat(scores)

    def _encode_text(self, prompts: list[str]) -> torch.Tensor:
        """[n, E] float32 L2-normalised text embeddings."""
        import torch
        import torch.nn.functional as F

        tokens = self.tokenizer(
            prompts, padding="max_length", max_length=PICKSCORE_MAX_LENGTH, truncation=True, return_tensors="pt"
        ).to(self.device)
        with torch.no_grad(), autocast(self.device.type, dtype=self.compute_dtype):
            output = self.model.get_text_features(
                input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]
            )
        return F.normalize(_projected(output).float(), dim=-1)


def _load(hps_dir: Path, device: torch.device | str, dtype: torch.dtype) -> PickScoreReward:
    return PickScoreReward(pickscore_dir(hps_dir), device, compute_dtype=dtype)


def _write_tiny(hps_dir: Path, seed: int) -> dict[str, int]:
    return {"pickscore": write_tiny_pickscore(pickscore_dir(hps_dir), seed)}


RECORD = RewardRecord(
    "pickscore",
    _load,
    parts=(
        WeightsPart(
            "pickscore",
            lambda hps_dir: check_pickscore_dir(pickscore_dir(hps_dir)),
            hub=REWARD_HUB_PARTS["pickscore"],
        ),
    ),
    write_tiny=_write_tiny,
    parameters=986_109_440,  # CLIP ViT-H-14
)


def write_tiny_pickscore(folder: Path, seed: int = 0) -> int:
    """Write a tiny PickScore (``model/`` + ``processor/``) into ``folder`` with a manifest in each; returns bytes.

    ``folder`` is normally ``pickscore_dir(hps_dir)``; afterwards ``check_pickscore_dir(folder)`` reports complete.
    """
    from transformers import CLIPImageProcessor

    from fluxgrpo.rewards.tiny import PICKSCORE_PROCESSOR_CONFIG, build_tiny_pickscore_model

    folder = Path(folder)
    model_dir, processor_dir = folder / PICKSCORE_MODEL_DIR, folder / PICKSCORE_PROCESSOR_DIR
    fresh_subfolders(model_dir, processor_dir)
    build_tiny_pickscore_model(seed).save_pretrained(model_dir)
    tokenizer = build_tiny_clip_tokenizer()
    tokenizer.save_pretrained(processor_dir)
    # The hub repo also has the BPE pair (vocab.json + merges.txt), which transformers 5 no longer writes; the
    # tiny vocabulary has no merges, so the pair is the vocabulary and merges.txt's version line.
    (processor_dir / PICKSCORE_BPE_FILES[0]).write_text(json.dumps(tokenizer.get_vocab(), ensure_ascii=False) + "\n")
    (processor_dir / PICKSCORE_BPE_FILES[1]).write_text("#version: 0.2\n")
    CLIPImageProcessor(**PICKSCORE_PROCESSOR_CONFIG).save_pretrained(processor_dir)
    return write_subfolder_manifests("pickscore", model_dir, processor_dir)
