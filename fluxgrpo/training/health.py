"""A run that cannot learn stops: K iterations in a row without a single optimizer step.

An iteration skips its update when nothing finite came out of it: no finite reward on any rank, or a non-finite
gradient norm at every accumulation boundary (a non-finite loss gives one). The weights are then untouched, which is
right for a passing glitch; but when every iteration skips, the run would "succeed" with the base weights. Settings
that cause it are refused in validation (``TrainConfig.problems``); whatever slips through stops here, naming the
quantity that was not finite.
"""

from __future__ import annotations

import math
from typing import Any

from fluxgrpo.errors import FluxgrpoError

MAX_CONSECUTIVE_SKIPPED_UPDATES = 3


def non_finite_quantity(record: dict[str, Any]) -> str:
    """What kept an iteration from updating, from its metrics record (reduced over ranks, so the same on each)."""
    if record.get("update_skipped"):
        return "the reward (no finite reward on any rank)"
    loss = record.get("loss")
    if isinstance(loss, float) and not math.isfinite(loss):
        return f"the loss ({loss})"
    return "the gradient norm (at every accumulation boundary)"


class SkippedUpdateWatch:
    """Counts iterations in a row that took no optimizer step; ``observe`` raises at ``limit`` of them, or at
    ``last_iteration`` when no iteration since the first stepped (a run shorter than ``limit`` exited 0)."""

    def __init__(self, limit: int = MAX_CONSECUTIVE_SKIPPED_UPDATES, last_iteration: int | None = None) -> None:
        self.limit = limit
        self.last_iteration = last_iteration  # the run's last: there, a run that never stepped fails (#50.5)
        self.streak = 0

    def observe(self, record: dict[str, Any]) -> None:
        """Call once per iteration with its metrics record, on every rank (each raises at the same iteration).

        Raises:
            FluxgrpoError: the last ``limit`` iterations all skipped their update.
        """
        if record["optimizer_steps"]:
            self.streak = 0
            return
        self.streak += 1
        iteration = record["iteration"]
        if iteration == self.last_iteration and self.streak == iteration < self.limit:
            raise FluxgrpoError(
                f"{'the only iteration' if iteration == 1 else f'all {iteration} iterations'} skipped their update "
                f"because {non_finite_quantity(record)} was not finite, so the weights never moved: failing the run. "
                "Check --learning-rate, --eta, --kl-beta, --shift, --guidance, the objective's flags and the reward "
                "weights; metrics.jsonl has every iteration"
            )
        if self.streak >= self.limit:
            raise FluxgrpoError(
                f"iterations {iteration - self.limit + 1}-{iteration} all skipped their update because "
                f"{non_finite_quantity(record)} was not finite, so the weights no longer move: stopping. Check "
                "--learning-rate, --eta, --kl-beta, --shift, --guidance and the reward weights; metrics.jsonl has "
                "every iteration"
            )
