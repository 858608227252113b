"""The GRPO policy update: PPO-clip on a random subset of each trajectory's timesteps, micro-batched,
with gradient accumulation, clipping, and a guard that never lets a non-finite gradient reach the weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fluxgrpo.grpo.loss import clipped_policy_loss
from fluxgrpo.grpo.rollout import predict_velocity
from fluxgrpo.grpo.schedule import model_timesteps
from fluxgrpo.grpo.sde import sde_step
from fluxgrpo.grpo.types import Conditioning, Rollout, UpdateStats
from fluxgrpo.runtime.dist import reshard_sharded_modules

if TYPE_CHECKING:
    from fluxgrpo.config import TrainConfig


@dataclass(frozen=True)
class UpdateSettings:
    """The hyperparameters of one policy update (validated by ``TrainConfig``; named as there)."""

    num_train_timesteps: int  # T: timesteps each trajectory trains on
    clip_range: float  # PPO ε
    micro_batch_size: int  # trajectories per forward
    grad_accum_steps: int  # micro-batches per optimizer step (GA)
    max_grad_norm: float  # global gradient-norm clip
    compute_dtype: torch.dtype | None = None  # autocast dtype; None is the runtime's choice

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> UpdateSettings:
        return cls(
            num_train_timesteps=cfg.train_timesteps,
            clip_range=cfg.clip_range,
            micro_batch_size=cfg.train_micro_batch_size,
            grad_accum_steps=cfg.gradient_accumulation_steps,
            max_grad_norm=cfg.max_grad_norm,
        )


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


def skipped_update(rollout: Rollout, settings: UpdateSettings) -> UpdateStats:
    """The statistics of an update that did not run (no usable reward anywhere): no forward, no optimizer step.

    Every accumulation boundary counts as skipped and the ratio statistics are NaN (nothing was measured).
    """
    device = rollout.latents.device
    num_trajectories = rollout.num_trajectories
    num_micro_batches = -(-num_trajectories // settings.micro_batch_size)
    num_boundaries = -(-num_micro_batches // settings.grad_accum_steps)
    nan = torch.full((), float("nan"), device=device)
    return UpdateStats(
        loss_sum=nan,
        ratio_mean=nan,
        ratio_min=nan,
        ratio_max=nan,
        clip_fraction=nan,
        grad_norms=torch.full((num_boundaries,), float("nan"), device=device),
        first_microbatch_max_abs_log_ratio=nan,
        optimizer_steps=0,
        skipped_steps=num_boundaries,
        num_microbatches=num_micro_batches,
        train_timestep_indices=torch.empty((num_trajectories, 0), dtype=torch.int64),
        update_skipped=True,
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
) -> UpdateStats:
    """Train the policy on one rollout; returns statistics reduced once at the end.

    Procedure (DanceGRPO §6, batched as in the Ascend recipe):
    - The last transition is never trained; each trajectory b draws randperm(N−1) from ``generator_cpu``
      (trajectories in order) and trains on its first T = ``settings.num_train_timesteps`` entries.
    - Trajectories are taken in micro-batches of ``micro_batch_size``; for k < T, micro-batch step k stacks
      each trajectory's own k-th timestep, so σ differs per sample.
    - Each step: forward in train mode under autocast, log-prob of the stored next latent via ``sde_step``,
      PPO-clip loss scaled by 1/(GA·T), backward at once (no graph is kept across steps).
    - After micro-batch m, if (m+1) % GA == 0 (the recipe's ``(i//mbs+1) % GA == 0``), an ``optimizer_step``.
      Gradients left over at the end (micro-batch count not a multiple of GA) are stepped too, with the same
      1/(GA·T) scale, so that window weighs less; DanceGRPO dropped them. A boundary whose gradient norm is not
      finite is skipped (weights untouched) and shows as a non-finite entry of ``UpdateStats.grad_norms``.

    Gradients present on entry are discarded. Computation happens on ``cond.prompt_embeds.device``.

    Args:
        transformer: FluxTransformer2DModel-like module, plain or FSDP2 ``fully_shard``-ed.
        rollout: from ``generate_rollout`` with the same conditioning.
        cond: one row per trajectory.
        advantages: [B] per-trajectory advantages, already clipped (``group_advantages`` does it).
        settings: the update's hyperparameters.
        optimizer: built over the transformer's trainable parameters.
        lr_scheduler: anything with ``step()``; stepped once per optimizer step taken.
        device_type: the runtime device type, for autocast.
        generator_cpu: CPU RNG for the timestep permutations (save it for an exact resume).
    """
    num_trajectories, num_steps = rollout.num_trajectories, rollout.num_steps
    if advantages.shape != (num_trajectories,):
        raise ValueError(f"advantages must be [{num_trajectories}], got {tuple(advantages.shape)}")
    if cond.num_rows != num_trajectories:
        raise ValueError(f"{cond.num_rows} conditioning rows for {num_trajectories} trajectories")
    num_train = settings.num_train_timesteps
    if not 1 <= num_train <= num_steps - 1:
        raise ValueError(f"cannot train {num_train} timesteps of a {num_steps}-step rollout (1…{num_steps - 1})")

    device = cond.prompt_embeds.device
    sigmas = rollout.sigmas.to(device=device, dtype=torch.float32)
    fed_timesteps = model_timesteps(sigmas)
    img_ids = rollout.img_ids.to(device)
    latents = rollout.latents.to(device)
    old_log_probs = rollout.log_probs.to(device)
    advantages = advantages.to(device=device, dtype=torch.float32)
    guidance_values = torch.full((num_trajectories,), rollout.guidance, dtype=torch.float32, device=device)

    train_indices = draw_train_timesteps(num_trajectories, num_steps, num_train, generator_cpu)  # [B, T] cpu
    train_indices_device = train_indices.to(device)
    loss_scale = 1.0 / (settings.grad_accum_steps * num_train)

    zero = torch.zeros((), dtype=torch.float32, device=device)
    loss_sum, ratio_sum, clipped_sum = zero.clone(), zero.clone(), zero.clone()
    ratio_min = torch.full((), float("inf"), device=device)
    ratio_max = torch.full((), float("-inf"), device=device)
    first_abs_log_ratio = zero.clone()
    grad_norms: list[torch.Tensor] = []

    reshard_sharded_modules(transformer)
    transformer.train()
    optimizer.zero_grad(set_to_none=True)
    micro_batches = [
        (start, min(start + settings.micro_batch_size, num_trajectories))
        for start in range(0, num_trajectories, settings.micro_batch_size)
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
                settings.compute_dtype,
            )
            new_log_prob = sde_step(
                x, velocity, sigmas[step_index], sigmas[step_index + 1], rollout.eta, prev_sample=x_next
            ).log_prob
            log_ratio = new_log_prob - old_log_probs[rows, step_index]
            loss, stats = clipped_policy_loss(log_ratio, advantages[start:stop], settings.clip_range, loss_scale)
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
        if (micro_index + 1) % settings.grad_accum_steps == 0:
            grad_norms.append(optimizer_step(transformer, optimizer, lr_scheduler, settings.max_grad_norm))
            pending = False
    if pending:
        grad_norms.append(optimizer_step(transformer, optimizer, lr_scheduler, settings.max_grad_norm))

    norms = torch.stack(grad_norms).to(device)
    taken = int(torch.isfinite(norms).sum())
    num_samples = num_trajectories * num_train
    return UpdateStats(
        loss_sum=loss_sum,
        ratio_mean=ratio_sum / num_samples,
        ratio_min=ratio_min,
        ratio_max=ratio_max,
        clip_fraction=clipped_sum / num_samples,
        grad_norms=norms,
        first_microbatch_max_abs_log_ratio=first_abs_log_ratio,
        optimizer_steps=taken,
        skipped_steps=len(grad_norms) - taken,
        num_microbatches=len(micro_batches),
        train_timestep_indices=train_indices,
    )
