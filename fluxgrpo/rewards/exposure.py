"""The exposure smoke-test reward (no weights): a held-out cross-reward that brightness training certainly hurts."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from fluxgrpo.rewards.base import check_batch
from fluxgrpo.rewards.registry import RewardRecord

if TYPE_CHECKING:
    import torch


class ExposureReward:
    """SMOKE TEST ONLY, not a measure of quality: 1 − 2·mean(max(x − ½, 0)) over each image's pixels, in [0, 1].

    It penalises pixels brighter than mid-grey, in proportion: every gain of brightness made by brightening such
    pixels lowers it. Trained with ``--reward brightness`` and evaluated with ``--eval-rewards exposure``, a tiny
    run therefore shows a training reward that rises while a held-out reward falls — reward hacking in miniature,
    what ``--guard`` is for (the guard tests and the README's walk-through use it).
    """

    name = "exposure"

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        check_batch(images, prompts)
        excess = (images.float() - 0.5).clamp(min=0.0)
        return 1.0 - 2.0 * excess.mean(dim=(1, 2, 3))


def _load(hps_dir: Path, device: torch.device | str, dtype: torch.dtype) -> ExposureReward:
    return ExposureReward()


RECORD = RewardRecord("exposure", _load)  # no weights
