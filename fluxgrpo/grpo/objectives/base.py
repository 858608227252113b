"""The objective seam: what an objective tells the rollout and the update driver, and the metrics it reports.

An objective (``--objective``; its torch-free entry in ``catalogue.py``) declares:
- what the rollout must keep: the per-step trajectory with its log-probs (``keeps_trajectory``: GRPO's ratio needs
  them; ``keeps_step_means`` for GRPO-Guard), or the final samples only (DiffusionNFT, AWM), with every latent of the
  ODE on the σ grid (``keeps_ode_path``: Neighbor GRPO's candidates);
- how many samples its update trains (``update_size``: the trajectories, or Neighbor GRPO's anchors);
- which forwards each loss step needs (``UpdateWork``): the policy's at the inputs it names (``model_input``), the
  KL reference's (``wants_reference``), and velocities computed once before the first optimizer step
  (``precomputed_forwards``: the current weights, ``CURRENT_POLICY``, or a policy copy by name);
- how those velocities become a loss and its metrics (``UpdateWork.loss``), from tensors only.

The update driver (``grpo/update.py:run_update``) owns the plumbing and knows no objective: the micro-batches, the
device the tensors live on, every forward, the scaling of each loss term by 1/(GA·slots), backward and
``optimizer_step``. Each metric declares how it is reduced (``Metric``), so a new objective's metrics reach
metrics.jsonl, TensorBoard/wandb, the progress line and ``report`` without edits there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from fluxgrpo.grpo.weight_copies import PolicyCopy

# How a metric is reduced: over the micro-batch steps of one update on a rank, then over ranks.
#   sum      Σ over steps of the reported value;                      mean over ranks
#   mean     Σ over steps of the reported per-sample sum, ÷ samples;  mean over ranks
#   max/min  extreme over steps;                                      extreme over ranks
#   per_step (σ-table indices [m], values [m]) summed per index with a count per index; summed over ranks and
#            logged as the mean per index (None where nothing was trained)
REDUCTIONS = ("sum", "mean", "max", "min", "per_step")
CURRENT_POLICY = "policy"  # a precomputed forward with the weights as they are before the update's first step


@dataclass(frozen=True)
class Metric:
    """One metric an objective reports: its metrics.jsonl key and its reduction (``REDUCTIONS``)."""

    key: str
    reduction: str
    count_name: str = ""  # per_step only: the name its per-index counts are kept under


# Σ over (micro-batch, step) of the scaled loss (DanceGRPO's `total_loss`): the driver reports it for every objective.
LOSS_METRIC = {"loss_sum": Metric("loss", "sum")}


@dataclass(frozen=True)
class UpdateLayout:
    """How the driver cuts one update: micro-batches of the samples [start, stop), ``grad_accum_steps`` of them
    per optimizer step."""

    bounds: tuple[tuple[int, int], ...]
    grad_accum_steps: int

    @classmethod
    def of(cls, num_samples: int, micro_batch_size: int, grad_accum_steps: int) -> UpdateLayout:
        bounds = tuple(
            (start, min(start + micro_batch_size, num_samples)) for start in range(0, num_samples, micro_batch_size)
        )
        return cls(bounds, grad_accum_steps)

    @property
    def num_micro_batches(self) -> int:
        return len(self.bounds)

    def before_first_optimizer_step(self, micro_index: int) -> bool:
        return micro_index < self.grad_accum_steps


@dataclass(frozen=True)
class ModelInput:
    """What the transformer is fed at one loss step (the driver adds the conditioning, guidance and image ids)."""

    latents: torch.Tensor  # [m', L, C]
    timesteps: torch.Tensor  # [m'] σ-valued (the model multiplies by 1000 itself)
    # [m'] the sample (row of the update's conditioning) each latent row belongs to, when they are not the step's
    # samples start…stop−1 one row each: V-GRPO feeds N_MC rows per sample, Neighbor GRPO its anchors' rows.
    rows: torch.Tensor | None = None


@dataclass(frozen=True)
class UpdateStep:
    """One loss step as the driver hands it to the objective: samples start…stop−1 at their slot-th timestep."""

    micro_index: int
    start: int
    stop: int
    slot: int
    model_input: ModelInput
    velocity: torch.Tensor  # [m, L, C] the policy's, with gradients, in the autocast dtype
    reference_velocity: torch.Tensor | None  # [m, L, C] the KL reference's (no gradients) when the work wants it
    precomputed: Mapping[str, torch.Tensor]  # name → [m, L, C] velocities at this input, before the update


@dataclass
class StepLoss:
    """An objective's loss of one step: unscaled terms (the driver scales each by 1/(GA·slots), sums them in order
    and backpropagates) and its metrics (detached; ``Metric`` names; no ``loss_sum``, which the driver adds)."""

    terms: tuple[torch.Tensor, ...]
    metrics: dict[str, Any]  # name → tensor, or (indices, values) for per_step metrics


@dataclass
class StepResult:
    """One micro-batch step: the scaled loss to backpropagate and its metrics (detached; ``Metric`` names)."""

    loss: torch.Tensor
    metrics: dict[str, Any]  # name → tensor, or (indices, values) for per_step metrics
    num_samples: int  # samples in this step (the divisor of ``mean`` metrics)


class UpdateWork(Protocol):
    """One update's worth of work prepared by an objective from a rollout: ``slots`` loss steps per micro-batch."""

    slots: int
    train_timestep_indices: torch.Tensor  # [B, T] int64 cpu, what each sample trained at (logged and tested)
    wants_reference: bool  # the reference's velocity at each step's input (the KL term)
    precomputed_forwards: tuple[str, ...]  # ``CURRENT_POLICY`` or policy copies' names, computed in this order

    def model_input(self, start: int, stop: int, slot: int) -> ModelInput: ...

    def loss(self, step: UpdateStep) -> StepLoss: ...


