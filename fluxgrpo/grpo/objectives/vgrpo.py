"""``--objective vgrpo``: V-GRPO, GRPO on an ELBO-style likelihood surrogate of the final sample (Tang et al.,
arXiv 2604.23380, "V-GRPO: Online RL for Denoising Generative Models Is Easier than You Think"; README "V-GRPO").

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
θ_old's value); later micro-batches use lp_old computed with the pre-update weights before the first optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fluxgrpo.grpo.objectives.base import Metric, StepResult
from fluxgrpo.grpo.objectives.draws import group_bounds, indices_per_unit, random_indices, sample_bounds
from fluxgrpo.grpo.objectives.grpo import micro_batch_bounds
from fluxgrpo.grpo.objectives.nft import FlowMatchingBatch
from fluxgrpo.grpo.reference import ReferenceModel
from fluxgrpo.grpo.rollout import predict_velocity
from fluxgrpo.grpo.types import Conditioning, FinalSamples

VGRPO_METRICS = {
    "loss_sum": Metric("loss", "sum"),
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
    """V-GRPO's hyperparameters (``TrainConfig``'s names in the comments)."""

    num_mc: int  # vgrpo_mc_samples: the (t, ε) pairs per sample
    micro_batch_size: int
    grad_accum_steps: int
    group_size: int  # num_generations: the rows a group-shared draw covers
    clip_range: float = 6e-3  # clip_range: the ratio clip ε (the paper: 6e-3 … 1e-2)
    adv_soft_clip: float = 0.0  # vgrpo_adv_soft_clip: η of η·tanh(A/η) (0: off)
    kl_beta: float = 0.0  # kl_beta: weight of mean((v − v_ref)²)
    sharing: str = "group"  # fm_draws
    timestep_rule: str = "stratified"  # fm_timestep_rule
    compute_dtype: torch.dtype | None = None


class VgrpoObjective:
    name = "vgrpo"
    keeps_trajectory = False
    metrics = VGRPO_METRICS
    progress = VGRPO_PROGRESS

    def __init__(self, settings: VgrpoSettings, reference: ReferenceModel | None = None) -> None:
        if settings.kl_beta > 0 and reference is None:
            raise ValueError("kl_beta > 0 needs a reference model")
        if settings.num_mc < 1:
            raise ValueError(f"V-GRPO needs at least one (t, ε) pair per sample, not {settings.num_mc}")
        self.settings, self.reference = settings, reference

    def rollout_policy(self) -> None:
        """Rollouts sample with the current policy (θ_old is the weights at rollout time)."""
        return None

    def prepare(
        self,
        transformer: nn.Module,
        rollout: FinalSamples,
        cond: Conditioning,
        advantages: torch.Tensor,
        *,
        device_type: str,
        generator_cpu: torch.Generator,
    ) -> VgrpoWork:
        return VgrpoWork(self, transformer, rollout, cond, advantages, device_type, generator_cpu)

    def finish(self, transformer: nn.Module, optimizer_steps: int) -> None:
        """Nothing to update: θ_old is the next rollout's weights."""


