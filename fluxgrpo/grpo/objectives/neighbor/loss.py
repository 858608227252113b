"""``--objective neighbor``: Neighbor GRPO, contrastive ODE policy optimisation (He et al., arXiv 2511.16955,
"Neighbor GRPO: Contrastive ODE Policy Optimization Aligns Flow Models"; docs/algorithms.md).

No SDE: a group's G candidates are deterministic DPM-Solver++(2M) ODE trajectories from a neighbourhood of one
base noise, and the rollout keeps every candidate's latents x^(i)_j on the σ grid:

    ε^(i) = √(1−σ²)·ε* + σ·δ^(i)                                        (Eq. 7; σ = ``neighbor_sigma``)

The update trains B anchors per group (symmetric anchor sampling: any candidate can be the anchor) at K of the
N−1 transitions each. At transition j the anchor k takes one Euler (DDIM) step with the current weights, and a
surrogate "leaping" policy over the G candidates is the softmax of the negative squared distances to it:

    x^θ = x^(k)_j + (σ_{j+1} − σ_j)·v_θ(x^(k)_j, σ_j)
    π_θ(i) = softmax_i(−‖x^(i)_{j+1} − x^θ‖² / τ)                      (Eq. 8; τ = 1 in the paper)
    A'_i = A_i / (Σ_k |A_k|^p)^{1/p}                                    (Eq. 11, per group; p = 0.8)
    loss = mean_i max(−A'_i·ρ_i, −A'_i·clip(ρ_i, 1±ε)),  ρ_i = π_θ(i) / π_old(i)    (Eq. 9)

scaled by 1/(GA·K); with β_KL > 0 plus β_KL·mean((v − v_ref)²) at the anchor. The update's micro-batches cut the
anchors (``update_size``). On the first GA micro-batches π_old = π_θ.detach() (ρ = 1: the weights are the
rollout's); later micro-batches use π_old of the velocities the update driver computes with the pre-update weights
before the first optimizer step. The gradient of log π_i is (2/τ)·(x^(i) − E_π[x])·∇x^θ: with
centred advantages the anchor's step moves towards the high-advantage candidates and away from the low ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from fluxgrpo.grpo.latents import pack_latents
from fluxgrpo.grpo.objectives.base import (
    CURRENT_POLICY,
    Metric,
    ModelInput,
    ObjectiveBase,
    StepLoss,
    UpdateLayout,
    UpdateStep,
)
from fluxgrpo.grpo.objectives.entry import ObjectiveRun
from fluxgrpo.grpo.objectives.neighbor.settings import NeighborOptions
from fluxgrpo.grpo.schedule import model_timesteps
from fluxgrpo.grpo.types import FinalSamples
from fluxgrpo.grpo.weight_copies import PolicyCopy

NEIGHBOR_METRICS = {
    "policy_loss": Metric("policy_loss", "mean"),
    "ratio_mean": Metric("ratio_mean", "mean"),  # mean over the G candidates, per anchor
    "ratio_min": Metric("ratio_min", "min"),
    "ratio_max": Metric("ratio_max", "max"),
    "leap_entropy": Metric("leap_entropy", "mean"),  # entropy of π_θ over the candidates (0: one-hot)
    "kl_mean": Metric("kl", "mean"),
}
NEIGHBOR_PROGRESS = "ratio {ratio_mean:.4f} [{ratio_min:.4f}, {ratio_max:.4f}] · leap H {leap_entropy:.3g}"


def neighborhood_noise(base: torch.Tensor, deltas: torch.Tensor, sigma: float) -> torch.Tensor:
    """[P·G, L, C] ε^(i) = √(1−σ²)·ε* + σ·δ^(i): ``base`` [P, L, C] repeated over each group's ``deltas`` rows."""
    group_size = deltas.shape[0] // base.shape[0]
    return math.sqrt(1.0 - sigma**2) * base.repeat_interleave(group_size, dim=0) + sigma * deltas


def neighborhood_initial_noise(
    settings: NeighborOptions,
    num_prompts: int,
    group_size: int,
    size: tuple[int, int, int],
    generator: torch.Generator,
    device: torch.device,
) -> torch.Tensor:
    """[P·G, L, C] the rollout's initial noises (the entry's ``initial_noise``): per group one base noise of ``size``
    (C, h, w), then one perturbation per member, packed."""
    base = torch.randn((num_prompts, *size), generator=generator, device=device, dtype=torch.float32)
    deltas = torch.randn((num_prompts * group_size, *size), generator=generator, device=device)
    return neighborhood_noise(pack_latents(base), pack_latents(deltas), settings.sigma)


