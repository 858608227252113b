"""The phase bench's results: one ``PhaseFigure`` per measured configuration, speed-ups against the smallest batch
size, and the per-resolution summary (one iteration's time, each phase's share, what checkpointing costs)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TypeVar

_T = TypeVar("_T")

PHASES = ("rollout", "decode", "reward", "update", "optimizer")


# --------------------------------------------------------------------------------------------- results


@dataclass(frozen=True)
class PhaseFigure:
    """One measured configuration of one phase (a row of the table, a ``figure`` JSON line)."""

    phase: str  # rollout | decode | reward | update | optimizer
    resolution: str  # "720x720"
    batch_size: int | None  # trajectories per forward (update: micro-batch); None for the optimizer
    activation_checkpointing: bool | None  # update/optimizer rows
    work: int  # what one timed run does, in ``unit``s
    unit: str  # images | samples (trajectory × trained timestep) | steps
    seconds: float | None  # median over the repeats of one run's wall time, device-synchronised
    seconds_min: float | None
    per_second: float | None  # work / seconds
    speedup: float | None  # per_second over this phase's per_second at its smallest batch size
    tflops: float | None  # achieved model TFLOP/s (transformer phases)
    mfu: float | None  # tflops / peak
    peak_memory_bytes: int | None  # allocator peak during the timed runs; None on cpu
    activation_bytes: int | None  # update rows: bytes held for backward after one micro-batch forward
    max_abs_log_ratio: float | None  # update rows: max |log ρ| over the first micro-batch (should be ~0)
    error: str | None = None  # "out of memory" and the like; the other figures are then None

    def to_record(self) -> dict[str, Any]:
        return {"record": "figure", **asdict(self)}


@dataclass
class Timing:
    seconds: list[float] = field(default_factory=list)  # one per timed run
    peak_memory_bytes: int | None = None  # the highest allocator peak of those runs
    excluded_seconds: list[float] = field(default_factory=list)  # per run: time spent in another phase (optimizer)

    def add(self, seconds: float, peak: int | None, excluded: float = 0.0) -> None:
        self.seconds.append(seconds)
        self.excluded_seconds.append(excluded)
        if peak is not None:
            self.peak_memory_bytes = max(self.peak_memory_bytes or 0, peak)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


@dataclass(frozen=True)
class MeasuredRow:
    """What one row measures, before its timing is known (the first six fields of a ``PhaseFigure``)."""

    phase: str
    resolution: str
    batch_size: int | None
    activation_checkpointing: bool | None
    work: int
    unit: str


def phase_figure(
    row: MeasuredRow,
    timing: Timing | None,
    flops: int | None = None,
    peak_tflops: float | None = None,
    *,
    error: str | None = None,
    activation_bytes: int | None = None,
    max_abs_log_ratio: float | None = None,
) -> PhaseFigure:
    """The row's figures from its timing; without a timing (or runs), its error (default "not measured")."""
    if timing is None or not timing.seconds:
        return PhaseFigure(
            **asdict(row),
            seconds=None,
            seconds_min=None,
            per_second=None,
            speedup=None,
            tflops=None,
            mfu=None,
            peak_memory_bytes=None,
            activation_bytes=activation_bytes,
            max_abs_log_ratio=max_abs_log_ratio,
            error=error or "not measured",
        )
    seconds = timing.median
    tflops = flops / seconds / 1e12 if flops is not None and seconds > 0 else None
    return PhaseFigure(
        **asdict(row),
        seconds=seconds,
        seconds_min=min(timing.seconds),
        per_second=row.work / seconds if seconds > 0 else None,
        speedup=None,
        tflops=tflops,
        mfu=tflops / peak_tflops if tflops is not None and peak_tflops else None,
        peak_memory_bytes=timing.peak_memory_bytes,
        activation_bytes=activation_bytes,
        max_abs_log_ratio=max_abs_log_ratio,
        error=error,
    )


def with_speedups(figures: Sequence[PhaseFigure]) -> list[PhaseFigure]:
    """Each figure's rate over the rate of the same phase, resolution and checkpointing at the smallest batch size."""
    baselines: dict[tuple[str, str, bool | None], PhaseFigure] = {}
    for figure in figures:
        if figure.batch_size is None or figure.per_second is None:
            continue
        key = (figure.phase, figure.resolution, figure.activation_checkpointing)
        if key not in baselines or figure.batch_size < baselines[key].batch_size:  # type: ignore[operator]
            baselines[key] = figure
    out = []
    for figure in figures:
        base = baselines.get((figure.phase, figure.resolution, figure.activation_checkpointing))
        if base is not None and figure.per_second is not None and base.per_second:
            figure = replace(figure, speedup=figure.per_second / base.per_second)
        out.append(figure)
    return out


