"""Rewards: HPSv2.1 and PickScore (batched on device from tensors) and a brightness smoke-test reward.

A reward is any callable ``reward(images, prompts) -> scores`` with images [B, 3, H, W] float in [0, 1] on the
compute device and one prompt per image; scores are [B] float32 (``RewardFn``). ``load_reward(name, ...)`` builds
one by name.

HPSv2.1 is open_clip's ViT-H-14 with the HPS fine-tuned weights. The score is the cosine similarity of the
L2-normalised image and text features (no logit scale), as hpsv2's ``img_score`` computes it. Preprocessing is
hpsv2's validation transform: resize the longest side to 224 (bicubic, antialiased), pad to a square with zeros
(centred), normalise with the OpenAI CLIP mean and std. Unlike DanceGRPO, which scored in fp16 autocast (a reward
resolution of about 2e-4), the encoders run in the runtime's compute dtype and everything after them in float32.

PickScore is transformers' CLIPModel with the PickScore_v1 weights and laion's CLIP-ViT-H-14 processor, from
``<hps_dir>/pickscore`` (``layout.pickscore_dir``). The score is the official scorer's:
``logit_scale.exp() * cosine(text_embeds, image_embeds)`` (about 100 × the cosine for the real weights), each image
against its own prompt. DanceGRPO's version left out ``logit_scale`` and scored every image against the batch's
first caption; neither is reproduced. Preprocessing is the CLIP image processor's, done on the tensors: shortest side
to 224 (bicubic, antialiased), centre crop 224, the processor's mean and std; text is CLIPTokenizer padded to 77.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import pickle
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from fluxgrpo.errors import FluxgrpoError, UsageError
from fluxgrpo.weights.layout import (
    HPS_CHECKPOINT,
    OPEN_CLIP_WEIGHTS,
    PICKSCORE_MODEL_DIR,
    PICKSCORE_PROCESSOR_DIR,
    check_hps_dir,
    check_pickscore_dir,
    pickscore_dir,
    reward_architecture,
)

if TYPE_CHECKING:
    import torch
    from PIL import Image

REAL_REWARD_ARCH = "ViT-H-14"
# OpenAI CLIP's pixel statistics, which HPSv2 (and open_clip's ViT-H-14 LAION weights) normalise with.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class RewardFn(Protocol):
    """Score generated images against their prompts."""

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """images [B, 3, H, W] float in [0, 1] on the compute device, len(prompts) == B → scores [B] float32."""
        ...


def _check_batch(images: torch.Tensor, prompts: list[str]) -> None:
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must be [B, 3, H, W], got {tuple(images.shape)}")
    if len(prompts) != images.shape[0]:
        raise ValueError(f"{images.shape[0]} images but {len(prompts)} prompts: one prompt per image")


class BrightnessReward:
    """SMOKE TEST ONLY, not a measure of quality: the mean pixel value of each image, in [0, 1].

    The tiny random HPS model barely varies with the image, so a tiny training run cannot show learning against
    it; brightness is a reward a tiny policy can visibly learn within a minute (the ``tiny-cpu`` config uses it).
    """

    name = "brightness"

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        _check_batch(images, prompts)
        return images.float().mean(dim=(1, 2, 3))


# --- open_clip architecture -------------------------------------------------------------------------------------

_config_dir: tempfile.TemporaryDirectory | None = None


def register_open_clip_config(config: dict[str, Any]) -> str:
    """Register an open_clip model config and return the name ``open_clip.create_model`` knows it by.

    Accepts open_clip's model-config format (embed_dim, vision_cfg, text_cfg), or the ``{"model_cfg": ...}``
    wrapper of open_clip's own ``open_clip_config.json``. The name is derived from the content, so registering the
    same architecture twice is harmless and two different tiny architectures never collide.
    """
    global _config_dir
    import open_clip

    model_cfg = config.get("model_cfg", config)
    if not all(key in model_cfg for key in ("embed_dim", "vision_cfg", "text_cfg")):
        raise FluxgrpoError(
            "reward architecture file lacks embed_dim/vision_cfg/text_cfg: re-run `fluxgrpo fetch-weights` "
            "(or delete the file to use the real ViT-H-14)"
        )
    digest = hashlib.sha256(json.dumps(model_cfg, sort_keys=True).encode()).hexdigest()[:16]
    name = f"fluxgrpo-reward-{digest}"
    if name not in open_clip.list_models():
        # open_clip registers configs only from files, and re-reads every registered path whenever another is
        # added, so the file must outlive the call: it lives in a folder removed when the process exits.
        if _config_dir is None:
            _config_dir = tempfile.TemporaryDirectory(prefix="fluxgrpo-open-clip-")
        path = Path(_config_dir.name) / f"{name}.json"
        path.write_text(json.dumps(model_cfg))
        open_clip.add_model_config(path)
    return name


def reward_model_name(hps_dir: str | Path) -> str:
    """The open_clip architecture for the weights in ``hps_dir``: the tiny one's registered name, or ViT-H-14."""
    config = reward_architecture(hps_dir)
    return REAL_REWARD_ARCH if config is None else register_open_clip_config(config)


