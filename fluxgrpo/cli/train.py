"""``fluxgrpo train``: the GRPO loop under torchrun.

The hyperparameter flags are generated from ``fluxgrpo.config.TrainConfig`` so a flag, its YAML key and its
help can never drift apart (and no flag exists that the trainer ignores).
"""

from __future__ import annotations

import inspect
from dataclasses import MISSING
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from fluxgrpo.cli.common import err_console, escape, handle_errors, log, out_console, print_json, say
from fluxgrpo.cli.help import HelpCommand
from fluxgrpo.config import build_config, config_fields, config_summary, shipped_configs
from fluxgrpo.errors import FluxgrpoError

if TYPE_CHECKING:
    from fluxgrpo.config import TrainConfig
    from fluxgrpo.training.launch_plan import TrainPlan

_PY_TYPES = {"int": int, "float": float, "str": str, "bool": bool}
# Config keys whose flag `command` declares itself, among the launch options (the YAML key still sets it).
HAND_DECLARED = frozenset({"dies"})
# The help panel of each config section, keyed by the section's first field (config.py's order): every flag is
# also a YAML key.
SECTION_PANELS = {
    "model": "Data and weights (each flag is also a YAML key)",
    "height": "Rollout",
    "timestep_fraction": "Policy update: optimizer, clipping, LoRA",
    "objective": "Algorithm options: objective, sampler, SDE window, KL",
    "seed": "Loop, checkpoints, logging",
    "eval_every": "Held-out evaluation and guards",
}
RUN_PANEL, LAUNCH_PANEL = "Run", "Launch: dies, nodes, restarts"


def _hyperparameter_parameters() -> list[inspect.Parameter]:
    params = []
    panel = SECTION_PANELS[next(iter(SECTION_PANELS))]
    for f in config_fields():
        panel = SECTION_PANELS.get(f.name, panel)
        if f.name in HAND_DECLARED:
            continue
        flag = f.name.replace("_", "-")
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        default = f.default if f.default is not MISSING else None
        # an empty default is said in the help text ("empty: …"); "[default: ]" would say nothing
        # a comma list is shown with spaces, so a narrow terminal can wrap it (the parser strips them)
        shown = f" [default: {str(default).replace(',', ', ')}]" if default != "" else ""
        if kind == "bool":
            shown = f" Off: --no-{flag}.{shown}"
        option = typer.Option(
            None,
            f"--{flag}/--no-{flag}" if kind == "bool" else f"--{flag}",
            help=f"{f.metadata['help']}{shown}",
            show_default=False,
            rich_help_panel=panel,
        )
        params.append(
            inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=_PY_TYPES[kind] | None)
        )
    return params


def _list_configs() -> None:
    table = Table(title="Shipped configs (--config NAME)", title_justify="left", show_lines=True)
    table.add_column("name", style="bold")
    table.add_column("what it is, and the command that launches it")
    for name, path in sorted(shipped_configs().items()):
        table.add_row(escape(name), escape(config_summary(path)))
    out_console.print(table)


def _train(
    *,
    config: str | None,
    list_configs: bool,
    dies: int | None,
    nnodes: int | None,
    node_rank: int | None,
    master_addr: str | None,
    master_port: int | None,
    rdzv_endpoint: str | None,
    max_restarts: int,
    collective_timeout: str,
    resume: str | None,
    overwrite: bool,
    dry_run: bool,
    json_output: bool,
    **hyperparameters: Any,
) -> None:
    if list_configs:
        _list_configs()
        return
    from fluxgrpo.runtime.dist import CollectiveTimeout
    from fluxgrpo.training.launch_plan import launch_spec, launch_training, plan_training

    cfg = build_config(config, {**hyperparameters, "dies": dies})
    spec = launch_spec(
        cfg,
        dies=cfg.dies,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        rdzv_endpoint=rdzv_endpoint,
        max_restarts=max_restarts,
        collective_timeout=CollectiveTimeout.parse(collective_timeout),
        log=log,
    )
    plan = plan_training(cfg, spec, resume, dry_run=dry_run, overwrite=overwrite)
    for model_warning in plan.memory.warnings:
        log(f"warning: {model_warning}")
    if dry_run:
        _print_dry_run(cfg, plan)
        return
    threads = ""
    if plan.device_type == "cpu":  # what each worker runs on, so a slow run says why
        from fluxgrpo.runtime.cpu_threads import plan_cpu_threads

        threads = f", {plan_cpu_threads(spec.nproc_per_node).text()}"
    err_console.print(
        f"[bold]fluxgrpo train[/]: {plan.device_type} × {spec.world_size}{threads}, output {escape(cfg.output_dir)}"
    )
    _summarize_run(cfg, launch_training(plan, log=log), json_output)


