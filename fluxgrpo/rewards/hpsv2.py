"""HPSv2.1: open_clip's ViT-H-14 with the HPS fine-tuned weights, batched on device from tensors.

The score is the cosine similarity of the L2-normalised image and text features (no logit scale), as hpsv2's
``img_score`` computes it. Preprocessing is hpsv2's validation transform: resize the longest side to 224 (bicubic,
antialiased), pad to a square with zeros (centred), normalise with the OpenAI CLIP mean and std. Unlike DanceGRPO,
which scored in fp16 autocast (a reward resolution of about 2e-4), the encoders run in float32 by default
(``--reward-dtype``) and everything after them in float32.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fluxgrpo.errors import FluxgrpoError, not_usable
from fluxgrpo.rewards.base import check_batch, check_pil_batch, normalize_clip, pil_to_tensor, read_state_dict
from fluxgrpo.rewards.open_clip_model import ARCHITECTURE_KEYS, OpenClipCosine, create_fitting_open_clip
from fluxgrpo.rewards.registry import RewardRecord, WeightsPart
from fluxgrpo.weights.hub_parts import REWARD_HUB_PARTS
from fluxgrpo.weights.layout import (
    CLIP_MANIFEST,
    HPS_CHECKPOINT,
    HPS_MANIFEST,
    OPEN_CLIP_WEIGHTS,
    REWARD_ARCH_FILE,
    check_clip_part,
    check_hps_dir,
)
from fluxgrpo.weights.manifest import Manifest, describe_files, write_manifest
from fluxgrpo.weights.tiny_writing import TINY_SOURCE, refuse_unless_tiny_or_empty

if TYPE_CHECKING:
    import torch
    from PIL import Image


def load_hps_model(hps_dir: str | Path) -> tuple[Any, str]:
    """The HPS open_clip model on cpu in float32, eval, gradients off; and its architecture name.

    The HPS checkpoint holds the full CLIP (every key ViT-H-14 has), so it alone defines the model.
    ``open_clip_pytorch_model.bin`` (LAION's ViT-H-14) is what hpsv2 loads first as initial weights before
    overwriting them all with the checkpoint; it is read here only when the checkpoint lacks some keys, to fill
    them. Both files must be present either way (``fetch-weights`` fetches both, as DanceGRPO's recipe does).
    """
    hps_dir = Path(hps_dir)
    problems = [(part.problems, part.fix) for part in check_hps_dir(hps_dir) if not part.complete]
    if problems:
        details = "; ".join(p for found, _ in problems for p in found)
        raise not_usable(f"reward weights in {hps_dir}", [details], problems[0][1])

    refetch = f"re-run `fluxgrpo fetch-weights --only hps --hps-dir {hps_dir}`"
    hps_state = read_state_dict(hps_dir / HPS_CHECKPOINT, refetch)
    sized_by = hps_state
    if any(key not in hps_state for key in ARCHITECTURE_KEYS):  # those keys come from the open_clip weights
        clip_state = read_state_dict(hps_dir / OPEN_CLIP_WEIGHTS, refetch)
        sized_by = {**clip_state, **hps_state}
    model, arch = create_fitting_open_clip(hps_dir, sized_by, hps_dir / HPS_CHECKPOINT, refetch)
    expected = set(model.state_dict())
    unexpected = sorted(set(hps_state) - expected)
    if unexpected:
        raise FluxgrpoError(
            f"{hps_dir / HPS_CHECKPOINT} does not match the {arch} architecture (unexpected keys such as "
            f"{unexpected[0]}): {refetch}"
        )
    try:
        if expected - set(hps_state):
            clip_fix = f"re-run `fluxgrpo fetch-weights --only clip --hps-dir {hps_dir}`"
            model.load_state_dict(read_state_dict(hps_dir / OPEN_CLIP_WEIGHTS, clip_fix), strict=True)
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


class HpsV2Reward(OpenClipCosine):
    """HPSv2.1 scores, batched on ``device``; see the module docstring for the exact computation."""

    name = "hpsv2"

    def __init__(
        self,
        hps_dir: str | Path,
        device: torch.device | str = "cpu",
        batch_size: int = 32,
        text_cache_size: int = 4096,
        compute_dtype: torch.dtype | None = None,
    ):
        model, arch = load_hps_model(hps_dir)
        super().__init__(model, arch, device, batch_size, text_cache_size, compute_dtype)

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        import torch

        check_batch(images, prompts)
        pixels = images.to(self.device, torch.float32)
        return self.cosine(normalize_clip(resize_longest_and_pad(pixels, self.image_size)), prompts)

    def score_pil(self, images: list[Image.Image], prompts: list[str]) -> torch.Tensor:
        """hpsv2's own input path: PIL images of any size → RGB → ToTensor → the same resize/pad/normalise."""
        check_pil_batch(images, prompts)
        return self.cosine(self._pil_pixels(images), prompts)

    def embed_pil(self, images: list[Image.Image]) -> torch.Tensor:
        """[B, E] L2-normalised image features of PIL images, through ``score_pil``'s input path."""
        return self.image_features(self._pil_pixels(images))

    def _pil_pixels(self, images: list[Image.Image]) -> torch.Tensor:
        import torch

        pixels = torch.cat(
            [
                resize_longest_and_pad(pil_to_tensor(image).unsqueeze(0).to(self.device), self.image_size)
                for image in images
            ]
        )
        return normalize_clip(pixels)


def _load(hps_dir: Path, device: torch.device | str, dtype: torch.dtype) -> HpsV2Reward:
    return HpsV2Reward(hps_dir, device, compute_dtype=dtype)


def _write_tiny(hps_dir: Path, seed: int) -> dict[str, int]:
    hps_bytes, clip_bytes = write_tiny_reward(hps_dir, seed)  # the pair: a checkpoint and its initial weights
    return {"hps": hps_bytes, "clip": clip_bytes}


RECORD = RewardRecord(
    "hpsv2",
    _load,
    parts=(
        WeightsPart(
            "hps",
            lambda hps_dir: check_hps_dir(hps_dir)[0],
            hub=REWARD_HUB_PARTS["hps"],
        ),
        WeightsPart(
            "clip",
            check_clip_part,
            hub=REWARD_HUB_PARTS["clip"],
        ),
    ),
    write_tiny=_write_tiny,
    # open_clip ViT-H-14 (counted on a meta-device build, as for every reward's count).
    parameters=986_109_440,
)


# The files the tiny writer may replace in an --hps-dir (the other rewards live in subfolders).
_TINY_FILES = (HPS_CHECKPOINT, OPEN_CLIP_WEIGHTS, REWARD_ARCH_FILE, HPS_MANIFEST, CLIP_MANIFEST)


def write_tiny_reward(hps_dir: Path, seed: int = 0) -> tuple[int, int]:
    """Write the tiny HPS checkpoint, the open_clip initial weights, the architecture file and both manifests.

    Returns (hps bytes incl. the architecture file, clip bytes).
    """
    import torch

    from fluxgrpo.rewards.tiny import TINY_REWARD_CONFIG, build_tiny_reward_model

    hps_dir = Path(hps_dir)
    refuse_unless_tiny_or_empty(hps_dir, (HPS_MANIFEST, CLIP_MANIFEST), _TINY_FILES, "--hps-dir")
    hps_dir.mkdir(parents=True, exist_ok=True)
    for name in (HPS_MANIFEST, CLIP_MANIFEST):  # manifests go first so a crash below leaves an unfinished part
        (hps_dir / name).unlink(missing_ok=True)

    hps_model = build_tiny_reward_model(seed)
    initial_model = build_tiny_reward_model(seed + 1)
    torch.save({"state_dict": hps_model.state_dict()}, hps_dir / HPS_CHECKPOINT)
    torch.save(initial_model.state_dict(), hps_dir / OPEN_CLIP_WEIGHTS)
    (hps_dir / REWARD_ARCH_FILE).write_text(json.dumps(TINY_REWARD_CONFIG, indent=2) + "\n")

    hps_files = describe_files(hps_dir, [HPS_CHECKPOINT, REWARD_ARCH_FILE])
    clip_files = describe_files(hps_dir, [OPEN_CLIP_WEIGHTS])
    write_manifest(hps_dir, Manifest(part="hps", source=TINY_SOURCE, files=hps_files), HPS_MANIFEST)
    write_manifest(hps_dir, Manifest(part="clip", source=TINY_SOURCE, files=clip_files), CLIP_MANIFEST)
    return sum(f.size for f in hps_files), sum(f.size for f in clip_files)
