"""What every reward shares: the protocol, input checks, the text-feature cache, the PIL path, safe weight reading.

A reward is any callable ``reward(images, prompts) -> scores`` with images [B, 3, H, W] float in [0, 1] on the
compute device and one prompt per image; scores are [B] float32 (``RewardFn``). A reward that has its authors' own
input path from PIL images (the path ``fluxgrpo score`` takes) also has ``score_pil(images, prompts)``.

Encoders run in ``compute_dtype`` (float32 by default, ``--reward-dtype bf16`` for bf16 autocast); everything after
the encoders (normalisation, cosine, scale) runs in float32 either way.
"""

from __future__ import annotations

import pickle
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from fluxgrpo.errors import FluxgrpoError, UsageError

if TYPE_CHECKING:
    import torch
    from PIL import Image

# OpenAI CLIP's pixel statistics: HPSv2, PickScore's processor and open_clip's ViT-H-14 LAION weights all use them.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# --reward-dtype choices → torch dtype names.
REWARD_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


class RewardFn(Protocol):
    """Score generated images against their prompts."""

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """images [B, 3, H, W] float in [0, 1] on the compute device, len(prompts) == B → scores [B] float32."""
        ...


def reward_torch_dtype(name: str) -> torch.dtype:
    """``fp32`` / ``bf16`` (``--reward-dtype``) → the torch dtype the reward encoders run in."""
    import torch

    if name not in REWARD_DTYPES:
        raise UsageError(f"unknown reward dtype {name!r}: use --reward-dtype with one of {', '.join(REWARD_DTYPES)}")
    return getattr(torch, REWARD_DTYPES[name])


def check_batch(images: torch.Tensor, prompts: list[str]) -> None:
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must be [B, 3, H, W], got {tuple(images.shape)}")
    if len(prompts) != images.shape[0]:
        raise ValueError(f"{images.shape[0]} images but {len(prompts)} prompts: one prompt per image")


def check_pil_batch(images: list[Image.Image], prompts: list[str]) -> None:
    if len(images) != len(prompts):
        raise ValueError(f"{len(images)} images but {len(prompts)} prompts: one prompt per image")


def pil_to_tensor(image: Image.Image) -> torch.Tensor:
    """PIL image → [3, H, W] float32 in [0, 1] (RGB conversion, then torchvision's ToTensor)."""
    from torchvision.transforms.functional import to_tensor

    return to_tensor(image.convert("RGB"))


def normalize(pixels: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """Per-channel (x - mean) / std of [B, 3, H, W] pixels."""
    import torch

    mean_t = torch.tensor(mean, dtype=pixels.dtype, device=pixels.device).view(1, 3, 1, 1)
    std_t = torch.tensor(std, dtype=pixels.dtype, device=pixels.device).view(1, 3, 1, 1)
    return (pixels - mean_t) / std_t


def normalize_clip(pixels: torch.Tensor) -> torch.Tensor:
    """Per-channel (x - mean) / std with the OpenAI CLIP statistics."""
    return normalize(pixels, CLIP_MEAN, CLIP_STD)


def resize_like_pil(images: torch.Tensor, height: int, width: int, mode: str = "bicubic") -> torch.Tensor:
    """[B, 3, H, W] in [0, 1] → [B, 3, height, width], antialiased, as PIL's 8-bit resize behind the reward
    processors: two passes, width then height, each clamped to [0, 1]. A single 2-D interpolation keeps the first
    pass's overshoot at sharp edges and differs from PIL by up to 20/255 when upscaling; what remains is PIL's
    rounding to 1/255."""
    import torch.nn.functional as F

    in_height, in_width = images.shape[-2:]
    if width != in_width:
        images = F.interpolate(images, size=(in_height, width), mode=mode, align_corners=False, antialias=True)
        images = images.clamp(0.0, 1.0)
    if height != in_height:
        images = F.interpolate(images, size=(height, width), mode=mode, align_corners=False, antialias=True)
        images = images.clamp(0.0, 1.0)
    return images


class TextFeatureCache:
    """Bounded LRU of per-prompt text features: GRPO scores every prompt G times per iteration."""

    def __init__(self, encode: Callable[[list[str]], torch.Tensor], max_size: int) -> None:
        self._encode = encode  # distinct prompts → [n, E] float32 features, one row per prompt
        self._rows: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._max_size = max_size

    def __len__(self) -> int:
        return len(self._rows)

    def __call__(self, prompts: list[str]) -> torch.Tensor:
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


def _refusal_reason(exc: Exception) -> str:
    """The line of torch's weights-only refusal that names what was refused (e.g. "unsupported GLOBAL posix.system")."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    named = [line for line in lines if "GLOBAL" in line or "WeightsUnpickler error" in line]
    return (named or lines or ["refused by the safe loader"])[0].removeprefix("WeightsUnpickler error: ").rstrip(".")


def read_state_dict(path: Path, fix: str) -> dict[str, Any]:
    """A state dict from a torch pickle (``{"state_dict": ...}`` or a plain one), read with the safe loader only.

    ``torch.load(weights_only=True)`` admits tensors and plain containers and nothing that can run code. A file it
    refuses is reported in one line naming the file (``fix`` says what to do); it is never loaded any other way.
    """
    import torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise FluxgrpoError(
            f"{path} holds more than tensors and plain containers ({_refusal_reason(exc)}); fluxgrpo reads weights "
            f"only with torch's safe loader, which never runs code from a file: {fix}"
        ) from exc
    except Exception as exc:
        first_line = (str(exc).splitlines() or [""])[0]
        raise FluxgrpoError(f"cannot read {path} ({type(exc).__name__}: {first_line}): {fix}") from exc
    state = obj.get("state_dict", obj) if isinstance(obj, dict) else None
    if not isinstance(state, dict) or not state:
        raise FluxgrpoError(f"{path} holds no state dict: {fix}")
    if all(key.startswith("module.") for key in state):  # saved from a DDP-wrapped model
        state = {key[len("module.") :]: value for key, value in state.items()}
    return state


def load_pretrained(load: Callable[[], Any], folder: Path, what: str, fix: str) -> Any:
    """Run a transformers ``from_pretrained`` call; any failure (a refused pickle included) is one line naming
    ``folder`` (``safe_load.load_pretrained``). transformers reads ``.bin`` files with
    ``torch.load(weights_only=True)``, so nothing in them runs."""
    from fluxgrpo.safe_load import load_pretrained as load_safely

    return load_safely(load, what, folder, fix)
