"""The GRPO policy update: PPO-clip on a random subset of each trajectory's timesteps, micro-batched,
with gradient accumulation, clipping, and a guard that never lets a non-finite gradient reach the weights."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from fluxgrpo.errors import UsageError
from fluxgrpo.grpo.loss import clipped_policy_loss
from fluxgrpo.grpo.rollout import predict_velocity
from fluxgrpo.grpo.schedule import model_timesteps, num_train_timesteps
from fluxgrpo.grpo.sde import sde_step
from fluxgrpo.grpo.types import Conditioning, OptimizerStepEvent, Rollout, UpdateStats
from fluxgrpo.runtime.dist import reshard_sharded_modules


class _Ema(Protocol):
    def update(self, model: nn.Module) -> None: ...


def _as_plain_tensor(value: torch.Tensor) -> torch.Tensor:
    """clip_grad_norm_ returns a DTensor for FSDP2 (DTensor) parameters; make it an ordinary tensor."""
    full_tensor = getattr(value, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else value


def draw_train_timesteps(
    num_trajectories: int, num_steps: int, num_train: int, generator: torch.Generator
) -> torch.Tensor:
    """[B, T] σ-table indices: for each trajectory in order, the first T of its own randperm(N−1).

    A random subset of the trainable transitions 0…N−2 without replacement, visited in random order,
    drawn independently per trajectory (DanceGRPO §6.2).
    """
    perms = [torch.randperm(num_steps - 1, generator=generator)[:num_train] for _ in range(num_trajectories)]
    return torch.stack(perms)


def policy_update(
    transformer: nn.Module,
    rollout: Rollout,
    cond: Conditioning,
    advantages: torch.Tensor,
    *,
    sigmas: torch.Tensor | None = None,
    timestep_fraction: float,
    clip_range: float,
    adv_clip_max: float,
    micro_batch_size: int,
    grad_accum_steps: int,
    max_grad_norm: float,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    device_type: str,
    generator_cpu: torch.Generator,
    ema: _Ema | None = None,
    on_optimizer_step: Callable[[OptimizerStepEvent], None] | None = None,
    compute_dtype: torch.dtype | None = None,
) -> UpdateStats:
    """Train the policy on one rollout; returns statistics reduced once at the end.

    Procedure (DanceGRPO §6, batched as in the Ascend recipe):
    - The last transition is never trained; each trajectory b draws randperm(N−1) from ``generator_cpu``
      (trajectories in order) and trains on its first T = int((N−1)·timestep_fraction) entries.
    - Trajectories are taken in micro-batches of ``micro_batch_size``; for k < T, micro-batch step k stacks
      each trajectory's own k-th timestep, so σ differs per sample.
    - Each step: forward in train mode under autocast, log-prob of the stored next latent via ``sde_step``,
      PPO-clip loss scaled by 1/(GA·T), backward at once (no graph is kept across steps).
    - After micro-batch m, if (m+1) % GA == 0 (the recipe's ``(i//mbs+1) % GA == 0``), an optimizer step:
      ``clip_grad_norm_(max_grad_norm)`` over the trainable parameters (global norm, before clipping), then
      ``optimizer.step()``, ``lr_scheduler.step()``, ``ema.update()``, ``zero_grad``. Gradients left over at
      the end (micro-batch count not a multiple of GA) are stepped too, with the same 1/(GA·T) scale, so that
      window weighs less; DanceGRPO dropped them.
    - A non-finite gradient norm skips that boundary: gradients are zeroed, the optimizer, scheduler and EMA
      are not stepped, and the weights stay exactly as they were. The check is one host sync per boundary
      (the global norm is already reduced over ranks, so every rank takes the same branch).

    Gradients present on entry are discarded. Computation happens on ``cond.prompt_embeds.device``.

    Args:
        transformer: FluxTransformer2DModel-like module, plain or FSDP2 ``fully_shard``-ed.
        rollout: from ``generate_rollout`` with the same conditioning.
        cond: one row per trajectory.
        advantages: [B] per-trajectory advantages.
        sigmas: the exact σ table; defaults to ``rollout.sigmas`` and must match its length.
        timestep_fraction: fraction of the N−1 trainable transitions to train on.
        clip_range: PPO ε.
        adv_clip_max: advantage clip bound.
        micro_batch_size: trajectories per forward.
        grad_accum_steps: micro-batches per optimizer step (GA).
        max_grad_norm: global gradient-norm clip.
        optimizer: built over the transformer's trainable parameters.
        lr_scheduler: anything with ``step()``; stepped once per optimizer step taken.
        device_type: the runtime device type, for autocast.
        generator_cpu: CPU RNG for the timestep permutations (save it for an exact resume).
        ema: updated once per optimizer step taken.
        on_optimizer_step: called at every boundary, taken or skipped.
        compute_dtype: autocast dtype; None is the runtime's choice for ``device_type``.
    """
    if micro_batch_size < 1:
        raise UsageError(f"--train-micro-batch-size must be at least 1, got {micro_batch_size}")
    if grad_accum_steps < 1:
        raise UsageError(f"--gradient-accumulation-steps must be at least 1, got {grad_accum_steps}")
    num_trajectories, num_steps = rollout.num_trajectories, rollout.num_steps
    if advantages.shape != (num_trajectories,):
        raise ValueError(f"advantages must be [{num_trajectories}], got {tuple(advantages.shape)}")
    if cond.num_rows != num_trajectories:
        raise ValueError(f"{cond.num_rows} conditioning rows for {num_trajectories} trajectories")
    if sigmas is None:
        sigmas = rollout.sigmas
    if sigmas.shape != (num_steps + 1,):
        raise ValueError(f"σ table has {sigmas.shape[0]} points but the rollout has {num_steps} steps")
    num_train = num_train_timesteps(num_steps, timestep_fraction)

    device = cond.prompt_embeds.device
    sigmas = sigmas.to(device=device, dtype=torch.float32)
    fed_timesteps = model_timesteps(sigmas)
    img_ids = rollout.img_ids.to(device)
    latents = rollout.latents.to(device)
    old_log_probs = rollout.log_probs.to(device)
    advantages = advantages.to(device=device, dtype=torch.float32)
    guidance_values = torch.full((num_trajectories,), rollout.guidance, dtype=torch.float32, device=device)

    train_indices = draw_train_timesteps(num_trajectories, num_steps, num_train, generator_cpu)  # [B, T] cpu
    train_indices_device = train_indices.to(device)
    loss_scale = 1.0 / (grad_accum_steps * num_train)

    zero = torch.zeros((), dtype=torch.float32, device=device)
    loss_sum, ratio_sum, clipped_sum = zero.clone(), zero.clone(), zero.clone()
    ratio_min = torch.full((), float("inf"), device=device)
    ratio_max = torch.full((), float("-inf"), device=device)
    first_abs_log_ratio = zero.clone()
    grad_norms: list[torch.Tensor] = []
    optimizer_steps = skipped_steps = 0

    def boundary() -> None:
        nonlocal optimizer_steps, skipped_steps
        # Walked after backward, when FSDP2 has resharded: these are the parameters the optimizer holds.
        trainable = [parameter for parameter in transformer.parameters() if parameter.requires_grad]
        norm = _as_plain_tensor(torch.nn.utils.clip_grad_norm_(trainable, max_grad_norm)).detach()
        norm = norm.to(device=device, dtype=torch.float32)
        grad_norms.append(norm)
        finite = bool(torch.isfinite(norm))  # the one host sync per optimizer step
        if finite:
            optimizer.step()
            lr_scheduler.step()
            if ema is not None:
                ema.update(transformer)
            optimizer_steps += 1
        else:
            skipped_steps += 1
        optimizer.zero_grad(set_to_none=True)
        if on_optimizer_step is not None:
            on_optimizer_step(OptimizerStepEvent(index=len(grad_norms) - 1, grad_norm=norm, skipped=not finite))

    reshard_sharded_modules(transformer)
    transformer.train()
    optimizer.zero_grad(set_to_none=True)
    micro_batches = [
        (start, min(start + micro_batch_size, num_trajectories))
        for start in range(0, num_trajectories, micro_batch_size)
    ]
    pending = False
    for micro_index, (start, stop) in enumerate(micro_batches):
        rows = torch.arange(start, stop, device=device)
        micro_cond = cond.rows(start, stop)
        for k in range(num_train):
            step_index = train_indices_device[start:stop, k]  # [m] each trajectory's own k-th timestep
            x = latents[rows, step_index]
            x_next = latents[rows, step_index + 1]
            velocity = predict_velocity(
                transformer,
                x,
                micro_cond,
                fed_timesteps[step_index],
                guidance_values[start:stop],
                img_ids,
                device_type,
                compute_dtype,
            )
            new_log_prob = sde_step(
                x, velocity, sigmas[step_index], sigmas[step_index + 1], rollout.eta, prev_sample=x_next
            ).log_prob
            loss, stats = clipped_policy_loss(
                new_log_prob,
                old_log_probs[rows, step_index],
                advantages[start:stop],
                clip_range,
                adv_clip_max,
                loss_scale,
            )
            loss.backward()
            pending = True
            count = stop - start
            loss_sum += loss.detach()
            ratio_sum += stats.ratio_mean * count
            clipped_sum += stats.clip_fraction * count
            ratio_min = torch.minimum(ratio_min, stats.ratio_min)
            ratio_max = torch.maximum(ratio_max, stats.ratio_max)
            if micro_index == 0:
                first_abs_log_ratio = torch.maximum(first_abs_log_ratio, stats.max_abs_log_ratio)
        if (micro_index + 1) % grad_accum_steps == 0:
            boundary()
            pending = False
    if pending:
        boundary()

    num_samples = num_trajectories * num_train
    return UpdateStats(
        loss_sum=loss_sum,
        ratio_mean=ratio_sum / num_samples,
        ratio_min=ratio_min,
        ratio_max=ratio_max,
        clip_fraction=clipped_sum / num_samples,
        grad_norms=torch.stack(grad_norms),
        first_microbatch_max_abs_log_ratio=first_abs_log_ratio,
        optimizer_steps=optimizer_steps,
        skipped_steps=skipped_steps,
        num_microbatches=len(micro_batches),
        train_timestep_indices=train_indices,
    )