def _print_dry_run(cfg: TrainConfig, plan: TrainPlan) -> None:
    """What a launch would run: the memory model on stderr, the resolved plan as JSON on stdout."""
    for line in plan.memory.lines():
        err_console.print(line, highlight=False)
    for check in plan.skipped_checks:
        log(f"not checked (dry run): {check}")
    print_json(
        {
            "config": cfg.to_dict(),
            "derived": plan.derived,
            "device_type": plan.device_type,
            "worker_env": plan.worker_env,
            "resume_from": plan.resume_checkpoint,
            "memory_per_die": plan.memory.as_dict(),
            "skipped_checks": plan.skipped_checks,
        }
    )


def _summarize_run(cfg: TrainConfig, records: list[dict[str, Any]], json_output: bool) -> None:
    """The finished run's result: the train-reward trend, its collapse warning, the held-out change, a guard's stop
    (exit code GUARD_STOP_EXIT_CODE)."""
    from fluxgrpo.metrics import held_out_trend, reward_trend
    from fluxgrpo.training.guards import GUARD_STOP_EXIT_CODE, guard_stop

    trend = reward_trend(records)
    iterations = [r for r in records if "reward_mean" in r]  # metrics.jsonl also holds evaluation and guard records
    stopped = guard_stop(records)
    held_out = held_out_trend(records)
    result = {
        "output_dir": cfg.output_dir,
        "iterations": len(iterations),
        "reward_trend": trend,
        "held_out": held_out,
        "final": iterations[-1] if iterations else None,
        "guard_stop": stopped["guard_stop_message"] if stopped else None,
        "best": _best_or_none(cfg.output_dir),
    }
    warning = collapse_warning(cfg.output_dir, records)
    result["collapse_warning"] = warning
    per_prompt = _per_prompt(cfg, held_out)
    result["per_prompt"] = per_prompt
    if json_output:
        print_json(result)
    elif trend is not None:
        arrow = "↑" if trend["change"] > 0 else "↓"
        say(
            f"reward {trend['first']:.4f} → {trend['last']:.4f} ({arrow} {trend['change']:+.4f}; mean of the first "
            f"and last {trend['window']} of {trend['iterations']} iterations). Checkpoints and metrics.jsonl in "
            f"{cfg.output_dir}"
        )
    if warning is not None and not json_output:  # part of the summary, right under the trend it qualifies
        say(warning)
    if not json_output:
        for name, change in held_out.items():
            say(
                f"held-out {name} {change['first']:.4f} (iteration {change['first_iteration']}) → "
                f"{change['last']:.4f} (iteration {change['last_iteration']}), {change['change']:+.4f}"
                + _against_noise(change)
                + _headroom_share(change, cfg.eval_images_per_prompt)
            )
    if held_out and not json_output:
        _print_per_prompt(per_prompt)
    if stopped:  # a clean end, told apart from success and failure by its exit code (training/guards.py)
        log(stopped["guard_stop_message"])  # one line, never cut (the rule, the iteration, the values)
        raise typer.Exit(GUARD_STOP_EXIT_CODE)