class Objective(Protocol):
    """A training objective: what the rollout keeps, the update's work, and the metrics it reports."""

    @property
    def name(self) -> str: ...

    @property
    def keeps_trajectory(self) -> bool:
        """True: the SDE trajectory and its log-probs (``Rollout``); False: final samples (``FinalSamples``)."""
        ...

    @property
    def keeps_step_means(self) -> bool:
        """With ``keeps_trajectory``: also each SDE step's mean μ_old (GRPO-Guard's ratio)."""
        ...

    @property
    def keeps_ode_path(self) -> bool:
        """Without ``keeps_trajectory``: also every latent of the ODE on the σ grid (``FinalSamples.path``)."""
        ...

    @property
    def metrics(self) -> Mapping[str, Metric]: ...

    @property
    def progress(self) -> str:
        """The progress line's fragment for this objective: a format string over record keys."""
        ...

    @property
    def policy_copies(self) -> Mapping[str, PolicyCopy]:
        """The policy copies its precomputed forwards name (NFT's old policy, AWM's EMA policy)."""
        ...

    def prepare(
        self, rollout: Any, advantages: torch.Tensor, layout: UpdateLayout, generator_cpu: torch.Generator
    ) -> UpdateWork:
        """The update's work; ``rollout`` and ``advantages`` [B] are on the computation device; ``generator_cpu``
        draws whatever the update draws (timesteps, noise: saved for an exact resume)."""
        ...

    def rollout_policy(self) -> PolicyCopy | None:
        """The ``PolicyCopy`` rollouts sample with (NFT's θ_old), or None for the current weights."""
        ...

    def update_size(self, rollout: Any) -> int:
        """The samples the update's micro-batches cut (``prepare`` gets that layout): the rollout's trajectories, or
        Neighbor GRPO's B anchors per group."""
        ...

    def finish(self, transformer: nn.Module, optimizer_steps: int) -> None:
        """After the update (``optimizer_steps``: taken so far in the run): soft-update any policy copy."""
        ...


class ObjectiveBase:
    """The defaults of an ``Objective``: no step means, no ODE path, every trajectory trained, rollouts with the
    current weights, nothing to do after the update. An objective derives from it and sets what differs."""

    @property
    def keeps_step_means(self) -> bool:
        return False

    @property
    def keeps_ode_path(self) -> bool:
        return False

    def update_size(self, rollout: Any) -> int:
        return int(rollout.num_trajectories)

    def rollout_policy(self) -> PolicyCopy | None:
        return None

    def finish(self, transformer: nn.Module, optimizer_steps: int) -> None:
        return None


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
