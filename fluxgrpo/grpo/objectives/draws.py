"""The (timestep, noise) draws of the objectives that train on forward-noised final samples (nft, awm, vgrpo).

Two variance controls, each an option (``--fm-draws``, ``--fm-timestep-rule``):
- who shares a draw: ``sample`` (every sample its own timesteps and noise: DiffusionNFT's authors; AWM's authors
  share the timesteps within a micro-batch, the noise per sample) or ``group`` (one set of (t, ε) pairs for all the
  samples of a prompt's group: V-GRPO's "group-shared timestep-noise pairs", which makes the group's surrogates
  comparable: the group advantage compares samples, and a shared basis removes the draw from the comparison);
- how a unit's T timesteps are chosen from the grid: ``random`` (T distinct indices, a random permutation's first T:
  DiffusionNFT's) or ``stratified`` (one per stratum of the grid: AWM's and V-GRPO's).

Every draw comes from the update's CPU generator, in a fixed order (all the timestep draws, then the noise), so an
exact resume redraws them.
"""

from __future__ import annotations

import torch

SHARINGS = ("sample", "group")
TIMESTEP_RULES = ("random", "stratified")


def group_bounds(num_samples: int, group_size: int) -> list[tuple[int, int]]:
    """(start, stop) of each prompt's group (groups are contiguous rows of ``group_size``)."""
    if group_size < 1 or num_samples % group_size:
        raise ValueError(f"{num_samples} samples do not split into groups of {group_size}")
    return [(start, start + group_size) for start in range(0, num_samples, group_size)]


def sample_bounds(num_samples: int) -> list[tuple[int, int]]:
    return [(row, row + 1) for row in range(num_samples)]


def linspace_strata(grid: range, count: int, generator: torch.Generator) -> torch.Tensor:
    """[T] AWM's stratified draw over ``grid``: b = linspace(lo, hi, T+1).long(), index_k = b_k + ⌊u_k·(b_{k+1}−b_k)⌋."""
    bounds = torch.linspace(grid.start, grid.stop, count + 1).long()
    u = torch.rand(count, generator=generator)
    return bounds[:-1] + torch.floor(u * (bounds[1:] - bounds[:-1])).long()


def random_indices(grid: range, count: int, generator: torch.Generator) -> torch.Tensor:
    """[T] DiffusionNFT's draw: the first T of a random permutation of ``grid``."""
    return grid.start + torch.randperm(len(grid), generator=generator)[:count]


def indices_per_unit(
    units: list[tuple[int, int]], draw, grid: range, count: int, generator: torch.Generator
) -> torch.Tensor:
    """[B, T] int64: one ``draw(grid, count, generator)`` per unit (start, stop), repeated over the unit's rows."""
    rows = [draw(grid, count, generator).expand(stop - start, -1) for start, stop in units]
    return torch.cat(rows)


def draw_noise(
    num_samples: int, count: int, shape: tuple[int, ...], group_size: int, generator: torch.Generator
) -> torch.Tensor:
    """[B, T, *shape] fp32 standard normal: fresh per sample (``group_size`` 1), or one per group repeated over it."""
    draws = torch.randn((num_samples // group_size, count, *shape), generator=generator, dtype=torch.float32)
    return draws if group_size == 1 else draws.repeat_interleave(group_size, dim=0)