def read_state_dict(path: Path) -> dict[str, Any]:
    """A state dict from an HPS checkpoint (``{"state_dict": ...}``) or a plain one (LAION's open_clip .bin)."""
    import torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        # The HPS file comes from the HPSv2 authors' training run and was never checked byte by byte here; if it
        # pickles more than tensors and plain containers, the safe loader refuses it. It was fetched by name from
        # the official repository, so loading it fully is the same trust hpsv2 itself extends.
        try:
            obj = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as exc:
            raise FluxgrpoError(f"cannot read {path} ({exc}): re-run `fluxgrpo fetch-weights`") from exc
    except Exception as exc:
        raise FluxgrpoError(
            f"cannot read {path} ({type(exc).__name__}: {exc}): re-run `fluxgrpo fetch-weights`"
        ) from exc
    state = obj.get("state_dict", obj) if isinstance(obj, dict) else None
    if not isinstance(state, dict) or not state:
        raise FluxgrpoError(f"{path} holds no state dict: re-run `fluxgrpo fetch-weights`")
    if all(key.startswith("module.") for key in state):  # saved from a DDP-wrapped model
        state = {key[len("module.") :]: value for key, value in state.items()}
    return state


class _DropRandomInitWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "initialized randomly" not in record.getMessage()


@contextlib.contextmanager
def _quiet_random_init_warning() -> Iterator[None]:
    """open_clip warns that a model built with ``pretrained=None`` is random; ours gets its weights right after."""
    root = logging.getLogger()
    log_filter = _DropRandomInitWarning()
    root.addFilter(log_filter)
    try:
        yield
    finally:
        root.removeFilter(log_filter)


def load_hps_model(hps_dir: str | Path) -> tuple[Any, str]:
    """The HPS open_clip model on cpu in float32, eval, gradients off; and its architecture name.

    The HPS checkpoint holds the full CLIP (every key ViT-H-14 has), so it alone defines the model.
    ``open_clip_pytorch_model.bin`` (LAION's ViT-H-14) is what hpsv2 loads first as initial weights before
    overwriting them all with the checkpoint; it is read here only when the checkpoint lacks some keys, to fill
    them. Both files must be present either way (``fetch-weights`` fetches both, as DanceGRPO's recipe does).
    """
    import open_clip

    hps_dir = Path(hps_dir)
    problems = [(part.problems, part.fix) for part in check_hps_dir(hps_dir) if not part.complete]
    if problems:
        details = "; ".join(p for found, _ in problems for p in found)
        raise FluxgrpoError(f"reward weights in {hps_dir} are not usable ({details}): {problems[0][1]}")

    arch = reward_model_name(hps_dir)
    with _quiet_random_init_warning():
        model = open_clip.create_model(arch, pretrained=None, precision="fp32", device="cpu")
    expected = set(model.state_dict())
    hps_state = read_state_dict(hps_dir / HPS_CHECKPOINT)
    unexpected = sorted(set(hps_state) - expected)
    if unexpected:
        raise FluxgrpoError(
            f"{hps_dir / HPS_CHECKPOINT} does not match the {arch} architecture (unexpected keys such as "
            f"{unexpected[0]}): re-run `fluxgrpo fetch-weights --hps-dir {hps_dir}`"
        )
    try:
        if expected - set(hps_state):
            model.load_state_dict(read_state_dict(hps_dir / OPEN_CLIP_WEIGHTS), strict=True)
            model.load_state_dict(hps_state, strict=False)
        else:
            model.load_state_dict(hps_state, strict=True)
    except RuntimeError as exc:
        first_line = str(exc).splitlines()[0]
        raise FluxgrpoError(
            f"reward weights in {hps_dir} do not fit the {arch} architecture ({first_line}): "
            f"re-run `fluxgrpo fetch-weights --hps-dir {hps_dir}`"
        ) from exc
    return model.eval().requires_grad_(False), arch


# --- preprocessing shared by the tensor and PIL paths ------------------------------------------------------------


def resize_longest_and_pad(images: torch.Tensor, size: int) -> torch.Tensor:
    """[B, 3, H, W] → [B, 3, size, size]: longest side to ``size`` (bicubic, antialiased), centred zero padding.

    The new short side is ``round(short * size / long)``; the padding splits as floor on the left/top. hpsv2 skips
    the padding when the longest side is already ``size``; padding regardless keeps a non-square input square.
    """
    import torch.nn.functional as F

    height, width = images.shape[-2:]
    scale = size / max(height, width)
    if scale != 1.0:
        new_size = (round(height * scale), round(width * scale))
        images = F.interpolate(images, size=new_size, mode="bicubic", align_corners=False, antialias=True)
    pad_h, pad_w = size - images.shape[-2], size - images.shape[-1]
    if pad_h or pad_w:
        images = F.pad(images, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2), value=0.0)
    return images


