"""The update driver: it owns the plumbing of every objective's update and knows none of them.

For one rollout it cuts the samples into micro-batches (``UpdateLayout``), runs every forward the objective's work
asks for (velocities precomputed before the first optimizer step, the KL reference's, the policy's with gradients,
all fed the same conditioning, guidance and image ids, under the device's autocast), scales each loss term by
1/(GA·slots), backpropagates each step at once, and steps the optimizer every GA micro-batches with a guard that
never lets a non-finite gradient reach the weights (``optimizer_step``). The objective (``grpo/objectives``) turns
the velocities of a step into its loss terms and metrics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from fluxgrpo.grpo.objectives.base import (
    CURRENT_POLICY,
    LOSS_METRIC,
    Metric,
    MetricTally,
    ModelInput,
    Objective,
    StepResult,
    UpdateLayout,
    UpdateStep,
    UpdateWork,
    unmeasured,
)
from fluxgrpo.grpo.rollout import predict_velocity
from fluxgrpo.grpo.types import Conditioning, FinalSamples, Rollout, UpdateStats
from fluxgrpo.grpo.weight_copies import ReferenceModel
from fluxgrpo.runtime.dist import reshard_sharded_modules


@dataclass(frozen=True)
class UpdatePlumbing:
    """How an update is batched and stepped, whatever the objective (``TrainConfig``'s names)."""

    micro_batch_size: int  # samples per training forward (train_micro_batch_size)
    grad_accum_steps: int  # micro-batches per optimizer step (gradient_accumulation_steps)
    max_grad_norm: float  # global gradient-norm clip
    compute_dtype: torch.dtype | None = None  # autocast dtype; None is the runtime's choice


def update_metrics(objective: Objective) -> dict[str, Metric]:
    """Every metric an update of ``objective`` reports: the driver's loss, then the objective's own."""
    return {**LOSS_METRIC, **objective.metrics}


def _as_plain_tensor(value: torch.Tensor) -> torch.Tensor:
    """clip_grad_norm_ returns a DTensor for FSDP2 (DTensor) parameters; make it an ordinary tensor."""
    full_tensor = getattr(value, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else value


def optimizer_step(
    transformer: nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any, max_grad_norm: float
) -> torch.Tensor:
    """Clip the accumulated gradients and step, unless their global norm is not finite; returns that norm.

    ``clip_grad_norm_(max_grad_norm)`` over the trainable parameters (the global norm, reduced over ranks, so
    every rank takes the same branch), then ``optimizer.step()`` and ``lr_scheduler.step()``. A non-finite norm
    skips both: the weights, the optimizer state and the schedule stay exactly as they were. Gradients are
    zeroed either way. One host sync (the finiteness check).
    """
    # Walked after backward, when FSDP2 has resharded: these are the parameters the optimizer holds.
    trainable = [parameter for parameter in transformer.parameters() if parameter.requires_grad]
    norm = _as_plain_tensor(torch.nn.utils.clip_grad_norm_(trainable, max_grad_norm)).detach().to(torch.float32)
    if bool(torch.isfinite(norm)):
        optimizer.step()
        lr_scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


@dataclass(frozen=True)
class Forwards:
    """What every forward of one update is fed besides the step's own input."""

    transformer: nn.Module
    cond: Conditioning
    guidance: torch.Tensor  # [B] fp32, the rollout's guidance for every sample
    img_ids: torch.Tensor  # [L, 3]
    device_type: str
    compute_dtype: torch.dtype | None

    def fed(self, model_input: ModelInput, start: int, stop: int) -> tuple[Conditioning, torch.Tensor]:
        """The conditioning and guidance of ``model_input``'s latent rows: samples start…stop−1, or its ``rows``."""
        if model_input.rows is None:
            return self.cond.rows(start, stop), self.guidance[start:stop]
        rows = model_input.rows.to(self.guidance.device)
        cond = Conditioning(self.cond.prompt_embeds[rows], self.cond.pooled[rows], self.cond.text_ids)
        return cond, self.guidance[rows]

    def velocity(self, model_input: ModelInput, start: int, stop: int, module: nn.Module | None = None) -> torch.Tensor:
        """v of ``module`` (default: the policy) for samples start…stop−1 at ``model_input``."""
        cond, guidance = self.fed(model_input, start, stop)
        return predict_velocity(
            module if module is not None else self.transformer, model_input.latents, cond, model_input.timesteps,
            guidance, self.img_ids, self.device_type, self.compute_dtype,
        )  # fmt: skip

    def precompute(self, work: UpdateWork, layout: UpdateLayout) -> list[list[torch.Tensor]]:
        """[micro-batch][slot] → fp32 velocities: the module's at every step's input, without gradients."""
        with torch.no_grad():
            return [
                [self.velocity(work.model_input(start, stop, slot), start, stop).to(torch.float32) for slot in
                 range(work.slots)]
                for start, stop in layout.bounds
            ]  # fmt: skip


class UpdatePass:
    """One update's work with its forwards: the objective's work prepared from the rollout, the velocities it
    wants precomputed (with the weights as they are now, a policy copy swapped in where it names one), and
    ``step``, one scaled loss step. ``run_update`` walks it; tests drive single steps with it."""

    def __init__(
        self,
        transformer: nn.Module,
        objective: Objective,
        rollout: Rollout | FinalSamples,
        cond: Conditioning,
        advantages: torch.Tensor,
        plumbing: UpdatePlumbing,
        *,
        device_type: str,
        generator_cpu: torch.Generator,
        reference: ReferenceModel | None = None,
    ) -> None:
        device = cond.prompt_embeds.device
        num_samples = rollout.num_trajectories
        if advantages.shape != (num_samples,):
            raise ValueError(f"advantages must be [{num_samples}], got {tuple(advantages.shape)}")
        if cond.num_rows != num_samples:
            raise ValueError(f"{cond.num_rows} conditioning rows for {num_samples} trajectories")
        self.layout = UpdateLayout.of(
            objective.update_size(rollout), plumbing.micro_batch_size, plumbing.grad_accum_steps
        )
        self.work = objective.prepare(
            rollout, advantages.to(device=device, dtype=torch.float32), self.layout, generator_cpu
        )
        if self.work.wants_reference and reference is None:
            raise ValueError("kl_beta > 0 needs a reference model")
        # --retain-rollout-graphs: the rollout kept the trained steps' forwards; the policy's is not run again
        self.retained = rollout.retained if isinstance(rollout, Rollout) else None
        if self.retained is not None:
            self.retained.check_layout(self.layout.num_micro_batches, plumbing.grad_accum_steps)
            self.retained.check_indices(self.work.train_timestep_indices)
        self.reference = reference
        self.forwards = Forwards(
            transformer, cond, torch.full((num_samples,), rollout.guidance, dtype=torch.float32, device=device),
            rollout.img_ids.to(device), device_type, plumbing.compute_dtype,
        )  # fmt: skip
        self.precomputed: dict[str, list[list[torch.Tensor]]] = {}
        for name in self.work.precomputed_forwards:
            copy = (
                contextlib.nullcontext()
                if name == CURRENT_POLICY
                else objective.policy_copies[name].swapped_in(transformer)
            )
            with copy:
                self.precomputed[name] = self.forwards.precompute(self.work, self.layout)
        self.loss_scale = 1.0 / (plumbing.grad_accum_steps * self.work.slots)

    def step(self, micro_index: int, slot: int) -> StepResult:
        """Micro-batch ``micro_index``'s loss at ``slot``: the reference's forward (first: a LoRA reference is the
        policy with its adapters off), the policy's, the objective's terms each scaled by 1/(GA·slots)."""
        start, stop = self.layout.bounds[micro_index]
        model_input = self.work.model_input(start, stop, slot)
        forwards, reference_velocity = self.forwards, None
        if self.work.wants_reference:
            assert self.reference is not None  # checked on construction
            cond, guidance = forwards.fed(model_input, start, stop)
            reference_velocity = self.reference.reference_prediction(
                model_input.latents, cond, model_input.timesteps, guidance, forwards.img_ids, forwards.device_type,
                forwards.compute_dtype,
            )  # fmt: skip
        precomputed = {name: velocities[micro_index][slot] for name, velocities in self.precomputed.items()}
        if self.retained is not None:  # the rollout's forward, kept: a leaf whose gradient ``after_backward`` hands on
            velocity = self.retained.step_velocity(
                range(start, stop), self.work.train_timestep_indices[start:stop, slot]
            )
        else:
            velocity = forwards.velocity(model_input, start, stop)
        step_loss = self.work.loss(
            UpdateStep(micro_index, start, stop, slot, model_input, velocity, reference_velocity, precomputed)
        )
        loss = step_loss.terms[0] * self.loss_scale
        for term in step_loss.terms[1:]:
            loss = loss + term * self.loss_scale
        return StepResult(loss, {"loss_sum": loss.detach(), **step_loss.metrics}, stop - start)

    def after_backward(self) -> None:
        """After a step's backward: with the rollout's graphs kept, its gradient goes on into them (``retain.py``)."""
        if self.retained is not None:
            self.retained.after_backward()


class Trainee(Protocol):
    """What an update trains and steps: the training's parts, or the bench's and the deep check's own."""

    @property
    def transformer(self) -> nn.Module: ...
    @property
    def optimizer(self) -> Any: ...  # step() and zero_grad(): a torch optimizer, or the bench's timed wrapper
    @property
    def lr_scheduler(self) -> Any: ...  # step(); its last_epoch counts the run's optimizer steps
    @property
    def reference(self) -> ReferenceModel | None: ...  # answers the KL term's forwards; None without a KL


def run_update(
    trainee: Trainee,
    objective: Objective,
    rollout: Rollout | FinalSamples,
    cond: Conditioning,
    advantages: torch.Tensor,
    plumbing: UpdatePlumbing,
    *,
    device_type: str,
    generator_cpu: torch.Generator,
) -> UpdateStats:
    """Train ``trainee.transformer`` on one rollout with ``objective``; returns statistics reduced once at the end.

    Computation happens on ``cond.prompt_embeds.device``; ``advantages`` [B] are already clipped;
    ``generator_cpu`` draws what the objective draws (save it for an exact resume). For each micro-batch, each of its ``work.slots`` loss steps (``UpdatePass.step``) is
    backpropagated at once (no graph is kept across steps). After micro-batch m, if (m+1) % GA == 0 (the recipe's
    ``(i//mbs+1) % GA == 0``), an ``optimizer_step``. Gradients left over at the end (micro-batch count not a
    multiple of GA) are stepped too, with the same scale, so that window weighs less; DanceGRPO dropped them. A
    boundary whose gradient norm is not finite is skipped (weights untouched) and shows as a non-finite entry of
    ``UpdateStats.grad_norms``. Gradients present on entry are discarded.
    """
    transformer, optimizer, lr_scheduler = trainee.transformer, trainee.optimizer, trainee.lr_scheduler
    update = UpdatePass(
        transformer, objective, rollout, cond, advantages, plumbing, device_type=device_type,
        generator_cpu=generator_cpu, reference=trainee.reference,
    )  # fmt: skip
    specs = update_metrics(objective)
    tally = MetricTally(specs, cond.prompt_embeds.device, rollout.num_steps)
    grad_norms: list[torch.Tensor] = []
    reshard_sharded_modules(transformer)
    transformer.train()
    optimizer.zero_grad(set_to_none=True)
    pending = False
    for micro_index in range(update.layout.num_micro_batches):
        for slot in range(update.work.slots):
            step = update.step(micro_index, slot)
            step.loss.backward()
            update.after_backward()
            pending = True
            tally.add(step)
        if (micro_index + 1) % plumbing.grad_accum_steps == 0:
            grad_norms.append(optimizer_step(transformer, optimizer, lr_scheduler, plumbing.max_grad_norm))
            pending = False
    if pending:
        grad_norms.append(optimizer_step(transformer, optimizer, lr_scheduler, plumbing.max_grad_norm))
    norms = torch.stack(grad_norms).to(cond.prompt_embeds.device)
    taken = int(torch.isfinite(norms).sum())
    return UpdateStats(
        metrics=tally.result(),
        specs=specs,
        grad_norms=norms,
        optimizer_steps=taken,
        skipped_steps=len(grad_norms) - taken,
        num_microbatches=update.layout.num_micro_batches,
        train_timestep_indices=update.work.train_timestep_indices,
    )


def skipped_update(
    specs: Mapping[str, Metric],
    *,
    num_trajectories: int,
    num_steps: int,
    micro_batch_size: int,
    grad_accum_steps: int,
    device: torch.device,
) -> UpdateStats:
    """The statistics of an update that did not run (no usable reward anywhere): no forward, no optimizer step.

    Every accumulation boundary counts as skipped and the metrics are NaN (nothing was measured).
    """
    num_micro_batches = -(-num_trajectories // micro_batch_size)
    num_boundaries = -(-num_micro_batches // grad_accum_steps)
    return UpdateStats(
        metrics=unmeasured(specs, num_steps, device),
        specs=specs,
        grad_norms=torch.full((num_boundaries,), float("nan"), device=device),
        optimizer_steps=0,
        skipped_steps=num_boundaries,
        num_microbatches=num_micro_batches,
        train_timestep_indices=torch.empty((num_trajectories, 0), dtype=torch.int64),
        update_skipped=True,
    )
