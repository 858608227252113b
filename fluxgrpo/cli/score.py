"""``fluxgrpo score``: HPSv2 (or other rewards, side by side) scores of saved images, per image, per prompt, overall."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from fluxgrpo.cli.common import (
    DeviceOption,
    HpsDirOption,
    err_console,
    handle_errors,
    log,
    out_console,
    print_json,
    say,
)
from fluxgrpo.errors import UsageError
from fluxgrpo.paths import DEFAULT_HPS_DIR
from fluxgrpo.rewards import reward_names


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
        str,
        typer.Option(
            "--reward",
            help=f"Reward model: {', '.join(reward_names())} (shapes: the shapes world's checker; brightness, exposure: "
            "smoke tests); several separated by "
            "commas are scored side by side, one model in memory at a time.",
        ),
    ] = "hpsv2",
    hps_dir: HpsDirOption = DEFAULT_HPS_DIR,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Images per reward forward pass.")] = 16,
    device: DeviceOption = "auto",
    json_output: Annotated[
        bool,
        typer.Option(
            "--json",
            help='Print one JSON object with stable keys; with several rewards {"rewards": [...]}, one per reward.',
        ),
    ] = False,
    out: Annotated[
        str | None,
        typer.Option(
            "--out", help="Also write one CSV row per image to this file (atomically); a score column per reward."
        ),
    ] = None,
    compare: Annotated[
        str | None,
        typer.Option("--compare", help="Another sample index: per-prompt means side by side and the difference."),
    ] = None,
    show_headroom: Annotated[
        bool,
        typer.Option(
            "--headroom",
            help="Also print best-of-k and pass@k over each prompt's images (k = 1, 2, 4, …): how far the best "
            "samples already are above the mean, the room a reward-driven update has (sample with "
            "--images-per-prompt 32 first).",
        ),
    ] = False,
    pass_threshold: Annotated[
        float | None,
        typer.Option(
            "--pass-threshold",
            help="With --headroom: the score an image needs to pass, for pass@k (default: 1.0, every claim holding, "
            "for the shapes checker's rewards; none for other rewards).",
        ),
    ] = None,
) -> None:
    """Score images against their prompts: a table per image and per prompt (mean ± std), and overall.

    Examples:
      fluxgrpo score --index data/outputs/samples/base/index.json
      fluxgrpo score --index data/outputs/samples/grpo-checkpoint-300/index.json \\
          --compare data/outputs/samples/base/index.json
      fluxgrpo score --images my_images --prompts my_prompts.txt --json
      fluxgrpo score --index data/outputs/samples/base/index.json \\
          --reward hpsv2,imagereward,hpsv3
      fluxgrpo score --index data/outputs/samples/shapes/index.json \\
          --reward shapes
      fluxgrpo score --index data/outputs/samples/shapes/index.json \\
          --reward shapes --headroom

    --reward shapes (the shapes world's checker, no weights) also prints the strict all-claims rate and, on the
    world's held-out captions, the seen- and novel-combination scores apart ("details" in --json).

    Several rewards (--reward hpsv2,imagereward,hpsv3) score the same images one after another, side by side:
    a column per reward in each table. --json then prints {"rewards": [...]}: one object per reward, in order,
    each exactly what --reward NAME alone prints. The --out CSV has a score_<reward> column per reward
    (with --compare also other_score_<reward> and difference_<reward>).
    """
    from fluxgrpo.score import ScoreRequest, check_csv_destination, score_rewards, write_csv

    if pass_threshold is not None and not show_headroom:
        raise UsageError("--pass-threshold is read only with --headroom: add --headroom, or drop --pass-threshold")

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
    several = len(request.reward_list()) > 1
    report = score_rewards(request, progress=_progress_printer(), on_reward=_announce_reward if several else None)
    if out is not None:
        write_csv(report, out)
        log(f"wrote {out}")
    collapse = _collapse_check(request.index, request.compare)
    rooms = [r.headroom(_pass_threshold(r.reward, pass_threshold)) for r in report.reports] if show_headroom else []
    if json_output:
        document = report.to_dict()
        if collapse is not None:  # each reward's comparison says it, so several rewards print each one's alone
            for one in document.get("rewards", [document]):
                one["compare"]["collapse"] = collapse
        if show_headroom:
            for one, room in zip(document.get("rewards", [document]), rooms, strict=True):
                one["headroom"] = asdict(room)
        print_json(document)
        return
    if several:
        _print_reward_tables(report)
    else:
        _print_tables(report.reports[0])
    if show_headroom:
        for one, room in zip(report.reports, rooms, strict=True):
            _print_headroom(one.reward, room)
    if collapse is not None and collapse["warning"] is not None:
        say(collapse["warning"])


def _pass_threshold(reward: str, given: float | None) -> float | None:
    """--pass-threshold, or the checker rewards' own: 1.0 (every claim holds)."""
    if given is not None:
        return given
    return 1.0 if reward in ("shapes", "shapes-scene", "shapes-strict") else None


def _print_headroom(reward: str, room) -> None:
    table = Table(
        title=f"{reward} headroom: {room.prompts} prompts, {room.images_per_prompt} images each", title_justify="left"
    )
    table.add_column("k", justify="right")
    table.add_column("best of k", justify="right")
    if room.pass_at is not None:
        table.add_column(f"pass@k (score ≥ {room.threshold:g})", justify="right")
    for k, best in room.best_of.items():
        row = [str(k), f"{best:.4f}"]
        if room.pass_at is not None:
            row.append(f"{room.pass_at[k]:.4f}")
        table.add_row(*row)
    out_console.print(table)
    out_console.print(
        f"headroom: mean {room.mean:.4f} → best of {room.images_per_prompt} {room.ceiling:.4f} "
        f"({room.ceiling - room.mean:+.4f})"
    )


def _collapse_check(index: str | None, compare: str | None) -> dict | None:
    """With --compare: both runs' image spread (``training/collapse.py``) and the warning when one run's images
    kept less than half the other's spread: a score gain with images that all look alike is not an improvement."""
    if index is None or compare is None:
        return None
    from fluxgrpo.score import images_from_index
    from fluxgrpo.training.collapse import image_spread, spread_sign, warning_line

    this = image_spread([item.path for item in images_from_index(index)])
    other = image_spread([item.path for item in images_from_index(compare)])
    this_lost = spread_sign(other, this, "the --compare run", "this run")
    other_lost = spread_sign(this, other, "this run", "the --compare run")
    what_to_do = (
        "A better score for images that all look alike is reward hacking, not an improvement: look at both runs' "
        "grid.png"
    )
    warning = None
    if this_lost is not None:
        warning = warning_line([this_lost], what_to_do, subject=f"this run ({index})")
    elif other_lost is not None:
        warning = warning_line([other_lost], what_to_do, subject=f"the --compare run ({compare})")
    return {"image_spread": this, "other_image_spread": other, "warning": warning}


def _announce_reward(name: str, position: int, count: int) -> None:
    log(f"scoring with {name} ({position} of {count})")


def _progress_printer():
    """A callback that counts scored images on stderr every few hundred images."""
    done = [0]

    def advance(count: int) -> None:
        done[0] += count
        if done[0] // 256 != (done[0] - count) // 256:
            err_console.print(f"scored {done[0]} images")

    return advance


def _print_tables(report) -> None:
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
    if report.details:
        out_console.print(escape(_details_line(report)), soft_wrap=True)

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
    say(
        f"mean difference (this − other): {comparison.mean_difference:+.5f} over {comparison.count} paired images "
        f"({comparison.mean:.5f} vs {comparison.other_mean:.5f}); improved prompts: {comparison.improved_prompts} of "
        f"{comparison.prompt_count} ({comparison.improved_fraction:.0%})"
    )


def _details_line(report) -> str:
    """A reward's own numbers beside the mean, e.g. ``shapes: strict 0.50000 · seen mean 0.81250 · …``."""
    return f"{report.reward}: " + " · ".join(
        f"{key.replace('_', ' ')} {value:.5f}" for key, value in report.details.items()
    )


def _mean_std(mean: float, std: float) -> str:
    return f"{mean:.5f}\n± {std:.5f}"  # two lines: three rewards' columns fit 80 columns beside the prompt


def _difference(value: float) -> str:
    style = "green" if value > 0 else "red" if value < 0 else ""
    return f"[{style}]{value:+.5f}[/]" if style else f"{value:+.5f}"


def _print_reward_tables(multi) -> None:
    """Several rewards side by side: a column per reward in the per-image, per-prompt and --compare tables."""

    reports = multi.reports
    first = reports[0]
    images = Table(title="scores per image", title_justify="left")
    images.add_column("file")
    images.add_column("prompt", overflow="fold")
    for name in multi.rewards:
        images.add_column(name, justify="right")
    for row, image in enumerate(first.images):
        images.add_row(escape(image.file), escape(image.prompt), *(f"{r.images[row].score:.5f}" for r in reports))
    out_console.print(images)

    prompts = Table(title="mean ± std per prompt", title_justify="left", show_lines=True)
    prompts.add_column("#", justify="right")
    prompts.add_column("prompt", overflow="fold")
    prompts.add_column("n", justify="right")
    for name in multi.rewards:
        prompts.add_column(name, justify="right")
    for row, stats in enumerate(first.prompts):
        cells = [_mean_std(r.prompts[row].mean, r.prompts[row].std) for r in reports]
        prompts.add_row(str(stats.prompt_index), escape(stats.prompt), str(stats.count), *cells)
    cells = [_mean_std(r.overall.mean, r.overall.std) for r in reports]
    prompts.add_row("", "[bold]overall[/]", str(first.overall.count), *cells)
    out_console.print(prompts)
    for report in reports:
        if report.details:
            out_console.print(escape(_details_line(report)), soft_wrap=True)

    if first.comparison is None:
        return
    comparisons = [r.comparison for r in reports if r.comparison is not None]
    table = Table(
        title=f"compared with {escape(first.comparison.other)} (Δ = this − other)",
        title_justify="left",
        show_lines=True,
    )
    table.add_column("#", justify="right")
    table.add_column("prompt", overflow="fold")
    table.add_column("run")
    for name in multi.rewards:
        table.add_column(name, justify="right")
    runs = "this\nother\nΔ"
    for row, compared in enumerate(first.comparison.prompts):
        cells = [
            f"{c.prompts[row].mean:.5f}\n{c.prompts[row].other_mean:.5f}\n{_difference(c.prompts[row].difference)}"
            for c in comparisons
        ]
        table.add_row(str(compared.prompt_index), escape(compared.prompt), runs, *cells)
    cells = [f"{c.mean:.5f}\n{c.other_mean:.5f}\n{_difference(c.mean_difference)}" for c in comparisons]
    table.add_row("", f"[bold]overall[/] ({first.comparison.count} paired images)", runs, *cells)
    cells = [f"{c.improved_prompts} of {c.prompt_count}\n({c.improved_fraction:.0%})" for c in comparisons]
    table.add_row("", "prompts improved", "", *cells)
    out_console.print(table)
