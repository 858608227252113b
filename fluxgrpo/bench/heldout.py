"""What `bench --algorithms` measures beside the training reward: the held-out gain, and the work per iteration.

- **Held-out gain**: with evaluation on (``--eval-every`` in the config), each run's held-out score (the shapes
  checker when the run evaluates it, else the first evaluated reward) at its last evaluation minus at iteration 0
  (the base model), from the run's own metrics.jsonl; over the training time, its gain per second. Held-out prompts
  are never trained on, so this is the gain that generalises, next to the training reward's gain (which a policy
  can get by memorising its prompts or hacking its reward).
- **Work per iteration**: transformer forwards, backwards and optimizer steps, counted while the runs train
  (:class:`WorkCounter`), so a per-second comparison is never one of unequal work by accident. A forward or
  backward is one image through the transformer (a batch of 4 counts 4); forwards include the rollout, the update's
  recomputation, the reference model's (KL) and the drift probe's; the held-out evaluation's are left out (the same
  for every algorithm: images × ``--eval-steps`` per evaluation).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.modules.module import register_module_forward_hook

from fluxgrpo.metrics import read_metrics
from fluxgrpo.rewards.reward_set import eval_reward_names

if TYPE_CHECKING:
    from fluxgrpo.config import TrainConfig

TRANSFORMER_CLASS = "FluxTransformer2DModel"  # also matches FSDP2's FSDPFluxTransformer2DModel
WORLD_REWARD = "shapes"


def heldout_reward(cfg: TrainConfig) -> str | None:
    """The reward whose held-out gain the bench reports: ``shapes`` when the run evaluates it, else the first
    evaluated reward; None without evaluation (``eval_every`` 0)."""

    if cfg.eval_every <= 0:
        return None
    names = eval_reward_names(cfg.reward, cfg.eval_rewards)
    return WORLD_REWARD if WORLD_REWARD in names else names[0]


def heldout_scores(output_dir: str | Path, reward: str) -> list[tuple[int, float]]:
    """(iteration, held-out mean) of every evaluation of the run in ``output_dir``, in order."""

    key = f"eval_{reward}_mean"
    return [(int(r["iteration"]), float(r[key])) for r in read_metrics(Path(output_dir)) if key in r]


def heldout_gain(scores: list[tuple[int, float]]) -> float | None:
    """The last evaluation's score minus iteration 0's (the base model); None with fewer than two evaluations."""
    if len(scores) < 2 or scores[0][0] != 0:
        return None
    return scores[-1][1] - scores[0][1]


def heldout_summary(
    reward: str | None, runs: list[list[tuple[int, float]]], seconds_per_iteration: float, iterations: int
) -> dict[str, Any]:
    """One algorithm's held-out fields over its repeats: the median gain, its min–max, the gain per second of
    training (median seconds per iteration × iterations), and each repeat's curve."""
    gains = [heldout_gain(scores) for scores in runs]
    measured = [gain for gain in gains if gain is not None]
    if reward is None or not measured:
        return {"heldout_reward": reward, "heldout_gain": None, "heldout_gain_per_second": None}
    gain = statistics.median(measured)
    return {
        "heldout_reward": reward,
        "heldout_first": runs[0][0][1],
        "heldout_last": runs[0][-1][1],
        "heldout_gain": gain,
        "heldout_gain_runs": measured,
        "heldout_gain_spread": [min(measured), max(measured)],
        "heldout_gain_per_second": gain / (seconds_per_iteration * iterations),
        "heldout_curves": [[list(point) for point in scores] for scores in runs],
    }


def heldout_verdict(row: dict[str, Any], baseline: dict[str, Any]) -> str | None:
    """How the row's held-out gain compares with the baseline's: better or worse where the two min–max spreads over
    the repeats do not overlap, within noise where they do; None for the baseline, single runs, or no gain."""
    if row["algorithm"] == baseline["algorithm"] or min(row["repeats"], baseline["repeats"]) < 2:
        return None
    if row.get("heldout_gain") is None or baseline.get("heldout_gain") is None:
        return None
    low, high = row["heldout_gain_spread"]
    baseline_low, baseline_high = baseline["heldout_gain_spread"]
    if low > baseline_high:
        return "better"
    if high < baseline_low:
        return "worse"
    return "within noise"


def median_curve(curves: list[list[list[float]]]) -> list[tuple[int, float]]:
    """The repeats' held-out curves as one: at every evaluation iteration all of them reached, their median score."""
    shared = sorted(set.intersection(*({int(point[0]) for point in curve} for curve in curves)))
    scores = [{int(point[0]): float(point[1]) for point in curve} for curve in curves]
    return [(iteration, statistics.median(score[iteration] for score in scores)) for iteration in shared]


