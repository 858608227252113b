"""Every sampling step in one place: the stochastic step a rollout samples with and the update scores with
(``--sampler``), and the ODE steps outside an SDE window (``--ode-solver``) and of NFT's/AWM's rollouts.

Every SDE step maps (x at σ, velocity v̂) to x' at σ' < σ with a Gaussian N(μ, std²) and a per-element mean
log-prob of x', differentiable through μ only. With dt = σ' − σ < 0 and x̂0 = x − σ·v̂:

- ``dance`` (DanceGRPO's ``flux_step``): g = η, score = −(x − (1−σ)·x̂0)/σ², μ = x + dt·v̂ + dt·(−½η²·score),
  std = η·√(−dt). The same marginals as the ODE dx/dσ = v (reference/dancegrpo-spec.md §3.6, §11).
- ``flow-grpo`` (Flow-GRPO's ``sde_step_with_logprob``, sde_type "sde"): g = a·√(σ/(1−σ)), with σ₁ in the
  denominator at σ = 1; μ = x·(1 + g²·dt/(2σ)) + v̂·(1 + g²(1−σ)/(2σ))·dt, std = g·√(−dt). The same reverse SDE
  as ``dance`` with a σ-dependent diffusion (algebraically identical means at equal g).
- ``cps`` (Coefficients-Preserving Sampling, Flow-GRPO's sde_type "cps"): s = σ'·sin(a·π/2),
  μ = (1−σ')·x̂0 + √(σ'² − s²)·x̂1 with x̂1 = x + (1−σ)·v̂ the predicted noise, std = s. x' keeps exactly the
  marginal x_σ' = (1−σ')·x0 + σ'·ε when x̂0, x̂1 are right. Its "log-prob" is the authors': −mean((x'−μ)²), all
  constants removed (not a density; the ratio's trust region scales with 1/(2s²) relative to a Gaussian's), which is
  why the authors pair it with a small clip range (1e-5).

a is ``--eta`` for all three. ``kl_scale`` is the std_dev_t each returns in the authors' code (η, g, s), which
Flow-GRPO's KL divides by. The Gaussian log-prob is averaged (not summed) over the non-batch elements, constants
included: the PPO ratio is exp(Δ/D), so with clip_range 1e-4 that is the effective trust region (DanceGRPO's).

Each step starts with the same prologue (``_prologue``: x and v̂ in fp32, σ and σ' per sample) and ends with the
same epilogue (x' sampled as μ + std·ξ from the caller's noise ξ, or the given x' scored; x' enters the log-prob
detached, so gradients flow through μ, i.e. the velocity, only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

_LOG_SQRT_TWO_PI = math.log(math.sqrt(2 * math.pi))
_HALF_LOG_TWO_PI = 0.5 * math.log(2 * math.pi)


@dataclass(frozen=True)
class SdeStep:
    """Result of one stochastic step (B = batch, * = the latent's own axes, e.g. L, C)."""

    prev_sample: torch.Tensor  # [B, *] fp32, x' (the sample, or the given prev_sample)
    x0_pred: torch.Tensor  # [B, *] fp32, x̂0
    log_prob: torch.Tensor  # [B] fp32, mean over * of log N(x'; μ, std²); differentiable through μ only
    mean: torch.Tensor  # [B, *] fp32, μ (differentiable)
    std: torch.Tensor  # [] or [B, 1, …] fp32, the step's standard deviation
    kl_scale: torch.Tensor  # [] or [B, 1, …] fp32, Flow-GRPO's std_dev_t: its KL is mean((μ−μ_ref)²)/(2·kl_scale²)


def per_sample(value: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A scalar or [B] noise level as fp32, shaped [B, 1, …, 1] (or 0-d) to broadcast against ``like``."""
    tensor = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    if tensor.ndim == 0:
        return tensor
    if tensor.ndim != 1 or tensor.shape[0] != like.shape[0]:
        raise ValueError(f"σ must be a scalar or one value per sample [{like.shape[0]}], got {tuple(tensor.shape)}")
    return tensor.reshape(-1, *([1] * (like.ndim - 1)))


def _prologue(
    x: torch.Tensor, velocity: torch.Tensor, sigma: float | torch.Tensor, sigma_next: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, v̂) in fp32 and (σ, σ') as 0-d or [B, 1, …] fp32: what every step starts from."""
    x, velocity = x.to(torch.float32), velocity.to(torch.float32)
    return x, velocity, per_sample(sigma, x), per_sample(sigma_next, x)


def dance_step(
    x: torch.Tensor,
    velocity: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    eta: float,
    prev_sample: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
) -> SdeStep:
    """DanceGRPO's SDE step from σ to σ' (< σ; σ' may be 0, the last step still adds noise) with diffusion η > 0.

    ``sigma``/``sigma_next`` are scalars or one per sample [B] (the update trains each trajectory on its own
    timesteps); ``noise`` [B, *] standard normal ξ is required when ``prev_sample`` is None (the caller draws it, so
    the RNG stream is under its control). Called twice with the same velocity and the first call's x', the
    log-probs are bit-identical.
    """
    if eta <= 0:
        raise ValueError(f"eta must be positive for a stochastic step with a log-probability, got {eta}")
    x, velocity, sigma_t, sigma_next_t = _prologue(x, velocity, sigma, sigma_next)
    delta_sigma = sigma_next_t - sigma_t  # negative: σ decreases towards the data
    x0_pred = x - sigma_t * velocity
    score = -(x - (1 - sigma_t) * x0_pred) / sigma_t**2
    mean = x + delta_sigma * velocity + delta_sigma * (-0.5 * eta**2 * score)
    std = eta * torch.sqrt(sigma_t - sigma_next_t)
    prev_sample = _sample_or_given(mean, std, prev_sample, noise)
    log_density = -((prev_sample.detach() - mean) ** 2) / (2 * std**2) - torch.log(std) - _HALF_LOG_TWO_PI
    # DanceGRPO's diffusion coefficient g = η (std = g·√(σ−σ'))
    return SdeStep(prev_sample, x0_pred, _mean_over_elements(log_density), mean, std, torch.full_like(std, eta))


def flow_grpo_step(
    x: torch.Tensor,
    velocity: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    noise_level: float,
    sigma_max: float,
    prev_sample: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
) -> SdeStep:
    """Flow-GRPO's SDE step; ``sigma_max`` is σ₁ of the table (it replaces σ = 1 in g's denominator)."""
    x, velocity, sigma_t, sigma_next_t = _prologue(x, velocity, sigma, sigma_next)
    dt = sigma_next_t - sigma_t
    std_dev_t = torch.sqrt(sigma_t / (1 - torch.where(sigma_t == 1, sigma_max, sigma_t))) * noise_level
    mean = (
        x * (1 + std_dev_t**2 / (2 * sigma_t) * dt) + velocity * (1 + std_dev_t**2 * (1 - sigma_t) / (2 * sigma_t)) * dt
    )
    std = std_dev_t * torch.sqrt(-1 * dt)
    prev_sample = _sample_or_given(mean, std, prev_sample, noise)
    log_density = -((prev_sample.detach() - mean) ** 2) / (2 * std**2) - torch.log(std) - _LOG_SQRT_TWO_PI
    return SdeStep(prev_sample, x - sigma_t * velocity, _mean_over_elements(log_density), mean, std, std_dev_t)


def cps_step(
    x: torch.Tensor,
    velocity: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    noise_level: float,
    prev_sample: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
) -> SdeStep:
    """Coefficients-preserving step (Flow-GRPO's "cps"); noiseless (s = 0) at σ' = 0."""
    x, velocity, sigma_t, sigma_next_t = _prologue(x, velocity, sigma, sigma_next)
    std = sigma_next_t * math.sin(noise_level * math.pi / 2)
    x0_pred = x - sigma_t * velocity
    noise_pred = x + velocity * (1 - sigma_t)
    mean = x0_pred * (1 - sigma_next_t) + noise_pred * torch.sqrt(sigma_next_t**2 - std**2)
    prev_sample = _sample_or_given(mean, std, prev_sample, noise)
    log_prob = _mean_over_elements(-((prev_sample.detach() - mean) ** 2))
    return SdeStep(prev_sample, x0_pred, log_prob, mean, std, std)


class Sampler(Protocol):
    """A stochastic step that carries its own parameters: the rollout samples with it, the update scores with it."""

    @property
    def name(self) -> str: ...

    def step(
        self,
        x: torch.Tensor,
        velocity: torch.Tensor,
        sigma: float | torch.Tensor,
        sigma_next: float | torch.Tensor,
        prev_sample: torch.Tensor | None = None,
        noise: torch.Tensor | None = None,
    ) -> SdeStep: ...


@dataclass(frozen=True)
class DanceSampler:
    """DanceGRPO's step: diffusion η at every σ."""

    eta: float
    name: str = "dance"

    def step(
        self,
        x: torch.Tensor,
        velocity: torch.Tensor,
        sigma: float | torch.Tensor,
        sigma_next: float | torch.Tensor,
        prev_sample: torch.Tensor | None = None,
        noise: torch.Tensor | None = None,
    ) -> SdeStep:
        return dance_step(x, velocity, sigma, sigma_next, self.eta, prev_sample, noise)


@dataclass(frozen=True)
class FlowGrpoSampler:
    """Flow-GRPO's step: noise level a, and σ₁ of the table (it replaces σ = 1 in g's denominator)."""

    noise_level: float
    sigma_max: float
    name: str = "flow-grpo"

    def step(
        self,
        x: torch.Tensor,
        velocity: torch.Tensor,
        sigma: float | torch.Tensor,
        sigma_next: float | torch.Tensor,
        prev_sample: torch.Tensor | None = None,
        noise: torch.Tensor | None = None,
    ) -> SdeStep:
        return flow_grpo_step(x, velocity, sigma, sigma_next, self.noise_level, self.sigma_max, prev_sample, noise)


@dataclass(frozen=True)
class CpsSampler:
    """The coefficients-preserving step at noise level a."""

    noise_level: float
    name: str = "cps"

    def step(
        self,
        x: torch.Tensor,
        velocity: torch.Tensor,
        sigma: float | torch.Tensor,
        sigma_next: float | torch.Tensor,
        prev_sample: torch.Tensor | None = None,
        noise: torch.Tensor | None = None,
    ) -> SdeStep:
        return cps_step(x, velocity, sigma, sigma_next, self.noise_level, prev_sample, noise)


SAMPLER_NAMES = ("dance", "flow-grpo", "cps")


def make_sampler(name: str, noise_level: float, sigma_max: float) -> Sampler:
    """The sampler called ``name`` (``SAMPLER_NAMES``) at ``noise_level`` (η or a); ``sigma_max`` is σ₁ of the
    σ table (only flow-grpo reads it)."""
    if name == "dance":
        return DanceSampler(noise_level)
    if name == "flow-grpo":
        return FlowGrpoSampler(noise_level, sigma_max)
    if name == "cps":
        return CpsSampler(noise_level)
    raise ValueError(f"unknown sampler {name!r}: one of {', '.join(SAMPLER_NAMES)}")


def euler_step(x: torch.Tensor, velocity: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
    """The probability-flow ODE step x' = x + (σ'−σ)·v̂ (every sampler above at noise level 0), in fp32."""
    return x.to(torch.float32) + (sigma_next - sigma) * velocity.to(torch.float32)


def dpm_solver_2m_step(
    x: torch.Tensor,
    x0_pred: torch.Tensor,
    previous_x0_pred: torch.Tensor,
    sigma_previous: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
) -> torch.Tensor:
    """DPM-Solver++(2M), data prediction, for the flow x_σ = (1−σ)·x0 + σ·ε (MixGRPO-Flash's tail solver).

    With α = 1−σ and λ = log(α/σ): h = λ(σ') − λ(σ), h₀ = λ(σ) − λ(σ_prev), D0 = x̂0, D1 = (h/h₀)(x̂0 − x̂0_prev),
    x' = (σ'/σ)·x − α'·(e^{−h} − 1)·(D0 + ½·D1). With a constant x̂0 (D1 = 0) this is the Euler step exactly in
    exact arithmetic. Not for σ' = 0 (λ = ∞): the last step is Euler (first order), as in DPM-Solver++.
    """
    x, x0_pred, previous_x0_pred = (t.to(torch.float32) for t in (x, x0_pred, previous_x0_pred))

    def log_snr(value: torch.Tensor) -> torch.Tensor:
        return torch.log(1 - value) - torch.log(value)

    h = log_snr(sigma_next) - log_snr(sigma)
    h_previous = log_snr(sigma) - log_snr(sigma_previous)
    correction = (h / h_previous) * (x0_pred - previous_x0_pred)
    return (sigma_next / sigma) * x - (1 - sigma_next) * torch.expm1(-h) * (x0_pred + 0.5 * correction)


def _sample_or_given(
    mean: torch.Tensor, std: torch.Tensor, prev_sample: torch.Tensor | None, noise: torch.Tensor | None
) -> torch.Tensor:
    if prev_sample is not None:
        return prev_sample.to(torch.float32)
    if noise is None:
        raise ValueError("a sampler step needs `noise` (standard normal, shaped like x) when prev_sample is None")
    return mean + std * noise.to(torch.float32)


def _mean_over_elements(values: torch.Tensor) -> torch.Tensor:
    return values.mean(dim=tuple(range(1, values.ndim)))
