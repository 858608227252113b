"""What one iteration reports: reward, advantage and update statistics reduced over ranks, the per-step ratio
means, the phase clock, the metrics.jsonl record and the progress line; and what it says about the run's health
(``SkippedUpdateWatch``).

A run that cannot learn stops: K iterations in a row without a single optimizer step.

An iteration skips its update when nothing finite came out of it: no finite reward on any rank, or a non-finite
gradient norm at every accumulation boundary (a non-finite loss gives one). The weights are then untouched, which is
right for a passing glitch; but when every iteration skips, the run would "succeed" with the base weights. Settings
that cause it are refused in validation (``TrainConfig.problems``); whatever slips through stops here, naming the
quantity that was not finite.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from fluxgrpo.config import TrainConfig
from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.grpo.advantages import finite_mean_std, flat_groups
from fluxgrpo.grpo.types import UpdateStats
from fluxgrpo.runtime import device as rt_device
from fluxgrpo.runtime import dist as rt_dist
from fluxgrpo.runtime.dist import DistContext
from fluxgrpo.training.parts import TrainingParts


def reward_statistics(ctx: DistContext, rewards: torch.Tensor, group_size: int) -> dict[str, float]:
    """Global reward statistics over every rank's trajectories: one gather, one host sync.

    Non-finite rewards are left out (and counted); a group's spread is the unbiased std of its finite rewards,
    0 when fewer than two are finite. ``zero_std_group_fraction`` counts the groups whose advantages are all 0
    because their rewards are equal (``flat_groups``, the same rule ``group_advantages`` applies).
    """

    gathered = rt_dist.all_gather_tensor(ctx, rewards.detach().float())  # [B·world]
    finite, count, mean, std = finite_mean_std(gathered, dim=0)
    low = torch.where(finite, gathered, torch.full_like(gathered, float("inf"))).min()
    high = torch.where(finite, gathered, torch.full_like(gathered, float("-inf"))).max()

    group_finite, group_count, _, group_std = finite_mean_std(gathered.reshape(-1, group_size), dim=1)
    group_std = torch.where(group_count > 1, group_std, torch.zeros_like(group_std))

    stats = torch.stack(
        [
            mean,
            std,
            low,
            high,
            group_std.mean(),
            flat_groups(gathered.reshape(-1, group_size), group_finite).float().mean(),
            (~finite).sum().float(),
            count,
        ]
    ).tolist()
    names = (
        "reward_mean",
        "reward_std",
        "reward_min",
        "reward_max",
        "group_std_mean",
        "zero_std_group_fraction",
        "nonfinite_rewards",
    )
    out = dict(zip(names, stats[:-1], strict=True))
    if stats[-1] == 0:
        out.update(reward_mean=math.nan, reward_std=math.nan, reward_min=math.nan, reward_max=math.nan)
    return out


def any_finite_reward(ctx: DistContext, rewards: torch.Tensor) -> bool:
    """Whether any rank has a finite reward this iteration (one all-reduce; every rank gets the same answer)."""
    count = torch.isfinite(rewards).sum().to(torch.float32).reshape(1)
    rt_dist.all_reduce_sum(ctx, count)
    return bool(count.item() > 0)


def per_reward_statistics(ctx: DistContext, scores: torch.Tensor, names: list[str]) -> dict[str, float]:
    """reward_<name>_mean / _std over every rank's finite scores of each reward; nothing for a single reward
    (its statistics are reward_mean / reward_std)."""
    if len(names) < 2:
        return {}
    gathered = rt_dist.all_gather_tensor(ctx, scores.detach().float())  # [B·world, K]

    _, count, mean, std = finite_mean_std(gathered, dim=0)
    out = {}
    for name, m, s, n in zip(names, mean.tolist(), std.tolist(), count.tolist(), strict=True):
        out[f"reward_{name}_mean"], out[f"reward_{name}_std"] = (m, s) if n else (math.nan, math.nan)
    return out


def reduce_update_stats(ctx: DistContext, update: UpdateStats) -> dict[str, float]:
    """Each number of ``update.as_floats`` reduced over ranks as its metric declares: mean over ranks of the
    averages (and of per-rank sums), min of mins, max of maxes (device tensors: collectives need them)."""
    stats = update.as_floats()
    reductions = update.scalar_reductions()
    mean_keys = [key for key, reduction in reductions.items() if reduction == "mean"]
    means = torch.tensor([stats[k] for k in mean_keys], dtype=torch.float32, device=ctx.device)
    rt_dist.all_reduce_sum(ctx, means)
    # min(x) = −max(−x), so one MAX reduction covers both ends
    extreme_keys = [key for key, reduction in reductions.items() if reduction in ("max", "min")]
    signs = [-1.0 if reductions[key] == "min" else 1.0 for key in extreme_keys]
    extremes = torch.tensor(
        [sign * stats[key] for sign, key in zip(signs, extreme_keys, strict=True)],
        dtype=torch.float32,
        device=ctx.device,
    )
    rt_dist.all_reduce_max(ctx, extremes)
    out = dict(zip(mean_keys, (means / ctx.world_size).tolist(), strict=True))
    for sign, key, value in zip(signs, extreme_keys, extremes.tolist(), strict=True):
        out[key] = sign * value
    out["optimizer_steps"] = stats["optimizer_steps"]
    out["skipped_steps"] = stats["skipped_steps"]
    out["update_skipped"] = stats["update_skipped"]  # the same on every rank (decided from a global count)
    return out


def per_step_means(ctx: DistContext, update: UpdateStats) -> dict[str, list[float | None]]:
    """Each per-step metric's mean per σ-table step over every rank's trained samples (None: not trained this
    iteration): e.g. the drift of the ratio across steps that GRPO-Guard corrects."""
    out = {}
    for key, (sums, counts) in update.per_step().items():
        packed = torch.stack([sums, counts])
        rt_dist.all_reduce_sum(ctx, packed)
        totals, numbers = packed.tolist()
        means = [total / count if count else None for total, count in zip(totals, numbers, strict=True)]
        out[key] = [mean if mean is not None and math.isfinite(mean) else None for mean in means]
    return out


def advantage_statistics(ctx: DistContext, advantages: torch.Tensor) -> dict[str, float]:
    gathered = rt_dist.all_gather_tensor(ctx, advantages.detach().float())
    abs_mean, low, high = torch.stack([gathered.abs().mean(), gathered.min(), gathered.max()]).tolist()
    return {"advantage_abs_mean": abs_mean, "advantage_min": low, "advantage_max": high}


def progress_line(record: dict[str, Any], total: int, objective_fragment: str) -> str:
    """One console line per iteration on rank 0 (the full record is in metrics.jsonl); ``objective_fragment`` is
    the objective's own part (``Objective.progress``, a format string over record keys)."""
    seconds = record["seconds_rollout"] + record["seconds_decode_reward"] + record["seconds_update"]
    skipped = f" · skipped steps {record['skipped_steps']:.0f}" if record["skipped_steps"] else ""
    if record["update_skipped"]:
        skipped = " · update skipped: no finite reward"
    bad = f" · non-finite rewards {record['nonfinite_rewards']:.0f}" if record["nonfinite_rewards"] else ""
    drift = record.get("velocity_norm_ratio")
    drift_text = f" · v-ratio {drift:.4f}" if isinstance(drift, float) and math.isfinite(drift) else ""
    fired = record.get("guards_fired")
    guards = f" · guards fired {fired}" if fired else ""
    return (
        f"iteration {record['iteration']}/{total} · reward {record['reward_mean']:.4f} ± {record['reward_std']:.4f} "
        f"· {objective_fragment.format(**record)} · loss {record['loss']:.3g} · grad {record['grad_norm_mean']:.3g} "
        f"· lr {record['lr']:.2g}{drift_text} · {seconds:.1f} s ({record['images_per_second']:.2f} img/s){skipped}{bad}"
        f"{guards}"
    )


