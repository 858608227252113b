"""``report.html``: one self-contained file (inline SVG curves, inline JPEG thumbnails, inline CSS; no network).

Sections: the summary paragraph, the curves, the eval grids over iterations (one row per held-out prompt, one
column per evaluation, image 0 of every prompt, so a column differs from its neighbours only by the weights), and
the run's resolved config, derived numbers, versions and hardware. With ``--compare`` the curves overlay every
run and each run gets its own grids and facts.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from fluxgrpo import __version__
from fluxgrpo.grpo.objectives.catalogue import settings_not_read
from fluxgrpo.metrics import held_out_trend, noise_verdict, reward_trend
from fluxgrpo.report.figures import flat_metrics
from fluxgrpo.report.run import Evaluation, RunData
from fluxgrpo.rewards.registry import reward_names as known_rewards
from fluxgrpo.rewards.registry import reward_record
from fluxgrpo.training.collapse import evaluation_spread_sign, record_signs, warning_line

MAX_GRID_COLUMNS = 10  # evaluations shown side by side; the first and last always, the rest evenly spaced
THUMBNAIL_SIDE = 160  # pixels on the long side of a grid thumbnail
STRIP_PROMPTS = 4  # prompts in the summary PNG's grid strip

CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1d1d1f;background:#fafafa}
header{background:#20232a;color:#fff;padding:18px 28px}
header h1{margin:0;font-size:22px}header p{margin:4px 0 0;color:#bbb;font-size:13px}
main{padding:8px 28px 40px;max-width:1500px}
h2{font-size:18px;border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:32px}
h3{font-size:15px;margin:22px 0 8px}
.summary{font-size:15px;line-height:1.5;background:#fff;border-left:4px solid #1f77b4;padding:10px 16px}
.curves{display:grid;grid-template-columns:repeat(auto-fill,minmax(340px,1fr));gap:12px}
.curve{background:#fff;border:1px solid #e3e3e3;border-radius:6px;padding:4px}
.curve svg{width:100%;height:auto;display:block}
.gridwrap{overflow-x:auto;background:#fff;border:1px solid #e3e3e3;border-radius:6px;padding:8px}
table.grid{border-collapse:collapse}
table.grid th{font-size:12px;font-weight:600;padding:4px 6px;vertical-align:bottom;min-width:120px}
table.grid th .note{display:block;font-weight:400;white-space:nowrap}
table.grid :is(th,td).best{background:#e8f5e9}table.grid :is(th,td).fired{background:#fdecea}
.tag{display:inline-block;font-size:11px;font-weight:600;border-radius:3px;padding:0 4px;margin-top:2px}
.tag.best{background:#2e7d32;color:#fff}.tag.fired{background:#c62828;color:#fff}
table.grid td{padding:2px}
table.grid td.prompt{font-size:12px;min-width:180px;max-width:260px;padding-right:10px;color:#333}
table.grid img{display:block;width:120px;height:auto;border-radius:3px}
table.grid td{vertical-align:top}
table.grid .claims{font-size:10px;line-height:1.25;max-width:120px;color:#333}
table.facts{border-collapse:collapse;font-size:13px;background:#fff}
table.facts td{border:1px solid #e3e3e3;padding:3px 8px;vertical-align:top;overflow-wrap:anywhere;max-width:520px}
table.facts td:first-child{color:#555;white-space:nowrap}
.columns{display:flex;flex-wrap:wrap;gap:24px}
.note{color:#666;font-size:13px}
@media (max-width:900px){main{padding:8px 12px 32px}header{padding:14px 12px}table.grid td.prompt{min-width:110px}}
"""


@dataclass(frozen=True)
class GridColumn:
    evaluation: Evaluation
    images: dict[int, Any]  # prompt_index → image 0's EvalImage


def grid_columns(evaluations: list[Evaluation], ema: bool) -> list[GridColumn]:
    """At most MAX_GRID_COLUMNS evaluations (first, last, evenly spaced between), with image 0 of each prompt."""
    chosen = [e for e in evaluations if e.ema == ema]
    if len(chosen) > MAX_GRID_COLUMNS:
        picks = sorted({round(i * (len(chosen) - 1) / (MAX_GRID_COLUMNS - 1)) for i in range(MAX_GRID_COLUMNS)})
        chosen = [chosen[i] for i in picks]
    return [
        GridColumn(e, {img.prompt_index: img for img in e.images if img.image_index == 0 and img.path.is_file()})
        for e in chosen
    ]


