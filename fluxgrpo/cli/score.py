"""``fluxgrpo score``: HPSv2 (or another reward) scores of saved images, per image, per prompt, overall."""

from __future__ import annotations

from typing import Annotated

import typer

from fluxgrpo.cli.common import err_console, handle_errors, log, out_console, print_json
from fluxgrpo.paths import DEFAULT_HPS_DIR
from fluxgrpo.rewards import reward_names
from fluxgrpo.runtime.device import DEVICE_TYPES


@handle_errors
def command(
    index: Annotated[
        str | None, typer.Option("--index", help="index.json written by `fluxgrpo sample` (or its folder).")
    ] = None,
    images: Annotated[
        str | None,
        typer.Option("--images", help="Folder of images, sorted by name (digits as numbers); needs --prompts."),
    ] = None,
    prompts: Annotated[
        str | None,
        typer.Option("--prompts", help="With --images: one prompt line per image, in the images' name order."),
    ] = None,
    reward: Annotated[
        str, typer.Option("--reward", help=f"Reward model: {', '.join(reward_names())} (brightness: a smoke test).")
    ] = "hpsv2",
    hps_dir: Annotated[
        str, typer.Option("--hps-dir", help="Folder of HPS_v2.1_compressed.pt and open_clip_pytorch_model.bin.")
    ] = DEFAULT_HPS_DIR,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Images per reward forward pass.")] = 16,
    device: Annotated[
        str, typer.Option("--device", help=f"auto (the best found), or one of {', '.join(DEVICE_TYPES)}.")
    ] = "auto",
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object with stable keys.")] = False,
    out: Annotated[
        str | None, typer.Option("--out", help="Also write one CSV row per image to this file (atomically).")
    ] = None,
    compare: Annotated[
        str | None,
        typer.Option("--compare", help="Another sample index: per-prompt means side by side and the difference."),
    ] = None,
) -> None:
    """Score images against their prompts: a table per image and per prompt (mean ± std), and overall.

    Examples:
      fluxgrpo score --index data/outputs/samples/base/index.json
      fluxgrpo score --index data/outputs/samples/grpo-checkpoint-300/index.json \\
          --compare data/outputs/samples/base/index.json
      fluxgrpo score --images my_images --prompts my_prompts.txt --json
    """
    from fluxgrpo.score import ScoreRequest, check_csv_destination, score, write_csv

    request = ScoreRequest(
        index=index,
        images_dir=images,
        prompts_file=prompts,
        reward=reward,
        hps_dir=hps_dir,
        batch_size=batch_size,
        device=device,
        compare=compare,
    ).validate()
    if out is not None:
        check_csv_destination(out)  # before hours of scoring, not after
    report = score(request, progress=_progress_printer())
    if out is not None:
        write_csv(report, out)
        log(f"wrote {out}")
    if json_output:
        print_json(report.to_dict())
        return
    _print_tables(report)


def _progress_printer():
    """A callback that counts scored images on stderr every few hundred images."""
    done = [0]

    def advance(count: int) -> None:
        done[0] += count
        if done[0] // 256 != (done[0] - count) // 256:
            err_console.print(f"scored {done[0]} images")

    return advance


def _print_tables(report) -> None:
    from rich.markup import escape
    from rich.table import Table

    images = Table(title=f"{report.reward} per image", title_justify="left")
    images.add_column("file")
    images.add_column("prompt", overflow="fold")
    images.add_column("score", justify="right")
    for image in report.images:
        images.add_row(escape(image.file), escape(image.prompt), f"{image.score:.5f}")
    out_console.print(images)

    prompts = Table(title=f"{report.reward} per prompt", title_justify="left")
    prompts.add_column("#", justify="right")
    prompts.add_column("prompt", overflow="fold")
    prompts.add_column("images", justify="right")
    prompts.add_column("mean ± std", justify="right")
    for stats in report.prompts:
        prompts.add_row(
            str(stats.prompt_index), escape(stats.prompt), str(stats.count), f"{stats.mean:.5f} ± {stats.std:.5f}"
        )
    out_console.print(prompts)
    overall = report.overall
    out_console.print(f"overall: {overall.mean:.5f} ± {overall.std:.5f} over {overall.count} images")

    comparison = report.comparison
    if comparison is None:
        return
    table = Table(title=f"compared with {escape(comparison.other)}", title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("prompt", overflow="fold")
    table.add_column("this", justify="right")
    table.add_column("other", justify="right")
    table.add_column("this − other", justify="right")
    for row in comparison.prompts:
        style = "green" if row.difference > 0 else "red" if row.difference < 0 else ""
        table.add_row(
            str(row.prompt_index),
            escape(row.prompt),
            f"{row.mean:.5f}",
            f"{row.other_mean:.5f}",
            f"[{style}]{row.difference:+.5f}[/]" if style else f"{row.difference:+.5f}",
        )
    out_console.print(table)
    out_console.print(
        f"mean difference (this − other): {comparison.mean_difference:+.5f} over {comparison.count} paired images "
        f"({comparison.mean:.5f} vs {comparison.other_mean:.5f}); improved prompts: {comparison.improved_prompts} of "
        f"{comparison.prompt_count} ({comparison.improved_fraction:.0%})"
    )
