"""``fluxgrpo report``: a run folder (or several) → one self-contained ``report.html`` and, on request, a PNG.

``read_run`` (``run.py``) reads what training wrote, ``figures.py`` draws the curves with matplotlib (an optional
extra: ``pip install 'fluxgrpo[report]'``), ``html.py`` assembles the page. Nothing here touches a model or a device.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.paths import check_replaceable_output, write_atomic
from fluxgrpo.report.figures import panel_svgs, require_matplotlib, summary_png
from fluxgrpo.report.html import grid_columns, grid_strip, render_html, summary_text
from fluxgrpo.report.run import read_run

REPORT_HTML = "report.html"
REPORT_PNG = "report.png"
# What a file this command wrote starts with (html.py's generator tag; figures.py's PNG Software text).
REPORT_HTML_SIGNATURE = b"<meta name=generator content='fluxgrpo"
REPORT_PNG_SIGNATURE = b"fluxgrpo report"


@dataclass(frozen=True)
class ReportResult:
    """What ``build_report`` wrote; ``to_dict`` is the ``--json`` document."""

    html: str
    png: str | None
    runs: list[str]
    iterations: list[int]  # training iterations logged, per run
    evaluations: list[int]  # evaluations found, per run
    panels: list[str]
    summary: str  # the first run's summary paragraph
    warnings: list[str]  # what could not be read and was left out (a damaged evaluation index)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _write_atomically(path: Path, data: bytes) -> None:
    try:
        write_atomic(path, data)
    except OSError as exc:
        raise FluxgrpoError(f"cannot write {path} ({exc.strerror or exc}): choose another --out") from None


def build_report(
    run_dirs: list[str | Path], out: str | Path | None = None, png: bool | str | Path = False
) -> ReportResult:
    """Write the HTML report of ``run_dirs[0]`` (overlaid with the others) to ``out`` (default
    ``run_dirs[0]/report.html``); with ``png``, also the summary figure (default ``report.png`` beside it).

    Raises:
        UsageError: matplotlib is not installed.
        FluxgrpoError: a folder is not a training run, or the report cannot be written.
    """

    require_matplotlib()
    runs = [read_run(folder) for folder in run_dirs]
    seen: dict[str, int] = {}
    for run in runs:  # two runs called "grpo" in different parents still get distinct legend entries
        count = seen.get(run.name, 0)
        seen[run.name] = count + 1
        if count:
            run.name = f"{run.name} ({count + 1})"
    html_path = Path(out) if out is not None else runs[0].folder / REPORT_HTML
    check_replaceable_output(html_path, "--out", REPORT_HTML_SIGNATURE, "a fluxgrpo report")
    png_path = None
    if png:
        png_path = Path(png) if not isinstance(png, bool) else html_path.with_name(REPORT_PNG)
        check_replaceable_output(png_path, "--png", REPORT_PNG_SIGNATURE, "a fluxgrpo report figure")
    curves = panel_svgs(runs)
    _write_atomically(html_path, render_html(runs, curves).encode("utf-8"))
    if png_path is not None:
        columns = grid_columns(runs[0].evaluations, ema=False)

        def draw_strip(ax: Any) -> bool:
            strip = grid_strip(columns)
            if strip is None:
                return False
            ax.imshow(strip)
            ax.set_axis_off()
            first, last = columns[0].evaluation.iteration, columns[-1].evaluation.iteration
            ax.set_title(f"{runs[0].name}: held-out prompts (rows), iterations {first} → {last} (columns)", fontsize=10)
            return True

        title = "fluxgrpo: " + " vs ".join(run.name for run in runs)
        _write_atomically(png_path, summary_png(runs, title, draw_strip))
    return ReportResult(
        html=str(html_path),
        png=None if png_path is None else str(png_path),
        runs=[str(run.folder) for run in runs],
        iterations=[len(run.records) for run in runs],
        evaluations=[len(run.evaluations) for run in runs],
        panels=[panel.title for panel, _ in curves],
        summary=summary_text(runs[0]),
        warnings=[line for run in runs for line in run.left_out],
    )