class PhaseClock:
    """Wall time of each phase of an iteration, measured between device synchronisations."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}
        rt_device.synchronize(device)
        self._last = self._start = time.perf_counter()

    def lap(self, phase: str) -> None:
        rt_device.synchronize(self.device)
        rt_dist.mark_phase_done(phase)  # named if this rank stops or falls behind the others
        now = time.perf_counter()
        self.seconds[f"seconds_{phase}"] = now - self._last
        self._last = now

    @property
    def total(self) -> float:
        return self._last - self._start


def iteration_record(
    ctx: DistContext,
    cfg: TrainConfig,
    parts: TrainingParts,
    iteration: int,
    scores: torch.Tensor,
    rewards: torch.Tensor,
    advantages: torch.Tensor,
    update: UpdateStats,
    clock: PhaseClock,
) -> dict[str, Any]:
    """Everything metrics.jsonl holds for one iteration, reduced over ranks."""
    peak = rt_device.peak_memory_bytes(ctx.device)
    return {
        "iteration": iteration,
        **reward_statistics(ctx, rewards, cfg.num_generations),
        **per_reward_statistics(ctx, scores, parts.reward_fn.names),
        **advantage_statistics(ctx, advantages),
        **reduce_update_stats(ctx, update),
        **per_step_means(ctx, update),
        "lr": parts.lr_scheduler.get_last_lr()[0],
        **clock.seconds,
        "images_per_second": ctx.world_size * cfg.trajectories_per_rank / clock.total,
        "peak_memory_gib": None if peak is None else peak / 2**30,
        # --compile: graphs compiled, and their seconds, since the previous record (evaluations included)
        **(parts.compile_meter.lap().as_record() if parts.compile_meter is not None else {}),
    }


MAX_CONSECUTIVE_SKIPPED_UPDATES = 3


def non_finite_quantity(record: dict[str, Any]) -> str:
    """What kept an iteration from updating, from its metrics record (reduced over ranks, so the same on each)."""
    if record.get("update_skipped"):
        return "the reward (no finite reward on any rank)"
    loss = record.get("loss")
    if isinstance(loss, float) and not math.isfinite(loss):
        return f"the loss ({loss})"
    return "the gradient norm (at every accumulation boundary)"


class SkippedUpdateWatch:
    """Counts iterations in a row that took no optimizer step; ``observe`` raises at ``limit`` of them, or at
    ``last_iteration`` when no iteration since the first stepped (a run shorter than ``limit`` exited 0)."""

    def __init__(self, limit: int = MAX_CONSECUTIVE_SKIPPED_UPDATES, last_iteration: int | None = None) -> None:
        self.limit = limit
        self.last_iteration = last_iteration  # the run's last: there, a run that never stepped fails (#50.5)
        self.streak = 0

    def observe(self, record: dict[str, Any]) -> None:
        """Call once per iteration with its metrics record, on every rank (each raises at the same iteration).

        Raises:
            FluxgrpoError: the last ``limit`` iterations all skipped their update.
        """
        if record["optimizer_steps"]:
            self.streak = 0
            return
        self.streak += 1
        iteration = record["iteration"]
        if iteration == self.last_iteration and self.streak == iteration < self.limit:
            raise FluxgrpoError(
                f"{'the only iteration' if iteration == 1 else f'all {iteration} iterations'} skipped their update "
                f"because {non_finite_quantity(record)} was not finite, so the weights never moved: failing the run. "
                "Check --learning-rate, --eta, --kl-beta, --shift, --guidance, the objective's flags and the reward "
                "weights; metrics.jsonl has every iteration"
            )
        if self.streak >= self.limit:
            raise FluxgrpoError(
                f"iterations {iteration - self.limit + 1}-{iteration} all skipped their update because "
                f"{non_finite_quantity(record)} was not finite, so the weights no longer move: stopping. Check "
                "--learning-rate, --eta, --kl-beta, --shift, --guidance and the reward weights; metrics.jsonl has "
                "every iteration"
            )
