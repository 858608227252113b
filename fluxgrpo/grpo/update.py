"""The GRPO policy update: PPO-clip on a random subset of each trajectory's timesteps, micro-batched,
with gradient accumulation, clipping, and a guard that never lets a non-finite gradient reach the weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fluxgrpo.grpo.loss import LossStats, clipped_policy_loss
from fluxgrpo.grpo.ratio import guard_log_ratio, guard_step_weight
from fluxgrpo.grpo.reference import ReferenceModel, mean_kl
from fluxgrpo.grpo.rollout import predict_velocity
from fluxgrpo.grpo.samplers import sampler_step
from fluxgrpo.grpo.schedule import model_timesteps
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
    kl_beta: float = 0.0  # weight of the KL to the reference (0: off, no reference forward)
    ratio_normalization: str = "none"  # ``config.RATIO_NORMALIZATIONS``

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> UpdateSettings:
        return cls(
            num_train_timesteps=cfg.train_timesteps,
            clip_range=cfg.clip_range,
            micro_batch_size=cfg.train_micro_batch_size,
            grad_accum_steps=cfg.gradient_accumulation_steps,
            max_grad_norm=cfg.max_grad_norm,
            kl_beta=cfg.kl_beta,
            ratio_normalization=cfg.ratio_normalization,
        )


def _as_plain_tensor(value: torch.Tensor) -> torch.Tensor:
    """clip_grad_norm_ returns a DTensor for FSDP2 (DTensor) parameters; make it an ordinary tensor."""
    full_tensor = getattr(value, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else value


def draw_train_timesteps(
    num_trajectories: int, trainable: range, num_train: int, generator: torch.Generator
) -> torch.Tensor:
    """[B, T] σ-table indices: for each trajectory in order, start + the first T of its own randperm(len(trainable)).

    A random subset of the trainable transitions (DanceGRPO's 0…N−2, or the SDE window) without replacement,
    visited in random order, drawn independently per trajectory (DanceGRPO §6.2).
    """
    perms = [
        trainable.start + torch.randperm(len(trainable), generator=generator)[:num_train]
        for _ in range(num_trajectories)
    ]
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
        ratio_sum_per_step=torch.zeros(rollout.num_steps, device=device),
        count_per_step=torch.zeros(rollout.num_steps, device=device),
        kl_mean=nan,
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
    reference: ReferenceModel | None = None,
) -> UpdateStats:
    """Train the policy on one rollout; returns statistics reduced once at the end.

    Procedure (DanceGRPO §6, batched as in the Ascend recipe):
    - The last transition is never trained; each trajectory b draws randperm(N−1) from ``generator_cpu``
      (trajectories in order) and trains on its first T = ``settings.num_train_timesteps`` entries. With an SDE
      window the permutation is of the window's steps (``rollout.trainable``).
    - Trajectories are taken in micro-batches of ``micro_batch_size``; for k < T, micro-batch step k stacks
      each trajectory's own k-th timestep, so σ differs per sample.
    - Each step: forward in train mode under autocast, log-prob of the stored next latent with the rollout's
      sampler, the ratio (``settings.ratio_normalization``), PPO-clip loss plus β·KL to ``reference`` (when
      ``settings.kl_beta`` > 0), scaled by 1/(GA·T), backward at once (no graph is kept across steps).
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
        reference: the KL's reference model; required when ``settings.kl_beta`` > 0.
    """
    _check_update_inputs(rollout, cond, advantages, settings, reference)
    device = cond.prompt_embeds.device
    trajectories = _TrainingTrajectories.on_device(rollout, advantages, device, settings)
    num_trajectories, num_train = rollout.num_trajectories, settings.num_train_timesteps
    train_indices = draw_train_timesteps(num_trajectories, rollout.trainable, num_train, generator_cpu)  # [B, T] cpu
    train_indices_device = train_indices.to(device)
    loss_scale = 1.0 / (settings.grad_accum_steps * num_train)
    tally = _UpdateTally(rollout.num_steps, device, measures_kl=settings.kl_beta > 0)
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
        micro_cond = cond.rows(start, stop)
        for k in range(num_train):
            step_index = train_indices_device[start:stop, k]  # [m] each trajectory's own k-th timestep
            step = _micro_step_loss(
                transformer, trajectories, micro_cond, start, stop, step_index, settings, loss_scale,
                reference=reference, device_type=device_type,
            )  # fmt: skip
            step.loss.backward()
            pending = True
            tally.add(step_index, step, first_micro_batch=micro_index == 0)
        if (micro_index + 1) % settings.grad_accum_steps == 0:
            grad_norms.append(optimizer_step(transformer, optimizer, lr_scheduler, settings.max_grad_norm))
            pending = False
    if pending:
        grad_norms.append(optimizer_step(transformer, optimizer, lr_scheduler, settings.max_grad_norm))
    return tally.update_stats(grad_norms, train_indices, num_microbatches=len(micro_batches))


def _check_update_inputs(
    rollout: Rollout,
    cond: Conditioning,
    advantages: torch.Tensor,
    settings: UpdateSettings,
    reference: ReferenceModel | None,
) -> None:
    """Raise ValueError for inputs that cannot make an update (programming errors: the config validates sizes)."""
    num_trajectories = rollout.num_trajectories
    if advantages.shape != (num_trajectories,):
        raise ValueError(f"advantages must be [{num_trajectories}], got {tuple(advantages.shape)}")
    if cond.num_rows != num_trajectories:
        raise ValueError(f"{cond.num_rows} conditioning rows for {num_trajectories} trajectories")
    num_train, trainable = settings.num_train_timesteps, rollout.trainable
    if not 1 <= num_train <= len(trainable):
        raise ValueError(f"cannot train {num_train} timesteps of {len(trainable)} trainable ones (1…{len(trainable)})")
    if settings.kl_beta > 0 and reference is None:
        raise ValueError("kl_beta > 0 needs a reference model")
    if settings.ratio_normalization == "grpo-guard" and rollout.means is None:
        raise ValueError("GRPO-Guard needs the rollout's step means: generate_rollout(..., keep_means=True)")


@dataclass(frozen=True)
class _TrainingTrajectories:
    """What the update reads of a rollout, on the computation device: the stored trajectories and their scores."""

    latents: torch.Tensor  # [B, K, L, C] the stored z_0 … z_{K−1} (``Rollout.latents``)
    old_log_probs: torch.Tensor  # [B, N] log π_old of each transition
    old_means: torch.Tensor | None  # [B, K−1, L, C] μ_old of each SDE step (GRPO-Guard only), else None
    advantages: torch.Tensor  # [B] fp32
    sigmas: torch.Tensor  # [N+1] fp32 σ table
    fed_timesteps: torch.Tensor  # [N+1] the timesteps the transformer is fed for each σ
    guidance_values: torch.Tensor  # [B] fp32, the rollout's guidance for every trajectory
    img_ids: torch.Tensor  # [L, 3]
    sampler: str
    eta: float
    sigma_max: float  # flow-grpo's σ₁

    @classmethod
    def on_device(
        cls, rollout: Rollout, advantages: torch.Tensor, device: torch.device, settings: UpdateSettings
    ) -> _TrainingTrajectories:
        guard = settings.ratio_normalization == "grpo-guard"
        sigmas = rollout.sigmas.to(device=device, dtype=torch.float32)
        num_trajectories = rollout.num_trajectories
        return cls(
            latents=rollout.latents.to(device),
            old_log_probs=rollout.log_probs.to(device),
            old_means=rollout.means.to(device) if guard and rollout.means is not None else None,
            advantages=advantages.to(device=device, dtype=torch.float32),
            sigmas=sigmas,
            fed_timesteps=model_timesteps(sigmas),
            guidance_values=torch.full((num_trajectories,), rollout.guidance, dtype=torch.float32, device=device),
            img_ids=rollout.img_ids.to(device),
            sampler=rollout.sampler,
            eta=rollout.eta,
            sigma_max=float(sigmas[1]),
        )


@dataclass(frozen=True)
class _MicroStepLoss:
    """One micro-batch step: the scaled loss to backpropagate and what the statistics need of it (detached)."""

    loss: torch.Tensor  # [] PPO-clip loss (+ β·KL), scaled by 1/(GA·T)
    log_ratio: torch.Tensor  # [m] log ρ, still attached to the graph
    stats: LossStats  # the PPO loss's diagnostics
    kl: torch.Tensor | None  # [m] KL to the reference per sample (detached); None when the KL is off


def _micro_step_loss(
    transformer: nn.Module,
    trajectories: _TrainingTrajectories,
    micro_cond: Conditioning,
    start: int,
    stop: int,
    step_index: torch.Tensor,
    settings: UpdateSettings,
    loss_scale: float,
    *,
    reference: ReferenceModel | None,
    device_type: str,
) -> _MicroStepLoss:
    """The loss of trajectories ``start…stop−1``, each at its own σ-table step ``step_index`` ([m]).

    The policy's log-prob of the stored next latent gives log ρ (plain, or GRPO-Guard's re-centred one with its
    1/|dt| weights); the PPO-clip loss on it, plus β·KL between the policy's and the reference's step means.
    """
    rows = torch.arange(start, stop, device=step_index.device)
    x = trajectories.latents[rows, step_index]
    x_next = trajectories.latents[rows, step_index + 1]
    fed, guidance = trajectories.fed_timesteps[step_index], trajectories.guidance_values[start:stop]
    sigma, sigma_next = trajectories.sigmas[step_index], trajectories.sigmas[step_index + 1]
    img_ids, compute_dtype = trajectories.img_ids, settings.compute_dtype
    measures_kl = settings.kl_beta > 0
    if measures_kl:  # first: a LoRA reference is the policy with its adapters off
        assert reference is not None  # checked on entry
        reference_velocity = reference.reference_prediction(
            x, micro_cond, fed, guidance, img_ids, device_type, compute_dtype
        )
    velocity = predict_velocity(transformer, x, micro_cond, fed, guidance, img_ids, device_type, compute_dtype)
    sampler, eta, sigma_max = trajectories.sampler, trajectories.eta, trajectories.sigma_max
    new = sampler_step(sampler, x, velocity, sigma, sigma_next, eta, sigma_max, prev_sample=x_next)
    old_log_prob = trajectories.old_log_probs[rows, step_index]
    sample_weights = None
    if settings.ratio_normalization == "grpo-guard":
        assert trajectories.old_means is not None  # moved whenever guard is on
        log_ratio = guard_log_ratio(new, old_log_prob, trajectories.old_means[rows, step_index])
        sample_weights = guard_step_weight(sigma, sigma_next)
    else:
        log_ratio = new.log_prob - old_log_prob
    advantages = trajectories.advantages[start:stop]
    loss, stats = clipped_policy_loss(log_ratio, advantages, settings.clip_range, loss_scale, sample_weights)
    kl = None
    if measures_kl:
        reference_mean = sampler_step(
            sampler, x, reference_velocity, sigma, sigma_next, eta, sigma_max, prev_sample=x_next
        ).mean
        kl = mean_kl(new.mean, reference_mean, new.kl_scale)  # [m]
        loss = loss + settings.kl_beta * kl.mean() * loss_scale
        kl = kl.detach()
    return _MicroStepLoss(loss=loss, log_ratio=log_ratio, stats=stats, kl=kl)


class _UpdateTally:
    """The update's statistics, summed on the device step by step (no host sync) and turned into ``UpdateStats``."""

    def __init__(self, num_steps: int, device: torch.device, *, measures_kl: bool) -> None:
        zero = torch.zeros((), dtype=torch.float32, device=device)
        self.device = device
        self.loss_sum, self.ratio_sum, self.clipped_sum = zero.clone(), zero.clone(), zero.clone()
        self.ratio_min = torch.full((), float("inf"), device=device)
        self.ratio_max = torch.full((), float("-inf"), device=device)
        self.first_abs_log_ratio = zero.clone()  # max |log ρ| over micro-batch 0, before any optimizer step
        self.kl_sum = zero.clone() if measures_kl else None
        self.ratio_sum_per_step = torch.zeros(num_steps, dtype=torch.float32, device=device)
        self.count_per_step = torch.zeros(num_steps, dtype=torch.float32, device=device)
        self.num_samples = 0

    def add(self, step_index: torch.Tensor, step: _MicroStepLoss, *, first_micro_batch: bool) -> None:
        """Count one micro-batch step; ``step_index`` ([m]) is each sample's σ-table step."""
        log_ratio = step.log_ratio.detach()
        self.ratio_sum_per_step.index_add_(0, step_index, torch.exp(log_ratio))
        self.count_per_step.index_add_(0, step_index, torch.ones_like(log_ratio, dtype=torch.float32))
        count = log_ratio.shape[0]
        self.num_samples += count
        self.loss_sum += step.loss.detach()
        self.ratio_sum += step.stats.ratio_mean * count
        self.clipped_sum += step.stats.clip_fraction * count
        self.ratio_min = torch.minimum(self.ratio_min, step.stats.ratio_min)
        self.ratio_max = torch.maximum(self.ratio_max, step.stats.ratio_max)
        if first_micro_batch:
            self.first_abs_log_ratio = torch.maximum(self.first_abs_log_ratio, step.stats.max_abs_log_ratio)
        if self.kl_sum is not None and step.kl is not None:
            self.kl_sum += step.kl.sum()

    def update_stats(
        self, grad_norms: list[torch.Tensor], train_indices: torch.Tensor, *, num_microbatches: int
    ) -> UpdateStats:
        """The statistics of the whole update; ``grad_norms`` holds one norm per accumulation boundary."""
        norms = torch.stack(grad_norms).to(self.device)
        taken = int(torch.isfinite(norms).sum())
        num_samples = self.num_samples
        nan = torch.full((), float("nan"), device=self.device)
        return UpdateStats(
            loss_sum=self.loss_sum,
            ratio_mean=self.ratio_sum / num_samples,
            ratio_min=self.ratio_min,
            ratio_max=self.ratio_max,
            clip_fraction=self.clipped_sum / num_samples,
            grad_norms=norms,
            first_microbatch_max_abs_log_ratio=self.first_abs_log_ratio,
            optimizer_steps=taken,
            skipped_steps=len(grad_norms) - taken,
            num_microbatches=num_microbatches,
            train_timestep_indices=train_indices,
            ratio_sum_per_step=self.ratio_sum_per_step,
            count_per_step=self.count_per_step,
            kl_mean=self.kl_sum / num_samples if self.kl_sum is not None else nan,
        )
