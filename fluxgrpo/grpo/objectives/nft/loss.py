"""``--objective nft``: DiffusionNFT (NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py``; reference §6.1, §6.3).

Rollouts come from the *old* policy θ_old with the deterministic DPM-Solver++(2M) ODE, keeping the final latents
x0 only. Each sample trains on T of the sampler's N timesteps (its own random permutation), with fresh noise ε
(the authors'; ``draws.py``: or one stratified and/or group-shared set of (t, ε)):

    x_t = (1−t)·x0 + t·ε;  v = v_θ(x_t);  v_old = v_θold(x_t) (no grad);  r = clamp(A)/c / 2 + ½  (c = adv clip)
    v⁺ = β·v + (1−β)·v_old;  v⁻ = (1+β)·v_old − β·v;  x̂0^± = x_t − t·v^±
    L^± = mean_d((x̂0^± − x0)²) / sg(mean_d|x̂0^± − x0|).clip(1e-5)       (the adaptive weight in fp64)
    loss = c·mean_b((r·L⁺ + (1−r)·L⁻)/β) + β_KL·mean_b(mean_d((v − v_ref)²))

scaled by 1/(GA·T) as every objective. After the update θ_old ← d·θ_old + (1−d)·θ with d = ``old_policy_decay``
of the optimizer steps taken so far (the authors' ``return_decay``).

v_old of every (sample, slot) is computed before the first optimizer step, with θ_old swapped in once (θ_old does
not change during an update); the authors compute it inline, which gives the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fluxgrpo.grpo.objectives.base import Metric, ModelInput, ObjectiveBase, StepLoss, UpdateLayout, UpdateStep
from fluxgrpo.grpo.objectives.draws import (
    draw_noise,
    group_bounds,
    indices_per_unit,
    linspace_strata,
    random_indices,
    sample_bounds,
)
from fluxgrpo.grpo.objectives.entry import OLD_POLICY, ObjectiveRun
from fluxgrpo.grpo.objectives.nft.settings import NftOptions
from fluxgrpo.grpo.schedule import model_timesteps
from fluxgrpo.grpo.types import FinalSamples
from fluxgrpo.grpo.weight_copies import PolicyCopy

# The authors' decay types: (steps held at 0, rise per step, ceiling).
DECAY_TYPES = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}

NFT_METRICS = {
    "policy_loss": Metric("policy_loss", "mean"),  # c·(r·L⁺ + (1−r)·L⁻)/β per sample, unscaled
    "kl_mean": Metric("kl", "mean"),  # mean_d((v − v_ref)²); NaN when the KL is off
    "old_deviation": Metric("old_deviation", "mean"),  # mean_d((v − v_old)²): how far θ has moved from θ_old
    "x0_error": Metric("x0_error", "mean"),  # mean_d((x̂0 − x0)²) of the policy's own prediction
}
NFT_PROGRESS = "policy {policy_loss:.4g} · old dev {old_deviation:.3g}"


def old_policy_decay(optimizer_steps: int, decay_type: int) -> float:
    """d of θ_old ← d·θ_old + (1−d)·θ after ``optimizer_steps`` steps: 0 while held, then rising to a ceiling."""
    flat, rise, ceiling = DECAY_TYPES[decay_type]
    if optimizer_steps < flat:
        return 0.0
    return min((optimizer_steps - flat) * rise, ceiling)


def optimality_probability(advantages: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """r = clamp(clamp(A, ±c)/c/2 + ½, 0, 1): A = 0 → ½, A ≥ c → 1, A ≤ −c → 0."""
    clipped = advantages.clamp(-adv_clip_max, adv_clip_max)
    return torch.clamp(clipped / adv_clip_max / 2.0 + 0.5, 0, 1)


def nft_policy_loss(
    velocity: torch.Tensor,
    old_velocity: torch.Tensor,
    x_t: torch.Tensor,
    x0: torch.Tensor,
    t: torch.Tensor,
    optimality: torch.Tensor,
    beta: float,
    adv_clip_max: float,
) -> torch.Tensor:
    """[B] c·(r·L⁺ + (1−r)·L⁻)/β per sample (module docstring); t and r are [B]."""
    axes = tuple(range(1, x0.ndim))
    t = t.reshape(-1, *([1] * (x0.ndim - 1)))
    old_velocity = old_velocity.detach()
    positive = beta * velocity + (1 - beta) * old_velocity
    negative = (1.0 + beta) * old_velocity - beta * velocity

    def weighted_error(prediction: torch.Tensor) -> torch.Tensor:
        x0_prediction = x_t - t * prediction
        with torch.no_grad():
            weight = (x0_prediction.double() - x0.double()).abs().mean(dim=axes, keepdim=True).clip(min=1e-5)
        return ((x0_prediction - x0) ** 2 / weight).mean(dim=axes)

    per_sample = optimality * weighted_error(positive) / beta + (1.0 - optimality) * weighted_error(negative) / beta
    return per_sample * adv_clip_max


@dataclass(frozen=True)
class NftSettings:
    """DiffusionNFT's hyperparameters (the config keys in the comments)."""

    num_train_timesteps: int  # T of the N sampler timesteps per sample (int(N·timestep_fraction))
    beta: float = 1.0  # nft_beta: the implicit policies' step β
    kl_beta: float = 0.0  # kl_beta: weight of mean((v − v_ref)²)
    adv_clip_max: float = 5.0  # c
    decay_type: int = 1  # nft_decay_type
    sharing: str = "sample"  # fm_draws: sample (the authors') or group (one (t, ε) set per prompt group)
    timestep_rule: str = "random"  # fm_timestep_rule: random (the authors' permutation) or stratified
    group_size: int = 1  # G, the rows a group-shared draw covers

    @classmethod
    def from_run(cls, run: ObjectiveRun) -> NftSettings:
        options, (sharing, timestep_rule) = run.own(NftOptions), run.draws
        return cls(
            run.train_timesteps, options.beta, run.kl_beta, run.adv_clip_max, options.decay_type, sharing,
            timestep_rule, run.group_size,
        )  # fmt: skip