def thumbnail(path: Path, side: int = THUMBNAIL_SIDE) -> Any:
    """The image shrunk to fit ``side``; a damaged or unreadable file becomes a gray tile (the report still
    renders, and the gap shows where)."""

    try:
        with Image.open(path) as source:
            image = source.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        return Image.new("RGB", (side, side), (200, 200, 200))
    image.thumbnail((side, side), Image.Resampling.LANCZOS)
    return image


def _data_uri(image: Any) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=88)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def grid_strip(columns: list[GridColumn], prompts: int = STRIP_PROMPTS) -> Any | None:
    """A PIL image: the first ``prompts`` prompts (rows) across the evaluations (columns); None without images."""

    rows = sorted({i for column in columns for i in column.images})[:prompts]
    if not rows or not columns:
        return None
    tiles = {
        (r, c): thumbnail(col.images[r].path, 128) for c, col in enumerate(columns) for r in rows if r in col.images
    }
    width = max(t.width for t in tiles.values())
    height = max(t.height for t in tiles.values())
    gap = 3
    sheet = Image.new("RGB", (len(columns) * (width + gap) - gap, len(rows) * (height + gap) - gap), (255, 255, 255))
    for (row, col), tile in tiles.items():
        sheet.paste(tile, (col * (width + gap), rows.index(row) * (height + gap)))
    return sheet


# --------------------------------------------------------------------------------------------- summary


def _fmt(value: float | None) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return f"{value:.4g}"


def summary_text(run: RunData) -> str:
    """One paragraph: length, reward first → last, the eval curve and its best iteration, and warnings."""
    parts = []
    iterations = [r["iteration"] for r in run.records]
    planned = run.config.get("max_train_steps")
    reward = run.config.get("reward", "the reward")
    if iterations:
        of = f" of {planned} planned" if isinstance(planned, int) else ""
        parts.append(f"{run.name} ran {len(iterations)} iterations{of} (last: {iterations[-1]}) against {reward}.")
    else:
        parts.append(f"{run.name} has no training iteration logged yet.")
    trend = reward_trend(run.records)
    if trend is not None:
        parts.append(
            f"The train reward moved from {_fmt(trend['first'])} to {_fmt(trend['last'])} "
            f"({trend['change']:+.4g}; means of the first and last {trend['window']} iterations)."
        )
    warning = collapse_warning(run)
    if warning is not None:
        parts.append(warning[0].upper() + warning[1:])
    fired_at = {
        record["iteration"]: [name for name in run.guard_names() if record.get(f"guard_{name}_fired")]
        for record in run.guard_records
    }
    changes = held_out_trend(run.eval_records)  # the first and last evaluations, with train's noise figure
    for name in run.eval_rewards():
        xs, ys = run.series(f"eval_{name}_mean", run.eval_records)
        if not xs:
            continue
        best = max(range(len(ys)), key=lambda i: ys[i])
        change = changes.get(name)
        verdict = noise_verdict(change) if change else None
        against = f" ({change['change']:+.4f}, {verdict})" if change and verdict else ""
        parts.append(
            f"Held-out eval {name}: {_fmt(ys[0])} at iteration {xs[0]} → {_fmt(ys[-1])} at iteration {xs[-1]}"
            f"{against}; best {_fmt(ys[best])} at iteration {xs[best]}{_why_not_best(run, name, xs[best], fired_at)}."
        )
    for record in run.guard_records:
        fired = fired_at[record["iteration"]]
        if fired:
            parts.append(
                f"Guard{'s' if len(fired) > 1 else ''} {', '.join(fired)} fired at iteration {record['iteration']}."
            )
        if record.get("guard_stop"):
            parts.append(f"The run was stopped there by its guard ({record.get('guard_stop_message', '')}).")
    if run.best is not None:
        parts.append(
            f"best/ is iteration {run.best.get('iteration')} ({run.best.get('metric')} {_fmt(run.best.get('value'))}; "
            "the best evaluation after iteration 0 at which no guard fired)."
        )
    zero = run.series("zero_std_group_fraction")[1]
    if zero and sum(zero[-5:]) / len(zero[-5:]) > 0.5:
        parts.append("Most recent groups have no reward spread, so they carry no learning signal.")
    bad = sum(v for v in run.series("nonfinite_rewards")[1])
    if bad:
        parts.append(f"{bad:.0f} non-finite rewards were left out of the statistics.")
    skipped = sum(run.series("skipped_steps")[1])
    if skipped:
        parts.append(f"{skipped:.0f} optimizer steps were skipped (non-finite gradients).")
    return " ".join(parts)


