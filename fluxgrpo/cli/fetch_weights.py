"""``fluxgrpo fetch-weights``: put FLUX, HPS and PickScore weights in place, in the layout every command loads from."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from fluxgrpo.cli.common import JsonOption, escape, handle_errors, log, out_console, print_json
from fluxgrpo.errors import FluxgrpoError, UsageError, disk_full_error, os_error_reason
from fluxgrpo.paths import (
    DEFAULT_FLUX_DIR,
    DEFAULT_HPS_DIR,
    DEFAULT_PROMPTS_DIR,
    ensure_writable_dir,
    give_default_mode,
)
from fluxgrpo.rewards.registry import weights_parts
from fluxgrpo.shapes.sizes import FLUX_SUBDIR
from fluxgrpo.weights import layout
from fluxgrpo.weights.layout import check_flux_dir
from fluxgrpo.weights.manifest import MANIFEST_NAME
from fluxgrpo.weights.tiny_writing import refuse_unless_tiny_or_empty

if TYPE_CHECKING:
    from fluxgrpo.weights.hub import FetchRequest, FetchSummary

SOURCES = ("tiny", "shapes", "hf", "modelscope")
HUB_HELP = "Hub sources (hf, modelscope)"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _parse_only(only: str | None) -> list[str] | None:
    """``--only flux,hps`` → ["flux", "hps"]; None when not given. Names are checked by the library."""

    if only is None:
        return None
    names = [name.strip() for name in only.split(",") if name.strip()]
    if not names:
        raise UsageError("--only needs at least one part, e.g. `--only flux,hps,clip` or `--only pickscore`")
    return names


@handle_errors
def command(
    source: Annotated[
        str,
        typer.Option(
            "--source",
            help="hf (Hugging Face), modelscope, tiny (random tiny models, offline), or shapes (the shapes world's "
            "pretrained tiny FLUX and HPS, shipped in the package, offline).",
        ),
    ] = "hf",
    only: Annotated[
        str | None,
        typer.Option(
            "--only",
            help="Comma-separated parts: flux, hps, clip, pickscore, imagereward, hpsv3, hpdv2-prompts (benchmark "
            "prompts). Default: flux,hps,clip from a hub or for shapes; every model part for tiny.",
        ),
    ] = None,
    flux_dir: Annotated[
        str, typer.Option("--flux-dir", help="Where the FLUX diffusers folder goes.")
    ] = DEFAULT_FLUX_DIR,
    hps_dir: Annotated[
        str,
        typer.Option(
            "--hps-dir",
            help="Where the HPS checkpoint and open_clip weights go; the other rewards in subfolders (pickscore/, "
            "imagereward/, hpsv3/).",
        ),
    ] = DEFAULT_HPS_DIR,
    prompts_dir: Annotated[
        str,
        typer.Option("--prompts-dir", help="Where benchmark prompt sets go (hpdv2/), for `train --eval-prompts NAME`."),
    ] = DEFAULT_PROMPTS_DIR,
    revision: Annotated[
        str | None,
        typer.Option(
            "--revision", help="Branch, tag or commit to fetch; needs a single part (--only).", rich_help_panel=HUB_HELP
        ),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(
            "--token",
            help="Access token. Default: HF_TOKEN / `hf auth login`, MODELSCOPE_API_TOKEN / "
            "`modelscope login`. Never printed or saved.",
            rich_help_panel=HUB_HELP,
            show_default=False,
        ),
    ] = None,
    endpoint: Annotated[
        str | None,
        typer.Option(
            "--endpoint",
            help="Hub URL, e.g. a mirror. Default: HF_ENDPOINT / MODELSCOPE_ENDPOINT, else the hub itself.",
            rich_help_panel=HUB_HELP,
        ),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="List the files, their sizes and what is missing; download nothing.",
            rich_help_panel=HUB_HELP,
        ),
    ] = False,
    max_workers: Annotated[
        int | None,
        typer.Option(
            "--max-workers",
            help="Files downloaded in parallel (default 8).",
            rich_help_panel=HUB_HELP,
            show_default=False,
        ),
    ] = None,
    rehash: Annotated[
        bool,
        typer.Option(
            "--rehash",
            help="Re-read every file on disk to verify it, even those a manifest vouches for.",
            rich_help_panel=HUB_HELP,
        ),
    ] = False,
    seed: Annotated[
        int | None,
        typer.Option(
            "--seed", help="Seed of the tiny random weights, --source tiny only (default 0).", show_default=False
        ),
    ] = None,
    json_output: JsonOption = False,
) -> None:
    """Fetch FLUX.1-dev, HPSv2.1 and (on request) the other rewards' weights, or write tiny random ones for a CPU trial.

    Each part gets a manifest, written last, which env-check, train and sample read to call it complete. A rerun
    downloads only what is missing or damaged; FLUX.1-dev is gated on Hugging Face (accept its licence first).

    Examples:
      fluxgrpo fetch-weights
      fluxgrpo fetch-weights --dry-run
      fluxgrpo fetch-weights --source modelscope
      HF_ENDPOINT=https://hf-mirror.com fluxgrpo fetch-weights \\
          --only hps,clip,pickscore
      fluxgrpo fetch-weights --only hpsv3 --dry-run
      fluxgrpo fetch-weights --source tiny --flux-dir /tmp/flux \\
          --hps-dir /tmp/hps --seed 1
      fluxgrpo fetch-weights --source shapes
    """

    if source not in SOURCES:
        raise UsageError(f"unknown --source {source!r}: use one of {', '.join(SOURCES)}")
    parts = _parse_only(only)
    if source in ("tiny", "shapes"):
        hub_only = {
            "--revision": revision,
            "--token": token,
            "--endpoint": endpoint,
            "--dry-run": dry_run,
            "--max-workers": max_workers,
            "--rehash": rehash,
        }
        given = [flag for flag, value in hub_only.items() if value not in (None, False)]
        if given:
            raise UsageError(f"{given[0]} applies to --source hf or modelscope, not to --source {source}")
        if prompts_dir != DEFAULT_PROMPTS_DIR or any(name.endswith("-prompts") for name in parts or []):
            raise UsageError("benchmark prompt sets come from a hub: fetch them with --source hf")
        if source == "shapes":
            if seed is not None:
                raise UsageError(
                    "--seed applies to --source tiny only: the shapes weights are one build's (rebuild another "
                    "seed with `python -m fluxgrpo.lab.build --out DIR --seed N`)"
                )
            _shapes(parts, flux_dir, hps_dir, json_output)
            return
        _tiny(parts, flux_dir, hps_dir, 0 if seed is None else seed, json_output)
        return
    if seed is not None:
        raise UsageError("--seed applies to --source tiny only: hub weights are the published ones")
    from fluxgrpo.weights.hub import DEFAULT_PARTS, FetchRequest

    request = FetchRequest(
        source,
        parts=parts or list(DEFAULT_PARTS),
        flux_dir=flux_dir,
        hps_dir=hps_dir,
        prompts_dir=prompts_dir,
        revision=revision,
        token=token,
        endpoint=endpoint,
        dry_run=dry_run,
        max_workers=8 if max_workers is None else max_workers,
        progress=not json_output,
        rehash=rehash,
    )
    _hub(request, json_output)


def _tiny(parts: list[str] | None, flux_dir: str, hps_dir: str, seed: int, json_output: bool) -> None:
    from fluxgrpo.rewards.tiny_weights import tiny_parts, write_tiny_weights
    from fluxgrpo.runtime.worker import quiet_library_progress

    selected = parts or list(tiny_parts())
    if "flux" in selected:
        ensure_writable_dir(flux_dir, "FLUX weights", "--flux-dir")
    if set(selected) & (set(tiny_parts()) - {"flux"}):  # unknown names are refused below, before anything is made
        ensure_writable_dir(hps_dir, "reward weights", "--hps-dir")
    log(f"writing tiny random weights (seed {seed}) to {flux_dir} and {hps_dir}")
    try:
        with quiet_library_progress():  # save_pretrained's "Writing model shards" bars: ours is the one progress
            summary = write_tiny_weights(Path(flux_dir), Path(hps_dir), seed=seed, parts=selected)
    except OSError as exc:  # e.g. a full disk, or a sub-folder that is read-only
        where = exc.filename or f"{flux_dir} / {hps_dir}"
        raise FluxgrpoError(
            f"cannot write tiny weights to {where} ({exc.strerror or exc}): free space there or pass writable "
            "folders with --flux-dir and --hps-dir"
        ) from None
    for folder in {Path(flux_dir), Path(hps_dir)}:
        for weights in folder.rglob("*.safetensors"):
            give_default_mode(weights)  # safetensors leaves them 0600
    _report_written("tiny", summary.part_bytes, flux_dir, hps_dir, json_output, {"seed": seed})


def _shapes(parts: list[str] | None, flux_dir: str, hps_dir: str, json_output: bool) -> None:
    """Write the shapes weights into hidden siblings of --flux-dir / --hps-dir first, then move them in: a failure
    (a full disk) leaves the folders as they were and nothing half-written that would block the rerun."""

    from fluxgrpo.shapes.shipped import SHAPES_PARTS, write_shapes_weights

    selected = parts or list(SHAPES_PARTS)
    unknown = [part for part in selected if part not in SHAPES_PARTS]
    if unknown:
        raise UsageError(
            f"unknown part {unknown[0]!r} for --source shapes: choose from {', '.join(SHAPES_PARTS)} (--only)"
        )
    reward_manifests = (layout.HPS_MANIFEST, layout.CLIP_MANIFEST)
    reward_files = (layout.HPS_CHECKPOINT, layout.OPEN_CLIP_WEIGHTS, layout.REWARD_ARCH_FILE, *reward_manifests)
    targets: list[tuple[str, Path]] = []  # (part, the folder it goes to), each staged in a sibling
    if "flux" in selected:
        ensure_writable_dir(flux_dir, "FLUX weights", "--flux-dir")
        if not _partial_shapes_copy(Path(flux_dir)):  # an older fluxgrpo's interrupted copy is replaced, not refused
            refuse_unless_tiny_or_empty(Path(flux_dir), (MANIFEST_NAME,), None, "--flux-dir", making="shapes")
        targets.append(("flux", Path(flux_dir)))
    if {"hps", "clip"} & set(selected):
        ensure_writable_dir(hps_dir, "reward weights", "--hps-dir")
        refuse_unless_tiny_or_empty(Path(hps_dir), reward_manifests, reward_files, "--hps-dir", making="shapes")
        targets.append(("hps", Path(hps_dir)))
    log(f"writing the shapes world's pretrained weights to {flux_dir} and {hps_dir}")
    written: dict[str, int] = {}
    for part, target in targets:
        staging = target.with_name(f".{target.name}.fetching")  # a killed run's is ours to replace
        shutil.rmtree(staging, ignore_errors=True)
        try:
            if part == "flux":
                written |= write_shapes_weights(staging, Path(hps_dir), parts=["flux"])
            else:
                written |= write_shapes_weights(Path(flux_dir), staging, parts=["hps"])
        except BaseException as exc:
            shutil.rmtree(staging, ignore_errors=True)
            full = disk_full_error(exc, target.parent)
            if full is not None:
                raise full from None
            if not isinstance(exc, OSError):
                raise
            reason = os_error_reason(exc)
            raise FluxgrpoError(
                f"cannot write the shapes weights to {target} ({reason}): free space there or pass writable "
                f"folders with --flux-dir and --hps-dir (nothing was left there)"
            ) from None
        if part == "flux":  # checked above as empty or offline-written: replaced whole
            shutil.rmtree(target)
            staging.rename(target)
            continue
        for name in reward_manifests:  # the part is unfinished until its manifests arrive, last
            (target / name).unlink(missing_ok=True)
        for name in sorted(os.listdir(staging), key=lambda name: name in reward_manifests):
            os.replace(staging / name, target / name)  # a rename on one filesystem: no space needed
        staging.rmdir()
    _report_written("shapes", written, flux_dir, hps_dir, json_output, {})


def _partial_shapes_copy(folder: Path) -> bool:
    """Whether ``folder`` holds nothing but part of the shipped shapes FLUX, without its manifest: what an
    interrupted ``fetch-weights --source shapes`` of an older fluxgrpo left (#50.2: it copied in place). Each file
    must be one of the shipped files, at most its size; anything else (a user's file, other weights) is not ours."""
    from fluxgrpo.shapes.shipped import shipped_weights_dir

    shipped = shipped_weights_dir() / FLUX_SUBDIR
    if not folder.is_dir() or (folder / MANIFEST_NAME).exists() or not shipped.is_dir():
        return False
    files = [path for path in folder.rglob("*") if not path.is_dir()]
    for path in files:
        twin = shipped / path.relative_to(folder)
        if path.is_symlink() or not twin.is_file() or path.stat().st_size > twin.stat().st_size:
            return False
    return bool(files)


def _report_written(
    source: str, part_bytes: dict[str, int], flux_dir: str, hps_dir: str, json_output: bool, extra: dict[str, Any]
) -> None:
    """One row per part written (its check after writing), as a table or one JSON document."""

    rows: list[dict[str, Any]] = []
    reward_parts = weights_parts()
    for part, size in part_bytes.items():
        status = check_flux_dir(flux_dir) if part == "flux" else reward_parts[part].check(Path(hps_dir))
        rows.append(
            {
                "part": status.name,
                "path": status.path,
                "source": status.source,
                "complete": status.complete,
                "bytes": size,
                "problems": status.problems,
            }
        )
    if json_output:
        print_json({"source": source, **extra, "parts": rows})
        return

    table = Table(title=f"fetch-weights --source {source}", title_justify="left")
    for column in ("part", "path", "source", "size", "status"):
        table.add_column(column)
    for row in rows:
        shown = "[green]complete[/]" if row["complete"] else f"[bold red]{escape('; '.join(row['problems']))}[/]"
        table.add_row(row["part"], escape(row["path"]), escape(row["source"] or ""), _mib(row["bytes"]), shown)
    out_console.print(table)


def _hub(request: FetchRequest, json_output: bool) -> None:
    from fluxgrpo.weights.hub import fetch_from_hub

    summary = fetch_from_hub(request)
    if json_output:
        print_json(summary.to_dict())
    elif request.dry_run:
        _print_plan(summary)
    else:
        _print_summary(summary)


def _short(revision: str) -> str:
    return revision[:12] if len(revision) == 40 else revision


def _print_plan(summary: FetchSummary) -> None:
    from fluxgrpo.weights.hub_progress import format_bytes

    plan = summary.plan
    for part in plan.parts:
        title = escape(f"{part.part}: {part.repo}@{_short(part.revision)} → {part.root}")
        table = Table(title=title, title_justify="left")
        table.add_column("file", overflow="fold")
        table.add_column("size", justify="right")
        table.add_column("state")
        for planned in part.files:
            table.add_row(escape(planned.path), format_bytes(planned.size), planned.state)
        out_console.print(table)
    files = sum(len(p.files) for p in plan.parts)
    out_console.print(
        f"dry run ({plan.source}, {plan.endpoint}): {plan.files_to_fetch} of {files} files to download, "
        f"{format_bytes(plan.bytes_to_fetch)} of {format_bytes(plan.bytes_total)} ({plan.bytes_to_fetch} bytes); "
        "nothing was written",
        highlight=False,
        soft_wrap=True,
    )


def _print_summary(summary: FetchSummary) -> None:
    from fluxgrpo.weights.hub_progress import format_bytes

    table = Table(title=f"fetch-weights --source {summary.source} ({summary.endpoint})", title_justify="left")
    for column in ("part", "repo", "folder", "files", "downloaded", "already present"):
        table.add_column(column, overflow="fold")
    for part in summary.parts:
        table.add_row(
            part.part,
            escape(f"{part.repo}@{_short(part.revision)}"),
            escape(str(part.dir)),
            str(part.files),
            f"{part.files_downloaded} ({format_bytes(part.bytes_downloaded)})",
            format_bytes(part.bytes_present),
        )
    out_console.print(table)
    out_console.print(
        f"complete: {summary.files} files in place; downloaded {summary.files_downloaded} "
        f"({format_bytes(summary.bytes_downloaded)}), {format_bytes(summary.bytes_present)} already present; "
        f"{summary.seconds:.1f} s",
        highlight=False,
        soft_wrap=True,
    )
