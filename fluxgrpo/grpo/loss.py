"""The PPO-clip surrogate DanceGRPO trains on (no KL term, no entropy bonus)."""

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
    surrogate: torch.Tensor  # the unscaled mean surrogate loss


def clipped_policy_loss(
    log_prob_new: torch.Tensor,
    log_prob_old: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
    adv_clip_max: float,
    scale: float,
) -> tuple[torch.Tensor, LossStats]:
    """scale · mean(max(−Â·ρ, −Â·clamp(ρ, 1−ε, 1+ε))) with ρ = exp(new − old) and Â = clamp(A, ±adv_clip_max).

    Args:
        log_prob_new: [M] log-probs under the current policy (differentiable).
        log_prob_old: [M] log-probs stored at rollout (treated as constants).
        advantages: [M] advantages of each sample's trajectory.
        clip_range: ε.
        adv_clip_max: advantage clip bound.
        scale: 1/(GA·T_train) in the update, so that the gradients summed over one accumulation window are
            the gradient of the mean surrogate over that window.

    Returns:
        (loss, stats): the scaled scalar loss to backpropagate, and detached diagnostics.
    """
    log_ratio = log_prob_new - log_prob_old.detach()
    ratio = torch.exp(log_ratio)
    clipped_advantages = advantages.detach().to(ratio.dtype).clamp(-adv_clip_max, adv_clip_max)
    unclipped_loss = -clipped_advantages * ratio
    clipped_loss = -clipped_advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    surrogate = torch.maximum(unclipped_loss, clipped_loss).mean()
    with torch.no_grad():
        detached = ratio.detach()
        stats = LossStats(
            ratio_mean=detached.mean(),
            ratio_min=detached.min(),
            ratio_max=detached.max(),
            clip_fraction=((detached - 1.0).abs() > clip_range).to(torch.float32).mean(),
            max_abs_log_ratio=log_ratio.detach().abs().max(),
            surrogate=surrogate.detach(),
        )
    return surrogate * scale, stats
