"""The PPO-clip surrogate DanceGRPO trains on (no entropy bonus; the KL option adds its own term)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    scale: float,
    sample_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """scale · mean(w·max(−A·ρ, −A·clamp(ρ, 1−ε, 1+ε))) with ρ = exp(log_ratio) and w = ``sample_weights`` (1).

    Args:
        log_ratio: [M] log ρ = log π_θ − log π_old (differentiable through π_θ).
        advantages: [M] advantages of each sample's trajectory, already clipped (``group_advantages``).
        clip_range: ε.
        scale: 1/(GA·T_train) in the update, so that the gradients summed over one accumulation window are
            the gradient of the mean surrogate over that window.
        sample_weights: [M] per-sample weights (GRPO-Guard's 1/|dt|); None weighs all alike.

    Returns:
        (loss, stats): the scaled scalar loss to backpropagate, and detached diagnostics.
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
    return surrogate * scale, stats
