"""The report's curves, drawn with matplotlib (object API only: no pyplot state, no display needed).

Each panel names the metrics.jsonl keys it plots; a panel whose keys no run holds is left out, so a run without
KL or without evaluations gets no empty axes, and a panel whose every line is one value throughout (a tiny run's clip
fraction, learning rate, …) is drawn as a number in one line instead of a flat line (``flat_metrics``). With several
runs every panel overlays them, one colour per run.
"""

from __future__ import annotations

import io
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fluxgrpo.errors import UsageError
from fluxgrpo.report.run import RunData

RUN_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
LINE_STYLES = ("-", "--", ":", "-.")


@dataclass(frozen=True)
class Line:
    key: str
    label: str
    band: tuple[str, str] | None = None  # keys of the lower and upper edge of a shaded band
    eval_line: bool = False  # drawn from the eval records, with markers
    guard_line: bool = False  # drawn from the guard records, with markers; where the rule fired, a red cross


@dataclass(frozen=True)
class Panel:
    title: str
    ylabel: str
    lines: list[Line] = field(default_factory=list)
    log_y: bool = False


def require_matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise UsageError("`fluxgrpo report` draws its curves with matplotlib: pip install 'fluxgrpo[report]'") from None
    return matplotlib


def panels_for(runs: list[RunData]) -> list[Panel]:
    """The panels with something to plot, in reading order: rewards first, then the update's health, then speed and
    memory."""
    return [p for p in _every_panel(runs) if any(_has(run, line) for run in runs for line in p.lines)]


def _every_panel(runs: list[RunData]) -> list[Panel]:
    train_reward = Panel(
        "Train reward (mean, min–max band)",
        "reward",
        [Line("reward_mean", "mean", band=("reward_min", "reward_max"))],
    )
    panels = [train_reward, *_eval_panels(runs), *_guard_panels(runs), *_update_panels(runs)]
    panels += _other_number_panels(runs, panels)
    phase_keys = sorted({k for run in runs for r in run.records for k in r if k.startswith("seconds_")})
    panels += [
        Panel("Seconds per phase", "seconds", [Line(k, k.removeprefix("seconds_")) for k in phase_keys]),
        Panel("Throughput", "images / s", [Line("images_per_second", "images/s")]),
        Panel("Peak device memory", "GiB", [Line("peak_memory_gib", "peak")]),
    ]
    return panels


def _eval_panels(runs: list[RunData]) -> list[Panel]:
    """Per evaluation reward its mean and its own numbers, then the diversity of a prompt's seeds."""
    panels = []
    rewards: dict[str, None] = {}
    for run in runs:
        rewards.update(dict.fromkeys(run.eval_rewards()))
    for reward in rewards:
        panels.append(
            Panel(
                f"Eval {reward} (held-out prompts, mean ± std)",
                reward,
                [
                    Line(f"eval_{reward}_mean", "weights", band=(f"eval_{reward}_std", ""), eval_line=True),
                    Line(f"eval_ema_{reward}_mean", "EMA", band=(f"eval_ema_{reward}_std", ""), eval_line=True),
                ],
            )
        )
        # A reward's own numbers beside its mean (RewardRecord.summarize; shapes: seen and novel combinations
        # apart, the strict all-claims rate), one panel per reward.
        details = sorted(
            {
                key.removeprefix(f"eval_{reward}_")
                for run in runs
                for record in run.eval_records
                for key in record
                # the paired noise of a change (metrics.held_out_trend reads it) is no score of the images
                if key.startswith(f"eval_{reward}_") and not key.endswith(("_mean", "_std", "_change_noise"))
            }
        )
        if details:
            panels.append(
                Panel(
                    f"Eval {reward}: {', '.join(d.replace('_', ' ') for d in details)} (held-out prompts)",
                    reward,
                    [Line(f"eval_{reward}_{d}", d.replace("_", " "), eval_line=True) for d in details],
                )
            )
    panels.append(
        Panel(
            "Eval diversity (1 − cos between a prompt's seeds)",
            "diversity",
            [Line("eval_diversity", "weights", eval_line=True), Line("eval_ema_diversity", "EMA", eval_line=True)],
        )
    )
    return panels


