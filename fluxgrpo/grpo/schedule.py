"""The σ (noise level) table of DanceGRPO's FLUX sampler, and the quantised timesteps the model is fed."""

from __future__ import annotations

import torch

from fluxgrpo.errors import UsageError


def sigma_schedule(num_steps: int, shift: float) -> torch.Tensor:
    """σ_i = s·t/(1+(s−1)·t) for t = 1 − i/N, i = 0…N: a float32 tensor [N+1] running from 1 to 0.

    Computed exactly as DanceGRPO does (``linspace(1, 0, N+1)`` in float32, then the SD3-style time shift in
    float32), so the table is bit-identical to the original's.
    """
    if num_steps < 1:
        raise UsageError(f"--sampling-steps must be at least 1, got {num_steps}")
    if shift <= 0:
        raise UsageError(f"--shift must be positive, got {shift}")
    t = torch.linspace(1, 0, num_steps + 1, dtype=torch.float32)
    return (shift * t) / (1 + (shift - 1) * t)


def model_timesteps(sigmas: torch.Tensor) -> torch.Tensor:
    """floor(1000·σ)/1000 in float32, same shape as ``sigmas``: the σ the transformer is fed.

    DanceGRPO truncates 1000·σ to an integer timestep and sends it divided by 1000, so the model sees a
    quantised σ while the SDE update uses the exact one. Kept for parity with the original's trained models.
    (FluxTransformer2DModel multiplies the value by 1000 again internally.)
    """
    scaled = sigmas.to(torch.float32) * 1000
    return torch.floor(scaled) / 1000


def num_train_timesteps(num_steps: int, timestep_fraction: float) -> int:
    """T_train = int((N−1)·fraction): how many of the N−1 trainable transitions each trajectory trains on.

    The last transition (N−1 → N) is never trained: the image is decoded from x̂0 of step N−1, so that
    transition cannot affect the reward.
    """
    if not 0 < timestep_fraction <= 1:
        raise UsageError(f"--timestep-fraction must be in (0, 1], got {timestep_fraction}")
    count = int((num_steps - 1) * timestep_fraction)
    if count < 1:
        raise UsageError(
            f"--timestep-fraction {timestep_fraction} with --sampling-steps {num_steps} trains on "
            f"int(({num_steps}-1)·{timestep_fraction}) = {count} timesteps: raise --timestep-fraction or "
            "--sampling-steps (at least 2 steps are needed)"
        )
    return count