def normalize_clip(pixels: torch.Tensor) -> torch.Tensor:
    """Per-channel (x - mean) / std with the OpenAI CLIP statistics."""
    import torch

    mean = torch.tensor(CLIP_MEAN, dtype=pixels.dtype, device=pixels.device).view(1, 3, 1, 1)
    std = torch.tensor(CLIP_STD, dtype=pixels.dtype, device=pixels.device).view(1, 3, 1, 1)
    return (pixels - mean) / std


def pil_to_tensor(image: Image.Image) -> torch.Tensor:
    """PIL image → [3, H, W] float32 in [0, 1] (RGB conversion, then torchvision's ToTensor)."""
    from torchvision.transforms.functional import to_tensor

    return to_tensor(image.convert("RGB"))


class TextFeatureCache:
    """Bounded LRU of per-prompt text features: GRPO scores every prompt G times per iteration."""

    def __init__(self, encode: Callable[[list[str]], Any], max_size: int) -> None:
        self._encode = encode  # distinct prompts → [n, E] float32 features, one row per prompt
        self._rows: OrderedDict[str, Any] = OrderedDict()
        self._max_size = max_size

    def __len__(self) -> int:
        return len(self._rows)

    def __call__(self, prompts: list[str]) -> Any:
        """[B, E] features for ``prompts`` (encoding only those not cached)."""
        import torch

        missing = list(dict.fromkeys(p for p in prompts if p not in self._rows))
        if missing:
            for prompt, row in zip(missing, self._encode(missing), strict=True):
                self._rows[prompt] = row
        rows = []
        for prompt in prompts:
            self._rows.move_to_end(prompt)
            rows.append(self._rows[prompt])
        while len(self._rows) > self._max_size:
            self._rows.popitem(last=False)
        return torch.stack(rows)


