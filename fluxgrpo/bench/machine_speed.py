"""How fast this machine is right now, so a baseline's seconds reused from another run can be read against it.

`bench --algorithms --baseline-from earlier.json` reuses the baseline's times from the earlier run. Training is
deterministic, its seconds are not: the same dance runs, identical to the last digit in every score, took 9.12 s per
iteration on one day's 2-core machine and 7.83 s on the next's (same CPU name, same code). So every comparison
records the seconds of one fixed reference workload before and after its training, and a reused row is read with
the ratio of the two runs' reference seconds beside it: a per-second ratio against a reused baseline is only as good
as that ratio is close to 1.

The workload is fixed float32 matrix products at torch's current thread count, the kind of work a transformer
forward is made of; it is a proxy (it does not see memory bandwidth or a neighbour that comes and goes during the
run), which is why it is measured on both sides of the training.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

REFERENCE_SIDE = 384
REFERENCE_PRODUCTS = 32
REFERENCE_REPEATS = 5
# Beyond this far from 1 the two runs' machines differ by more than their own run-to-run spread does here (dance's
# three runs on one machine spread by about 6 % on the 2 cores), so the note says so.
NOTICEABLE = 0.05


def reference_seconds(repeats: int = REFERENCE_REPEATS) -> float:
    """The median seconds, over ``repeats`` timed runs after one untimed, of the reference workload."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(REFERENCE_SIDE, REFERENCE_SIDE, generator=generator)
    b = torch.randn(REFERENCE_SIDE, REFERENCE_SIDE, generator=generator)

    def once() -> float:
        start = time.perf_counter()
        out = a
        for _ in range(REFERENCE_PRODUCTS):
            out = torch.tanh(out @ b)  # tanh keeps the values bounded, so no product runs into inf or denormals
        return time.perf_counter() - start

    once()
    return statistics.median(once() for _ in range(repeats))


def measured_speed(before: float, after: float) -> dict[str, Any]:
    """The document's record: the reference seconds on both sides of the training, and their mean."""
    return {"before": before, "after": after, "mean": (before + after) / 2}


def speed_note(earlier: dict[str, Any] | None, here: dict[str, Any] | None) -> str:
    """One sentence on the two runs' machines: how many times as fast this one ran the reference workload."""
    if not earlier or not here:
        return (
            "that run did not record its machine's speed (a document from before 2026-12-07), so how its seconds "
            "compare with this machine's is unknown"
        )
    factor = float(earlier["mean"]) / float(here["mean"])
    measured = f"the reference workload took {earlier['mean'] * 1e3:.0f} ms there and {here['mean'] * 1e3:.0f} ms here"
    if abs(factor - 1) <= NOTICEABLE:
        return f"{measured}: the same speed within {NOTICEABLE:.0%}"
    return (
        f"{measured}: this machine ran it {factor:.2f}× as fast, so ratios of seconds to the reused row carry that "
        "factor; train the baseline again (drop --baseline-from) to compare on one machine"
    )
