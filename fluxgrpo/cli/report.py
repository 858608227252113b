"""``fluxgrpo report``: one self-contained HTML page (and optionally a PNG) of a training run, or several."""

from __future__ import annotations

from typing import Annotated

import typer

from fluxgrpo.cli.common import JsonOption, err_console, handle_errors, log, out_console, print_json


@handle_errors
def command(
    run_dir: Annotated[str, typer.Argument(help="A training --output-dir (holds metrics.jsonl).", show_default=False)],
    compare: Annotated[
        list[str] | None,
        typer.Option("--compare", help="Another run folder to overlay on the same axes (repeatable)."),
    ] = None,
    png: Annotated[
        bool, typer.Option("--png", help="Also write report.png: one summary figure (curves + eval grid strip).")
    ] = False,
    out: Annotated[
        str | None, typer.Option("--out", help="Where to write the HTML (default: RUN_DIR/report.html).")
    ] = None,
    json_output: JsonOption = False,
) -> None:
    """Write RUN_DIR/report.html: curves, eval grids over iterations, config, versions, hardware, a summary.

    The file needs no network to view (inline SVG, images and CSS). Needs matplotlib: pip install 'fluxgrpo[report]'.

    Examples:
      fluxgrpo report data/outputs/shapes-cpu
      fluxgrpo report data/outputs/tiny-cpu
      fluxgrpo report data/outputs/dance --compare data/outputs/mixgrpo --png
    """
    from fluxgrpo.report import build_report

    result = build_report([run_dir, *(compare or [])], out=out, png=png)
    for warning in result.warnings:
        log(f"warning: {warning}")
    err_console.print(f"{len(result.panels)} curve panels, {sum(result.evaluations)} evaluations")
    if json_output:
        print_json(result.to_dict())
        return
    out_console.print(result.summary, highlight=False, markup=False, soft_wrap=True)
    out_console.print(result.html, highlight=False, markup=False, soft_wrap=True)
    if result.png:
        out_console.print(result.png, highlight=False, markup=False, soft_wrap=True)
