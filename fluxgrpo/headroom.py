"""Headroom: how good a model's best samples already are, the ceiling a reward-driven update can reach cheaply.

Reinforcement learning with a group-relative advantage moves the policy towards the samples that score best in their
group. Before a cluster is booked, the base model's best-of-k tells how far that can go: if the best of 32 images per
prompt is barely better than the mean, no RL run will raise the mean much; if it is far better, the gap is the
headroom, and a run's held-out gain can be read as the share of it used.

For each prompt with n scored images (``s_1 ≤ … ≤ s_n``), without replacement and without bias (every k-subset of
the n images counted once, as Codex's pass@k estimator counts):

- **best-of-k**: the expected best score of k images, ``Σ_{i=k..n} C(i−1, k−1) / C(n, k) · s_i``;
- **pass@k**: the chance that at least one of k images passes (score ≥ a threshold: 1.0 for the shapes checker,
  every claim holds), ``1 − C(n − c, k) / C(n, k)`` with c passing images.

Both are averaged over prompts. ``fluxgrpo score --headroom`` prints them; the training's held-out evaluation logs
best-of-n (``eval_<reward>_best_of_n``) and the closing line says the share of that headroom a run used.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


def best_of_k(scores: Sequence[float], k: int) -> float:
    """The expected best of ``k`` of ``scores`` drawn without replacement (``k`` ≤ len)."""
    n = len(scores)
    if not 1 <= k <= n:
        raise ValueError(f"best-of-{k} needs 1 ≤ k ≤ {n} scores")
    ordered = sorted(scores)
    total = math.comb(n, k)
    return sum(math.comb(i - 1, k - 1) * ordered[i - 1] for i in range(k, n + 1)) / total


def pass_at_k(scores: Sequence[float], k: int, threshold: float) -> float:
    """The chance that at least one of ``k`` of ``scores`` (drawn without replacement) is ≥ ``threshold``."""
    n = len(scores)
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 ≤ k ≤ {n} scores")
    failing = sum(1 for s in scores if not s >= threshold)
    return 1.0 - math.comb(failing, k) / math.comb(n, k)


def ks_up_to(n: int) -> list[int]:
    """1, 2, 4, … and n itself: the k a headroom table reports."""
    ks = [1 << p for p in range(n.bit_length()) if 1 << p <= n]
    return ks if ks[-1] == n else [*ks, n]


@dataclass(frozen=True)
class Headroom:
    """Best-of-k and pass@k averaged over prompts, for every k of :func:`ks_up_to` the smallest group allows."""

    prompts: int
    images_per_prompt: int  # the smallest group: every prompt is read at the same k
    best_of: dict[int, float]
    pass_at: dict[int, float] | None  # None without a threshold
    threshold: float | None

    @property
    def mean(self) -> float:
        return self.best_of[1]

    @property
    def ceiling(self) -> float:
        return self.best_of[self.images_per_prompt]


def headroom(groups: Mapping[str, Sequence[float]], threshold: float | None = None) -> Headroom:
    """The headroom of per-prompt scores (``{prompt: scores}``); non-finite scores are left out of their group."""
    finite = {p: [s for s in v if math.isfinite(s)] for p, v in groups.items()}
    finite = {p: v for p, v in finite.items() if v}
    if not finite:
        raise ValueError("no finite score to read a headroom from")
    n = min(len(v) for v in finite.values())
    ks = ks_up_to(n)
    best = {k: sum(best_of_k(v, k) for v in finite.values()) / len(finite) for k in ks}
    passing = (
        None
        if threshold is None
        else {k: sum(pass_at_k(v, k, threshold) for v in finite.values()) / len(finite) for k in ks}
    )
    return Headroom(len(finite), n, best, passing, threshold)


def best_of_n_mean(prompt_of_image: Sequence[str], scores: Sequence[float]) -> float | None:
    """The mean over prompts of each prompt's best finite score (best-of-n with every image: n = its group); None
    when no prompt has two images (one image has no headroom to read)."""
    groups: dict[str, list[float]] = {}
    for prompt, score in zip(prompt_of_image, scores, strict=True):
        if math.isfinite(score):
            groups.setdefault(prompt, []).append(score)
    if not groups or max(len(v) for v in groups.values()) < 2:
        return None
    return sum(max(v) for v in groups.values()) / len(groups)


def share_used(first: float, last: float, ceiling: float) -> float | None:
    """The share of the headroom (``ceiling − first``) a change ``last − first`` used; None with no headroom."""
    room = ceiling - first
    return None if room <= 1e-9 else (last - first) / room
