"""`bench --algorithms --plot FILE`: each algorithm's held-out score against training seconds, as a PNG.

The x axis is what a user pays: an evaluation at iteration k sits at k × the algorithm's median seconds per
iteration (training time only; the evaluations themselves are the same work for every algorithm and are left out,
as the bench's per-second figures leave them out). The line is the median over the repeats at each evaluated
iteration, the band their min–max, so a gain inside another algorithm's band reads as noise.
"""

from __future__ import annotations

import io
import statistics
from pathlib import Path
from typing import Any

from fluxgrpo.errors import UsageError


def curve_points(row: dict[str, Any]) -> list[tuple[float, float, float, float]]:
    """(seconds, median, min, max) of the row's held-out score at each iteration every repeat evaluated."""
    curves = row.get("heldout_curves") or []
    if not curves:
        return []
    by_iteration: dict[int, list[float]] = {}
    for curve in curves:
        for iteration, score in curve:
            by_iteration.setdefault(int(iteration), []).append(float(score))
    seconds = float(row["seconds_per_iteration"])
    return [
        (iteration * seconds, statistics.median(scores), min(scores), max(scores))
        for iteration, scores in sorted(by_iteration.items())
        if len(scores) == len(curves)
    ]


def heldout_png(document: dict[str, Any]) -> bytes:
    """The figure for a ``run_efficiency`` document whose runs evaluated (``--config`` with ``--eval-every``)."""
    rows = [row for row in document["algorithms"] if curve_points(row)]
    if not rows:
        raise UsageError(
            "--plot draws the held-out score, and these runs did not evaluate: use a --config that evaluates "
            "(shapes-cpu, or one with --eval-every)"
        )
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError("--plot draws with matplotlib: pip install 'fluxgrpo[report]'") from None

    figure = Figure(figsize=(7.5, 4.5), layout="constrained")
    ax = figure.add_subplot()
    for row in rows:
        points = curve_points(row)
        x = [p[0] for p in points]
        (line,) = ax.plot(x, [p[1] for p in points], marker="o", label=f"{row['algorithm']} ({row['repeats']} runs)")
        ax.fill_between(x, [p[2] for p in points], [p[3] for p in points], color=line.get_color(), alpha=0.15)
    reward = rows[0].get("heldout_reward") or "reward"
    config = document["config"]
    ax.set_xlabel("training seconds (median seconds per iteration × iterations)")
    ax.set_ylabel(f"held-out {reward} score")
    name = Path(str(config["config"])).name  # a YAML path would crowd the title out: its file name says it
    ax.set_title(f"bench --algorithms --config {name}: median of the repeats, band min–max", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, metadata={"Software": "fluxgrpo bench"})
    return buffer.getvalue()