class VgrpoWork:
    slots = 1  # the N_MC pairs of a micro-batch are one batched forward

    def __init__(
        self,
        objective: VgrpoObjective,
        transformer: nn.Module,
        rollout: FinalSamples,
        cond: Conditioning,
        advantages: torch.Tensor,
        device_type: str,
        generator_cpu: torch.Generator,
    ) -> None:
        settings = objective.settings
        num_samples, num_steps = rollout.num_trajectories, rollout.num_steps
        if advantages.shape != (num_samples,) or cond.num_rows != num_samples:
            raise ValueError(f"advantages {tuple(advantages.shape)} and {cond.num_rows} rows for {num_samples} samples")
        if not 1 <= settings.num_mc <= num_steps:
            raise ValueError(f"cannot draw {settings.num_mc} (t, ε) pairs from the sampler's {num_steps} timesteps")
        device = cond.prompt_embeds.device
        shared = settings.sharing == "group"
        units = group_bounds(num_samples, settings.group_size) if shared else sample_bounds(num_samples)
        draw = tensor_split_strata if settings.timestep_rule == "stratified" else random_indices
        # The sampler's N timesteps σ_0 … σ_{N−1} (σ_N = 0 would noise nothing).
        self.train_timestep_indices = indices_per_unit(units, draw, range(num_steps), settings.num_mc, generator_cpu)
        self.batch = FlowMatchingBatch(
            rollout, self.train_timestep_indices, generator_cpu, device, settings.group_size if shared else 1
        )
        self.bounds = micro_batch_bounds(num_samples, settings.micro_batch_size)
        self.num_micro_batches = len(self.bounds)
        self.advantages = soft_clipped(advantages.to(device=device, dtype=torch.float32), settings.adv_soft_clip)
        self.objective, self.transformer, self.cond, self.device_type = objective, transformer, cond, device_type
        self.loss_scale = 1.0 / settings.grad_accum_steps
        # Off-policy micro-batches (after the first optimizer step) need lp under the weights before it.
        self.old_log_probs: torch.Tensor | None = None
        if self.num_micro_batches > settings.grad_accum_steps:
            with torch.no_grad():
                self.old_log_probs = torch.cat(
                    [self._forward(transformer, start, stop)[0] for start, stop in self.bounds]
                )

    def _noised(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(z [m·K, L, C], t [m·K], o [m·K, L, C]) for samples start…stop−1 at all their K pairs, sample-major."""
        batch, count = self.batch, self.objective.settings.num_mc
        x0 = batch.x0[start:stop].repeat_interleave(count, dim=0)
        t = batch.t[start:stop].reshape(-1)
        noise = batch.noise[start:stop].flatten(0, 1)
        t_b = t.reshape(-1, *([1] * (x0.ndim - 1)))
        return (1 - t_b) * x0 + t_b * noise, t, x0

    def _forward(self, module: nn.Module, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(lp [m], velocity [m·K, L, C] fp32, z) of ``module`` for samples start…stop−1."""
        settings, batch = self.objective.settings, self.batch
        count = settings.num_mc
        z, t, x0 = self._noised(start, stop)
        velocity = predict_velocity(
            module, z, self.cond.rows(start, stop).repeat_interleave(count), batch.fed[start:stop].reshape(-1),
            batch.guidance[start:stop].repeat_interleave(count), batch.img_ids, self.device_type,
            settings.compute_dtype,
        ).to(torch.float32)  # fmt: skip
        t_b = t.reshape(-1, *([1] * (x0.ndim - 1)))
        surrogate = self_normalized_surrogate(z - t_b * velocity, x0)
        return surrogate.reshape(stop - start, count).mean(dim=1), velocity, z

    def loss(self, micro_index: int, slot: int) -> StepResult:
        settings = self.objective.settings
        start, stop = self.bounds[micro_index]
        log_prob, velocity, z = self._forward(self.transformer, start, stop)
        if micro_index < settings.grad_accum_steps or self.old_log_probs is None:
            old_log_prob = log_prob.detach()  # on-policy: ρ = 1, the gradient is −A'·∇lp
        else:
            old_log_prob = self.old_log_probs[start:stop]
        advantages = self.advantages[start:stop]
        policy, ratio = vgrpo_policy_loss(log_prob, old_log_prob, advantages, settings.clip_range)
        loss = policy.mean()
        metrics: dict[str, object] = {}
        if settings.kl_beta > 0:
            reference = self.objective.reference
            assert reference is not None  # checked on construction
            count, batch = settings.num_mc, self.batch
            reference_velocity = reference.reference_prediction(
                z, self.cond.rows(start, stop).repeat_interleave(count), batch.fed[start:stop].reshape(-1),
                batch.guidance[start:stop].repeat_interleave(count), batch.img_ids, self.device_type,
                settings.compute_dtype,
            ).to(torch.float32)  # fmt: skip
            axes = tuple(range(1, velocity.ndim))
            kl = ((velocity - reference_velocity) ** 2).mean(dim=axes).reshape(stop - start, count).mean(dim=1)
            loss = loss + settings.kl_beta * kl.mean()
            metrics["kl_mean"] = kl.detach().sum()
        loss = loss * self.loss_scale
        detached = ratio.detach().float()
        metrics.update(
            loss_sum=loss.detach().float(),
            policy_loss=policy.detach().float().sum(),
            ratio_mean=detached.sum(),
            ratio_min=detached.min(),
            ratio_max=detached.max(),
            clip_fraction=((detached - 1.0).abs() > settings.clip_range).float().sum(),
            surrogate=log_prob.detach().float().sum(),
        )
        return StepResult(loss=loss, metrics=metrics, num_samples=stop - start)
