"""The σ (noise level) table of DanceGRPO's FLUX sampler, and the quantised timesteps the model is fed."""

from __future__ import annotations

import torch


def sigma_schedule(num_steps: int, shift: float) -> torch.Tensor:
    """σ_i = s·t/(1+(s−1)·t) for t = 1 − i/N, i = 0…N: a float32 tensor [N+1] running from 1 to 0.

    Computed exactly as DanceGRPO does (``linspace(1, 0, N+1)`` in float32, then the SD3-style time shift in
    float32), so the table is bit-identical to the original's.
    """
    if num_steps < 1 or shift <= 0:  # TrainConfig and the sample options validate these for the user
        raise ValueError(f"a σ table needs at least 1 step and a positive shift, got {num_steps} steps, shift {shift}")
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
