"""Signs that a run collapsed or hacked its reward, read from what it already measured: one warning line for
`train`'s closing summary, `score --compare` and the report's summary.

A rising training reward does not say the images are still good: the quickstart's 30 iterations raise brightness
while every prompt and seed turns into the same grid pattern. These signals do, each past a documented threshold:

- ``velocity_norm_ratio`` (the drift probe, ``training/drift.py``): its mean over the last ``WINDOW`` iterations
  above ``VELOCITY_NORM_ALARM`` = 1.05, the published alarm threshold for RL-inflated velocities.
- ``group_spread`` (``group_std_mean``, the within-group reward std that carries the learning signal): the mean of
  the last ``WINDOW`` iterations below 1/``GROUP_SPREAD_FALL`` of the first ``WINDOW``'s, i.e. it fell 3× or more.
- ``diversity`` (``eval_diversity``, a prompt's seeds in CLIP features): the last evaluation below
  ``KEPT_FRACTION`` (half) of the iteration-0 one.
- image spread (``image_spread``: the RMS distance of a set of images from their mean image, 0–255, no model
  needed): the last evaluation's (or the trained run's, in ``score --compare``) below half of the base model's.
- ``held_out`` (``metrics.held_out_trend``): a held-out reward's last evaluation below its first by more than the
  noise of a redraw of the images (2 standard errors of the change: image by image when both evaluations drew the
  same seeds, else of the two means) and by ``HELD_OUT_FALL`` (5 %) of the first or more, the training reward's rise
  beside it: the shapes world's AWM at lr 3e-4 raised its training reward by 0.15 while the held-out checker fell
  0.08 (docs/results/shapes-world.md).

Nothing here imports torch or loads a model: the report and ``score`` call it as they are.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from fluxgrpo.metrics import held_out_trend, reward_trend

VELOCITY_NORM_ALARM = 1.05
# A held-out fall is a sign only when it is also this fraction of the first evaluation or more: the paired noise of
# weights that barely moved is a few thousandths, so a real but negligible drift (the toy's exposure 0.872 → 0.868
# after 2 iterations) is beyond it; the shapes world's AWM hack fell 14 %, and `--guard REWARD:-10%` is the usual stop.
HELD_OUT_FALL = 0.05
GROUP_SPREAD_FALL = 3.0
KEPT_FRACTION = 0.5
WINDOW = 5
SPREAD_SIDE = 64  # images are compared at this size (pixels per side): cheap, and blind to resolution

WHAT_TO_DO = (
    "Look at the images before trusting the reward (`fluxgrpo report` shows the eval grids), then lower "
    "--learning-rate, add --kl-beta, or guard the run (--eval-every K --guard velocity_norm_ratio:max=1.05 "
    "--keep-best REWARD)"
)


@dataclass(frozen=True)
class CollapseSign:
    """One signal past its threshold, with the numbers that put it there."""

    signal: str  # velocity_norm_ratio | group_spread | diversity | image_spread | held_out
    text: str  # "v-ratio 11.0 (alarm above 1.05)"


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def _finite(records: Sequence[dict[str, Any]], key: str) -> list[float]:
    out = []
    for record in records:
        value = record.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            out.append(float(value))
    return out


def record_signs(records: Sequence[dict[str, Any]]) -> list[CollapseSign]:
    """The signs in a run's metrics records (iteration and evaluation records, in iteration order)."""
    signs = []
    iterations = [r for r in records if "reward_mean" in r]
    ratios = _finite(iterations, "velocity_norm_ratio")
    if ratios:
        recent = _mean(ratios[-WINDOW:])
        if recent > VELOCITY_NORM_ALARM:
            signs.append(
                CollapseSign(
                    "velocity_norm_ratio",
                    f"v-ratio {recent:.3g} over the last {min(WINDOW, len(ratios))} iterations "
                    f"(alarm above {VELOCITY_NORM_ALARM})",
                )
            )
    spreads = _finite(iterations, "group_std_mean")
    if len(spreads) >= 4:
        window = min(WINDOW, len(spreads) // 2)
        first, last = _mean(spreads[:window]), _mean(spreads[-window:])
        if first > 0 and last * GROUP_SPREAD_FALL < first:
            fall = f"{first / last:.1f}×" if last > 0 else "to 0"
            signs.append(
                CollapseSign(
                    "group_spread",
                    f"within-group reward std fell {fall} ({first:.3g} → {last:.3g}; alarm at {GROUP_SPREAD_FALL:g}×)",
                )
            )
    evaluations = [r for r in records if "eval_diversity" in r]
    diversity = _finite(evaluations, "eval_diversity")
    if len(diversity) >= 2 and diversity[0] > 0 and diversity[-1] < KEPT_FRACTION * diversity[0]:
        signs.append(
            CollapseSign(
                "diversity",
                f"eval diversity {diversity[0]:.3g} → {diversity[-1]:.3g} "
                f"({_percent(diversity[-1], diversity[0])}; alarm below {KEPT_FRACTION:.0%} of the start)",
            )
        )
    signs += held_out_signs(records)
    return signs


def held_out_signs(records: Sequence[dict[str, Any]]) -> list[CollapseSign]:
    """A held-out reward that fell beyond the noise of its evaluations, with the training reward's change beside it."""
    trained = reward_trend(list(records))
    rose = f" while the training reward rose {trained['change']:+.3g}" if trained and trained["change"] > 0 else ""
    signs = []
    for name, change in held_out_trend(list(records)).items():
        noise = change.get("noise")
        large = change["change"] < -HELD_OUT_FALL * abs(change["first"])
        if noise is not None and change["change"] < -noise and large:
            signs.append(
                CollapseSign(
                    "held_out",
                    f"held-out {name} {change['first']:.3g} → {change['last']:.3g} ({change['change']:+.3g}, beyond "
                    f"the ±{noise:.2g} a redraw of the images could give){rose}",
                )
            )
    return signs


def _percent(value: float, reference: float) -> str:
    return f"{100 * (value - reference) / reference:+.0f} %"


def image_spread(paths: Sequence[Path]) -> float:
    """RMS distance (0–255) of the images at ``paths`` from their mean image, each resized to SPREAD_SIDE²: 0 when
    they are all the same image, about 21 for the tiny base model's samples. NaN for fewer than two images."""

    arrays = []
    for path in paths:
        try:
            with Image.open(path) as image:
                rgb = image.convert("RGB").resize((SPREAD_SIDE, SPREAD_SIDE), Image.Resampling.BILINEAR)
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
            continue  # a damaged image is left out: a warning, not the failure of the command that asks
        arrays.append(np.asarray(rgb, dtype=np.float64))
    if len(arrays) < 2:
        return math.nan
    stack = np.stack(arrays)
    return float(np.sqrt(((stack - stack.mean(axis=0)) ** 2).mean()))


def spread_sign(before: float, after: float, before_name: str, after_name: str) -> CollapseSign | None:
    """The image-spread sign when ``after`` kept less than half of ``before`` (None otherwise, or unmeasured)."""
    if not (math.isfinite(before) and math.isfinite(after)) or before <= 0 or after >= KEPT_FRACTION * before:
        return None
    return CollapseSign(
        "image_spread",
        f"image spread {before:.1f} ({before_name}) → {after:.1f} ({after_name}) of 255, "
        f"{_percent(after, before)} (alarm below {KEPT_FRACTION:.0%}): the images look alike",
    )


def evaluation_spread_sign(evaluations: Sequence[Any]) -> CollapseSign | None:
    """The image-spread sign between a run's first and last held-out evaluation of its trained weights
    (``report.run.Evaluation``s: ``iteration``, ``ema``, ``images`` with a ``path`` each)."""
    chosen = sorted((e for e in evaluations if not e.ema), key=lambda e: e.iteration)
    if len(chosen) < 2:
        return None
    first, last = chosen[0], chosen[-1]
    return spread_sign(
        image_spread([image.path for image in first.images]),
        image_spread([image.path for image in last.images]),
        f"iteration {first.iteration}",
        f"iteration {last.iteration}",
    )


def warning_line(signs: Sequence[CollapseSign], what_to_do: str = WHAT_TO_DO, subject: str = "this run") -> str | None:
    """One line naming every sign and what to do; None when there is none."""
    if not signs:
        return None
    return f"warning: {subject} looks collapsed or reward-hacked: {'; '.join(s.text for s in signs)}. {what_to_do}"