def _against_noise(change: dict[str, float]) -> str:
    """The held-out change told apart from sampling noise: another draw of the same model's images moves the mean."""
    from fluxgrpo.metrics import noise_verdict

    verdict = noise_verdict(change)
    return "" if verdict is None else f", {verdict}"


# The overfit check trains on a handful of prompts and evaluates those: its closing lines say each one's change.
PER_PROMPT_LINES = 8


def _per_prompt(cfg: TrainConfig, held_out: dict[str, dict[str, float]]) -> dict[str, list[dict[str, Any]]]:
    """Per-prompt first → last evaluation of each held-out reward, when there are few prompts; else {}."""
    from fluxgrpo.training.eval import per_prompt_change

    if not held_out:
        return {}
    change = next(iter(held_out.values()))
    table = per_prompt_change(cfg.output_dir, int(change["first_iteration"]), int(change["last_iteration"]))
    return table if table and all(len(rows) <= PER_PROMPT_LINES for rows in table.values()) else {}


def _print_per_prompt(table: dict[str, list[dict[str, Any]]]) -> None:
    for name, rows in table.items():
        for row in rows:
            strict = (
                f" (every claim {row['first_strict']:.2f} → {row['last_strict']:.2f})" if "first_strict" in row else ""
            )
            say(f"  {name} {row['first']:.4f} → {row['last']:.4f}{strict} over {row['images']} images: {row['prompt']}")


def _headroom_share(change: dict[str, float], images_per_prompt: int) -> str:
    """The change as a share of the headroom: the first evaluation's best image per prompt over its mean."""
    if "headroom_used" not in change:
        return ""
    return (
        f"; {change['headroom_used']:.0%} of the headroom to the first evaluation's best-of-{images_per_prompt} "
        f"{change['ceiling']:.4f}"
    )


def _best_or_none(output_dir: str) -> dict[str, Any] | None:
    """The run's best/ record for its summary; a damaged one was already warned about, and is not the run's result."""
    from fluxgrpo.checkpoint.best import read_best

    try:
        return read_best(output_dir)
    except FluxgrpoError:
        return None


def collapse_warning(output_dir: str, records: list[dict[str, Any]]) -> str | None:
    """The one line saying the run looks collapsed or hacked (``training/collapse.py``), or None."""
    from fluxgrpo.report.run import read_evaluations
    from fluxgrpo.training.collapse import evaluation_spread_sign, record_signs, warning_line

    signs = record_signs(records)
    spread = evaluation_spread_sign(read_evaluations(Path(output_dir)))
    if spread is not None:
        signs.append(spread)
    return warning_line(signs)