def time_to_baseline_final(row: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    """When the row's median held-out curve first reaches the baseline's final median score: that evaluation's
    iteration, its seconds of training (iteration × the row's median seconds per iteration) and their share of the
    baseline's whole run; and whether the row's own final median score is still at or above it (a row can pass the
    baseline early and fall below it by the end, as a sliding SDE window does). None where a run has no curve or the
    row never reaches it (within its evaluations, so evaluate more often, --eval-every, to resolve it finer)."""
    empty = {
        "iteration_to_baseline_final": None,
        "seconds_to_baseline_final": None,
        "time_to_baseline_final_ratio": None,
        "held_baseline_final": None,
    }
    if row["algorithm"] == baseline["algorithm"] or not row.get("heldout_curves") or not baseline.get("heldout_curves"):
        return empty
    target = median_curve(baseline["heldout_curves"])[-1][1]
    curve = median_curve(row["heldout_curves"])
    reached = next((it for it, score in curve if it > 0 and score >= target), None)
    if reached is None:
        return empty
    seconds = reached * row["seconds_per_iteration"]
    baseline_seconds = baseline["seconds_per_iteration"] * baseline["iterations"]
    return {
        "iteration_to_baseline_final": reached,
        "seconds_to_baseline_final": seconds,
        "time_to_baseline_final_ratio": seconds / baseline_seconds,
        "held_baseline_final": curve[-1][1] >= target,
    }


# --------------------------------------------------------------------------------------------- work counts


# A backward pass costs about two forwards (the gradient with respect to the activations and to the weights: each
# a matrix product the size of the forward's), so a trained image costs about three forwards; the usual 6·N·tokens
# training-FLOP rule against 2·N·tokens per forward.
BACKWARD_IN_FORWARDS = 2


@dataclass
class WorkCounts:
    forwards: int = 0  # images through the transformer, evaluation's included (see WorkCounter)
    backwards: int = 0


class WorkCounter:
    """Counts images through every FLUX transformer's forward and backward while active (torch's global module
    hooks: the trainer's code runs unchanged). ``counts`` holds the totals since the last ``reset``."""

    def __init__(self) -> None:
        self.counts = WorkCounts()

    def reset(self) -> WorkCounts:
        counts, self.counts = self.counts, WorkCounts()
        return counts

    def _forward(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if TRANSFORMER_CLASS not in type(module).__name__:
            return
        hidden = args[0] if args else kwargs.get("hidden_states")
        images = int(hidden.shape[0]) if isinstance(hidden, torch.Tensor) else 1
        self.counts.forwards += images
        sample = output[0] if isinstance(output, tuple) else getattr(output, "sample", output)
        if isinstance(sample, torch.Tensor) and sample.requires_grad:

            def backward(grad: torch.Tensor) -> None:
                self.counts.backwards += images

            sample.register_hook(backward)

    @contextmanager
    def active(self) -> Iterator[WorkCounter]:
        handle = register_module_forward_hook(self._forward, with_kwargs=True)
        try:
            yield self
        finally:
            handle.remove()


def evaluation_forwards(cfg: TrainConfig, evaluations: int, prompts: int) -> int:
    """Images through the transformer in ``evaluations`` held-out evaluations of ``prompts`` prompts on one
    process: each image is ``eval_steps`` forwards of FluxPipeline's Euler loop (one call per step)."""
    return evaluations * prompts * cfg.eval_images_per_prompt * cfg.eval_steps


def work_per_iteration(
    counts: WorkCounts, records: list[dict[str, Any]], cfg: TrainConfig, evaluations: int, prompts: int
) -> dict[str, float]:
    """One run's counts per training iteration (its evaluations' forwards taken out)."""
    iterations = max(len(records), 1)
    forwards = counts.forwards - evaluation_forwards(cfg, evaluations, prompts)
    steps = sum(float(record.get("optimizer_steps", 0.0)) for record in records)
    return {
        "forwards": forwards / iterations,
        "backwards": counts.backwards / iterations,
        "forward_equivalents": (forwards + BACKWARD_IN_FORWARDS * counts.backwards) / iterations,
        "optimizer_steps": steps / iterations,
    }


def gain_per_kilo_forward_equivalent(row: dict[str, Any]) -> float | None:
    """The row's held-out gain per 1,000 forward-equivalents of training (its forward-equivalents per iteration ×
    iterations): the cost measure that does not depend on the machine; None without a gain or counted work."""
    work = row.get("work_per_iteration")
    if row.get("heldout_gain") is None or not work or not work.get("forward_equivalents"):
        return None
    return 1000 * row["heldout_gain"] / (work["forward_equivalents"] * row["iterations"])


def counted(
    train: Callable[[TrainConfig], list[dict[str, Any]]], counter: WorkCounter
) -> Callable[[TrainConfig], list[dict[str, Any]]]:
    """``train`` with the counter active and reset before each run."""

    def run(cfg: TrainConfig) -> list[dict[str, Any]]:
        counter.reset()
        with counter.active():
            return train(cfg)

    return run
