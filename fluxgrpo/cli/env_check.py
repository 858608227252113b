"""``fluxgrpo env-check``: what this machine has and whether training could start."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from fluxgrpo.cli.common import HpsDirOption, JsonOption, escape, handle_errors, out_console, print_json
from fluxgrpo.config import TrainConfig
from fluxgrpo.errors import UsageError
from fluxgrpo.paths import DEFAULT_EMBEDDINGS_DIR, DEFAULT_FLUX_DIR, DEFAULT_HPS_DIR
from fluxgrpo.runtime.device import is_ascend

_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red"}


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


@handle_errors
def command(
    json_output: JsonOption = False,
    flux_dir: Annotated[str, typer.Option("--flux-dir", help="FLUX diffusers folder.")] = DEFAULT_FLUX_DIR,
    hps_dir: HpsDirOption = DEFAULT_HPS_DIR,
    embeddings_dir: Annotated[
        str, typer.Option("--embeddings", help="Embeddings folder written by `fluxgrpo preprocess`.")
    ] = DEFAULT_EMBEDDINGS_DIR,
    device: Annotated[str, typer.Option("--device", help="auto, or a device type to check for.")] = "auto",
    reward: Annotated[
        str,
        typer.Option(
            "--reward",
            help="The reward(s) of the run to check for, as train --reward takes them; other rewards without weights only warn.",
        ),
    ] = TrainConfig.reward,
    deep: Annotated[
        bool,
        typer.Option(
            "--deep",
            help="Run short real checks on the device (kernels, on-policy start, memory, collectives, loading, rewards).",
        ),
    ] = False,
    quick: Annotated[
        bool, typer.Option("--quick", help="With --deep: the subset that runs in under 2 minutes.")
    ] = False,
    config: Annotated[
        str | None,
        typer.Option(
            "--config",
            help="The train config of the run to check for (name or YAML path): its rewards (and its evaluation's), "
            "folders, device and --dies; with --deep, the settings the checks run.",
        ),
    ] = None,
    dies: Annotated[
        int | None,
        typer.Option(
            "--dies",
            help="The run's workers, as train takes them; with --deep, for collectives and loading [default: all dies].",
        ),
    ] = None,
    report_file: Annotated[
        str, typer.Option("--report-file", help="With --deep: where to write the JSON report.")
    ] = "env-check-deep.json",
    nnodes: Annotated[
        int,
        typer.Option(
            "--nnodes",
            help="Nodes of the run: with --rdzv-endpoint, the multi-node checks; with --deep, the nodes the "
            "collectives span (run the same command on each).",
        ),
    ] = 1,
    rdzv_endpoint: Annotated[
        str | None,
        typer.Option(
            "--rdzv-endpoint",
            help="HOST:PORT of node 0, as train takes it: checks that it is reachable and the interface variables.",
        ),
    ] = None,
    node_rank: Annotated[int, typer.Option("--node-rank", help="With --deep: this node's index, 0 … nnodes−1.")] = 0,
    master_addr: Annotated[
        str | None, typer.Option("--master-addr", help="With --deep: address of node 0 (multi-node).")
    ] = None,
    master_port: Annotated[
        int | None, typer.Option("--master-port", help="With --deep: rendezvous port on node 0.")
    ] = None,
) -> None:
    """Report devices, versions, accelerator variables, weights and embeddings; exit 0 only if training could start.

    Examples:
      fluxgrpo env-check
      fluxgrpo env-check --config shapes-quickstart --dies 2
      fluxgrpo env-check --reward hpsv2:1,pickscore:0.5
      fluxgrpo env-check --json > env.json
      fluxgrpo env-check --nnodes 2 --rdzv-endpoint 10.0.0.1:29500
      fluxgrpo env-check --deep --config a3-8die
      fluxgrpo env-check --deep --quick --device cpu
    """
    if deep:
        from fluxgrpo.cli.env_check_deep import run_and_show
        from fluxgrpo.deepcheck.run import DeepCheckSettings

        settings = DeepCheckSettings(
            device,
            quick,
            config,
            flux_dir,
            hps_dir,
            reward,
            dies,
            report_file,
            nnodes,
            node_rank,
            master_addr,
            master_port,
        )
        if not run_and_show(settings, json_output):
            raise typer.Exit(1)
        return
    deep_only = {
        "--quick": quick,
        "--node-rank": node_rank != 0,
        "--master-addr": master_addr is not None,
        "--master-port": master_port is not None,
    }
    if any(deep_only.values()):
        given = ", ".join(flag for flag, set_ in deep_only.items() if set_)
        raise UsageError(f"{given} only apply to `fluxgrpo env-check --deep`: add --deep")
    from fluxgrpo.envcheck import collect_report, run_to_check

    run = None
    if dies is not None and config is None:
        raise UsageError("--dies needs --config: the run's workers are checked with the run's settings")
    if config is not None:  # the run this config starts: its folders and device where the flags were left alone
        if reward != TrainConfig.reward:
            raise UsageError("pass either --config (its rewards are checked) or --reward, not both")
        run = run_to_check(config, dies)
        flux_dir = run["flux_dir"] if flux_dir == DEFAULT_FLUX_DIR else flux_dir
        hps_dir = run["hps_dir"] if hps_dir == DEFAULT_HPS_DIR else hps_dir
        embeddings_dir = run["embeddings_dir"] if embeddings_dir == DEFAULT_EMBEDDINGS_DIR else embeddings_dir
        device = run["device"] if device == "auto" else device
    report = collect_report(
        flux_dir,
        hps_dir,
        embeddings_dir,
        requested_device=device,
        reward=reward,
        nnodes=nnodes,
        rdzv_endpoint=rdzv_endpoint,
        run=run,
    )
    if json_output:
        print_json(report)
    else:
        _render(report, show_accelerator_env=is_ascend(report["device"]["type"], device))
    if not report["ready"]:
        raise typer.Exit(1)


def _render(report: dict, show_accelerator_env: bool) -> None:
    """The report as tables; the Ascend variables only where an Ascend device is present or asked for (elsewhere they are
    all unset and say nothing: --json always has them)."""

    system = Table(title="fluxgrpo env-check", show_header=False, title_justify="left")
    system.add_column("item", style="bold")
    system.add_column("value")
    system.add_row("fluxgrpo", report["fluxgrpo_version"])
    system.add_row("platform", escape(report["platform"]))
    system.add_row("python", report["python"])
    for name, version in report["packages"].items():
        system.add_row(name, version or "[dim]not installed[/]")
    dev = report["device"]
    stack = dev["accelerator_stack"]
    system.add_row("accelerator runtime", stack["cann_version"] or "[dim]not found[/]")
    workers = f"; the run: {report['run']['dies']} worker(s)" if report.get("run") else ""
    system.add_row(
        "device", f"{dev['type']} × {dev['count']} (backend {dev['backend']}{workers})" if dev["type"] else "?"
    )
    for d in dev["devices"]:
        free = "available" if dev["type"] == "cpu" else "free"  # host memory: what the kernel can hand out
        system.add_row(
            f"  [{d['index']}] {escape(d['name'])}", f"{_gib(d['total_bytes'])} total, {_gib(d['free_bytes'])} {free}"
        )
    system.add_row("disk free", f"{_gib(report['disk']['free_bytes'])} at {escape(report['disk']['path'])}")
    system.add_row("/dev/shm", _gib(report["shm"]["total_bytes"]))
    out_console.print(system)

    if show_accelerator_env:
        _render_accelerator_env(report)
    _render_checks(report)


def _render_accelerator_env(report: dict) -> None:
    env = Table(title="Accelerator environment variables", title_justify="left")
    env.add_column("variable")
    env.add_column("value")
    env.add_column("recommended (set for workers when unset)")
    for row in report["accelerator_env"]:
        env.add_row(
            row["name"],
            escape(row["value"]) if row["value"] is not None else "[dim]unset[/]",
            escape(row["recommended"]) if row["recommended"] else "[dim]cluster-specific[/]",
        )
    out_console.print(env)


def _render_checks(report: dict) -> None:
    checks = Table(title="Checks", title_justify="left")
    checks.add_column("check")
    checks.add_column("status")
    checks.add_column("detail")
    checks.add_column("what to do")
    for c in report["checks"]:
        status = f"[{_STYLE[c['status']]}]{c['status']}[/]"
        checks.add_row(c["name"], status, escape(c["detail"]), escape(c["fix"] or ""))
    out_console.print(checks)
    rewards = report["rewards"]
    usable = [name for name, reward in rewards.items() if reward["ready"]]
    lacking = [name for name, reward in rewards.items() if not reward["ready"]]
    line = f"rewards with their weights in place: {', '.join(usable) or 'none'}"
    if lacking:
        line += f"; weights missing for: {', '.join(lacking)}"
    out_console.print(escape(line))
    from fluxgrpo.envcheck import run_label

    run = escape(run_label(report))
    verdict = (
        f"[green]ready to train ({run})[/]"
        if report["ready"]
        else f"[bold red]not ready ({run}): fix the failing checks above[/]"
    )
    out_console.print(verdict, soft_wrap=True)  # one line, never cut: a long --config path stays whole
