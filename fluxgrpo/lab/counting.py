"""Why counting is the stiff part of the shapes world: ``python -m fluxgrpo.lab.counting --flux-dir D``.

In the quadrant world (``world.LAYOUT``) a scene puts one object to a quadrant, so `three circles` is three of the
four quadrants filled and one left empty, each quadrant empty in a quarter of the training renders. A model that
fills each quadrant on its own at those odds (3/4) draws exactly three in 4 · 0.75³ · 0.25 = 0.42 of its images
(:func:`independent_ceiling`, the best equally likely independent quadrants can do). Above that it must either
*coordinate* the quadrants (leave one empty because the others are filled) or break their symmetry (leave one
quadrant empty more often than the others, which no training render prefers). This reads, on a model's own samples
of counting captions:

- which quadrants hold an object (an object's box centre; the checker's :func:`~fluxgrpo.shapes.checker.find_objects`)
  and how often each is filled;
- how often exactly the asked number is filled, against what independent quadrants with those odds would give
  (:func:`exactly_if_independent`, the Poisson-binomial: the excess is coordination) and the ceiling above (the
  excess of the independent reading over it is broken symmetry);
- the mean correlation between two quadrants' occupancy (0: decided apart; negative: coordinated);
- how often an image holds more objects than filled quadrants (a shape drawn in pieces, or two in one quadrant).

Prints one JSON document. ``lab.plasticity`` adds the same reading to its judgings of counting captions.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fluxgrpo.shapes import world
from fluxgrpo.shapes.checker import CheckResult, FoundObject, check

QUADRANTS = 4
DEFAULT_CAPTIONS = ("three circles", "three red circles", "three triangles", "two red triangles")


def filled_quadrants(objects: Sequence[FoundObject], size: int) -> tuple[bool, ...]:
    """Which quadrant (top-left, top-right, bottom-left, bottom-right) holds an object's box centre."""
    filled = [False] * QUADRANTS
    for found in objects:
        x0, y0, x1, y1 = found.box
        column, row = int((x0 + x1) / 2 >= size / 2), int((y0 + y1) / 2 >= size / 2)
        filled[column + 2 * row] = True
    return tuple(filled)


def exactly_if_independent(odds: Sequence[float], count: int) -> float:
    """P(exactly ``count`` of the quadrants filled) if each is filled on its own with its ``odds``."""
    total = 0.0
    for pattern in itertools.product((False, True), repeat=len(odds)):
        if sum(pattern) == count:
            total += math.prod(p if filled else 1 - p for p, filled in zip(odds, pattern, strict=True))
    return total


def independent_ceiling(count: int, cells: int = QUADRANTS) -> float:
    """The most "exactly ``count`` of ``cells``" independent, *equally likely* cells can give: the binomial at its
    best odds, ``count / cells``. (Unequal odds can do better: a cell never filled and the others always.)"""
    p = count / cells
    return math.comb(cells, count) * p**count * (1 - p) ** (cells - count)


def counting_report(results: Sequence[CheckResult], size: int) -> dict[str, Any] | None:
    """The reading of the module docstring on the checker's ``results`` for images (``size`` px) of one caption;
    None for a caption without a count."""
    if not results:
        return None
    caption = results[0].caption
    count = world.parse_caption(caption).count
    if count is None:
        return None
    filled = [filled_quadrants(result.objects, size) for result in results]
    objects = [len(result.objects) for result in results]
    strict = [result.strict for result in results]
    occupancy = np.array(filled, dtype=float)
    odds = occupancy.mean(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        correlation = np.corrcoef(occupancy.T)[~np.eye(QUADRANTS, dtype=bool)]
    correlation = correlation[np.isfinite(correlation)]
    return {
        "images": len(results),
        "strict": round(float(np.mean(strict)), 4),
        "count_asked": count,
        "quadrants_filled": np.bincount(occupancy.sum(axis=1).astype(int), minlength=QUADRANTS + 1).tolist(),
        "quadrant_odds": [round(float(p), 3) for p in odds],
        "exactly_asked_filled": round(float((occupancy.sum(axis=1) == count).mean()), 4),
        "if_independent": round(exactly_if_independent(odds.tolist(), count), 4),
        "independent_ceiling": round(independent_ceiling(count), 4),
        "mean_correlation": round(float(correlation.mean()), 3) if correlation.size else None,
        "more_objects_than_filled_quadrants": round(float(np.mean(np.array(objects) > occupancy.sum(axis=1))), 4),
    }


def main(argv: list[str] | None = None) -> int:
    from fluxgrpo.lab.measure import sample_images

    parser = argparse.ArgumentParser(prog="python -m fluxgrpo.lab.counting", description=__doc__.splitlines()[0])
    parser.add_argument("--flux-dir", required=True)
    parser.add_argument("--captions", nargs="+", default=list(DEFAULT_CAPTIONS), help="counting captions to read")
    parser.add_argument("--images", type=int, default=256, help="samples per caption (256: ±0.03 on a rate)")
    parser.add_argument("--seed", type=int, default=5, help="the sampling seed (the evaluation's is 0)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    try:
        unknown = [c for c in args.captions if world.parse_caption(c).count is None]
    except world.CaptionError as exc:
        parser.error(f"--captions: {exc}")
    if unknown:
        parser.error(f"--captions: {', '.join(unknown)} name no count; give counting captions (e.g. 'three circles')")
    groups = sample_images(Path(args.flux_dir), args.captions, args.images, 12, seed=args.seed)
    report = {
        c: counting_report([check(im, c) for im in g], len(g[0])) for c, g in zip(args.captions, groups, strict=True)
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
