"""The objective seam: what an objective tells the rollout and the update driver, and the metrics it reports.

An objective (``--objective``) decides two things:
- what the rollout must keep: the per-step trajectory with its log-probs (``keeps_trajectory``: GRPO's ratio needs
  them), or the final samples only (DiffusionNFT and AWM train on forward-noised final samples);
- how a micro-batch of the rollout becomes a loss and its metrics (``UpdateWork.loss``).

The update driver (``grpo/update.py:run_update``: micro-batches × gradient accumulation → backward →
``optimizer_step``) knows no objective. Each metric declares how it is reduced (``Metric``), so a new objective's
metrics reach metrics.jsonl, TensorBoard/wandb, the progress line and ``report`` without edits there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from fluxgrpo.grpo.types import Conditioning

# How a metric is reduced: over the micro-batch steps of one update on a rank, then over ranks.
#   sum      Σ over steps of the reported value;                      mean over ranks
#   mean     Σ over steps of the reported per-sample sum, ÷ samples;  mean over ranks
#   max/min  extreme over steps;                                      extreme over ranks
#   per_step (σ-table indices [m], values [m]) summed per index with a count per index; summed over ranks and
#            logged as the mean per index (None where nothing was trained)
REDUCTIONS = ("sum", "mean", "max", "min", "per_step")


@dataclass(frozen=True)
class Metric:
    """One metric an objective reports: its metrics.jsonl key and its reduction (``REDUCTIONS``)."""

    key: str
    reduction: str
    count_name: str = ""  # per_step only: the name its per-index counts are kept under


@dataclass
class StepResult:
    """One micro-batch step: the scaled loss to backpropagate and its metrics (detached; ``Metric`` names)."""

    loss: torch.Tensor
    metrics: dict[str, Any]  # name → tensor, or (indices, values) for per_step metrics
    num_samples: int  # samples in this step (the divisor of ``mean`` metrics)


class UpdateWork(Protocol):
    """One update's worth of work prepared by an objective from a rollout: ``slots`` loss steps per micro-batch."""

    num_micro_batches: int
    slots: int
    train_timestep_indices: torch.Tensor  # [B, T] int64 cpu, what each sample trained at (logged and tested)

    def loss(self, micro_index: int, slot: int) -> StepResult: ...


class Objective(Protocol):
    """A training objective: what the rollout keeps, the update's work, and the metrics it reports."""

    @property
    def name(self) -> str: ...

    @property
    def keeps_trajectory(self) -> bool:
        """True: the SDE trajectory and its log-probs (``Rollout``); False: final samples (``FinalSamples``)."""
        ...

    @property
    def metrics(self) -> Mapping[str, Metric]: ...

    @property
    def progress(self) -> str:
        """The progress line's fragment for this objective: a format string over record keys."""
        ...

    def prepare(
        self,
        transformer: nn.Module,
        rollout: Any,
        cond: Conditioning,
        advantages: torch.Tensor,
        *,
        device_type: str,
        generator_cpu: torch.Generator,
    ) -> UpdateWork: ...

    def rollout_policy(self) -> Any:
        """The ``PolicyCopy`` rollouts sample with (NFT's θ_old), or None for the current weights."""
        ...

    def finish(self, transformer: nn.Module, optimizer_steps: int) -> None:
        """After the update (``optimizer_steps``: taken so far in the run): soft-update any policy copy."""
        ...


@dataclass
class MetricTally:
    """The metrics of one update, accumulated on the device step by step (no host sync)."""

    specs: Mapping[str, Metric]
    device: torch.device
    num_steps: int  # length of per_step vectors
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    num_samples: int = 0

    def __post_init__(self) -> None:
        for name, spec in self.specs.items():
            self.values[name] = _initial(spec.reduction, self.num_steps, self.device)
            if spec.reduction == "per_step":
                self.values[spec.count_name] = torch.zeros(self.num_steps, dtype=torch.float32, device=self.device)
        self.reported: set[str] = set()

    def add(self, result: StepResult) -> None:
        self.num_samples += result.num_samples
        for name, value in result.metrics.items():
            spec = self.specs[name]
            self.reported.add(name)
            if spec.reduction in ("sum", "mean"):
                self.values[name] += value
            elif spec.reduction == "max":
                self.values[name] = torch.maximum(self.values[name], value)
            elif spec.reduction == "min":
                self.values[name] = torch.minimum(self.values[name], value)
            else:
                indices, per_sample = value
                self.values[name].index_add_(0, indices, per_sample)
                self.values[spec.count_name].index_add_(0, indices, torch.ones_like(per_sample, dtype=torch.float32))

    def result(self) -> dict[str, torch.Tensor]:
        """Name → value on this rank; a scalar metric never reported is NaN (nothing was measured)."""
        out = dict(self.values)
        nan = torch.full((), float("nan"), device=self.device)
        for name, spec in self.specs.items():
            if spec.reduction == "per_step":
                continue
            if name not in self.reported:
                out[name] = nan
            elif spec.reduction == "mean":
                out[name] = self.values[name] / self.num_samples
        return out


def unmeasured(specs: Mapping[str, Metric], num_steps: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The metrics of an update that did not run: NaN scalars, zero per-step sums and counts."""
    return MetricTally(specs, device, num_steps).result()


def _initial(reduction: str, num_steps: int, device: torch.device) -> torch.Tensor:
    if reduction == "per_step":
        return torch.zeros(num_steps, dtype=torch.float32, device=device)
    if reduction == "max":
        return torch.full((), float("-inf"), device=device)
    if reduction == "min":
        return torch.full((), float("inf"), device=device)
    if reduction in ("sum", "mean"):
        return torch.zeros((), dtype=torch.float32, device=device)
    raise ValueError(f"unknown metric reduction {reduction!r}: one of {', '.join(REDUCTIONS)}")
