"""``fluxgrpo sample``: images from the base model or a trained checkpoint, with an index and a contact sheet."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from fluxgrpo.cli.common import DeviceOption, JsonOption, handle_errors, log, out_console, print_json
from fluxgrpo.data.benchmarks import prompts_path
from fluxgrpo.errors import UsageError
from fluxgrpo.paths import DEFAULT_FLUX_DIR, empty_folders_removed_on_failure
from fluxgrpo.run_folder import move_aside
from fluxgrpo.runtime.adapt import ATTENTION_BACKENDS

_OWN = "[default: the model's own: 720 for FLUX.1-dev, 64 for the shapes world]"


@handle_errors
def command(
    model: Annotated[str, typer.Option("--model", help="FLUX diffusers folder (the base model).")] = DEFAULT_FLUX_DIR,
    checkpoint: Annotated[
        str | None,
        typer.Option(
            "--checkpoint",
            help="A checkpoint-<k> folder, a run's best/ (--keep-best), or a training --output-dir (its latest complete "
            "checkpoint). "
            "[default: none, the base model]",
            show_default=False,
        ),
    ] = None,
    ema: Annotated[
        bool, typer.Option("--ema", help="Use the checkpoint's EMA weights (runs trained with --use-ema).")
    ] = False,
    prompts_file: Annotated[
        str | None,
        typer.Option(
            "--prompts",
            help="Prompt file, one per line (blank lines and repeats dropped), or a shipped set: shapes-train, "
            "shapes-heldout.",
        ),
    ] = None,
    prompt: Annotated[
        list[str] | None, typer.Option("--prompt", help="A prompt; repeat the flag for more (instead of --prompts).")
    ] = None,
    images_per_prompt: Annotated[int, typer.Option("--images-per-prompt", help="Images K per prompt.")] = 1,
    height: Annotated[
        int | None,
        typer.Option("--height", help=f"Image height in pixels (multiple of 16). {_OWN}", show_default=False),
    ] = None,
    width: Annotated[
        int | None, typer.Option("--width", help=f"Image width in pixels (multiple of 16). {_OWN}", show_default=False)
    ] = None,
    steps: Annotated[
        int | None,
        typer.Option(
            "--steps",
            help="Denoising steps. [default: the model's own: 28 for FLUX.1-dev, 12 for the shapes world, as its "
            "evaluation]",
            show_default=False,
        ),
    ] = None,
    guidance: Annotated[
        float | None,
        typer.Option(
            "--guidance",
            help="FLUX-dev distilled guidance. [default: the model's own: 3.5 for FLUX.1-dev, 1.75 for the shapes "
            "world, as its configs]",
            show_default=False,
        ),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Run seed S; image j of prompt i is seeded from (S, i, j).")] = 0,
    batch_size: Annotated[
        int, typer.Option("--batch-size", help="Images per forward pass (does not change the images).")
    ] = 1,
    dies: Annotated[
        int, typer.Option("--dies", help="Worker processes, one per device (torchrun); prompts are split.")
    ] = 1,
    out: Annotated[
        str | None,
        typer.Option(
            "--out",
            help="Output folder; index.json is written there last. "
            "[default: data/outputs/samples/base, or .../<run>-checkpoint-<k>[-ema]]",
            show_default=False,
        ),
    ] = None,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            help="Move what --out holds to <out>.replaced-<time> first, never deleting it; needed for an --out inside "
            "a training run (e.g. its eval/iteration-<k>).",
        ),
    ] = False,
    device: DeviceOption = "auto",
    attention: Annotated[
        str, typer.Option("--attention", help=f"Attention kernel: {' or '.join(ATTENTION_BACKENDS)}.")
    ] = "sdpa",
    max_sequence_length: Annotated[
        int | None,
        typer.Option(
            "--max-sequence-length",
            help="T5 tokens per prompt (padded; longer prompts are cut). [default: the model's own: 512, the shapes "
            "world 12]",
            show_default=False,
        ),
    ] = None,
    compile_model: Annotated[
        bool,
        typer.Option(
            "--compile",
            help="torch.compile FLUX's repeated blocks (regional; CPUs and GPUs): pays off on long runs, "
            "images equal to rounding.",
        ),
    ] = False,
    json_output: JsonOption = False,
) -> None:
    """Generate images with the base model or a trained checkpoint, reproducibly (same seed, same images).

    Writes <out>/<i:04d>_<j:02d>.png, a grid.png contact sheet and, last, index.json (which `fluxgrpo score`
    reads).

    Examples:
      fluxgrpo sample --prompts prompts.txt --images-per-prompt 4
      fluxgrpo sample --checkpoint data/outputs/grpo --prompts prompts.txt \\
          --images-per-prompt 4 --dies 8
      fluxgrpo sample --checkpoint data/outputs/shapes-cpu \\
          --prompts shapes-heldout --images-per-prompt 4
    """
    from fluxgrpo.data.prompts import read_prompts
    from fluxgrpo.runtime.launch import LaunchSpec, run_workers
    from fluxgrpo.sample import build_request, model_sample_defaults, model_sample_guidance, model_sample_steps
    from fluxgrpo.sampling.request import SampleSettings

    spec = LaunchSpec(nproc_per_node=dies)
    spec.validate()
    if prompts_file is not None and prompt:
        raise UsageError("pass either --prompts FILE or --prompt TEXT, not both")
    if prompts_file is not None:
        prompts = read_prompts(prompts_path(prompts_file))
    else:
        prompts = list(dict.fromkeys(text.strip() for text in prompt or [] if text.strip()))
    side, tokens = model_sample_defaults(model)
    own_steps = model_sample_steps(model)
    own_guidance = model_sample_guidance(model)
    if (side, tokens, own_steps, own_guidance) != (
        SampleSettings.height,
        SampleSettings.max_sequence_length,
        SampleSettings.steps,
        SampleSettings.guidance,
    ) and None in (height, width, max_sequence_length, steps, guidance):
        log(
            f"{model} holds a model trained at {side}x{side} pixels and {tokens} T5 tokens and evaluated with "
            f"{own_steps} steps at guidance {own_guidance}: its own are the defaults"
        )
    settings = SampleSettings(
        height=side if height is None else height,
        width=side if width is None else width,
        steps=own_steps if steps is None else steps,
        guidance=own_guidance if guidance is None else guidance,
        seed=seed,
        images_per_prompt=images_per_prompt,
        batch_size=batch_size,
        max_sequence_length=tokens if max_sequence_length is None else max_sequence_length,
        attention=attention,
        compile=compile_model,
    )

    with empty_folders_removed_on_failure():  # a failure leaves no empty --out behind
        request = build_request(
            model=model,
            prompts=prompts,
            out_dir=out,
            checkpoint=checkpoint,
            ema=ema,
            settings=settings,
            device=device,
            overwrite=overwrite,
        )
        if overwrite:
            moved = move_aside(request.out_dir, "--overwrite")
            if moved is not None:
                log(f"moved what was in {request.out_dir} to {moved}")
        summary = run_workers("fluxgrpo.sample", request.to_dict(), spec, request.device, log=log)
    if json_output:
        print_json(summary)
        return

    table = Table(title="sample", show_header=False, title_justify="left")
    table.add_column("item", style="bold")
    table.add_column("value")
    weights = "base model" if summary["checkpoint"] is None else summary["checkpoint"]
    if summary["ema"]:
        weights += " (EMA)"
    table.add_row("weights", escape(weights))
    table.add_row("images", f"{summary['images']} ({summary['prompts']} prompts × {summary['images_per_prompt']})")
    table.add_row("index", escape(summary["index_path"]))
    table.add_row("grid", escape(summary["grid_path"]))
    table.add_row("ran on", f"{summary['world_size']} × {summary['device_type']}, {summary['dtype']}")
    out_console.print(table)