def quasi_norm_advantages(advantages: torch.Tensor, group_size: int, power: float) -> torch.Tensor:
    """[B] A'_i = A_i / (Σ_k |A_k|^p)^{1/p} within each group of ``group_size`` rows; a group of zeros stays 0."""
    grouped = advantages.reshape(-1, group_size)
    norm = grouped.abs().pow(power).sum(dim=1, keepdim=True).pow(1.0 / power)
    safe = torch.where(norm > 0, norm, torch.ones_like(norm))
    return torch.where(norm > 0, grouped / safe, torch.zeros_like(grouped)).reshape(-1)


def leap_log_probs(candidates: torch.Tensor, prediction: torch.Tensor, temperature: float) -> torch.Tensor:
    """[m, G] log π(i) = log_softmax_i(−‖x^(i) − x^θ‖²/τ) for candidates [m, G, L, C] and predictions [m, L, C]."""
    distances = ((candidates - prediction.unsqueeze(1)) ** 2).sum(dim=tuple(range(2, candidates.ndim)))
    return torch.log_softmax(-distances / temperature, dim=1)


def neighbor_policy_loss(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, clip_range: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """([m] mean_i max(−A'·ρ, −A'·clip(ρ, 1±ε)), [m, G] ρ) for log-probs and advantages [m, G]."""
    ratio = torch.exp(log_probs - old_log_probs)
    clipped = torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(-advantages * ratio, -advantages * clipped).mean(dim=1), ratio


@dataclass(frozen=True)
class NeighborSettings:
    """Neighbor GRPO's hyperparameters (the config keys in the comments)."""

    num_train_timesteps: int  # K of the N−1 transitions per anchor (int((N−1)·timestep_fraction))
    num_anchors: int  # neighbor_anchors: B of the G candidates per group
    group_size: int  # num_generations
    clip_range: float = 1e-4  # clip_range
    quasi_norm_power: float = 0.8  # neighbor_quasi_norm_p
    temperature: float = 1.0  # neighbor_temperature
    kl_beta: float = 0.0  # kl_beta: weight of mean((v − v_ref)²) at the anchor

    @classmethod
    def from_run(cls, run: ObjectiveRun) -> NeighborSettings:
        options = run.own(NeighborOptions)
        return cls(
            num_train_timesteps=run.train_timesteps, num_anchors=options.anchors, group_size=run.group_size,
            clip_range=run.clip_range, quasi_norm_power=options.quasi_norm_p, temperature=options.temperature,
            kl_beta=run.kl_beta,
        )  # fmt: skip


class NeighborObjective(ObjectiveBase):
    name = "neighbor"
    keeps_trajectory = False
    keeps_step_means = False
    keeps_ode_path = True  # the rollout keeps every candidate's latents on the σ grid
    metrics = NEIGHBOR_METRICS
    progress = NEIGHBOR_PROGRESS

    def __init__(self, settings: NeighborSettings) -> None:
        if not 1 <= settings.num_anchors <= settings.group_size:
            raise ValueError(f"{settings.num_anchors} anchors of a group of {settings.group_size}")
        self.settings = settings
        self.policy_copies: dict[str, PolicyCopy] = {}

    @classmethod
    def from_config(cls, run: ObjectiveRun, policy_copies: dict[str, PolicyCopy]) -> NeighborObjective:
        return cls(NeighborSettings.from_run(run))

    def update_size(self, rollout: FinalSamples) -> int:
        """The anchors the update trains: B per group."""
        return rollout.num_trajectories // self.settings.group_size * self.settings.num_anchors

    def rollout_policy(self) -> None:
        """Rollouts sample with the current policy."""
        return None

    def prepare(
        self, rollout: FinalSamples, advantages: torch.Tensor, layout: UpdateLayout, generator_cpu: torch.Generator
    ) -> NeighborWork:
        return NeighborWork(self.settings, rollout, advantages, layout, generator_cpu)

    def finish(self, transformer: nn.Module, optimizer_steps: int) -> None:
        """Nothing to update: π_old is the next rollout's weights."""


class NeighborWork:
    def __init__(
        self,
        settings: NeighborSettings,
        rollout: FinalSamples,
        advantages: torch.Tensor,
        layout: UpdateLayout,
        generator_cpu: torch.Generator,
    ) -> None:
        num_samples, num_steps, self.slots = rollout.num_trajectories, rollout.num_steps, settings.num_train_timesteps
        group_size = settings.group_size
        if num_samples % group_size:
            raise ValueError(f"{num_samples} samples do not split into groups of {group_size}")
        if rollout.path is None:
            raise ValueError("Neighbor GRPO trains on the candidates' ODE paths: roll out with keep_path")
        if not 1 <= self.slots <= num_steps - 1:
            raise ValueError(f"cannot train {self.slots} of the {num_steps - 1} transitions")
        self.settings, self.layout = settings, layout
        self.wants_reference = settings.kl_beta > 0
        device = advantages.device
        # B anchors per group (a random subset), each trained at K random transitions: CPU draws, in this order.
        anchors = [
            start + torch.randperm(group_size, generator=generator_cpu)[: settings.num_anchors]
            for start in range(0, num_samples, group_size)
        ]
        self.anchor_rows = torch.cat(anchors)  # [A] cpu
        self.train_timestep_indices = torch.stack(
            [torch.randperm(num_steps - 1, generator=generator_cpu)[: self.slots] for _ in self.anchor_rows]
        )  # [A, K] transitions j → j+1
        self.path = rollout.path.to(device=device, dtype=torch.float32)  # [B, N+1, L, C]
        self.sigmas = rollout.sigmas.to(device=device, dtype=torch.float32)
        reweighted = quasi_norm_advantages(advantages, group_size, settings.quasi_norm_power)
        self.group_advantages = reweighted.reshape(-1, group_size)  # [P, G]
        # Off-policy micro-batches (after the first optimizer step) need π_old under the weights before it.
        self.precomputed_forwards = (CURRENT_POLICY,) if layout.num_micro_batches > layout.grad_accum_steps else ()

    def model_input(self, start: int, stop: int, slot: int) -> ModelInput:
        """The anchors start…stop−1 at their slot-th transition: x^(k)_j, σ_j, their conditioning rows."""
        rows, steps = self._rows_and_steps(start, stop, slot)
        return ModelInput(self.path[rows, steps], model_timesteps(self.sigmas[steps]), self.anchor_rows[start:stop])

    def _rows_and_steps(self, start: int, stop: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.path.device
        return self.anchor_rows[start:stop].to(device), self.train_timestep_indices[start:stop, slot].to(device)

    def _log_probs(self, velocity: torch.Tensor, start: int, stop: int, slot: int) -> torch.Tensor:
        """[m, G] log π over each anchor's group after one Euler step of ``velocity`` [m, L, C] from x^(k)_j."""
        rows, steps = self._rows_and_steps(start, stop, slot)
        x = self.path[rows, steps]
        step = (self.sigmas[steps + 1] - self.sigmas[steps]).reshape(-1, *([1] * (x.ndim - 1)))
        prediction = x + step * velocity
        group_size = self.settings.group_size
        members = ((rows // group_size) * group_size).unsqueeze(1) + torch.arange(group_size, device=rows.device)
        candidates = self.path[members, (steps + 1).unsqueeze(1)]  # [m, G, L, C]
        return leap_log_probs(candidates, prediction, self.settings.temperature)

    def loss(self, step: UpdateStep) -> StepLoss:
        settings, start, stop, slot = self.settings, step.start, step.stop, step.slot
        velocity = step.velocity.to(torch.float32)
        log_probs = self._log_probs(velocity, start, stop, slot)
        if self.layout.before_first_optimizer_step(step.micro_index) or CURRENT_POLICY not in step.precomputed:
            old_log_probs = log_probs.detach()  # on-policy: ρ = 1
        else:
            old_log_probs = self._log_probs(step.precomputed[CURRENT_POLICY], start, stop, slot)
        rows = self.anchor_rows[start:stop].to(self.path.device)
        advantages = self.group_advantages[rows // settings.group_size]  # [m, G]
        policy, ratio = neighbor_policy_loss(log_probs, old_log_probs, advantages, settings.clip_range)
        loss = policy.mean()
        metrics: dict[str, object] = {}
        if step.reference_velocity is not None:
            kl = ((velocity - step.reference_velocity.to(torch.float32)) ** 2).mean(dim=tuple(range(1, velocity.ndim)))
            loss = loss + settings.kl_beta * kl.mean()
            metrics["kl_mean"] = kl.detach().sum()
        detached = ratio.detach().float()
        probs = log_probs.detach().exp()
        metrics.update(
            policy_loss=policy.detach().float().sum(),
            ratio_mean=detached.mean(dim=1).sum(),
            ratio_min=detached.min(),
            ratio_max=detached.max(),
            leap_entropy=-(probs * log_probs.detach()).sum(dim=1).float().sum(),
        )
        return StepLoss((loss,), metrics)
