"""Rewards: one module per reward model behind one protocol (``base.RewardFn``), and the name → loader registry.

``load_reward(name, hps_dir, device, reward_dtype)`` builds the reward called ``name``; ``reward_names()`` lists
them in the order the CLI shows them. Every reward reads its weights from inside ``hps_dir`` (``weights/layout.py``
says where), so `train --hps-dir` and `score --hps-dir` find all of them in one place. Heavy libraries are imported
by the loader that needs them, not here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fluxgrpo.errors import UsageError
from fluxgrpo.rewards.base import REWARD_DTYPES, RewardFn, reward_torch_dtype

if TYPE_CHECKING:
    import torch

    from fluxgrpo.weights.layout import PartStatus

# A loader builds one reward: (hps_dir, device, encoder dtype) → RewardFn.
RewardLoader = Callable[[Path, Any, "torch.dtype"], RewardFn]


def _hpsv2(hps_dir: Path, device: Any, dtype: torch.dtype) -> RewardFn:
    from fluxgrpo.rewards.hpsv2 import HpsV2Reward

    return HpsV2Reward(hps_dir, device, compute_dtype=dtype)


def _pickscore(hps_dir: Path, device: Any, dtype: torch.dtype) -> RewardFn:
    from fluxgrpo.rewards.pickscore import PickScoreReward
    from fluxgrpo.weights.layout import pickscore_dir

    return PickScoreReward(pickscore_dir(hps_dir), device, compute_dtype=dtype)


def _clipscore(hps_dir: Path, device: Any, dtype: torch.dtype) -> RewardFn:
    from fluxgrpo.rewards.clipscore import ClipScoreReward

    return ClipScoreReward(hps_dir, device, compute_dtype=dtype)


def _imagereward(hps_dir: Path, device: Any, dtype: torch.dtype) -> RewardFn:
    from fluxgrpo.rewards.imagereward import ImageRewardReward
    from fluxgrpo.weights.layout import imagereward_dir

    return ImageRewardReward(imagereward_dir(hps_dir), device, compute_dtype=dtype)


def _hpsv3(hps_dir: Path, device: Any, dtype: torch.dtype) -> RewardFn:
    from fluxgrpo.rewards.hpsv3 import HpsV3Reward
    from fluxgrpo.weights.layout import hpsv3_dir

    return HpsV3Reward(hpsv3_dir(hps_dir), device, compute_dtype=dtype)


def _brightness(hps_dir: Path, device: Any, dtype: torch.dtype) -> RewardFn:
    from fluxgrpo.rewards.brightness import BrightnessReward

    return BrightnessReward()


def _exposure(hps_dir: Path, device: Any, dtype: torch.dtype) -> RewardFn:
    from fluxgrpo.rewards.exposure import ExposureReward

    return ExposureReward()


# name → loader; the report helper's --eval-rewards and `score --reward` use the same mapping.
REWARDS: dict[str, RewardLoader] = {
    "hpsv2": _hpsv2,
    "pickscore": _pickscore,
    "clipscore": _clipscore,
    "imagereward": _imagereward,
    "hpsv3": _hpsv3,
    "brightness": _brightness,
    "exposure": _exposure,
}


def reward_weights_status(name: str, hps_dir: str | Path) -> list[PartStatus]:
    """The weight parts reward ``name`` reads from ``hps_dir``, each checked (``weights/layout.py``); [] for none."""
    from fluxgrpo.weights import layout

    checks: dict[str, Callable[[Path], list[PartStatus]]] = {
        "hpsv2": layout.check_hps_dir,
        "pickscore": lambda folder: [layout.check_pickscore_dir(layout.pickscore_dir(folder))],
        "clipscore": lambda folder: [layout.check_clip_part(folder)],
        "imagereward": lambda folder: [layout.check_imagereward_dir(layout.imagereward_dir(folder))],
        "hpsv3": lambda folder: [layout.check_hpsv3_dir(layout.hpsv3_dir(folder))],
    }
    return checks.get(name, lambda folder: [])(Path(hps_dir))


def reward_names() -> list[str]:
    return list(REWARDS)


def load_reward(name: str, hps_dir: str | Path, device: Any = "cpu", reward_dtype: str = "fp32") -> RewardFn:
    """The reward called ``name`` (``reward_names()``), loaded from ``hps_dir`` onto ``device``.

    ``reward_dtype`` (``fp32`` | ``bf16``, ``--reward-dtype``) is the dtype its encoders run in; scores are float32.
    """
    loader = REWARDS.get(name)
    if loader is None:
        raise UsageError(f"unknown reward {name!r}: use --reward with one of {', '.join(REWARDS)}")
    return loader(Path(hps_dir), device, reward_torch_dtype(reward_dtype))


__all__ = [
    "REWARDS",
    "REWARD_DTYPES",
    "RewardFn",
    "RewardLoader",
    "load_reward",
    "reward_names",
    "reward_weights_status",
]
