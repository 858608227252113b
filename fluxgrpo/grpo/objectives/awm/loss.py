"""``--objective awm``: Advantage-Weighted Matching (scxue/advantage_weighted_matching ``scripts/train_sd3_awm.py``;
reference §6.2, §6.3).

Rollouts are the deterministic DPM-Solver++(2M) ODE, keeping the final latents x0. Each micro-batch trains on T
timestep indices stratified over the sampler grid (the same for its samples), with fresh noise ε per sample (the
authors'; ``draws.py``: or one set of (t, ε) per prompt group):

    x_t = (1−t)·x0 + t·ε;  mse = mean_d((v_θ(x_t) − (ε − x0))²)  (fp64)
    lp  = −mse (uniform) | −mse·t | −mse·t² | ghuber: −((mse+1e-10)^p − 1e-10^p)·t/p | huber: −(√(mse+1e-10) − 1e-5)·t
    ρ   = exp(lp − lp_old);  A' = clamp(A, ±c)/c
    loss = mean(max(−A'·ρ, −A'·clip(ρ, 1±ε))) + β_KL·mean((v − v_ref)²) + β_EMA·mean((v − v_ema)²)

per timestep (the authors' ``exp_first``), scaled by 1/(GA·T). On the first GA micro-batches lp_old = lp.detach()
(ρ = 1: on-policy, the gradient is −A'·∇lp); later micro-batches use lp_old computed before the first optimizer
step. The EMA policy is soft-updated after the update with d = min(0.3, 0.001·optimizer steps).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fluxgrpo.grpo.objectives.awm.settings import AWM_TIME_FRACTION, AWM_TIME_TYPES, AWM_WEIGHTINGS, AwmOptions
from fluxgrpo.grpo.objectives.base import (
    CURRENT_POLICY,
    Metric,
    ModelInput,
    ObjectiveBase,
    StepLoss,
    UpdateLayout,
    UpdateStep,
)
from fluxgrpo.grpo.objectives.draws import group_bounds, indices_per_unit, linspace_strata, random_indices
from fluxgrpo.grpo.objectives.entry import EMA_POLICY, ObjectiveRun
from fluxgrpo.grpo.objectives.nft.loss import FlowMatchingBatch
from fluxgrpo.grpo.types import FinalSamples
from fluxgrpo.grpo.weight_copies import PolicyCopy

AWM_METRICS = {
    "policy_loss": Metric("policy_loss", "mean"),
    "ratio_mean": Metric("ratio_mean", "mean"),
    "ratio_min": Metric("ratio_min", "min"),
    "ratio_max": Metric("ratio_max", "max"),
    "fm_mse": Metric("fm_mse", "mean"),  # the flow-matching error mean_d((v − (ε − x0))²)
    "kl_mean": Metric("kl", "mean"),
    "ema_deviation": Metric("ema_deviation", "mean"),  # mean_d((v − v_ema)²); NaN when the EMA term is off
}
AWM_PROGRESS = "ratio {ratio_mean:.4f} [{ratio_min:.4f}, {ratio_max:.4f}] · fm mse {fm_mse:.4g}"


def ema_policy_decay(optimizer_steps: int) -> float:
    """d of θ_ema ← d·θ_ema + (1−d)·θ: min(0.3, 0.001·steps)."""
    return min(0.3, 0.001 * optimizer_steps)


def trainable_range(num_steps: int, time_type: str = "discrete_wo_init") -> range:
    """The sampler-grid indices AWM trains at: [lo, int(0.9·N)), lo = 1 (``discrete_wo_init``: the authors' GenEval
    and OCR rule) or 0 (``discrete``: their PickScore rule, which includes σ = 1, pure noise)."""
    return range(AWM_TIME_TYPES[time_type], int(num_steps * AWM_TIME_FRACTION))


def stratified_indices(
    num_steps: int, count: int, generator: torch.Generator, time_type: str = "discrete_wo_init"
) -> torch.Tensor:
    """[T] one index per stratum of ``trainable_range``: b = linspace(lo, hi, T+1).long(), b_k + ⌊u_k·(b_{k+1}−b_k)⌋."""
    return linspace_strata(trainable_range(num_steps, time_type), count, generator)


def weighted_log_prob(mse: torch.Tensor, t: torch.Tensor, weighting: str, power: float) -> torch.Tensor:
    """AWM's "log-prob" of the flow-matching error ``mse`` [B] (fp64) at times ``t`` [B]; t's powers are taken in t's
    own dtype, as the authors' (fp32 t² then promoted)."""
    if weighting == "uniform":
        return -mse
    if weighting == "t":
        return -mse * t
    if weighting == "t2":
        return -mse * t**2
    if weighting == "ghuber":
        return -((mse + 1e-10) ** power - 1e-10**power) * t / power
    if weighting == "huber":
        return -(torch.sqrt(mse + 1e-10) - 1e-5) * t
    raise ValueError(f"unknown AWM weighting {weighting!r}: one of {', '.join(AWM_WEIGHTINGS)}")


