"""``--objective grpo``: the PPO-clip surrogate on the SDE trajectory's per-step log-probs (DanceGRPO, Flow-GRPO,
CPS, MixGRPO windows, the KL to the reference, GRPO-Guard), on a random subset of each trajectory's timesteps."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fluxgrpo.grpo.loss import clipped_policy_loss
from fluxgrpo.grpo.objectives.base import Metric, StepResult
from fluxgrpo.grpo.ratio import guard_log_ratio, guard_step_weight
from fluxgrpo.grpo.reference import ReferenceModel, mean_kl
from fluxgrpo.grpo.rollout import predict_velocity
from fluxgrpo.grpo.samplers import Sampler
from fluxgrpo.grpo.schedule import model_timesteps
from fluxgrpo.grpo.types import Conditioning, Rollout

GRPO_METRICS = {
    "loss_sum": Metric("loss", "sum"),  # Σ over (micro-batch, step) of the scaled loss: DanceGRPO's `total_loss`
    "ratio_mean": Metric("ratio_mean", "mean"),  # mean ρ over every trained (trajectory, timestep)
    "ratio_min": Metric("ratio_min", "min"),
    "ratio_max": Metric("ratio_max", "max"),
    "clip_fraction": Metric("clip_fraction", "mean"),  # fraction of pairs with |ρ−1| > clip_range
    "first_microbatch_max_abs_log_ratio": Metric("first_abs_log_ratio", "max"),  # micro-batch 0, before any step
    "kl_mean": Metric("kl", "mean"),  # mean KL to the reference; NaN when the KL is off
    "ratio_sum_per_step": Metric("ratio_mean_per_step", "per_step", count_name="count_per_step"),
}
GRPO_PROGRESS = "ratio {ratio_mean:.4f} [{ratio_min:.4f}, {ratio_max:.4f}] · clip {clip_fraction:.2f}"


@dataclass(frozen=True)
class UpdateSettings:
    """The hyperparameters of one GRPO policy update (validated by ``TrainConfig``; named as there)."""

    num_train_timesteps: int  # T: timesteps each trajectory trains on
    clip_range: float  # PPO ε
    micro_batch_size: int  # trajectories per forward
    grad_accum_steps: int  # micro-batches per optimizer step (GA)
    max_grad_norm: float  # global gradient-norm clip
    compute_dtype: torch.dtype | None = None  # autocast dtype; None is the runtime's choice
    kl_beta: float = 0.0  # weight of the KL to the reference (0: off, no reference forward)
    ratio_normalization: str = "none"  # ``config.RATIO_NORMALIZATIONS``


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


def micro_batch_bounds(num_trajectories: int, micro_batch_size: int) -> list[tuple[int, int]]:
    return [
        (start, min(start + micro_batch_size, num_trajectories))
        for start in range(0, num_trajectories, micro_batch_size)
    ]


class GrpoObjective:
    """PPO-clip on the rollout's log-probs: the procedure of ``grpo.update.policy_update``."""

    name = "grpo"
    keeps_trajectory = True
    metrics = GRPO_METRICS
    progress = GRPO_PROGRESS

    def __init__(self, settings: UpdateSettings, reference: ReferenceModel | None = None) -> None:
        self.settings = settings
        self.reference = reference

    def prepare(
        self,
        transformer: nn.Module,
        rollout: Rollout,
        cond: Conditioning,
        advantages: torch.Tensor,
        *,
        device_type: str,
        generator_cpu: torch.Generator,
    ) -> GrpoWork:
        _check_update_inputs(rollout, cond, advantages, self.settings, self.reference)
        return GrpoWork(
            transformer, rollout, cond, advantages, self.settings, self.reference, device_type, generator_cpu
        )

    def rollout_policy(self) -> None:
        """Rollouts sample with the current policy."""
        return None

    def finish(self, transformer: nn.Module, optimizer_steps: int) -> None:
        """Nothing to do after a GRPO update (the EMA, if any, is the loop's)."""


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
    sampler: Sampler

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
        )