def _guard_panels(runs: list[RunData]) -> list[Panel]:
    panels = []
    guarded: dict[str, None] = {}
    for run in runs:
        guarded.update(dict.fromkeys(run.guard_names()))
    for name in guarded:
        panels.append(
            Panel(
                f"Guard {name} (× where it fired)",
                name,
                [
                    Line(f"guard_{name}_value", "value", guard_line=True),
                    Line(f"guard_{name}_limit", "limit", guard_line=True),
                ],
            )
        )
    # From the guard records, written after each evaluation: the iteration records' own ``guards_fired`` is taken
    # before that iteration's evaluation, so it never shows a firing at the iteration where the run stopped.
    panels.append(Panel("Guard rules fired (at each check)", "rules", [Line("guards_fired", "fired", guard_line=True)]))
    return panels


def _update_panels(runs: list[RunData]) -> list[Panel]:
    """What the policy update did: drift, group spread, ratio and clipping, KL, gradients, loss, learning rate."""
    panels = [
        Panel("Velocity-norm ratio, policy / reference (drift)", "ratio", [Line("velocity_norm_ratio", "‖v‖ ratio")]),
        Panel("Within-group reward std", "std", [Line("group_std_mean", "group std mean")]),
        Panel("Groups with zero reward spread", "fraction", [Line("zero_std_group_fraction", "zero-std fraction")]),
        Panel(
            "Probability ratio (mean, min–max band)",
            "ratio",
            [Line("ratio_mean", "mean", band=("ratio_min", "ratio_max"))],
        ),
        Panel("Clip fraction", "fraction", [Line("clip_fraction", "clipped")]),
    ]
    # the trainer logs kl = 0 when the KL term is off: a panel only when some run has a KL to show
    kl_keys = sorted({k for run in runs for r in run.records for k in r if re.match(r"^kl(_|$)", k) and r[k]})
    if kl_keys:
        panels.append(Panel("KL to the reference", "KL", [Line(k, k) for k in kl_keys]))
    panels += [
        Panel(
            "Gradient norm (before clipping)", "norm", [Line("grad_norm_mean", "mean"), Line("grad_norm_max", "max")]
        ),
        Panel("Loss", "loss", [Line("loss", "loss")]),
        Panel("Learning rate", "lr", [Line("lr", "lr")]),
    ]
    return panels


# Record keys that are bookkeeping or shown elsewhere (the summary, the phase and throughput panels), never a panel
# of their own.
_UNDRAWN_KEYS = frozenset(
    {
        "iteration",
        "optimizer_steps",
        "skipped_steps",
        "update_skipped",
        "sde_window_start",
        "first_abs_log_ratio",
        "guards_fired",
        "reward_std",
        "nonfinite_rewards",
        "advantage_abs_mean",
        "advantage_min",
        "advantage_max",
        "images_per_second",
        "peak_memory_gib",
    }
)


def _other_number_panels(runs: list[RunData], panels: list[Panel]) -> list[Panel]:
    """Any other number an objective logs (nft's policy_loss, awm's fm_mse, …) gets a panel of its own."""
    claimed = {key for panel in panels for line in panel.lines for key in (line.key, *(line.band or ()))}
    claimed |= _UNDRAWN_KEYS
    other_keys = sorted(
        {
            k
            for run in runs
            for r in run.records
            for k, v in r.items()
            if k not in claimed
            and not k.startswith(("seconds_", "reward_", "eval_", "kl"))
            and isinstance(v, int | float)
            and not isinstance(v, bool)
        }
    )
    # a number that is the loss itself under another name (nft's policy_loss without a KL) is not drawn twice
    other_keys = [k for k in other_keys if any(run.series(k) != run.series("loss") for run in runs)]
    return [Panel(key.replace("_", " ").capitalize(), key, [Line(key, key)]) for key in other_keys]


@dataclass(frozen=True)
class FlatMetrics:
    """What the panels left out carried: each key of a panel that held one value throughout, with that value, and
    the keys the runs logged but never as a finite number (NaN, or None: no device memory counter on a CPU)."""

    constant: dict[str, float]
    no_value: list[str]


def _values(runs: list[RunData], line: Line, key: str) -> set[float]:
    return {value for run in runs for value in run.series(key, _records(run, line))[1]}