def flow_matching_mse(velocity: torch.Tensor, noise: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """[B] mean_d((v − (ε − x0))²) in float64, the authors' precision."""
    error = velocity.double() - (noise.double() - x0.double())
    return (error**2).mean(dim=tuple(range(1, error.ndim)))


def awm_policy_loss(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, clip_range: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """([B] max(−A'·ρ, −A'·clip(ρ, 1±ε)), [B] ρ) with ρ = exp(lp − lp_old) and A' = ``advantages`` (already A/c)."""
    ratio = torch.exp(log_prob - old_log_prob)
    advantages = advantages.to(ratio.dtype)
    clipped = torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(-advantages * ratio, -advantages * clipped), ratio


@dataclass(frozen=True)
class AwmSettings:
    """AWM's hyperparameters (the config keys in the comments)."""

    num_train_timesteps: int  # T stratified indices per micro-batch
    weighting: str = "ghuber"  # awm_weighting
    ghuber_power: float = 0.25  # awm_ghuber_power
    clip_range: float = 1.0  # clip_range (1: effectively unclipped, the authors')
    kl_beta: float = 0.0  # kl_beta: weight of mean((v − v_ref)²)
    ema_beta: float = 0.0  # awm_ema_beta: weight of mean((v − v_ema)²)
    adv_clip_max: float = 5.0
    time_type: str = "discrete_wo_init"  # awm_time_type (AWM_TIME_TYPES)
    sharing: str = "sample"  # fm_draws: sample (the authors': t per micro-batch, ε per sample) or group
    timestep_rule: str = "stratified"  # fm_timestep_rule: stratified (the authors') or random
    group_size: int = 1  # G, the rows a group-shared draw covers

    @classmethod
    def from_run(cls, run: ObjectiveRun) -> AwmSettings:
        options, (sharing, timestep_rule) = run.own(AwmOptions), run.draws
        return cls(
            num_train_timesteps=run.train_timesteps, weighting=options.weighting, ghuber_power=options.ghuber_power,
            clip_range=run.clip_range, kl_beta=run.kl_beta, ema_beta=options.ema_beta, adv_clip_max=run.adv_clip_max,
            time_type=options.time_type, sharing=sharing, timestep_rule=timestep_rule, group_size=run.group_size,
        )  # fmt: skip


class AwmObjective(ObjectiveBase):
    name = "awm"
    keeps_trajectory = False
    keeps_step_means = False
    metrics = AWM_METRICS
    progress = AWM_PROGRESS

    def __init__(self, settings: AwmSettings, ema_policy: PolicyCopy | None = None) -> None:
        if settings.ema_beta > 0 and ema_policy is None:
            raise ValueError("ema_beta > 0 needs the EMA policy")
        self.settings, self.ema_policy = settings, ema_policy
        self.policy_copies = {} if ema_policy is None else {EMA_POLICY: ema_policy}

    @classmethod
    def from_config(cls, run: ObjectiveRun, policy_copies: dict[str, PolicyCopy]) -> AwmObjective:
        return cls(AwmSettings.from_run(run), policy_copies.get(EMA_POLICY))

    def rollout_policy(self) -> PolicyCopy | None:
        """Rollouts sample with the current policy."""
        return None

    def prepare(
        self, rollout: FinalSamples, advantages: torch.Tensor, layout: UpdateLayout, generator_cpu: torch.Generator
    ) -> AwmWork:
        return AwmWork(self.settings, rollout, advantages, layout, generator_cpu)

    def finish(self, transformer: nn.Module, optimizer_steps: int) -> None:
        if self.ema_policy is not None:
            self.ema_policy.blend(transformer, ema_policy_decay(optimizer_steps))


class AwmWork:
    def __init__(
        self,
        settings: AwmSettings,
        rollout: FinalSamples,
        advantages: torch.Tensor,
        layout: UpdateLayout,
        generator_cpu: torch.Generator,
    ) -> None:
        num_steps, self.slots = rollout.num_steps, settings.num_train_timesteps
        grid = trainable_range(num_steps, settings.time_type)
        if not 1 <= self.slots <= len(grid):
            raise ValueError(f"cannot train {self.slots} of {len(grid)} AWM timesteps")
        self.settings, self.layout = settings, layout
        self.wants_reference = settings.kl_beta > 0
        # One draw per micro-batch, shared by its samples (the authors'), or one per prompt group.
        shared = settings.sharing == "group"
        units = group_bounds(rollout.num_trajectories, settings.group_size) if shared else list(layout.bounds)
        draw = linspace_strata if settings.timestep_rule == "stratified" else random_indices
        self.train_timestep_indices = indices_per_unit(units, draw, grid, self.slots, generator_cpu)
        self.batch = FlowMatchingBatch(
            rollout, self.train_timestep_indices, generator_cpu, advantages.device, settings.group_size if shared else 1
        )
        self.advantages = advantages.clamp(-settings.adv_clip_max, settings.adv_clip_max) / settings.adv_clip_max
        # The EMA policy's velocities; and, for the off-policy micro-batches (after the first optimizer step), lp
        # under the weights before it.
        self.precomputed_forwards = ((EMA_POLICY,) if settings.ema_beta > 0 else ()) + (
            (CURRENT_POLICY,) if layout.num_micro_batches > layout.grad_accum_steps else ()
        )

    def model_input(self, start: int, stop: int, slot: int) -> ModelInput:
        return self.batch.model_input(start, stop, slot)

    def _log_prob(self, velocity: torch.Tensor, rows: slice, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(lp [m], mse [m]) in fp64 for the rows' samples at their slot-th timestep."""
        settings = self.settings
        mse = flow_matching_mse(velocity, self.batch.noise[rows, slot], self.batch.x0[rows])
        return weighted_log_prob(mse, self.batch.t[rows, slot], settings.weighting, settings.ghuber_power), mse

    def loss(self, step: UpdateStep) -> StepLoss:
        settings, rows = self.settings, slice(step.start, step.stop)
        velocity = step.velocity.to(torch.float32)
        log_prob, mse = self._log_prob(velocity, rows, step.slot)
        if self.layout.before_first_optimizer_step(step.micro_index) or CURRENT_POLICY not in step.precomputed:
            old_log_prob = log_prob.detach()  # on-policy: ρ = 1, the gradient is −A'·∇lp
        else:
            old_log_prob = self._log_prob(step.precomputed[CURRENT_POLICY], rows, step.slot)[0]
        policy, ratio = awm_policy_loss(log_prob, old_log_prob, self.advantages[rows], settings.clip_range)
        loss = policy.mean()
        axes = tuple(range(1, velocity.ndim))
        metrics: dict[str, object] = {}
        if step.reference_velocity is not None:
            kl = ((velocity - step.reference_velocity.to(torch.float32)) ** 2).mean(dim=axes)
            loss = loss + settings.kl_beta * kl.mean()
            metrics["kl_mean"] = kl.detach().sum()
        if EMA_POLICY in step.precomputed:
            ema = ((velocity - step.precomputed[EMA_POLICY]) ** 2).mean(dim=axes)
            loss = loss + settings.ema_beta * ema.mean()
            metrics["ema_deviation"] = ema.detach().sum()
        detached = ratio.detach().float()
        metrics.update(
            policy_loss=policy.detach().float().sum(),
            ratio_mean=detached.sum(),
            ratio_min=detached.min(),
            ratio_max=detached.max(),
            fm_mse=mse.detach().float().sum(),
        )
        return StepLoss((loss,), metrics)