class GrpoWork:
    """One GRPO update: each trajectory's own T timesteps (``draw_train_timesteps``); slot k of a micro-batch stacks
    each trajectory's k-th timestep, so σ differs per sample."""

    def __init__(
        self,
        transformer: nn.Module,
        rollout: Rollout,
        cond: Conditioning,
        advantages: torch.Tensor,
        settings: UpdateSettings,
        reference: ReferenceModel | None,
        device_type: str,
        generator_cpu: torch.Generator,
    ) -> None:
        device = cond.prompt_embeds.device
        self.transformer, self.cond, self.settings, self.reference = transformer, cond, settings, reference
        self.device_type = device_type
        self.trajectories = _TrainingTrajectories.on_device(rollout, advantages, device, settings)
        num_trajectories, self.slots = rollout.num_trajectories, settings.num_train_timesteps
        self.train_timestep_indices = draw_train_timesteps(
            num_trajectories, rollout.trainable, self.slots, generator_cpu
        )  # [B, T] cpu
        self._indices_device = self.train_timestep_indices.to(device)
        self.loss_scale = 1.0 / (settings.grad_accum_steps * self.slots)
        self.bounds = micro_batch_bounds(num_trajectories, settings.micro_batch_size)
        self.num_micro_batches = len(self.bounds)

    def loss(self, micro_index: int, slot: int) -> StepResult:
        """The loss of the micro-batch's trajectories, each at its own σ-table step.

        The policy's log-prob of the stored next latent gives log ρ (plain, or GRPO-Guard's re-centred one with its
        1/|dt| weights); the PPO-clip loss on it, plus β·KL between the policy's and the reference's step means.
        """
        start, stop = self.bounds[micro_index]
        step_index = self._indices_device[start:stop, slot]  # [m] each trajectory's own k-th timestep
        trajectories, settings = self.trajectories, self.settings
        rows = torch.arange(start, stop, device=step_index.device)
        x = trajectories.latents[rows, step_index]
        x_next = trajectories.latents[rows, step_index + 1]
        fed, guidance = trajectories.fed_timesteps[step_index], trajectories.guidance_values[start:stop]
        sigma, sigma_next = trajectories.sigmas[step_index], trajectories.sigmas[step_index + 1]
        img_ids, compute_dtype, device_type = trajectories.img_ids, settings.compute_dtype, self.device_type
        micro_cond = self.cond.rows(start, stop)
        measures_kl = settings.kl_beta > 0
        if measures_kl:  # first: a LoRA reference is the policy with its adapters off
            assert self.reference is not None  # checked on entry
            reference_velocity = self.reference.reference_prediction(
                x, micro_cond, fed, guidance, img_ids, device_type, compute_dtype
            )
        velocity = predict_velocity(self.transformer, x, micro_cond, fed, guidance, img_ids, device_type, compute_dtype)
        sampler = trajectories.sampler
        new = sampler.step(x, velocity, sigma, sigma_next, prev_sample=x_next)
        old_log_prob = trajectories.old_log_probs[rows, step_index]
        sample_weights = None
        if settings.ratio_normalization == "grpo-guard":
            assert trajectories.old_means is not None  # moved whenever guard is on
            log_ratio = guard_log_ratio(new, old_log_prob, trajectories.old_means[rows, step_index])
            sample_weights = guard_step_weight(sigma, sigma_next)
        else:
            log_ratio = new.log_prob - old_log_prob
        advantages = trajectories.advantages[start:stop]
        loss, stats = clipped_policy_loss(log_ratio, advantages, settings.clip_range, self.loss_scale, sample_weights)
        count = stop - start
        metrics: dict[str, object] = {
            "loss_sum": None,  # filled below, once the KL term is in
            "ratio_sum_per_step": (step_index, torch.exp(log_ratio.detach())),
            "ratio_mean": stats.ratio_mean * count,
            "clip_fraction": stats.clip_fraction * count,
            "ratio_min": stats.ratio_min,
            "ratio_max": stats.ratio_max,
        }
        if micro_index == 0:
            metrics["first_microbatch_max_abs_log_ratio"] = stats.max_abs_log_ratio
        if measures_kl:
            reference_mean = sampler.step(x, reference_velocity, sigma, sigma_next, prev_sample=x_next).mean
            kl = mean_kl(new.mean, reference_mean, new.kl_scale)  # [m]
            loss = loss + settings.kl_beta * kl.mean() * self.loss_scale
            metrics["kl_mean"] = kl.detach().sum()
        metrics["loss_sum"] = loss.detach()
        return StepResult(loss=loss, metrics=metrics, num_samples=count)
