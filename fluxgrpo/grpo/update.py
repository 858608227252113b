"""The update driver: micro-batches × gradient accumulation → backward → ``optimizer_step``, with a guard that never
lets a non-finite gradient reach the weights. It knows no objective: ``UpdateWork`` (``grpo/objectives``) turns
each micro-batch step into a loss and its metrics."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fluxgrpo.grpo.objectives.base import Metric, MetricTally, UpdateWork, unmeasured
from fluxgrpo.grpo.objectives.grpo import GrpoObjective, UpdateSettings, draw_train_timesteps
from fluxgrpo.grpo.reference import ReferenceModel
from fluxgrpo.grpo.types import Conditioning, Rollout, UpdateStats
from fluxgrpo.runtime.dist import reshard_sharded_modules

__all__ = ["UpdateSettings", "draw_train_timesteps", "optimizer_step", "policy_update", "run_update"]


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


def run_update(
    transformer: nn.Module,
    work: UpdateWork,
    specs: Mapping[str, Metric],
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    *,
    grad_accum_steps: int,
    max_grad_norm: float,
    num_steps: int,
    device: torch.device,
) -> UpdateStats:
    """Train on ``work``; returns statistics reduced once at the end.

    For each micro-batch, each of its ``work.slots`` loss steps is backpropagated at once (no graph is kept across
    steps). After micro-batch m, if (m+1) % GA == 0 (the recipe's ``(i//mbs+1) % GA == 0``), an ``optimizer_step``.
    Gradients left over at the end (micro-batch count not a multiple of GA) are stepped too, with the same scale,
    so that window weighs less; DanceGRPO dropped them. A boundary whose gradient norm is not finite is skipped
    (weights untouched) and shows as a non-finite entry of ``UpdateStats.grad_norms``. Gradients present on entry
    are discarded. ``num_steps`` is the σ table's length N (per-step metrics have N entries).
    """
    tally = MetricTally(specs, device, num_steps)
    grad_norms: list[torch.Tensor] = []
    reshard_sharded_modules(transformer)
    transformer.train()
    optimizer.zero_grad(set_to_none=True)
    pending = False
    for micro_index in range(work.num_micro_batches):
        for slot in range(work.slots):
            step = work.loss(micro_index, slot)
            step.loss.backward()
            pending = True
            tally.add(step)
        if (micro_index + 1) % grad_accum_steps == 0:
            grad_norms.append(optimizer_step(transformer, optimizer, lr_scheduler, max_grad_norm))
            pending = False
    if pending:
        grad_norms.append(optimizer_step(transformer, optimizer, lr_scheduler, max_grad_norm))
    norms = torch.stack(grad_norms).to(device)
    taken = int(torch.isfinite(norms).sum())
    return UpdateStats(
        metrics=tally.result(),
        specs=specs,
        grad_norms=norms,
        optimizer_steps=taken,
        skipped_steps=len(grad_norms) - taken,
        num_microbatches=work.num_micro_batches,
        train_timestep_indices=work.train_timestep_indices,
    )


def policy_update(
    transformer: nn.Module,
    rollout: Rollout,
    cond: Conditioning,
    advantages: torch.Tensor,
    settings: UpdateSettings,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    *,
    device_type: str,
    generator_cpu: torch.Generator,
    reference: ReferenceModel | None = None,
) -> UpdateStats:
    """The GRPO update (``--objective grpo``): train the policy on one rollout.

    Procedure (DanceGRPO §6, batched as in the Ascend recipe):
    - The last transition is never trained; each trajectory b draws randperm(N−1) from ``generator_cpu``
      (trajectories in order) and trains on its first T = ``settings.num_train_timesteps`` entries. With an SDE
      window the permutation is of the window's steps (``rollout.trainable``).
    - Trajectories are taken in micro-batches of ``micro_batch_size``; for k < T, micro-batch step k stacks
      each trajectory's own k-th timestep, so σ differs per sample.
    - Each step: forward in train mode under autocast, log-prob of the stored next latent with the rollout's
      sampler, the ratio (``settings.ratio_normalization``), PPO-clip loss plus β·KL to ``reference`` (when
      ``settings.kl_beta`` > 0), scaled by 1/(GA·T), backward at once; accumulation as ``run_update``.

    Computation happens on ``cond.prompt_embeds.device``; ``advantages`` [B] are already clipped; ``generator_cpu``
    draws the timestep permutations (save it for an exact resume); ``reference`` is required when ``kl_beta`` > 0.
    """
    objective = GrpoObjective(settings, reference)
    work = objective.prepare(
        transformer, rollout, cond, advantages, device_type=device_type, generator_cpu=generator_cpu
    )
    return run_update(
        transformer, work, objective.metrics, optimizer, lr_scheduler, grad_accum_steps=settings.grad_accum_steps,
        max_grad_norm=settings.max_grad_norm, num_steps=rollout.num_steps, device=cond.prompt_embeds.device,
    )  # fmt: skip


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
