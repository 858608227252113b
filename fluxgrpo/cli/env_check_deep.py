"""``fluxgrpo env-check --deep``'s table (the checks run in ``fluxgrpo.deepcheck``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table

import fluxgrpo.deepcheck.run
from fluxgrpo.cli.common import escape, log, out_console, print_json

if TYPE_CHECKING:
    from fluxgrpo.deepcheck.result import DeepReport
    from fluxgrpo.deepcheck.run import DeepCheckSettings

_STYLE = {"passed": "green", "skipped": "yellow", "failed": "bold red"}


def run_and_show(settings: DeepCheckSettings, json_output: bool) -> bool:
    """Run the deep checks, print the table (or the JSON document); True when no check failed."""

    report = fluxgrpo.deepcheck.run.run_deep_check(settings, log=log)
    if json_output:
        print_json(report.to_dict())
    else:
        render(report, settings.report_file)
    for check in report.failed:
        log(f"failed: {check.name}: {check.detail}")
    return report.ok


def _figure(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}"


def render(report: DeepReport, report_file: str) -> None:
    env = report.environment
    table = Table(
        title=f"fluxgrpo env-check --deep ({env['mode']}): {env['device_type']} × {env['dies']} ({env['device_name']})",
        title_justify="left",
    )
    for column in ("check", "status", "figure", "detail"):
        table.add_column(column)
    for check in report.checks:
        table.add_row(
            escape(check.name),
            f"[{_STYLE[check.status]}]{check.status}[/]",
            escape(f"{_figure(check.figure)} {check.unit}".strip()),
            escape(check.detail),
        )
    out_console.print(table)
    verdict = "[green]every check passed or was skipped[/]" if report.ok else "[bold red]some checks failed[/]"
    out_console.print(f"{verdict} in {report.seconds:.1f} s; report: {escape(report_file)}")
