"""Mean and unbiased std over the finite values along one dimension: the one form the advantages and the logged
reward statistics share, so a NaN or ±inf reward is left out of both the same way."""

from __future__ import annotations

from typing import NamedTuple

import torch


class FiniteStats(NamedTuple):
    finite: torch.Tensor  # bool, like the values: which entries count
    num_finite: torch.Tensor  # float32 number of finite entries, reduced along ``dim``
    mean: torch.Tensor  # their mean (0 where none is finite)
    std: torch.Tensor  # their unbiased (n − 1) std (n − 1 clamped to 1: 0 for a single value)


def finite_mean_std(values: torch.Tensor, dim: int, keepdim: bool = False) -> FiniteStats:
    """Mean and unbiased std of ``values``' finite entries along ``dim``; non-finite entries count as absent.

    In float32 order: the masked sum over the count (clamped to 1), then the masked squared deviations' sum over
    count − 1 (clamped to 1), square-rooted.
    """
    finite = torch.isfinite(values)
    count = finite.sum(dim=dim, keepdim=True).to(torch.float32)
    safe = torch.where(finite, values, torch.zeros_like(values))
    mean = safe.sum(dim=dim, keepdim=True) / count.clamp(min=1)
    spread = torch.where(finite, values - mean, torch.zeros_like(values))
    std = (spread.pow(2).sum(dim=dim, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
    if not keepdim:
        count, mean, std = count.squeeze(dim), mean.squeeze(dim), std.squeeze(dim)
    return FiniteStats(finite, count, mean, std)