def collapse_warning(run: RunData) -> str | None:
    """``training/collapse.py``'s one line for this run: its drift signals, diversity and eval image spread."""
    signs = record_signs([*run.records, *run.eval_records])
    spread = evaluation_spread_sign(run.evaluations)
    if spread is not None:
        signs.append(spread)
    return warning_line(signs, "Look at the eval grids below before trusting the reward.")


def _why_not_best(run: RunData, reward: str, iteration: int, fired_at: dict[int, list[str]]) -> str:
    """Why ``best/`` is not the best evaluation of ``reward`` at ``iteration``, when it is not (else "")."""
    if run.best is None or run.best.get("iteration") == iteration or run.best.get("metric") != f"eval_{reward}_mean":
        return ""
    if fired_at.get(iteration):
        return f" (not best/: guard {', '.join(fired_at[iteration])} fired there)"
    if iteration == 0:
        return " (not best/: iteration 0 is the base model)"
    return ""


def flat_metrics_line(runs: list[RunData]) -> str:
    """The numbers the curves leave out, as one line ("" when none): a flat line's value is all it would show."""

    flat = flat_metrics(runs)
    these = "these runs" if len(runs) > 1 else "this run"
    out = []
    if flat.constant:
        values = ", ".join(f"{key} = {_fmt(value)}" for key, value in flat.constant.items())
        out.append(f"Constant during {these} (no panel): {values}.")
    if flat.no_value:
        out.append(f"Logged without a finite value (no panel): {', '.join(flat.no_value)}.")
    return " ".join(out)


# --------------------------------------------------------------------------------------------- HTML


def _grid_html(
    columns: list[GridColumn], reward_names: list[str], best: int | None = None, fired: frozenset[int] = frozenset()
) -> str:
    """The grid; the column of ``best`` (best/'s iteration) and those where a guard fired are marked."""
    if not columns:
        return ""
    prompt_text = {i: img.prompt for column in columns for i, img in column.images.items()}
    head = ["<tr><th>prompt</th>"]
    for column in columns:
        iteration = column.evaluation.iteration
        scores = "".join(  # one reward a line: three rewards' scores fit a thumbnail's width
            f"<span class=note>{html.escape(name)} {column.evaluation.scores[name]['mean']:.4g}</span>"
            for name in reward_names
            if name in column.evaluation.scores
        )
        tags = ""
        if iteration in fired:
            tags = "<span class='tag fired'>guard fired</span>"
        if iteration == best:
            tags += "<span class='tag best'>best/</span>"
        head.append(f"<th{_column_class(iteration, best, fired)}>iteration {iteration}{scores}{tags}</th>")
    head.append("</tr>")
    rows = []
    for prompt_index in sorted(prompt_text):
        cells = [f"<td class=prompt>{html.escape(prompt_text[prompt_index])}</td>"]
        for column in columns:
            image = column.images.get(prompt_index)
            kind = _column_class(column.evaluation.iteration, best, fired)
            if image is None:
                cells.append(f"<td{kind}></td>")
                continue
            alt = f"iteration {column.evaluation.iteration}, prompt {prompt_index}, seed {image.seed}"
            caption = "".join(
                f"<div class=claims>{html.escape(line)}</div>" for line in _explanations(image, reward_names)
            )
            cells.append(
                f'<td{kind}><img src="{_data_uri(thumbnail(image.path))}" alt="{html.escape(alt)}">{caption}</td>'
            )
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return '<div class=gridwrap><table class="grid">' + "".join(head) + "".join(rows) + "</table></div>"


def _column_class(iteration: int, best: int | None, fired: frozenset[int]) -> str:
    """The class that tints a whole column, not only its header: best/'s, or a fired guard's (never both: best/ is
    chosen among the evaluations where no guard fired)."""
    if iteration == best:
        return " class=best"
    return " class=fired" if iteration in fired else ""


def _explanations(image: Any, reward_names: list[str]) -> list[str]:
    """The lines the evaluated rewards give for one image (``RewardRecord.explain``; shapes: each claim ✓/✗)."""

    lines: list[str] = []
    for name in reward_names:
        explain = reward_record(name).explain if name in known_rewards() else None
        if explain is not None:
            lines += explain(image.path, image.prompt)
    return lines


