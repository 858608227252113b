"""Group-relative advantages: each reward standardised within its prompt's group of G generations, with the finite
statistics (``finite_mean_std``) they share with the logged reward statistics, so a NaN or ±inf reward is left out
of both the same way; and several rewards → one advantage per trajectory (MixGRPO's ``reward_aggr`` /
``advantage_aggr``, ``aggregate_rewards``).

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
from typing import NamedTuple

import torch


class FiniteStats(NamedTuple):
    finite: torch.Tensor  # bool, like the values: which entries count
    num_finite: torch.Tensor  # float32 number of finite entries, reduced along ``dim``
    mean: torch.Tensor  # their mean (0 where none is finite)
    std: torch.Tensor  # their unbiased (n − 1) std (n − 1 clamped to 1: 0 for a single value)


def finite_mean_std(values: torch.Tensor, dim: int, keepdim: bool = False) -> FiniteStats:
    """Mean and unbiased std of ``values``' finite entries along ``dim``; non-finite entries count as absent.

    In float32 order: the masked sum over the count (clamped to 1), then the masked squared deviations' sum over
    count − 1 (clamped to 1), square-rooted.
    """
    finite = torch.isfinite(values)
    count = finite.sum(dim=dim, keepdim=True).to(torch.float32)
    safe = torch.where(finite, values, torch.zeros_like(values))
    mean = safe.sum(dim=dim, keepdim=True) / count.clamp(min=1)
    spread = torch.where(finite, values - mean, torch.zeros_like(values))
    std = (spread.pow(2).sum(dim=dim, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
    if not keepdim:
        count, mean, std = count.squeeze(dim), mean.squeeze(dim), std.squeeze(dim)
    return FiniteStats(finite, count, mean, std)


# A group whose rewards spread by less than this fraction of their magnitude is "all equal": fp32 rewards carry
# about 6e-8 relative rounding, so such a spread is noise, and standardising it would blow rounding up to ±1.
FLAT_GROUP_RELATIVE_SPREAD = 1e-6


@dataclass(frozen=True)
class GroupAdvantages:
    """Advantages and how many rewards had to be ignored."""

    advantages: torch.Tensor  # [B·G] fp32, clipped to ±adv_clip_max; 0 where the reward was not finite
    num_nonfinite: int  # rewards that were NaN/±inf (excluded from their group's mean and std)


def flat_groups(grouped: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """[groups] bool: the group's finite rewards are all equal up to rounding (or fewer than two are finite).

    Decided in float64, where the mean of equal fp32 values is exact: max |r − mean| ≤ 1e-6 · max |r|. Computed
    on the host (a few numbers; accelerators need not support float64); the mask is on ``grouped``'s device.

    Args:
        grouped: [groups, G] rewards (any float dtype; non-finite entries are ignored).
        finite: [groups, G] which rewards are finite.
    """
    device = grouped.device
    finite = finite.detach().cpu()
    values = torch.where(finite, grouped.detach().cpu().to(torch.float64), torch.zeros((), dtype=torch.float64))
    count = finite.sum(dim=1, keepdim=True)
    mean = values.sum(dim=1, keepdim=True) / count.clamp(min=1)
    spread = torch.where(finite, (values - mean).abs(), torch.zeros_like(values)).amax(dim=1)
    magnitude = values.abs().amax(dim=1)
    return ((spread <= FLAT_GROUP_RELATIVE_SPREAD * magnitude) | (count.squeeze(1) < 2)).to(device)


def group_advantages(rewards: torch.Tensor, group_size: int, adv_clip_max: float, eps: float = 1e-8) -> GroupAdvantages:
    """A_j = clamp((r_j − mean_g) / (std_g + eps), ±adv_clip_max) per contiguous group g of ``group_size``.

    std is the unbiased (n−1) estimator, as in DanceGRPO. A non-finite reward gets advantage 0 and is left out
    of its group's statistics, so one failed reward cannot poison the whole group. A group with no usable spread
    (fewer than two finite rewards, or rewards all equal up to rounding: ``flat_groups``) gets all zeros;
    DanceGRPO gives 12 equal rewards of 0.3 advantages of ±0.72, its fp32 rounding divided by std + 1e-8.
    For DanceGRPO's global (non-group) mode pass all rewards with ``group_size = len(rewards)``. Advantages are
    clipped here, once; only ``sum-advantages`` (``aggregate_rewards``) clips its weighted sum again.

    Args:
        rewards: [B·G] rewards, groups contiguous ([p0×G, p1×G, …]).
        group_size: G; must divide the number of rewards.
        adv_clip_max: clip bound, > 0.
        eps: added to the std, 1e-8 as in DanceGRPO.
    """
    if rewards.ndim != 1 or group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(f"rewards {tuple(rewards.shape)} do not split into groups of {group_size}")
    grouped = rewards.to(torch.float32).reshape(-1, group_size)  # [groups, G]
    finite, _, mean, std = finite_mean_std(grouped, dim=1, keepdim=True)  # mean, std: [groups, 1]
    safe = torch.where(finite, grouped, torch.zeros_like(grouped))
    advantages = (safe - mean) / (std + eps)
    usable = finite & ~flat_groups(grouped, finite)[:, None]
    advantages = torch.where(usable, advantages, torch.zeros_like(advantages))
    advantages = advantages.clamp(-adv_clip_max, adv_clip_max)
    return GroupAdvantages(advantages=advantages.reshape(-1), num_nonfinite=int((~finite).sum().item()))


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
