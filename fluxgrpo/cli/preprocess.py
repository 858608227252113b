"""``fluxgrpo preprocess``: encode a prompt file with FLUX's text encoders into DanceGRPO's embedding layout."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from fluxgrpo.cli.common import DeviceOption, JsonOption, escape, handle_errors, log, out_console, print_json
from fluxgrpo.data.benchmarks import WEIGHTED_SETS
from fluxgrpo.data.benchmarks import prompts_path as named_prompts_path
from fluxgrpo.paths import DEFAULT_EMBEDDINGS_DIR, DEFAULT_FLUX_DIR, EMBEDDINGS_INDEX, empty_folders_removed_on_failure


@handle_errors
def command(
    prompts: Annotated[
        str | None,
        typer.Option(
            "--prompts",
            help="Prompt file, one per line, or a set shipped with fluxgrpo: shapes-train, shapes-train-balanced or "
            "shapes-heldout (the shapes world's captions). [default: the bundled prompt list]",
            show_default=False,
        ),
    ] = None,
    model: Annotated[
        str, typer.Option("--model", help="FLUX diffusers folder (its text encoders are used).")
    ] = DEFAULT_FLUX_DIR,
    out: Annotated[
        str, typer.Option("--out", help=f"Embeddings folder; {EMBEDDINGS_INDEX} is written there last.")
    ] = DEFAULT_EMBEDDINGS_DIR,
    max_sequence_length: Annotated[
        int, typer.Option("--max-sequence-length", help="T5 tokens per prompt (padded; longer prompts are cut).")
    ] = 512,
    keep_repeats: Annotated[
        bool,
        typer.Option(
            "--keep-repeats",
            help="A prompt on k lines is drawn k times as often in training (encoded once, listed per line); "
            "without it a repeat is dropped. Always on for shapes-train-balanced, whose repeats are its weights.",
        ),
    ] = False,
    dies: Annotated[int, typer.Option("--dies", help="Worker processes, one per device (torchrun).")] = 1,
    device: DeviceOption = "auto",
    json_output: JsonOption = False,
) -> None:
    """Encode prompts once (T5 + CLIP pooled) so training never loads the text encoders.

    Re-running resumes: prompts already encoded are skipped.

    Examples:
      fluxgrpo preprocess
      fluxgrpo preprocess --prompts my_prompts.txt --dies 8
      fluxgrpo preprocess --prompts shapes-train
      fluxgrpo preprocess --prompts shapes-train-balanced --out data/rl_balanced
    """
    from fluxgrpo.data.prompts import bundled_prompts_path
    from fluxgrpo.preprocess import check_inputs
    from fluxgrpo.runtime.launch import LaunchSpec, run_workers

    spec = LaunchSpec(nproc_per_node=dies)
    spec.validate()

    prompts_path = str(named_prompts_path(prompts)) if prompts else str(bundled_prompts_path())
    keep_repeats = keep_repeats or prompts in WEIGHTED_SETS

    with empty_folders_removed_on_failure():  # a failure leaves no empty --out behind
        check_inputs(prompts_path, model, out, max_sequence_length, keep_repeats)  # fail here, not in every worker
        payload = {
            "prompts_path": prompts_path,
            "flux_dir": model,
            "out_dir": out,
            "max_sequence_length": max_sequence_length,
            "device": device,
            "keep_repeats": keep_repeats,
        }
        summary = run_workers("fluxgrpo.preprocess", payload, spec, device, log=log)
    if json_output:
        print_json(summary)
        return

    table = Table(title="preprocess", show_header=False, title_justify="left")
    table.add_column("item", style="bold")
    table.add_column("value")
    table.add_row("index", escape(summary["index_path"]))
    table.add_row("prompts", str(summary["prompts"]))
    if summary["draws"] != summary["prompts"]:
        table.add_row("index entries", f"{summary['draws']} (repeated lines kept: sampling weights)")
    table.add_row("encoded now", str(summary["encoded"]))
    table.add_row("already present", str(summary["skipped"]))
    table.add_row("truncated", f"{summary['truncated']} (longer than {summary['seq_len']} T5 tokens)")
    table.add_row(
        "shapes",
        f"[{summary['seq_len']}, {summary['embed_dim']}] + pooled [{summary['pooled_dim']}], {summary['dtype']}",
    )
    table.add_row("ranks", str(summary["world_size"]))
    out_console.print(table)
