"""``fluxgrpo export``: a checkpoint as a standalone diffusers transformer, merging a LoRA adapter with --merge."""

from __future__ import annotations

from typing import Annotated

import typer

from fluxgrpo.cli.common import handle_errors, out_console, print_json


@handle_errors
def command(
    checkpoint: Annotated[
        str,
        typer.Option(
            "--checkpoint",
            help="A checkpoint-<k> folder, a run's best/ (--keep-best), or a training --output-dir (its latest complete "
            "checkpoint).",
        ),
    ],
    out: Annotated[str, typer.Option("--out", help="New (or empty) folder to write.")],
    merge: Annotated[
        bool,
        typer.Option(
            "--merge", help="LoRA checkpoints: fuse the adapter into the base transformer (default: copy the adapter)."
        ),
    ] = False,
    ema: Annotated[bool, typer.Option("--ema", help="Export the EMA weights (runs trained with --use-ema).")] = False,
    model: Annotated[
        str | None,
        typer.Option("--model", help="With --merge: the base FLUX folder [default: the one the run trained from]."),
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Write a checkpoint's transformer where other tools can load it.

    Examples:
      fluxgrpo export --checkpoint data/outputs/grpo --out flux-grpo-transformer
      fluxgrpo export --checkpoint data/outputs/grpo-lora/checkpoint-300 --merge \\
          --out flux-grpo-merged
      # a LoRA run: its adapter as pytorch_lora_weights.safetensors
      fluxgrpo export --checkpoint data/outputs/grpo-lora --out my-lora
    """
    from fluxgrpo.export import export_checkpoint

    result = export_checkpoint(checkpoint, out, merge=merge, ema=ema, model=model)
    if json_output:
        print_json(result.to_dict())
        return
    what = "merged transformer" if result.merged else ("LoRA adapter" if result.kind == "lora" else "transformer")
    out_console.print(f"{what} of {result.checkpoint} written to {result.out}", highlight=False, markup=False)
