"""DanceGRPO's SDE sampling step for rectified-flow models, with the log-probability GRPO needs.

With the flow convention x_σ = (1−σ)·x0 + σ·ε and a velocity model v ≈ ε − x0, one step from σ to σ' < σ is

    x̂0    = x − σ·v                               predicted clean sample
    score = −(x − (1−σ)·x̂0) / σ²                  = −ε̂/σ, the score of p_σ(x)
    μ     = x + (σ'−σ)·v + (σ'−σ)·(−½η²·score)     reverse-time SDE mean with diffusion η,
                                                   the same marginals as the ODE dx/dσ = v
    std   = η·√(σ−σ')
    x'    = μ + std·ξ,  ξ ~ N(0, I)

and log p(x' | x) is the Gaussian log-density of x' under N(μ, std²), averaged (not summed) over all
non-batch elements, constants included. The mean over D elements makes the PPO ratio exp(Δ/D): with
clip_range 1e-4 that is the effective trust region. Kept for parity with DanceGRPO; see
reference/dancegrpo-spec.md §3.6 and §11.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_HALF_LOG_TWO_PI = 0.5 * math.log(2 * math.pi)


@dataclass(frozen=True)
class SdeStep:
    """Result of one ``sde_step`` (B = batch, * = the latent's own axes, e.g. L, C)."""

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


def sde_step(
    x: torch.Tensor,
    velocity: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    eta: float,
    prev_sample: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
) -> SdeStep:
    """One SDE step from σ to σ' (< σ) and the log-probability of its result, all in float32.

    Args:
        x: [B, *] current latent at noise level σ.
        velocity: [B, *] model prediction v at (x, σ), any float dtype; cast to fp32.
        sigma: σ, a scalar or one per sample [B] (the update trains each trajectory on its own timesteps).
        sigma_next: σ', same form as ``sigma``; σ' may be 0 (the last step still adds noise).
        eta: η > 0, the SDE's diffusion coefficient.
        prev_sample: [B, *] the x' whose probability to score (the stored next latent when training).
            When None, x' is sampled as μ + std·noise.
        noise: [B, *] standard normal ξ, required when ``prev_sample`` is None; the caller draws it so that
            the RNG stream is under its control.

    Returns:
        SdeStep(prev_sample=x', x0_pred=x̂0, log_prob [B]). x' enters the log-prob detached, so gradients
        flow through μ (i.e. the velocity) only. Called twice with the same velocity and the first call's x',
        the log-probs are bit-identical.
    """
    if eta <= 0:
        raise ValueError(f"eta must be positive for a stochastic step with a log-probability, got {eta}")
    x = x.to(torch.float32)
    velocity = velocity.to(torch.float32)
    sigma_t = per_sample(sigma, x)
    sigma_next_t = per_sample(sigma_next, x)

    delta_sigma = sigma_next_t - sigma_t  # negative: σ decreases towards the data
    x0_pred = x - sigma_t * velocity
    score = -(x - (1 - sigma_t) * x0_pred) / sigma_t**2
    mean = x + delta_sigma * velocity + delta_sigma * (-0.5 * eta**2 * score)
    std = eta * torch.sqrt(sigma_t - sigma_next_t)

    if prev_sample is None:
        if noise is None:
            raise ValueError("sde_step needs `noise` (standard normal, shaped like x) when prev_sample is None")
        prev_sample = mean + std * noise.to(torch.float32)
    else:
        prev_sample = prev_sample.to(torch.float32)

    log_density = -((prev_sample.detach() - mean) ** 2) / (2 * std**2) - torch.log(std) - _HALF_LOG_TWO_PI
    log_prob = log_density.mean(dim=tuple(range(1, log_density.ndim)))
    return SdeStep(
        prev_sample=prev_sample,
        x0_pred=x0_pred,
        log_prob=log_prob,
        mean=mean,
        std=std,
        kl_scale=torch.full_like(std, eta),  # DanceGRPO's diffusion coefficient g = η (std = g·√(σ−σ'))
    )