class NftObjective(ObjectiveBase):
    name = "nft"
    keeps_trajectory = False
    keeps_step_means = False
    metrics = NFT_METRICS
    progress = NFT_PROGRESS

    def __init__(self, settings: NftSettings, old_policy: PolicyCopy) -> None:
        self.settings, self.old_policy = settings, old_policy
        self.policy_copies = {OLD_POLICY: old_policy}

    @classmethod
    def from_config(cls, run: ObjectiveRun, policy_copies: dict[str, PolicyCopy]) -> NftObjective:
        return cls(NftSettings.from_run(run), policy_copies[OLD_POLICY])

    def rollout_policy(self) -> PolicyCopy:
        """The weights rollouts sample with: θ_old."""
        return self.old_policy

    def prepare(
        self, rollout: FinalSamples, advantages: torch.Tensor, layout: UpdateLayout, generator_cpu: torch.Generator
    ) -> NftWork:
        return NftWork(self.settings, rollout, advantages, generator_cpu)

    def finish(self, transformer: nn.Module, optimizer_steps: int) -> None:
        """The old policy's soft update after the update (``optimizer_steps``: taken so far in the run)."""
        self.old_policy.blend(transformer, old_policy_decay(optimizer_steps, self.settings.decay_type))


class FlowMatchingBatch:
    """The forward-noised samples of one update: per sample its T timestep indices and noise, fresh per sample or
    shared by groups of ``noise_group_size`` rows (CPU draws from the update's generator, so an exact resume redraws
    them), and x_t for any (micro-batch, slot)."""

    def __init__(
        self,
        rollout: FinalSamples,
        indices: torch.Tensor,
        generator_cpu: torch.Generator,
        device: torch.device,
        noise_group_size: int = 1,
    ) -> None:
        self.x0 = rollout.final_x0.to(device=device, dtype=torch.float32)
        self.indices = indices  # [B, T] cpu
        shape = tuple(self.x0.shape[1:])
        self.noise = draw_noise(indices.shape[0], indices.shape[1], shape, noise_group_size, generator_cpu).to(device)
        sigmas = rollout.sigmas.to(device=device, dtype=torch.float32)
        self.t = sigmas[indices.to(device)]  # [B, T]
        self.fed = model_timesteps(self.t)  # the σ the transformer is fed, as in the rollout

    def noised(self, start: int, stop: int, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x_t [m, L, C], t [m], ε [m, L, C]) for samples start…stop−1 at their slot-th timestep."""
        t = self.t[start:stop, slot]
        noise = self.noise[start:stop, slot]
        x0 = self.x0[start:stop]
        t_b = t.reshape(-1, *([1] * (x0.ndim - 1)))
        return (1 - t_b) * x0 + t_b * noise, t, noise

    def model_input(self, start: int, stop: int, slot: int) -> ModelInput:
        """x_t and its fed σ: what every forward of the step sees (the policy, its copies, the reference)."""
        return ModelInput(self.noised(start, stop, slot)[0], self.fed[start:stop, slot])


class NftWork:
    def __init__(
        self, settings: NftSettings, rollout: FinalSamples, advantages: torch.Tensor, generator_cpu: torch.Generator
    ) -> None:
        num_samples, num_steps, self.slots = rollout.num_trajectories, rollout.num_steps, settings.num_train_timesteps
        if not 1 <= self.slots <= num_steps:
            raise ValueError(f"cannot train {self.slots} of the sampler's {num_steps} timesteps")
        self.settings = settings
        self.wants_reference = settings.kl_beta > 0
        self.precomputed_forwards = (OLD_POLICY,)  # v_old of every (sample, slot): θ_old does not change meanwhile
        shared = settings.sharing == "group"
        units = group_bounds(num_samples, settings.group_size) if shared else sample_bounds(num_samples)
        draw = linspace_strata if settings.timestep_rule == "stratified" else random_indices
        self.train_timestep_indices = indices_per_unit(units, draw, range(num_steps), self.slots, generator_cpu)
        self.batch = FlowMatchingBatch(
            rollout, self.train_timestep_indices, generator_cpu, advantages.device, settings.group_size if shared else 1
        )
        self.optimality = optimality_probability(advantages, settings.adv_clip_max)

    def model_input(self, start: int, stop: int, slot: int) -> ModelInput:
        return self.batch.model_input(start, stop, slot)

    def loss(self, step: UpdateStep) -> StepLoss:
        settings, start, stop = self.settings, step.start, step.stop
        x_t, t = step.model_input.latents, self.batch.t[start:stop, step.slot]
        velocity = step.velocity.to(torch.float32)
        old_velocity = step.precomputed[OLD_POLICY]
        x0 = self.batch.x0[start:stop]
        policy = nft_policy_loss(
            velocity, old_velocity, x_t, x0, t, self.optimality[start:stop], settings.beta, settings.adv_clip_max
        )
        loss = policy.mean()
        axes = tuple(range(1, x0.ndim))
        metrics: dict[str, object] = {"policy_loss": policy.detach().sum()}
        if step.reference_velocity is not None:
            kl = ((velocity - step.reference_velocity.to(torch.float32)) ** 2).mean(dim=axes)
            loss = loss + settings.kl_beta * kl.mean()
            metrics["kl_mean"] = kl.detach().sum()
        with torch.no_grad():
            metrics["old_deviation"] = ((velocity - old_velocity) ** 2).mean(dim=axes).sum()
            t_b = t.reshape(-1, *([1] * (x0.ndim - 1)))
            metrics["x0_error"] = ((x_t - t_b * velocity - x0) ** 2).mean(dim=axes).sum()
        return StepLoss((loss,), metrics)
