"""Diversity of the held-out evaluation: how different a prompt's images are from one another across seeds.

RL fine-tuning collapses a prompt's seeds towards one image (DanceGRPO's paper shows it) while every per-image
reward still looks fine, so the evaluation measures it directly. With ``--eval-images-per-prompt`` n ≥ 2, each
image is embedded with the CLIP image tower of a reward the evaluation already loads (the first of
``rewards/reward_set.py``'s ``EMBEDDING_REWARDS`` among the training and ``--eval-rewards`` rewards), L2-normalised, and

    diversity = mean over prompts of  mean over the n·(n−1)/2 pairs of that prompt's images of (1 − cos(fᵢ, fⱼ))

0 when a prompt's images are identical, larger as they spread (at most 2), the same whatever order the seeds come
in. It is logged as ``eval_diversity`` (``eval_ema_diversity`` for the EMA) and can be guarded (``--guard
diversity:-15%``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from fluxgrpo.rewards.scoring import load_image

if TYPE_CHECKING:
    from pathlib import Path


def diversity(features: torch.Tensor, prompt_indices: Sequence[int]) -> float:
    """Mean over prompts (those with ≥ 2 images) of the mean pairwise cosine distance of their images' features.

    ``features`` [N, D] (any scale: normalised here), ``prompt_indices`` [N] the prompt of each row. NaN when no
    prompt has two images.
    """

    if features.shape[0] != len(prompt_indices):
        raise ValueError(f"{features.shape[0]} feature rows for {len(prompt_indices)} prompt indices")
    unit = F.normalize(features.double(), dim=-1)
    per_prompt = []
    for prompt in sorted(set(prompt_indices)):
        rows = [i for i, p in enumerate(prompt_indices) if p == prompt]
        if len(rows) < 2:
            continue
        group = unit[rows]
        cosine = group @ group.T
        upper = torch.triu_indices(len(rows), len(rows), offset=1)
        distances = (1.0 - cosine[upper[0], upper[1]]).clamp(min=0.0)
        per_prompt.append(float(distances.mean()))
    return math.fsum(per_prompt) / len(per_prompt) if per_prompt else math.nan


def image_diversity(scorer: Any, paths: Sequence[Path], prompt_indices: Sequence[int], batch_size: int) -> float:
    """``diversity`` of the images at ``paths`` in ``scorer.embed_pil``'s features, read back from disk."""

    rows = []
    for start in range(0, len(paths), batch_size):
        images = [load_image(path) for path in paths[start : start + batch_size]]
        with torch.no_grad():
            rows.append(scorer.embed_pil(images).float().cpu())
    return diversity(torch.cat(rows), prompt_indices)
