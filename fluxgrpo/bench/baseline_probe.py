"""How fast this machine runs the baseline now, so the baseline's seconds reused from another run can be read.

`bench --algorithms --baseline-from earlier.json` reuses the baseline's row, times included, from the earlier run.
Training is deterministic, its seconds are not: dance's runs, identical to the last digit in every score, took 9.12 s
per iteration on one day's 2-core machine, 7.83 s on the next morning's and 8.54 s three hours later (same machine
type, same code). A fixed kernel timed beside the training was tried first and read the wrong way round: float32
matrix products took 33 ms beside dance's 7.83 s and 25 ms beside its 8.54 s, "1.3× as fast" on a machine that ran
dance 0.92× as fast. A small compute kernel does not see what holds the training back on a shared machine (memory
traffic, the neighbours' load), so the probe is the baseline itself: a reusing run trains it for a few iterations
here (no evaluation, no guards, one checkpoint) and compares the median seconds of those iterations, the first left
out (it allocates and warms up), with the reused row's seconds per iteration. Every reused document works, old or
new, since every row has its seconds per iteration; nothing extra has to be recorded when the baseline is trained.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fluxgrpo.config import TrainConfig

# Trained iterations of the probe; the first is left out of its median, so five are timed. Within one of dance's
# 72-iteration runs on the 2 cores single iterations took 7.2–9.7 s; the median of five landed within 5 % of the
# run's median (8.4 against 8.54, 7.7 against 8.03), at about a minute of the block's 25–55.
PROBE_ITERATIONS = 6
# Beyond this far from 1 the two machines differ by more than the probe's own error and dance's run-to-run spread
# (about 6 % over its three runs) do, so the note says to train the baseline again.
NOTICEABLE = 0.10


def probe_config(baseline: TrainConfig, iterations: int = PROBE_ITERATIONS) -> TrainConfig:
    """The baseline's training config cut to ``iterations`` (at most its own), with nothing beside the training:
    no held-out evaluation and so no guards or best/ (they act on it), in a run folder of its own."""
    return dataclasses.replace(
        baseline,
        output_dir=str(Path(baseline.output_dir).parent / "probe"),
        max_train_steps=min(iterations, baseline.max_train_steps),
        checkpointing_steps=min(iterations, baseline.max_train_steps),
        eval_every=0,
        guard="",
        keep_best="",
    ).validate()


def probe_seconds(iteration_seconds: list[float]) -> float:
    """The median seconds of the probe's iterations after the first (all of them when it trained one)."""
    timed = iteration_seconds[1:] or iteration_seconds
    return statistics.median(timed)


def run_probe(
    baseline: TrainConfig,
    reused_seconds: float,
    train: Callable[[TrainConfig], list[dict[str, Any]]],
    iteration_seconds: Callable[[dict[str, Any]], float],
) -> dict[str, Any]:
    """Train the probe with ``train`` and return the document's record: the probe's iterations and median seconds
    per iteration, the reused row's, and how many times as fast this machine ran the baseline (theirs over ours)."""
    records = train(probe_config(baseline))
    seconds = probe_seconds([iteration_seconds(record) for record in records])
    return {
        "iterations": len(records),
        "timed_iterations": max(len(records) - 1, 1),
        "seconds_per_iteration": seconds,
        "reused_seconds_per_iteration": reused_seconds,
        "speed_ratio": reused_seconds / seconds,
    }


def speed_note(probe: dict[str, Any] | None) -> str:
    """One sentence on the two runs' machines: how many times as fast this one ran the baseline's iterations."""
    if not probe:
        return "this run did not probe the baseline's speed here, so how its seconds compare is unknown"
    factor = float(probe["speed_ratio"])
    measured = (
        f"its iterations took {float(probe['reused_seconds_per_iteration']):.3g} s there and "
        f"{float(probe['seconds_per_iteration']):.3g} s here ({_timed(int(probe['timed_iterations']))})"
    )
    if abs(factor - 1) <= NOTICEABLE:
        return f"{measured}: the same speed within {NOTICEABLE:.0%}"
    return (
        f"{measured}: this machine ran them {factor:.2f}× as fast, so ratios of seconds to the reused row carry that "
        "factor; train the baseline again (drop --baseline-from) to compare on one machine"
    )


def _timed(count: int) -> str:
    return "one probe iteration" if count == 1 else f"median of {count} probe iterations"
