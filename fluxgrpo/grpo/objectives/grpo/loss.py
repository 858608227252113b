"""``--objective grpo``: the PPO-clip surrogate on the SDE trajectory's per-step log-probs (DanceGRPO, Flow-GRPO,
CPS, MixGRPO windows, the KL to the reference, GRPO-Guard), on a random subset of each trajectory's timesteps.

Procedure (DanceGRPO §6, batched as in the Ascend recipe):
- The last transition is never trained; each trajectory b draws randperm(N−1) from the update's CPU generator
  (trajectories in order) and trains on its first T = ``num_train_timesteps`` entries (``draw_train_timesteps``).
  With an SDE window the permutation is of the window's steps (``Rollout.trainable``).
- Slot k of a micro-batch stacks each trajectory's own k-th timestep, so σ differs per sample.
- Each step: the policy's velocity at the stored z_k (the driver's forward), the log-prob of the stored z_{k+1}
  with the rollout's sampler, the ratio (``--ratio-normalization``: plain, or GRPO-Guard's), the PPO-clip loss
  plus β·KL to the reference (``--kl-beta`` > 0). The driver scales both terms by 1/(GA·T).

The ratio. ``none`` (DanceGRPO, Flow-GRPO): log ρ = lp_θ − lp_old. ``grpo-guard`` (GRPO-Guard, arXiv 2510.22319,
read from its authors' ``train_sd3_GRPO_Guard.py``): with s the SDE step's std and b = mean((μθ − μ_old)²)/(2s²),

    log ρ = (lp_θ − lp_old + b)·s = mean(ξ ⊙ (μθ − μ_old)),   ξ = (x' − μ_old)/s,

so the normalised log-ratio has mean 0 over the step noise and a scale that does not depend on the step (the raw
one has mean −b < 0: the drift the method fixes), and each step's loss is weighted by 1/|dt|, which cancels the
dt in ∂μ/∂v̂ so every step's gradient has the same size. The authors compute b and s as one number per batch (all
their samples share a step); here each sample has its own step, so each gets its own b, s and dt.

The KL (Flow-GRPO's), per trained step: mean over elements of (μθ − μ_ref)² / (2·std_dev_t²), μ the SDE step's mean
from the policy's and the reference's velocity at the same (x, σ), std_dev_t the sampler's (``SdeStep.kl_scale``).
For the Gaussian samplers that is the KL between the two steps' distributions times |dt| (the authors divide by
std_dev_t², not by the step variance std_dev_t²·|dt|); fluxgrpo keeps their definition so their β values carry over.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fluxgrpo.grpo.objectives.base import Metric, ModelInput, ObjectiveBase, StepLoss, UpdateLayout, UpdateStep
from fluxgrpo.grpo.objectives.entry import ObjectiveRun
from fluxgrpo.grpo.samplers import SdeStep
from fluxgrpo.grpo.schedule import model_timesteps
from fluxgrpo.grpo.types import Rollout
from fluxgrpo.grpo.weight_copies import PolicyCopy

GRPO_METRICS = {
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
class LossStats:
    """Detached 0-d fp32 diagnostics of one loss call (M = samples in the call)."""

    ratio_mean: torch.Tensor
    ratio_min: torch.Tensor
    ratio_max: torch.Tensor
    clip_fraction: torch.Tensor  # fraction of the M ratios with |ρ−1| > clip_range
    max_abs_log_ratio: torch.Tensor  # max |log ρ|; ≈0 before the first optimizer step


def clipped_policy_loss(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
    sample_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """mean(w·max(−A·ρ, −A·clamp(ρ, 1−ε, 1+ε))) with ρ = exp(log_ratio) and w = ``sample_weights`` (1): DanceGRPO's
    surrogate (no entropy bonus).

    Args:
        log_ratio: [M] log ρ = log π_θ − log π_old (differentiable through π_θ).
        advantages: [M] advantages of each sample's trajectory, already clipped (``group_advantages``).
        clip_range: ε.
        sample_weights: [M] per-sample weights (GRPO-Guard's 1/|dt|); None weighs all alike.

    Returns:
        (loss, stats): the scalar loss (the update driver scales it by 1/(GA·T_train), so that the gradients
        summed over one accumulation window are the gradient of the mean surrogate over that window), and
        detached diagnostics.
    """
    ratio = torch.exp(log_ratio)
    advantages = advantages.detach().to(ratio.dtype)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    per_sample = torch.maximum(unclipped_loss, clipped_loss)
    if sample_weights is not None:
        per_sample = per_sample * sample_weights.detach()
    surrogate = per_sample.mean()
    with torch.no_grad():
        detached = ratio.detach()
        stats = LossStats(
            ratio_mean=detached.mean(),
            ratio_min=detached.min(),
            ratio_max=detached.max(),
            clip_fraction=((detached - 1.0).abs() > clip_range).to(torch.float32).mean(),
            max_abs_log_ratio=log_ratio.detach().abs().max(),
        )
    return surrogate, stats


def guard_log_ratio(new: SdeStep, old_log_prob: torch.Tensor, old_mean: torch.Tensor) -> torch.Tensor:
    """[B] GRPO-Guard's normalised log ρ for a Gaussian step (``dance`` or ``flow-grpo``)."""
    std = new.std.reshape(-1) if new.std.ndim else new.std
    squared = (new.mean - old_mean.detach()) ** 2
    bias = squared.mean(dim=tuple(range(1, squared.ndim))) / (2 * std**2)
    return (new.log_prob - old_log_prob + bias) * std


def guard_step_weight(sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
    """[B] 1/|dt| = 1/(σ − σ'): GRPO-Guard's per-step gradient re-weighting."""
    return 1.0 / (sigma - sigma_next)


def mean_kl(policy_mean: torch.Tensor, reference_mean: torch.Tensor, kl_scale: torch.Tensor) -> torch.Tensor:
    """[B] Flow-GRPO's KL: mean over all but the batch axis of (μθ − μ_ref)² / (2·kl_scale²)."""
    kl = (policy_mean - reference_mean.detach()) ** 2 / (2 * kl_scale**2)
    return kl.mean(dim=tuple(range(1, kl.ndim)))


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


@dataclass(frozen=True)
class GrpoSettings:
    """The hyperparameters of the GRPO loss (the run's, validated by its config; named as there)."""

    num_train_timesteps: int  # T: timesteps each trajectory trains on (train_timesteps)
    clip_range: float  # PPO ε
    kl_beta: float = 0.0  # weight of the KL to the reference (0: off, no reference forward)
    ratio_normalization: str = "none"  # ``config.RATIO_NORMALIZATIONS``

    @classmethod
    def from_run(cls, run: ObjectiveRun) -> GrpoSettings:
        return cls(run.train_timesteps, run.clip_range, run.kl_beta, run.ratio_normalization)


class GrpoObjective(ObjectiveBase):
    """PPO-clip on the rollout's log-probs (the module docstring)."""

    name = "grpo"
    keeps_trajectory = True
    metrics = GRPO_METRICS
    progress = GRPO_PROGRESS

    def __init__(self, settings: GrpoSettings) -> None:
        self.settings = settings
        self.policy_copies: dict[str, PolicyCopy] = {}  # none: the ratio's π_old is the rollout's own log-prob

    @classmethod
    def from_config(cls, run: ObjectiveRun, policy_copies: dict[str, PolicyCopy]) -> GrpoObjective:
        return cls(GrpoSettings.from_run(run))

    @property
    def keeps_step_means(self) -> bool:
        return self.settings.ratio_normalization == "grpo-guard"

    def prepare(
        self, rollout: Rollout, advantages: torch.Tensor, layout: UpdateLayout, generator_cpu: torch.Generator
    ) -> GrpoWork:
        num_train, trainable = self.settings.num_train_timesteps, rollout.trainable
        if not 1 <= num_train <= len(trainable):
            raise ValueError(
                f"cannot train {num_train} timesteps of {len(trainable)} trainable ones (1…{len(trainable)})"
            )
        if self.keeps_step_means and rollout.means is None:
            raise ValueError("GRPO-Guard needs the rollout's step means: RolloutSettings(keep_means=True)")
        return GrpoWork(self.settings, rollout, advantages, generator_cpu)

    def planned_train_indices(
        self, num_trajectories: int, trainable: range, generator_cpu: torch.Generator
    ) -> torch.Tensor:
        """[B, T] the steps ``prepare`` will draw from ``generator_cpu`` as it is now, drawn from a copy (the generator
        does not move): ``--retain-rollout-graphs`` keeps their forwards in the rollout (``grpo/retain.py``)."""
        copy = torch.Generator()
        copy.set_state(generator_cpu.get_state())
        return draw_train_timesteps(num_trajectories, trainable, self.settings.num_train_timesteps, copy)

    def rollout_policy(self) -> None:
        """Rollouts sample with the current policy."""
        return None

    def finish(self, transformer: torch.nn.Module, optimizer_steps: int) -> None:
        """Nothing to do after a GRPO update (the EMA, if any, is the loop's)."""


class GrpoWork:
    """One GRPO update: the stored trajectories on the computation device, and each trajectory's own T timesteps."""

    precomputed_forwards = ()

    def __init__(
        self, settings: GrpoSettings, rollout: Rollout, advantages: torch.Tensor, generator_cpu: torch.Generator
    ) -> None:
        device = advantages.device
        self.settings, self.advantages, self.sampler = settings, advantages, rollout.sampler
        self.guard = settings.ratio_normalization == "grpo-guard"
        self.wants_reference = settings.kl_beta > 0
        self.latents = rollout.latents.to(device)  # [B, K, L, C] z_0 … z_{K−1}
        self.old_log_probs = rollout.log_probs.to(device)  # [B, N]
        # [B, K−1, L, C] μ_old of each SDE step, GRPO-Guard only
        self.old_means = rollout.means.to(device) if self.guard and rollout.means is not None else None
        self.sigmas = rollout.sigmas.to(device=device, dtype=torch.float32)  # [N+1]
        self.fed_timesteps = model_timesteps(self.sigmas)  # what the transformer is fed for each σ
        self.slots = settings.num_train_timesteps
        self.train_timestep_indices = draw_train_timesteps(
            rollout.num_trajectories, rollout.trainable, self.slots, generator_cpu
        )  # [B, T] cpu
        self._indices_device = self.train_timestep_indices.to(device)

    def _rows(self, start: int, stop: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(trajectory rows [m], each one's own σ-table step [m]) of samples start…stop−1 at their slot-th step."""
        step_index = self._indices_device[start:stop, slot]
        return torch.arange(start, stop, device=step_index.device), step_index

    def model_input(self, start: int, stop: int, slot: int) -> ModelInput:
        rows, step_index = self._rows(start, stop, slot)
        return ModelInput(self.latents[rows, step_index], self.fed_timesteps[step_index])

    def loss(self, step: UpdateStep) -> StepLoss:
        """The policy's log-prob of the stored next latent gives log ρ (plain, or GRPO-Guard's re-centred one with
        its 1/|dt| weights); the PPO-clip loss on it, plus β·KL between the policy's and the reference's step
        means."""
        settings = self.settings
        rows, step_index = self._rows(step.start, step.stop, step.slot)
        x, x_next = step.model_input.latents, self.latents[rows, step_index + 1]
        sigma, sigma_next = self.sigmas[step_index], self.sigmas[step_index + 1]
        new = self.sampler.step(x, step.velocity, sigma, sigma_next, prev_sample=x_next)
        old_log_prob = self.old_log_probs[rows, step_index]
        sample_weights = None
        if self.old_means is not None:
            log_ratio = guard_log_ratio(new, old_log_prob, self.old_means[rows, step_index])
            sample_weights = guard_step_weight(sigma, sigma_next)
        else:
            log_ratio = new.log_prob - old_log_prob
        surrogate, stats = clipped_policy_loss(
            log_ratio, self.advantages[step.start : step.stop], settings.clip_range, sample_weights
        )
        count = step.stop - step.start
        metrics: dict[str, object] = {
            "ratio_sum_per_step": (step_index, torch.exp(log_ratio.detach())),
            "ratio_mean": stats.ratio_mean * count,
            "clip_fraction": stats.clip_fraction * count,
            "ratio_min": stats.ratio_min,
            "ratio_max": stats.ratio_max,
        }
        if step.micro_index == 0:
            metrics["first_microbatch_max_abs_log_ratio"] = stats.max_abs_log_ratio
        if step.reference_velocity is None:
            return StepLoss((surrogate,), metrics)
        reference_mean = self.sampler.step(x, step.reference_velocity, sigma, sigma_next, prev_sample=x_next).mean
        kl = mean_kl(new.mean, reference_mean, new.kl_scale)  # [m]
        metrics["kl_mean"] = kl.detach().sum()
        return StepLoss((surrogate, settings.kl_beta * kl.mean()), metrics)
