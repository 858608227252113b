"""``fluxgrpo fetch-weights``: put FLUX and HPS weights in place, in the layout every command loads from."""

from __future__ import annotations

from typing import Annotated

import typer

from fluxgrpo.cli.common import err_console, handle_errors, out_console, print_json
from fluxgrpo.paths import DEFAULT_FLUX_DIR, DEFAULT_HPS_DIR

SOURCES = ("tiny", "hf", "modelscope")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


@handle_errors
def command(
    source: Annotated[
        str, typer.Option("--source", help="tiny (random tiny models, offline, for CPU trials), hf or modelscope.")
    ] = "hf",
    flux_dir: Annotated[
        str, typer.Option("--flux-dir", help="Where the FLUX diffusers folder goes.")
    ] = DEFAULT_FLUX_DIR,
    hps_dir: Annotated[
        str, typer.Option("--hps-dir", help="Where the HPS checkpoint and open_clip weights go.")
    ] = DEFAULT_HPS_DIR,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the tiny random weights (--source tiny).")] = 0,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object with stable keys.")] = False,
) -> None:
    """Fetch FLUX.1-dev + HPSv2.1 weights, or write tiny random ones for a CPU trial.

    Each part gets a manifest, written last, which env-check, train and sample read to call it complete.

    Examples:
      fluxgrpo fetch-weights --source tiny
      fluxgrpo fetch-weights --source tiny --flux-dir /tmp/flux --hps-dir /tmp/hps --seed 1
    """
    from fluxgrpo.errors import UsageError

    if source not in SOURCES:
        raise UsageError(f"unknown --source {source!r}: use one of {', '.join(SOURCES)}")
    if source != "tiny":
        raise UsageError(
            f"--source {source} is not available in this build yet; only --source tiny (offline random weights) is"
        )
    from pathlib import Path

    from fluxgrpo.weights.layout import check_flux_dir, check_hps_dir
    from fluxgrpo.weights.tiny import write_tiny_weights

    err_console.print(f"writing tiny random weights (seed {seed}) to {flux_dir} and {hps_dir}")
    summary = write_tiny_weights(Path(flux_dir), Path(hps_dir), seed=seed)
    parts = [
        (check_flux_dir(flux_dir), summary.flux_bytes),
        *zip(check_hps_dir(hps_dir), (summary.hps_bytes, summary.clip_bytes), strict=True),
    ]
    rows = [
        {"part": status.name, "path": status.path, "source": status.source, "complete": status.complete,
         "bytes": size, "problems": status.problems}
        for status, size in parts
    ]
    if json_output:
        print_json({"source": source, "seed": seed, "parts": rows})
        return
    from rich.table import Table

    table = Table(title=f"fetch-weights --source {source}", title_justify="left")
    for column in ("part", "path", "source", "size", "status"):
        table.add_column(column)
    for row in rows:
        status = "[green]complete[/]" if row["complete"] else f"[bold red]{'; '.join(row['problems'])}[/]"
        table.add_row(row["part"], row["path"], row["source"] or "", _mib(row["bytes"]), status)
    out_console.print(table)
