"""Several rewards → one advantage per trajectory (MixGRPO's ``reward_aggr`` / ``advantage_aggr``).

scores [B, K] (one column per reward, groups of G contiguous rows), weights w [K] summing to 1:

- ``sum-rewards``: r = Σ_k w_k·r_k, then the group advantage of r (``group_advantages``). With several rewards, each
  reward's within-group spread, so its scale convention, sets how much it counts.
- ``sum-advantages``: A = clamp(Σ_k w_k·A_k, ±adv_clip_max) with A_k the group advantage of reward k alone: every
  reward is standardised within its group first, so its scale no longer matters. (MixGRPO clips once, after the
  sum; each A_k is also clipped here, which changes nothing unless one |A_k| exceeds adv_clip_max.)

A trajectory with any non-finite score gets advantage 0, as with one reward. With one reward (weight 1.0) both
are exactly today's ``group_advantages(rewards)``: x·1.0 and a sum over one column are exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fluxgrpo.grpo.advantages import GroupAdvantages, group_advantages

# --advantage-aggregation's choices (the config lists the same names, torch-free, in config/choices.py).
AGGREGATIONS = ("sum-rewards", "sum-advantages")


@dataclass(frozen=True)
class AggregatedRewards:
    rewards: torch.Tensor  # [B] fp32, Σ_k w_k·r_k: the reward logged as reward_mean/std/min/max
    advantages: GroupAdvantages

    def as_tuple(self) -> tuple[torch.Tensor, GroupAdvantages]:
        return self.rewards, self.advantages


def weighted_reward(scores: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[B, K] scores, [K] weights → [B] Σ_k w_k·r_k (NaN/inf propagate, so the trajectory is left out)."""
    return (scores.float() * weights.to(scores.device, torch.float32)).sum(dim=1)


def aggregate_rewards(
    scores: torch.Tensor, weights: torch.Tensor, aggregation: str, group_size: int, adv_clip_max: float
) -> AggregatedRewards:
    """The combined reward and the advantages of ``scores`` [B, K] under ``aggregation`` (``AGGREGATIONS``)."""
    if scores.ndim != 2 or scores.shape[1] != weights.numel():
        raise ValueError(f"scores {tuple(scores.shape)} do not have one column per weight ({weights.numel()})")
    rewards = weighted_reward(scores, weights)
    if aggregation == "sum-rewards":
        return AggregatedRewards(rewards, group_advantages(rewards, group_size, adv_clip_max))
    if aggregation != "sum-advantages":
        raise ValueError(f"unknown advantage aggregation {aggregation!r}: use one of {', '.join(AGGREGATIONS)}")
    per_reward = [group_advantages(scores[:, k], group_size, adv_clip_max) for k in range(scores.shape[1])]
    summed = torch.stack([adv.advantages for adv in per_reward], dim=1)
    advantages = weighted_reward(summed, weights).clamp(-adv_clip_max, adv_clip_max)
    all_finite = torch.isfinite(scores).all(dim=1)
    advantages = torch.where(all_finite, advantages, torch.zeros_like(advantages))
    nonfinite = int((~all_finite).sum().item())
    return AggregatedRewards(rewards, GroupAdvantages(advantages=advantages, num_nonfinite=nonfinite))
