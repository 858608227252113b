"""``--objective vgrpo``: V-GRPO, GRPO on an ELBO-style likelihood surrogate of the final sample (Tang et al.,
arXiv 2604.23380, "V-GRPO: Online RL for Denoising Generative Models Is Easier than You Think"; docs/algorithms.md).

The rollout is the deterministic DPM-Solver++(2M) ODE keeping the final latents o (one "atomic action" per image).
A sample's log-likelihood is replaced by its negative, self-normalised x-prediction loss at N_MC (t, ε) pairs:

    z = (1−t)·o + t·ε;  x̂ = z − t·v_θ(z);  ℓ(t, ε) = −mean_d((x̂ − o)²) / sg(mean_d|x̂ − o|)
    lp = mean over the N_MC pairs of ℓ;  ρ = exp(lp − lp_old);  A' = A, or η·tanh(A/η) (advantage soft clip)
    loss = mean(max(−A'·ρ, −A'·clip(ρ, 1±ε))) + β_KL·mean((v − v_ref)²)

scaled by 1/GA. The pairs are one stratified draw over the sampler's N timesteps (``torch.tensor_split`` of the
grid into N_MC chunks, one index uniformly from each) and one noise per pair, both shared by the whole prompt group
(``draws.py``; ``--fm-draws sample`` / ``--fm-timestep-rule random`` give the paper's ablations). The N_MC pairs of a
micro-batch go through the transformer as one batch (the authors' ``repeat_interleave``), so the ratio is taken on
the mean over all pairs, as theirs, and one update step is one ``loss`` call (``slots`` = 1).

On the first GA micro-batches lp_old = lp.detach() (ρ = 1: the weights have not moved since the rollout, so this is
θ_old's value); later micro-batches use lp_old of the velocities the update driver computes with the pre-update
weights before the first optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fluxgrpo.grpo.objectives.base import (
    CURRENT_POLICY,
    Metric,
    ModelInput,
    ObjectiveBase,
    StepLoss,
    UpdateLayout,
    UpdateStep,
)
from fluxgrpo.grpo.objectives.draws import group_bounds, indices_per_unit, random_indices, sample_bounds
from fluxgrpo.grpo.objectives.entry import ObjectiveRun
from fluxgrpo.grpo.objectives.nft.loss import FlowMatchingBatch
from fluxgrpo.grpo.objectives.vgrpo.settings import VgrpoOptions
from fluxgrpo.grpo.types import FinalSamples
from fluxgrpo.grpo.weight_copies import PolicyCopy

VGRPO_METRICS = {
    "policy_loss": Metric("policy_loss", "mean"),
    "ratio_mean": Metric("ratio_mean", "mean"),
    "ratio_min": Metric("ratio_min", "min"),
    "ratio_max": Metric("ratio_max", "max"),
    "clip_fraction": Metric("clip_fraction", "mean"),  # samples whose ratio left 1±ε
    "surrogate": Metric("surrogate", "mean"),  # lp: the mean self-normalised x-prediction loss, negated
    "kl_mean": Metric("kl", "mean"),
}
VGRPO_PROGRESS = "ratio {ratio_mean:.4f} [{ratio_min:.4f}, {ratio_max:.4f}] · surrogate {surrogate:.4g}"


def tensor_split_strata(grid: range, count: int, generator: torch.Generator) -> torch.Tensor:
    """[N_MC] the authors' stratified draw: ``torch.tensor_split`` of ``grid`` into N_MC chunks, one index uniformly
    from each (``chunk[randint(len(chunk))]``)."""
    chunks = torch.tensor_split(torch.arange(grid.start, grid.stop), count)
    return torch.cat([chunk[torch.randint(len(chunk), (1,), generator=generator)] for chunk in chunks])


def self_normalized_surrogate(x0_prediction: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """[rows] −mean_d((x̂ − o)²) / sg(mean_d|x̂ − o|), in fp32 (the authors' ``calc_surrogate`` with self_normalize)."""
    axes = tuple(range(1, x0.ndim))
    error = x0_prediction.float() - x0.float()
    with torch.no_grad():
        scale = error.detach().abs().mean(dim=axes)
    return -(error**2).mean(dim=axes) / scale


def soft_clipped(advantages: torch.Tensor, eta: float) -> torch.Tensor:
    """η·tanh(A/η) (the paper's advantage soft clipping); η = 0 leaves A as is."""
    return advantages if eta <= 0 else eta * torch.tanh(advantages / eta)


def vgrpo_policy_loss(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, clip_range: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """([B] max(−A·ρ, −A·clip(ρ, 1±ε)), [B] ρ) with ρ = exp(lp − lp_old), lp the mean over the N_MC pairs."""
    ratio = torch.exp(log_prob - old_log_prob)
    clipped = torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(-advantages * ratio, -advantages * clipped), ratio


@dataclass(frozen=True)
class VgrpoSettings:
    """V-GRPO's hyperparameters (the config keys in the comments)."""

    num_mc: int  # vgrpo_mc_samples: the (t, ε) pairs per sample
    group_size: int  # num_generations: the rows a group-shared draw covers
    clip_range: float = 6e-3  # clip_range: the ratio clip ε (the paper: 6e-3 … 1e-2)
    adv_soft_clip: float = 0.0  # vgrpo_adv_soft_clip: η of η·tanh(A/η) (0: off)
    kl_beta: float = 0.0  # kl_beta: weight of mean((v − v_ref)²)
    sharing: str = "group"  # fm_draws
    timestep_rule: str = "stratified"  # fm_timestep_rule

    @classmethod
    def from_run(cls, run: ObjectiveRun) -> VgrpoSettings:
        options, (sharing, timestep_rule) = run.own(VgrpoOptions), run.draws
        return cls(
            num_mc=options.mc_samples, group_size=run.group_size, clip_range=run.clip_range,
            adv_soft_clip=options.adv_soft_clip, kl_beta=run.kl_beta, sharing=sharing, timestep_rule=timestep_rule,
        )  # fmt: skip


class VgrpoObjective(ObjectiveBase):
    name = "vgrpo"
    keeps_trajectory = False
    keeps_step_means = False
    metrics = VGRPO_METRICS
    progress = VGRPO_PROGRESS

    def __init__(self, settings: VgrpoSettings) -> None:
        if settings.num_mc < 1:
            raise ValueError(f"V-GRPO needs at least one (t, ε) pair per sample, not {settings.num_mc}")
        self.settings = settings
        self.policy_copies: dict[str, PolicyCopy] = {}

    @classmethod
    def from_config(cls, run: ObjectiveRun, policy_copies: dict[str, PolicyCopy]) -> VgrpoObjective:
        return cls(VgrpoSettings.from_run(run))

    def rollout_policy(self) -> None:
        """Rollouts sample with the current policy (θ_old is the weights at rollout time)."""
        return None

    def prepare(
        self, rollout: FinalSamples, advantages: torch.Tensor, layout: UpdateLayout, generator_cpu: torch.Generator
    ) -> VgrpoWork:
        return VgrpoWork(self.settings, rollout, advantages, layout, generator_cpu)

    def finish(self, transformer: nn.Module, optimizer_steps: int) -> None:
        """Nothing to update: θ_old is the next rollout's weights."""


class VgrpoWork:
    slots = 1  # the N_MC pairs of a micro-batch are one batched forward

    def __init__(
        self,
        settings: VgrpoSettings,
        rollout: FinalSamples,
        advantages: torch.Tensor,
        layout: UpdateLayout,
        generator_cpu: torch.Generator,
    ) -> None:
        num_samples, num_steps = rollout.num_trajectories, rollout.num_steps
        if not 1 <= settings.num_mc <= num_steps:
            raise ValueError(f"cannot draw {settings.num_mc} (t, ε) pairs from the sampler's {num_steps} timesteps")
        self.settings, self.layout = settings, layout
        self.wants_reference = settings.kl_beta > 0
        shared = settings.sharing == "group"
        units = group_bounds(num_samples, settings.group_size) if shared else sample_bounds(num_samples)
        draw = tensor_split_strata if settings.timestep_rule == "stratified" else random_indices
        # The sampler's N timesteps σ_0 … σ_{N−1} (σ_N = 0 would noise nothing).
        self.train_timestep_indices = indices_per_unit(units, draw, range(num_steps), settings.num_mc, generator_cpu)
        self.batch = FlowMatchingBatch(
            rollout, self.train_timestep_indices, generator_cpu, advantages.device, settings.group_size if shared else 1
        )
        self.advantages = soft_clipped(advantages, settings.adv_soft_clip)
        # Off-policy micro-batches (after the first optimizer step) need lp under the weights before it.
        self.precomputed_forwards = (CURRENT_POLICY,) if layout.num_micro_batches > layout.grad_accum_steps else ()

    def model_input(self, start: int, stop: int, slot: int) -> ModelInput:
        """Samples start…stop−1 at all their K pairs, sample-major (the authors' ``repeat_interleave``)."""
        z, _, _ = self._noised(start, stop)
        rows = torch.arange(start, stop).repeat_interleave(self.settings.num_mc)
        return ModelInput(z, self.batch.fed[start:stop].reshape(-1), rows)

    def _noised(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(z [m·K, L, C], t [m·K], o [m·K, L, C]) for samples start…stop−1 at all their K pairs."""
        batch, count = self.batch, self.settings.num_mc
        x0 = batch.x0[start:stop].repeat_interleave(count, dim=0)
        t = batch.t[start:stop].reshape(-1)
        noise = batch.noise[start:stop].flatten(0, 1)
        t_b = t.reshape(-1, *([1] * (x0.ndim - 1)))
        return (1 - t_b) * x0 + t_b * noise, t, x0

    def _log_prob(self, velocity: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """[m] lp: the mean over the K pairs of the self-normalised surrogate of ``velocity`` [m·K, L, C]."""
        z, t, x0 = self._noised(start, stop)
        t_b = t.reshape(-1, *([1] * (x0.ndim - 1)))
        surrogate = self_normalized_surrogate(z - t_b * velocity, x0)
        return surrogate.reshape(stop - start, self.settings.num_mc).mean(dim=1)

    def loss(self, step: UpdateStep) -> StepLoss:
        settings, start, stop = self.settings, step.start, step.stop
        velocity = step.velocity.to(torch.float32)
        log_prob = self._log_prob(velocity, start, stop)
        if self.layout.before_first_optimizer_step(step.micro_index) or CURRENT_POLICY not in step.precomputed:
            old_log_prob = log_prob.detach()  # on-policy: ρ = 1, the gradient is −A'·∇lp
        else:
            old_log_prob = self._log_prob(step.precomputed[CURRENT_POLICY], start, stop)
        policy, ratio = vgrpo_policy_loss(log_prob, old_log_prob, self.advantages[start:stop], settings.clip_range)
        loss = policy.mean()
        metrics: dict[str, object] = {}
        if step.reference_velocity is not None:
            axes = tuple(range(1, velocity.ndim))
            kl = ((velocity - step.reference_velocity.to(torch.float32)) ** 2).mean(dim=axes)
            kl = kl.reshape(stop - start, settings.num_mc).mean(dim=1)
            loss = loss + settings.kl_beta * kl.mean()
            metrics["kl_mean"] = kl.detach().sum()
        detached = ratio.detach().float()
        metrics.update(
            policy_loss=policy.detach().float().sum(),
            ratio_mean=detached.sum(),
            ratio_min=detached.min(),
            ratio_max=detached.max(),
            clip_fraction=((detached - 1.0).abs() > settings.clip_range).float().sum(),
            surrogate=log_prob.detach().float().sum(),
        )
        return StepLoss((loss,), metrics)