def command(
    config: Annotated[
        str | None,
        typer.Option(
            "--config", rich_help_panel=RUN_PANEL, help="Shipped config name (see --list-configs) or a YAML file."
        ),
    ] = None,
    list_configs: Annotated[
        bool, typer.Option("--list-configs", rich_help_panel=RUN_PANEL, help="Show the shipped configs and exit.")
    ] = False,
    dies: Annotated[
        int | None,
        typer.Option(
            "--dies",
            rich_help_panel=LAUNCH_PANEL,
            help="Worker processes on this node (one per accelerator die). [default: the config's dies, else 1]",
        ),
    ] = None,
    nnodes: Annotated[
        int | None,
        typer.Option(
            "--nnodes",
            rich_help_panel=LAUNCH_PANEL,
            help="Nodes in the job (run the same command on each). [default: 1, or Slurm's]",
        ),
    ] = None,
    node_rank: Annotated[
        int | None,
        typer.Option(
            "--node-rank",
            rich_help_panel=LAUNCH_PANEL,
            help="This node's index, 0 … nnodes−1. [default: 0, or Slurm's]",
        ),
    ] = None,
    master_addr: Annotated[
        str | None,
        typer.Option(
            "--master-addr", rich_help_panel=LAUNCH_PANEL, help="Address of node 0 (static multi-node rendezvous)."
        ),
    ] = None,
    master_port: Annotated[
        int | None, typer.Option("--master-port", rich_help_panel=LAUNCH_PANEL, help="Rendezvous port on node 0.")
    ] = None,
    rdzv_endpoint: Annotated[
        str | None,
        typer.Option(
            "--rdzv-endpoint",
            rich_help_panel=LAUNCH_PANEL,
            help="HOST:PORT of node 0 for torchrun's elastic c10d rendezvous (multi-node; needed by --max-restarts).",
        ),
    ] = None,
    max_restarts: Annotated[
        int,
        typer.Option(
            "--max-restarts",
            rich_help_panel=LAUNCH_PANEL,
            help="After a failure, restart every worker up to N times; they resume from the newest complete "
            "checkpoint.",
        ),
    ] = 0,
    collective_timeout: Annotated[
        str,
        typer.Option(
            "--collective-timeout",
            rich_help_panel=LAUNCH_PANEL,
            help="STARTUP,STEADY seconds a rank waits for its peers: until the first iteration is done, then after.",
        ),
    ] = "300,100",
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            rich_help_panel=RUN_PANEL,
            help="Continue from the latest complete checkpoint in --output-dir (if any).",
        ),
    ] = False,
    resume_from: Annotated[
        str | None,
        typer.Option(
            "--resume-from",
            rich_help_panel=RUN_PANEL,
            help="Continue from this checkpoint folder (or its name in --output-dir).",
        ),
    ] = None,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            rich_help_panel=RUN_PANEL,
            help="Start over in an --output-dir that holds an earlier run: its files move to <dir>.replaced-<time>.",
        ),
    ] = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run", rich_help_panel=RUN_PANEL, help="Validate, print the resolved config as JSON, start nothing."
        ),
    ] = False,
    json_output: Annotated[
        bool, typer.Option("--json", rich_help_panel=RUN_PANEL, help="Print the run summary as one JSON document.")
    ] = False,
    **hyperparameters: Any,
) -> None:
    """Fine-tune the FLUX transformer with GRPO (rollout → reward → advantages → update → checkpoint).

    \b
    Examples:
      fluxgrpo train --config shapes-quickstart --dies 2
      fluxgrpo train --config shapes-cpu --dies 2
      fluxgrpo train --config shapes-cpu-vgrpo --dies 2
      fluxgrpo train --config tiny-cpu --dies 2
      fluxgrpo train --config a3-16die --dies 16
      fluxgrpo train --config a3-16die --dies 8 --nnodes 2 --node-rank 0 \\
          --master-addr 10.0.0.1
      fluxgrpo train --config a3-16die --dies 16 --nnodes 2 --node-rank 0 \\
          --rdzv-endpoint 10.0.0.1:29500 --max-restarts 3
      fluxgrpo train --config a3-16die --dies 16 --resume
      fluxgrpo train --config a3-16die --dies 16 \\
          --resume-from data/outputs/grpo/checkpoint-80
    """
    _train(
        config=config,
        list_configs=list_configs,
        dies=dies,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        rdzv_endpoint=rdzv_endpoint,
        max_restarts=max_restarts,
        collective_timeout=collective_timeout,
        resume=resume_from if resume_from is not None else ("latest" if resume else None),
        overwrite=overwrite,
        dry_run=dry_run,
        json_output=json_output,
        **hyperparameters,
    )


def _with_generated_signature(fn):
    fixed = [
        p
        for p in inspect.signature(fn, eval_str=True).parameters.values()
        if p.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    fn.__signature__ = inspect.Signature([*fixed, *_hyperparameter_parameters()])
    return fn


class TrainCommand(HelpCommand):
    help_panel = RUN_PANEL  # every other option has a panel: --help joins the run's


command = _with_generated_signature(handle_errors(command))
command_class = TrainCommand
