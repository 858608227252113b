"""Rewards: one module per reward model behind one protocol (``base.RewardFn``), each declaring one record
(``registry.RewardRecord``) that the rest of fluxgrpo reads.

``load_reward(name, hps_dir, device, reward_dtype)`` builds the reward called ``name``; ``reward_names()`` lists
them in the order the CLI shows them. Every reward reads its weights from inside ``hps_dir`` (its record says where
and how to check them), so `train --hps-dir` and `score --hps-dir` find all of them in one place. Heavy libraries are
imported by the loader that needs them, not here.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from fluxgrpo.rewards.base import REWARD_DTYPES, RewardFn, reward_torch_dtype
from fluxgrpo.rewards.registry import (
    RewardLoader,
    RewardRecord,
    register_reward,
    reward_names,
    reward_record,
    reward_weights_status,
)

if TYPE_CHECKING:
    import torch


def load_reward(
    name: str, hps_dir: str | Path, device: torch.device | str = "cpu", reward_dtype: str = "fp32"
) -> RewardFn:
    """The reward called ``name`` (``reward_names()``), loaded from ``hps_dir`` onto ``device``.

    ``reward_dtype`` (``fp32`` | ``bf16``, ``--reward-dtype``) is the dtype its encoders run in; scores are float32.
    """
    return reward_record(name).load(Path(hps_dir), device, reward_torch_dtype(reward_dtype))


__all__ = [
    "REWARD_DTYPES",
    "RewardFn",
    "RewardLoader",
    "RewardRecord",
    "load_reward",
    "register_reward",
    "reward_names",
    "reward_record",
    "reward_weights_status",
]
