"""CLIPScore: OpenCLIP ViT-H-14 (LAION-2B, the ``clip`` part HPSv2 already needs) scoring image–prompt agreement.

The score is ``max(100 · cos(image, text), 0)`` per image against its own prompt: Hessel et al.'s CLIP-S with
torchmetrics' weight 100 in place of the paper's 2.5 (a constant factor: group advantages do not see it, and 100
puts it on PickScore's scale). Flow-GRPO's variant (``100 · cos / 30``, OpenAI ViT-L/14, no clamp) and MixGRPO's
(raw cosine of DFN5B ViT-H-14) are not followed. Features are L2-normalised, no logit scale.

Preprocessing is open_clip's own for these weights (``open_clip.image_transform(224, is_train=False)``): shortest
side to 224 (bicubic, antialiased), centre crop 224, OpenAI CLIP mean and std. ``score_pil`` runs exactly that
transform on PIL images; the tensor path in training does the same on [0, 1] tensors on the device (two-pass resize
like PIL's, torchvision's rounded crop offsets), equal up to 8-bit rounding.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from fluxgrpo.errors import FluxgrpoError, not_usable
from fluxgrpo.rewards.base import check_batch, check_pil_batch, normalize_clip, read_state_dict
from fluxgrpo.rewards.open_clip_model import OpenClipCosine, create_fitting_open_clip
from fluxgrpo.rewards.pickscore import resize_shortest_edge
from fluxgrpo.rewards.registry import RewardRecord
from fluxgrpo.weights.layout import OPEN_CLIP_WEIGHTS, check_clip_part

if TYPE_CHECKING:
    import torch
    from PIL import Image

CLIPSCORE_WEIGHT = 100.0


def load_clip_model(hps_dir: str | Path) -> tuple[Any, str]:
    """LAION's ViT-H-14 (or the tiny architecture beside tiny weights) from ``open_clip_pytorch_model.bin``."""
    hps_dir = Path(hps_dir)
    status = check_clip_part(hps_dir)
    if not status.complete:
        raise not_usable(f"CLIP weights in {hps_dir}", status.problems, status.fix)
    fix = f"re-run `fluxgrpo fetch-weights --only clip --hps-dir {hps_dir}`"
    state = read_state_dict(hps_dir / OPEN_CLIP_WEIGHTS, fix)
    model, arch = create_fitting_open_clip(hps_dir, state, hps_dir / OPEN_CLIP_WEIGHTS, fix)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        first_line = str(exc).splitlines()[0]
        raise FluxgrpoError(
            f"{hps_dir / OPEN_CLIP_WEIGHTS} does not fit the {arch} architecture ({first_line}): {fix}"
        ) from exc
    return model, arch


def center_crop_rounded(images: torch.Tensor, size: int) -> torch.Tensor:
    """The centre ``size`` x ``size`` window with torchvision's offsets: ``int(round((side - size) / 2))``."""
    height, width = images.shape[-2:]
    if size > height or size > width:
        raise ValueError(f"cannot crop {size}x{size} from {height}x{width} images")
    top, left = round((height - size) / 2.0), round((width - size) / 2.0)  # half to even, as torchvision
    return images[..., top : top + size, left : left + size]


class ClipScoreReward(OpenClipCosine):
    """CLIPScore, batched on ``device``; see the module docstring for the exact computation."""

    name = "clipscore"

    def __init__(
        self,
        hps_dir: str | Path,
        device: torch.device | str = "cpu",
        batch_size: int = 32,
        text_cache_size: int = 4096,
        compute_dtype: torch.dtype | None = None,
    ):
        model, arch = load_clip_model(hps_dir)
        super().__init__(model, arch, device, batch_size, text_cache_size, compute_dtype)

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] in [0, 1] → the normalised [B, 3, 224, 224] pixels open_clip's transform makes (float32)."""
        import torch

        pixels = resize_shortest_edge(images.to(self.device, torch.float32), self.image_size, "bicubic")
        return normalize_clip(center_crop_rounded(pixels, self.image_size))

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        check_batch(images, prompts)
        return self.score_pixels(self.preprocess(images), prompts)

    def score_pil(self, images: list[Image.Image], prompts: list[str]) -> torch.Tensor:
        """open_clip's own input path: its evaluation transform on RGB PIL images."""
        check_pil_batch(images, prompts)
        return self.score_pixels(self._pil_pixels(images), prompts)

    def embed_pil(self, images: list[Image.Image]) -> torch.Tensor:
        """[B, E] L2-normalised CLIP image features of PIL images, through ``score_pil``'s input path."""
        return self.image_features(self._pil_pixels(images))

    def _pil_pixels(self, images: list[Image.Image]) -> torch.Tensor:
        import open_clip
        import torch

        transform = open_clip.image_transform(self.image_size, is_train=False)
        return torch.stack([transform(image.convert("RGB")) for image in images]).to(self.device)

    def score_pixels(self, pixels: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """Normalised pixels → max(100 · cos, 0) [B] float32."""
        return (CLIPSCORE_WEIGHT * self.cosine(pixels, prompts)).clamp(min=0.0)


def _load(hps_dir: Path, device: torch.device | str, dtype: torch.dtype) -> ClipScoreReward:
    return ClipScoreReward(hps_dir, device, compute_dtype=dtype)


# LAION's open_clip ViT-H-14 weights, the part HPSv2 owns (HPSv2 was fine-tuned from them).
RECORD = RewardRecord("clipscore", _load, reads=("clip",), parameters=986_109_440)
