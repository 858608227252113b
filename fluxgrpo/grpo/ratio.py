"""How the update turns log-probs into the PPO ratio (``--ratio-normalization``).

``none`` (DanceGRPO, Flow-GRPO): log ρ = lp_θ − lp_old.

``grpo-guard`` (GRPO-Guard, arXiv 2510.22319, read from its authors' ``train_sd3_GRPO_Guard.py``): with s the SDE
step's std and b = mean((μθ − μ_old)²)/(2s²),

    log ρ = (lp_θ − lp_old + b)·s = mean(ξ ⊙ (μθ − μ_old)),   ξ = (x' − μ_old)/s,

so the normalised log-ratio has mean 0 over the step noise and a scale that does not depend on the step (the raw
one has mean −b < 0: the drift the method fixes), and each step's loss is weighted by 1/|dt|, which cancels the
dt in ∂μ/∂v̂ so every step's gradient has the same size. The authors compute b and s as one number per batch (all
their samples share a step); here each sample has its own step, so each gets its own b, s and dt.
"""

from __future__ import annotations

import torch

from fluxgrpo.grpo.sde import SdeStep


def guard_log_ratio(new: SdeStep, old_log_prob: torch.Tensor, old_mean: torch.Tensor) -> torch.Tensor:
    """[B] GRPO-Guard's normalised log ρ for a Gaussian step (``dance`` or ``flow-grpo``)."""
    std = new.std.reshape(-1) if new.std.ndim else new.std
    squared = (new.mean - old_mean.detach()) ** 2
    bias = squared.mean(dim=tuple(range(1, squared.ndim))) / (2 * std**2)
    return (new.log_prob - old_log_prob + bias) * std


def guard_step_weight(sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
    """[B] 1/|dt| = 1/(σ − σ'): GRPO-Guard's per-step gradient re-weighting."""
    return 1.0 / (sigma - sigma_next)