def _keys(line: Line) -> list[str]:
    return [key for key in (line.key, *(line.band or ())) if key]


def _fired(runs: list[RunData], panel: Panel) -> bool:
    """Whether a guard panel's rule fired in some run: its red cross is worth the panel even on a flat value."""
    fired_keys = [line.key.removesuffix("_value") + "_fired" for line in panel.lines if line.guard_line]
    return any(record.get(key) for run in runs for record in run.guard_records for key in fired_keys)


def is_flat(panel: Panel, runs: list[RunData]) -> bool:
    """Whether every key the panel plots holds one value across all ``runs`` (a flat line tells nothing the value
    does; with several runs, two runs at different constants still differ, so that panel is drawn)."""
    if _fired(runs, panel):
        return False
    return all(len(_values(runs, line, key)) <= 1 for line in panel.lines for key in _keys(line))


def shown_panels(runs: list[RunData]) -> list[Panel]:
    """The panels worth drawing: those with something to plot that is not one value throughout."""
    return [panel for panel in panels_for(runs) if not is_flat(panel, runs)]


def flat_metrics(runs: list[RunData]) -> FlatMetrics:
    """The numbers of the panels ``shown_panels`` leaves out, in panel order, for the report's one line."""
    constant: dict[str, float] = {}
    no_value: dict[str, None] = {}
    plotted = panels_for(runs)
    for panel in _every_panel(runs):
        if panel in plotted and not is_flat(panel, runs):
            continue
        for line in panel.lines:
            for key in _keys(line):
                values = _values(runs, line, key)
                if values:
                    constant[key] = values.pop()
                elif panel not in plotted and any(key in r for run in runs for r in _records(run, line)):
                    no_value[key] = None
    return FlatMetrics(constant, list(no_value))


def _records(run: RunData, line: Line) -> list[dict[str, Any]]:
    if line.guard_line:
        return run.guard_records
    return run.eval_records if line.eval_line else run.records


def _has(run: RunData, line: Line) -> bool:
    return bool(run.series(line.key, _records(run, line))[0])


