"""Several rewards at once: ``--reward hpsv2:1.0,pickscore:0.5`` → a ``RewardSet`` scoring every image with each.

The spec is a comma-separated list of ``name`` or ``name:weight`` (weight 1 when omitted, > 0). As MixGRPO does,
the weights are normalised to sum to 1, so ``hpsv2`` and ``hpsv2:2`` are the same run and a single reward is
today's reward exactly (weight 1.0). How the scores become advantages (``sum-rewards`` or ``sum-advantages``) is
``grpo/reward_aggregation.py``'s business; the set only scores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fluxgrpo.errors import UsageError

if TYPE_CHECKING:
    import torch

    from fluxgrpo.rewards.base import RewardFn

# --advantage-aggregation choices (grpo/reward_aggregation.py implements them; named here, away from torch, so the
# config can validate without importing it).
AGGREGATIONS = ("sum-rewards", "sum-advantages")


@dataclass(frozen=True)
class RewardTerm:
    name: str
    weight: float  # as written; RewardSet.weights normalises


def _parse(spec: str) -> tuple[list[RewardTerm], list[str]]:
    from fluxgrpo.rewards import REWARDS

    terms: list[RewardTerm] = []
    problems: list[str] = []
    entries = [entry.strip() for entry in spec.split(",")]
    if not spec.strip() or any(not entry for entry in entries):
        return [], [
            f"--reward {spec!r}: write one or more name[:weight] separated by commas, e.g. hpsv2:1,pickscore:0.5"
        ]
    for entry in entries:
        name, _, weight_text = entry.partition(":")
        name = name.strip()
        if name not in REWARDS:
            problems.append(f"--reward: unknown reward {name!r}; use one of {', '.join(REWARDS)}")
            continue
        try:
            weight = float(weight_text) if weight_text.strip() else 1.0
        except ValueError:
            problems.append(f"--reward: weight {weight_text!r} of {name} is not a number")
            continue
        if not (math.isfinite(weight) and weight > 0):
            problems.append(f"--reward: weight of {name} must be a positive number (got {weight_text})")
            continue
        if any(term.name == name for term in terms):
            problems.append(f"--reward: {name} is listed twice; give it once with its weight")
            continue
        terms.append(RewardTerm(name, weight))
    try:
        total = math.fsum(term.weight for term in terms)
    except OverflowError:
        total = math.inf
    if not math.isfinite(total):
        problems.append(
            f"--reward {spec!r}: the weights add up past the largest float; scale them down (only their ratios matter)"
        )
    return terms, problems


def reward_spec_problems(spec: str) -> list[str]:
    """Every problem with a ``--reward`` spec (empty when it is valid), for config validation."""
    return _parse(spec)[1]


def parse_reward_spec(spec: str) -> list[RewardTerm]:
    """``"hpsv2:1.0,pickscore:0.5"`` → [RewardTerm("hpsv2", 1.0), RewardTerm("pickscore", 0.5)]; UsageError if bad."""
    terms, problems = _parse(spec)
    if problems:
        raise UsageError("; ".join(problems))
    return terms


def reward_spec_names(spec: str) -> list[str]:
    """The reward names a valid spec lists, in order."""
    return [term.name for term in parse_reward_spec(spec)]


class RewardSet:
    """Each reward of a spec, loaded once; ``set(images, prompts)`` → scores [B, K] float32, one column per reward.

    ``names`` and ``weights`` (normalised to sum 1, float32, on the scores' device) are in the spec's order.
    """

    def __init__(self, terms: list[RewardTerm], rewards: list[RewardFn], device: Any = "cpu") -> None:
        import torch

        self.names = [term.name for term in terms]
        self.rewards = rewards
        total = math.fsum(term.weight for term in terms)
        self.weights = torch.tensor([term.weight / total for term in terms], dtype=torch.float32, device=device)

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        import torch

        return torch.stack([reward(images, prompts).float() for reward in self.rewards], dim=1)


def load_reward_set(spec: str, hps_dir: str | Path, device: Any = "cpu", reward_dtype: str = "fp32") -> RewardSet:
    """Parse ``spec`` and load each reward it names (``rewards.load_reward``) onto ``device``."""
    from fluxgrpo.rewards import load_reward

    terms = parse_reward_spec(spec)
    return RewardSet(terms, [load_reward(term.name, hps_dir, device, reward_dtype) for term in terms], device)
