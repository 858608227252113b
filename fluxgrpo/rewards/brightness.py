"""The brightness smoke-test reward (no weights)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from fluxgrpo.rewards.base import check_batch
from fluxgrpo.rewards.registry import RewardRecord

if TYPE_CHECKING:
    import torch


class BrightnessReward:
    """SMOKE TEST ONLY, not a measure of quality: the mean pixel value of each image, in [0, 1].

    The tiny random HPS model barely varies with the image, so a tiny training run cannot show learning against
    it; brightness is a reward a tiny policy can visibly learn within a minute (the ``tiny-cpu`` config uses it).
    """

    name = "brightness"

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        check_batch(images, prompts)
        return images.float().mean(dim=(1, 2, 3))


def _load(hps_dir: Path, device: torch.device | str, dtype: torch.dtype) -> BrightnessReward:
    return BrightnessReward()


RECORD = RewardRecord("brightness", _load)  # no weights