def _draw_panel(ax: Any, panel: Panel, runs: list[RunData]) -> None:
    several = len(runs) > 1
    for run_number, run in enumerate(runs):
        for line_number, line in enumerate(panel.lines):
            records = _records(run, line)
            xs, ys = run.series(line.key, records)
            if not xs:
                continue
            if several:
                colour = RUN_COLOURS[run_number % len(RUN_COLOURS)]
                style = LINE_STYLES[line_number % len(LINE_STYLES)]
                label = run.name if len(panel.lines) == 1 else f"{run.name}: {line.label}"
            else:
                colour = RUN_COLOURS[line_number % len(RUN_COLOURS)]
                style = "-"
                label = line.label
            marker = "o" if line.eval_line or line.guard_line or len(xs) == 1 else None
            ax.plot(xs, ys, style, color=colour, label=label, marker=marker, markersize=4, linewidth=1.4)
            if line.guard_line and line.key.endswith("_value"):
                fired_key = line.key.removesuffix("_value") + "_fired"
                fired = [
                    (r["iteration"], r[line.key]) for r in records if r.get(fired_key) and r.get(line.key) is not None
                ]
                if fired:
                    ax.plot(
                        *zip(*fired, strict=True), "x", color="#d62728", markersize=9, markeredgewidth=2, label="fired"
                    )
            if line.band is not None:
                _draw_band(ax, run, records, line, xs, ys, colour)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # iterations are whole numbers
    if not panel.log_y:  # every tick its own number: no "1e-8" or "+1" in the corner for the reader to apply
        ax.yaxis.set_major_formatter(plain_ticks())
    ax.set_title(textwrap.fill(panel.title, TITLE_CHARS), fontsize=10)  # wrapped: never cut at both ends
    ax.set_xlabel("iteration", fontsize=8)
    ax.set_ylabel(panel.ylabel, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(True, alpha=0.3)
    if several or len([line for line in panel.lines if any(_has(r, line) for r in runs)]) > 1:
        ax.legend(fontsize=7, loc="best")


# Characters of a panel title per line at its font size in the narrowest panel (4.6 in at 10 pt): longer titles wrap.
TITLE_CHARS = 58


def plain_ticks() -> Any:
    """A tick formatter that writes each tick's value in full, with the fewest significant digits (3 or more) that
    tell the ticks apart: 1e-08 and 2e-08 under a loss, 0.9999999 and 1.0000001 under a ratio."""
    from matplotlib.ticker import Formatter

    class PlainTicks(Formatter):
        def __call__(self, x: float, pos: int | None = None) -> str:
            return f"{x:.6g}"

        def format_ticks(self, values: Any) -> list[str]:
            labels = [f"{v:.3g}" for v in values]
            for digits in range(3, 16):
                labels = [f"{v:.{digits}g}" for v in values]
                if len(set(labels)) == len(labels):
                    break
            return labels

    return PlainTicks()


def _draw_band(ax: Any, run: RunData, records: list[dict[str, Any]], line: Line, xs, ys, colour: str) -> None:
    """A shaded band: between two keys, or mean ± one key (a std) when the upper key is empty."""
    assert line.band is not None  # called for lines with a band only
    low_key, high_key = line.band
    by_iteration = dict(zip(xs, ys, strict=True))
    low_x, low = run.series(low_key, records)
    if high_key:
        high_x, high = run.series(high_key, records)
        lows, highs = dict(zip(low_x, low, strict=True)), dict(zip(high_x, high, strict=True))
        band_x = [x for x in xs if x in lows and x in highs]
        lower, upper = [lows[x] for x in band_x], [highs[x] for x in band_x]
    else:
        spread = dict(zip(low_x, low, strict=True))
        band_x = [x for x in xs if x in spread]
        lower = [by_iteration[x] - spread[x] for x in band_x]
        upper = [by_iteration[x] + spread[x] for x in band_x]
    if band_x:
        ax.fill_between(band_x, lower, upper, color=colour, alpha=0.15, linewidth=0)


def _figure(rows: int, cols: int, width: float, height: float) -> Any:
    require_matplotlib()
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def panel_svgs(runs: list[RunData]) -> list[tuple[Panel, str]]:
    """Each panel as an inline ``<svg>`` element (text kept as text, so it stays small and searchable)."""
    require_matplotlib()
    from matplotlib import rc_context

    out = []
    with rc_context({"svg.fonttype": "none", "svg.hashsalt": "fluxgrpo"}):
        for panel in shown_panels(runs):
            figure = _figure(1, 1, 4.6, 2.9)
            _draw_panel(figure.add_subplot(), panel, runs)
            buffer = io.StringIO()
            figure.savefig(buffer, format="svg", metadata={"Date": None})
            out.append((panel, _strip_xml_prolog(buffer.getvalue())))
    return out


def _strip_xml_prolog(svg: str) -> str:
    """The ``<svg>`` element alone: an XML declaration or DOCTYPE is not allowed inside HTML."""
    start = svg.find("<svg")
    return svg[start:] if start >= 0 else svg


SUMMARY_TITLES = (
    "Train reward (mean, min–max band)",
    "Eval ",
    "Within-group reward std",
    "Probability ratio (mean, min–max band)",
)


def summary_png(runs: list[RunData], title: str, grid: Callable[[Any], bool] | None = None) -> bytes:
    """One figure for a paper or a chat: the reward curves, the eval curves, group spread and ratio, plus the
    eval grid strip when ``grid`` draws one into the axes it is given (returns False when there is none)."""
    require_matplotlib()
    chosen = []
    for prefix in SUMMARY_TITLES:
        chosen += [p for p in shown_panels(runs) if p.title.startswith(prefix) and p not in chosen][:2]
    chosen = chosen[:4]
    rows = 2 if len(chosen) > 2 else 1
    extra_row = grid is not None
    figure = _figure(rows + extra_row, 2, 10, 3.2 * (rows + extra_row))
    spec = figure.add_gridspec(rows + extra_row, 2)
    for position, panel in enumerate(chosen):
        _draw_panel(figure.add_subplot(spec[position // 2, position % 2]), panel, runs)
    if grid is not None:  # the extra row
        ax = figure.add_subplot(spec[rows, :])
        if not grid(ax):
            figure.delaxes(ax)
    figure.suptitle(title, fontsize=12)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, metadata={"Software": "fluxgrpo report"})
    return buffer.getvalue()