class HpsV2Reward:
    """HPSv2.1 scores, batched on ``device``; see the module docstring for the exact computation.

    Text features are cached per prompt (bounded), since GRPO scores every prompt G times per iteration.
    """

    name = "hpsv2"

    def __init__(
        self,
        hps_dir: str | Path,
        device: Any = "cpu",
        batch_size: int = 32,
        text_cache_size: int = 4096,
        compute_dtype: torch.dtype | None = None,
    ):
        import open_clip
        import torch

        model, arch = load_hps_model(hps_dir)
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.architecture = arch
        self.tokenizer = open_clip.get_tokenizer(arch)
        image_size = self.model.visual.image_size
        self.image_size = int(image_size[0] if isinstance(image_size, tuple | list) else image_size)
        self.batch_size = batch_size
        # None: the runtime's compute dtype (bf16 encoders on accelerators, scores accumulated in fp32);
        # torch.float32: everything fp32, as `fluxgrpo score` does to match the reference scorer.
        self.compute_dtype = compute_dtype
        self._text_features = TextFeatureCache(self._encode_text, text_cache_size)

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        import torch

        _check_batch(images, prompts)
        pixels = images.to(self.device, torch.float32)
        pixels = normalize_clip(resize_longest_and_pad(pixels, self.image_size))
        return self._score_pixels(pixels, prompts)

    def score_pil(self, images: list[Image.Image], prompts: list[str]) -> torch.Tensor:
        """hpsv2's own input path: PIL images of any size → RGB → ToTensor → the same resize/pad/normalise."""
        import torch

        if len(images) != len(prompts):
            raise ValueError(f"{len(images)} images but {len(prompts)} prompts: one prompt per image")
        pixels = torch.cat(
            [
                resize_longest_and_pad(pil_to_tensor(image).unsqueeze(0).to(self.device), self.image_size)
                for image in images
            ]
        )
        return self._score_pixels(normalize_clip(pixels), prompts)

    def _score_pixels(self, pixels: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """Normalised pixels [B, 3, S, S] → cosine(image features, text features) [B] float32."""
        import torch
        import torch.nn.functional as F

        from fluxgrpo.runtime.device import autocast

        text_features = self._text_features(prompts)
        scores = []
        with torch.no_grad():
            for start in range(0, pixels.shape[0], self.batch_size):
                with autocast(self.device.type, dtype=self.compute_dtype):
                    features = self.model.encode_image(pixels[start : start + self.batch_size])
                features = F.normalize(features.float(), dim=-1)
                scores.append((features * text_features[start : start + self.batch_size]).sum(dim=-1))
        return torch.cat(scores)

    def _encode_text(self, prompts: list[str]) -> torch.Tensor:
        """[n, E] float32 L2-normalised text features."""
        import torch
        import torch.nn.functional as F

        from fluxgrpo.runtime.device import autocast

        with torch.no_grad(), autocast(self.device.type, dtype=self.compute_dtype):
            features = self.model.encode_text(self.tokenizer(prompts).to(self.device))
        return F.normalize(features.float(), dim=-1)


# --- PickScore ------------------------------------------------------------------------------------------------

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
    transformers computes it), antialiased.

    Like PIL and torchvision's 8-bit resize behind the CLIP image processor, it runs as two passes, width then
    height, each clamped to [0, 1]: a single 2-D interpolation keeps the first pass's overshoot at sharp edges and
    differs from the processor by up to 20/255 when upscaling. What remains is the processor's 8-bit rounding.
    """
    import torch.nn.functional as F

    height, width = images.shape[-2:]
    if height <= width:
        new_height, new_width = size, int(size * width / height)
    else:
        new_height, new_width = int(size * height / width), size
    if new_width != width:
        images = F.interpolate(images, size=(height, new_width), mode=mode, align_corners=False, antialias=True)
        images = images.clamp(0.0, 1.0)
    if new_height != height:
        images = F.interpolate(images, size=(new_height, new_width), mode=mode, align_corners=False, antialias=True)
        images = images.clamp(0.0, 1.0)
    return images


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
        device: Any = "cpu",
        batch_size: int = 32,
        text_cache_size: int = 4096,
        compute_dtype: Any = None,
    ):
        import torch
        from transformers import CLIPImageProcessor, CLIPModel, CLIPTokenizer

        folder = Path(folder)
        status = check_pickscore_dir(folder)
        if not status.complete:
            raise FluxgrpoError(
                f"PickScore weights in {folder} are not usable ({'; '.join(status.problems)}): {status.fix}"
            )
        try:
            model = CLIPModel.from_pretrained(folder / PICKSCORE_MODEL_DIR, dtype=torch.float32)
            self.tokenizer = CLIPTokenizer.from_pretrained(folder / PICKSCORE_PROCESSOR_DIR)
            processor = CLIPImageProcessor.from_pretrained(folder / PICKSCORE_PROCESSOR_DIR)
        except (OSError, ValueError) as exc:
            raise FluxgrpoError(
                f"cannot load PickScore from {folder} ({type(exc).__name__}: {exc}): re-run "
                f"`fluxgrpo fetch-weights --only pickscore --hps-dir {folder.parent}`"
            ) from exc
        self.device = torch.device(device)
        self.model = model.eval().requires_grad_(False).to(self.device)
        self.image_spec = ClipImageSpec.from_processor(processor)
        self.batch_size = batch_size
        self.compute_dtype = compute_dtype  # None: the runtime's compute dtype; torch.float32 for scoring runs
        self._text_embeds = TextFeatureCache(self._encode_text, text_cache_size)

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """images [B, 3, H, W] in [0, 1], len(prompts) == B → scores [B] float32."""
        _check_batch(images, prompts)
        return self.score_pixels(clip_preprocess(images.to(self.device), self.image_spec), prompts)

    def score_pixels(self, pixel_values: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """Preprocessed pixel_values [B, 3, S, S] (the image processor's output) → scores [B] float32."""
        import torch
        import torch.nn.functional as F

        from fluxgrpo.runtime.device import autocast

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

        from fluxgrpo.runtime.device import autocast

        tokens = self.tokenizer(
            prompts, padding="max_length", max_length=PICKSCORE_MAX_LENGTH, truncation=True, return_tensors="pt"
        ).to(self.device)
        with torch.no_grad(), autocast(self.device.type, dtype=self.compute_dtype):
            output = self.model.get_text_features(
                input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]
            )
        return F.normalize(_projected(output).float(), dim=-1)


_REWARDS: dict[str, Callable[[Path, Any], RewardFn]] = {
    "hpsv2": HpsV2Reward,
    "pickscore": lambda hps_dir, device: PickScoreReward(pickscore_dir(hps_dir), device),
    "brightness": lambda hps_dir, device: BrightnessReward(),
}


def reward_names() -> list[str]:
    return list(_REWARDS)


def load_reward(name: str, hps_dir: str | Path, device: Any = "cpu") -> RewardFn:
    """The reward called ``name`` (``reward_names()``), loaded from ``hps_dir`` onto ``device`` if it has weights.

    hpsv2 reads ``hps_dir`` itself, pickscore its ``pickscore/`` folder (``layout.pickscore_dir(hps_dir)``).
    """
    factory = _REWARDS.get(name)
    if factory is None:
        raise UsageError(f"unknown reward {name!r}: use --reward with one of {', '.join(_REWARDS)}")
    return factory(Path(hps_dir), device)