def _facts_table(items: dict[str, Any]) -> str:
    rows = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(_fact(v))}</td></tr>" for k, v in items.items())
    return f"<table class=facts>{rows}</table>"


def _config_table(config: dict[str, Any]) -> str:
    """The resolved config without the settings its objective does not read (the objectives' catalogue says which),
    named in a line under it: a clip range beside an nft run would read as if it had shaped the run."""

    objective = config.get("objective")
    unread = settings_not_read(objective, config) if isinstance(objective, str) else []
    table = _facts_table({key: value for key, value in config.items() if key not in unread})
    if not unread or not isinstance(objective, str):
        return table
    return table + (
        f"<p class=note>Not shown: {html.escape(', '.join(unread))} (--objective {html.escape(objective)} does not "
        "read them).</p>"
    )


def _fact(value: Any) -> str:
    if isinstance(value, dict | list):
        return json.dumps(value)
    return str(value)


def _run_section(run: RunData, several: bool) -> str:
    out = []
    if several:
        out.append(f"<h2>{html.escape(run.name)}</h2><p class=summary>{html.escape(summary_text(run))}</p>")
    rewards = run.eval_rewards()
    best = run.best.get("iteration") if run.best is not None else None
    fired = frozenset(
        r["iteration"] for r in run.guard_records if any(r.get(f"guard_{n}_fired") for n in run.guard_names())
    )
    for ema in (False, True):
        columns = grid_columns(run.evaluations, ema)
        if not columns:
            continue
        what = "EMA weights" if ema else "trained weights"
        out.append(
            f"<{'h3' if several else 'h2'}>Eval images over iterations ({what})</{'h3' if several else 'h2'}>"
            "<p class=note>Each row is one held-out prompt with the same seed in every column; columns differ only "
            "by the weights. Image 0 of each prompt; the full sets are in "
            f"{html.escape(str(run.folder / 'eval'))}.</p>" + _grid_html(columns, rewards, best, fired)
        )
    if not run.evaluations:
        out.append(
            "<p class=note>No held-out evaluations in this run (train with --eval-every K to get eval curves and "
            "image grids).</p>"
        )
    heading = "h3" if several else "h2"
    facts = [f"<{heading}>Run facts</{heading}><div class=columns>"]
    if run.config:
        facts.append(f"<div><h3>Resolved config</h3>{_config_table(run.config)}</div>")
    side = []
    if run.derived:
        side.append(f"<h3>Derived numbers and launch</h3>{_facts_table(run.derived)}")
    hardware = run.info.get("hardware")
    if hardware:
        side.append(f"<h3>Hardware</h3>{_facts_table(hardware)}")
    versions = run.info.get("versions")
    if versions:
        side.append(f"<h3>Versions</h3>{_facts_table(versions)}")
    if not run.info:
        side.append("<p class=note>No run_info.json (versions and hardware are recorded by newer fluxgrpo).</p>")
    facts.append("<div>" + "".join(side) + "</div></div>")
    out.append("".join(facts))
    return "".join(out)


def render_html(runs: list[RunData], curves: list[tuple[Any, str]]) -> str:
    """The whole document; ``curves`` are (panel, inline svg) pairs from ``figures.panel_svgs``."""
    several = len(runs) > 1
    title = " vs ".join(run.name for run in runs)
    subtitle = " · ".join(html.escape(str(run.folder.resolve())) for run in runs)
    parts = [
        "<!DOCTYPE html><html lang=en><head><meta charset=utf-8>",
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<meta name=generator content='fluxgrpo {__version__}'>",
        f"<title>fluxgrpo report: {html.escape(title)}</title><style>{CSS}</style></head><body>",
        f"<header><h1>fluxgrpo report: {html.escape(title)}</h1><p>{subtitle}</p></header><main>",
    ]
    if not several:
        parts.append(f"<h2>Summary</h2><p class=summary>{html.escape(summary_text(runs[0]))}</p>")
    parts.append("<h2>Curves</h2><div class=curves>")
    for panel, svg in curves:
        parts.append(f'<div class=curve title="{html.escape(panel.title)}">{svg}</div>')
    parts.append("</div>")
    flat = flat_metrics_line(runs)
    if flat:
        parts.append(f"<p class='note flat'>{html.escape(flat)}</p>")
    for run in runs:
        parts.append(_run_section(run, several))
    parts.append(f"<p class=note>Written by fluxgrpo {__version__} `fluxgrpo report`.</p></main></body></html>\n")
    return "".join(parts)