def summarize(figures: Sequence[PhaseFigure], resolution: str) -> dict[str, Any]:
    """One iteration's time at the smallest and at the largest batch sizes (per activation-checkpointing mode), each
    phase's share of it, each phase's speed-up, and what checkpointing saves and costs (a ``summary`` JSON line).

    The bench's update takes one optimizer step (one accumulation window over all B trajectories), so an iteration
    is rollout + decode + reward + update + one optimizer step; decode and reward use the rollout's batch size, as
    the trainer does."""
    rows = [f for f in figures if f.resolution == resolution and f.seconds is not None]
    by_phase = {phase: [f for f in rows if f.phase == phase] for phase in PHASES}
    optimizer_seconds = _known(by_phase["optimizer"][0].seconds) if by_phase["optimizer"] else 0.0

    def iteration(chosen: dict[str, PhaseFigure]) -> dict[str, Any]:
        seconds = {phase: _known(figure.seconds) for phase, figure in chosen.items()}
        seconds["optimizer"] = optimizer_seconds
        total = sum(seconds.values())
        return {
            "batch_sizes": {phase: figure.batch_size for phase, figure in chosen.items()},
            "seconds": total,
            "images_per_second": chosen["rollout"].work / total,
            "share": {phase: value / total for phase, value in seconds.items()},
        }

    iterations = []
    sampling = ("rollout", "decode", "reward")
    if all(by_phase[phase] for phase in (*sampling, "update")):
        common = set.intersection(*({_known(f.batch_size) for f in by_phase[phase]} for phase in sampling))
        for checkpointing in sorted({bool(f.activation_checkpointing) for f in by_phase["update"]}):
            updates = [f for f in by_phase["update"] if f.activation_checkpointing == checkpointing]
            if not common:
                break
            ends = {}
            for end, pick in (("smallest", min), ("largest", max)):
                size = pick(common)
                chosen = {phase: next(f for f in by_phase[phase] if f.batch_size == size) for phase in sampling}
                chosen["update"] = pick(updates, key=lambda f: _known(f.batch_size))
                ends[end] = iteration(chosen)
            iterations.append(
                {
                    "activation_checkpointing": checkpointing,
                    **ends,
                    "speedup": ends["smallest"]["seconds"] / ends["largest"]["seconds"],
                }
            )
    speedups = {}
    for phase in ("rollout", "decode", "reward", "update"):
        for checkpointed in sorted({f.activation_checkpointing for f in by_phase[phase]}, key=str):
            candidates = [f for f in by_phase[phase] if f.activation_checkpointing == checkpointed]
            low = min(candidates, key=lambda f: _known(f.batch_size))
            top = max(candidates, key=lambda f: _known(f.batch_size))
            suffix = "" if checkpointed is None else (" ckpt" if checkpointed else " no-ckpt")
            speedups[phase + suffix] = {
                "batch_size": top.batch_size,
                "vs_batch_size": low.batch_size,
                "speedup": top.speedup,
            }
    checkpointing_cost = {}
    for size in sorted({_known(f.batch_size) for f in by_phase["update"]}):
        on = next((f for f in by_phase["update"] if f.batch_size == size and f.activation_checkpointing), None)
        off = next((f for f in by_phase["update"] if f.batch_size == size and not f.activation_checkpointing), None)
        if on is None or off is None:
            continue
        checkpointing_cost[str(size)] = {
            "peak_memory_saved_bytes": _difference(off.peak_memory_bytes, on.peak_memory_bytes),
            "activation_bytes_saved": _difference(off.activation_bytes, on.activation_bytes),
            "time_ratio_on_over_off": _known(on.seconds) / _known(off.seconds),
        }
    return {
        "record": "summary",
        "resolution": resolution,
        "iterations": iterations,
        "speedups": speedups,
        "activation_checkpointing_by_micro_batch": checkpointing_cost,
    }


def _known(value: _T | None) -> _T:
    """A figure every row here has: ``seconds`` (rows are filtered on it), ``batch_size`` (all but the optimizer's)."""
    assert value is not None
    return value


def _difference(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a - b
