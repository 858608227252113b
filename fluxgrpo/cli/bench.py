"""``fluxgrpo bench``: per-phase time, throughput, memory and MFU of one GRPO iteration, batched vs batch 1; with
``--algorithms``, the learning efficiency of training algorithms instead (``fluxgrpo.bench.efficiency``).

The phase bench's flags are generated from ``fluxgrpo.bench.config.BenchConfig`` (one per field, its help in the
field), as train's are from ``TrainConfig``; the algorithm comparison's and --json are declared here."""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from fluxgrpo.bench.config import BenchConfig, build_bench_config
from fluxgrpo.bench.efficiency import (
    ALGORITHMS,
    BASELINE,
    EfficiencyConfig,
    parse_algorithms,
    run_efficiency,
    trains_in_the_world,
)
from fluxgrpo.cli.common import err_console, escape, handle_errors, out_console, print_json
from fluxgrpo.errors import UsageError


def _option(name: str, help: str) -> Any:
    return typer.Option(name, help=help)


def _bench_parameters() -> list[inspect.Parameter]:
    """The phase bench's flags, one per ``BenchConfig`` field, with the field's help (``bench/config.py``)."""

    hints = typing.get_type_hints(BenchConfig)
    params = []
    for f in dataclasses.fields(BenchConfig):
        meta = f.metadata
        kind, default = meta["typed"] or (hints[f.name], f.default)
        flag = meta["flag"] or "--" + (meta["name"] or f.name).replace("_", "-")
        annotation = Annotated[kind, _option(flag, meta["help"])]  # type: ignore[valid-type]
        params.append(
            inspect.Parameter(
                meta["name"] or f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation
            )
        )
    return params


def command(
    algorithms: Annotated[
        str | None,
        _option(
            "--algorithms",
            f"Compare training algorithms instead ({', '.join(ALGORITHMS)}): each trained --iterations on the "
            f"tiny model from the same start; ratios to {BASELINE}, and transformer forwards, backwards and "
            "optimizer steps per iteration.",
        ),
    ] = None,
    iterations: Annotated[int, _option("--iterations", "With --algorithms: iterations each algorithm trains.")] = 30,
    vary_seed: Annotated[
        bool,
        _option(
            "--vary-seed",
            "With --algorithms: repeat k trains with the config's seed + k − 1 (`seed:` in a --config YAML; --seed "
            "seeds the tiny weights), so the spread of the reward gain is measured (else every repeat reproduces "
            "the first's rewards and only time varies).",
        ),
    ] = False,
    config: Annotated[
        str,
        _option(
            "--config",
            "With --algorithms: the training settings (a shipped config or a YAML file). One that evaluates "
            "(--eval-every) adds each algorithm's held-out gain; one scored by the shapes checker (shapes-cpu) "
            "trains on shapes-train and reports the held-out checker.",
        ),
    ] = "tiny-cpu",
    prompts: Annotated[
        str | None,
        _option(
            "--prompts",
            "With --algorithms: the training prompts, a shipped set (shapes-train, shapes-train-balanced, ...) or a "
            "file; default shapes-train on a config scored by the shapes checker, else the bundled prompts. "
            "shapes-train-balanced is what --config shapes-balanced trains on (repeated lines kept as weights).",
        ),
    ] = None,
    baseline_from: Annotated[
        str | None,
        _option(
            "--baseline-from",
            f"With --algorithms: take {BASELINE}'s row from this earlier `bench --algorithms ... --json` output "
            f"instead of training {BASELINE} again (refused unless made with the same settings; training is "
            "deterministic, so only its times are of another hour: 6 of its iterations here say how this machine compares).",
        ),
    ] = None,
    plot: Annotated[
        str | None,
        _option(
            "--plot",
            "With --algorithms on an evaluating config (shapes-cpu): write a PNG of each algorithm's held-out score "
            "against training seconds (median of the repeats, band min-max) to this file.",
        ),
    ] = None,
    json_output: Annotated[
        bool,
        _option(
            "--json",
            "JSON lines (config, device, versions, model, figures, summaries) on stdout as they are measured; "
            "with --algorithms one JSON document at the end.",
        ),
    ] = False,
    **settings: Any,
) -> None:
    """Measure one GRPO iteration phase by phase, at several batch sizes side by side; or, with --algorithms,
    what each training algorithm gains per second.

    Examples:
      fluxgrpo bench --model tiny --steps 2
      fluxgrpo bench --model flux-dev-shaped --blocks 8,16 --resolution 720 \\
          --steps 16 --json > bench.jsonl
      fluxgrpo bench --algorithms dance,dance-t2 --iterations 30 --repeats 3
      fluxgrpo bench --algorithms dance,mixgrpo-flash-w2,nft --config shapes-cpu \\
          --text-tokens 12 --vary-seed --repeats 3 --plot heldout.png
    """
    arguments = {
        "algorithms": algorithms,
        "iterations": iterations,
        "config": config,
        "prompts": prompts,
        "baseline_from": baseline_from,
        "plot": plot,
        "json_output": json_output,
    }
    arguments.update(settings)

    if algorithms is not None:
        _refuse_flags(arguments, EFFICIENCY_FLAGS | SHARED_FLAGS, "the phase bench only: drop it, or drop --algorithms")
        _run_efficiency(
            algorithms,
            iterations,
            settings["repeats"],
            config,
            settings["text_tokens"],
            settings["seed"],
            settings["device"],
            json_output,
            vary_seed,
            plot,
            prompts,
            baseline_from,
        )
        return
    _refuse_flags(arguments, PHASE_FLAGS | SHARED_FLAGS, "--algorithms only: add --algorithms, or drop it")
    from fluxgrpo.bench.run import run_bench

    compile_model = settings.pop("compile_model")
    cfg = build_bench_config(**settings, compile=compile_model)

    def emit(record: dict[str, Any]) -> None:
        if json_output:
            sys.stdout.write(json.dumps(record, default=str) + "\n")
            sys.stdout.flush()

    records = run_bench(cfg, emit=emit, log=lambda line: err_console.print(line, highlight=False, markup=False))
    if not json_output:
        _render(records)


def _with_generated_signature(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The phase bench's flags first (``_bench_parameters``), then the algorithm comparison's and --json."""
    fixed = [
        p
        for p in inspect.signature(fn, eval_str=True).parameters.values()
        if p.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    keyword = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in fixed]
    fn.__signature__ = inspect.Signature([*_bench_parameters(), *keyword])  # type: ignore[attr-defined]
    return fn


command = _with_generated_signature(handle_errors(command))

# Flags that mean the same in both benches; the others belong to one of them.
SHARED_FLAGS = frozenset({"text_tokens", "seed", "device", "repeats", "json_output"})
EFFICIENCY_FLAGS = frozenset({"algorithms", "iterations", "config", "prompts", "baseline_from", "vary_seed", "plot"})
PHASE_FLAGS = frozenset(inspect.signature(command).parameters) - SHARED_FLAGS - EFFICIENCY_FLAGS


def _refuse_flags(arguments: dict[str, Any], allowed: frozenset[str], why: str) -> None:
    """A usage error for every flag outside ``allowed`` set to something other than its default."""

    parameters = inspect.signature(command).parameters
    stray = [
        name
        for name, value in arguments.items()
        if name in parameters and name not in allowed and value != parameters[name].default
    ]
    if stray:
        flags = ", ".join(_flag(name) for name in stray)
        raise UsageError(f"{flags}: {why}")


def _flag(name: str) -> str:
    return {"json_output": "--json", "compile_model": "--compile"}.get(name, "--" + name.replace("_", "-"))


def _run_efficiency(
    algorithms: str,
    iterations: int,
    repeats: int,
    config: str,
    text_tokens: int,
    seed: int,
    device: str,
    json_output: bool,
    vary_seed: bool = False,
    plot: str | None = None,
    prompts: str | None = None,
    baseline_from: str | None = None,
) -> None:
    cfg = EfficiencyConfig(
        algorithms=parse_algorithms(algorithms),
        iterations=iterations,
        repeats=repeats,
        config=config,
        text_tokens=text_tokens,
        seed=seed,
        device=None if device == "auto" else device,
        vary_seed=vary_seed,
        prompts=prompts,
        baseline_from=baseline_from,
    ).validate()
    if plot is not None:
        _check_plot(cfg, Path(plot))
    document = run_efficiency(cfg, log=lambda line: err_console.print(line, highlight=False, markup=False))
    if plot is not None:
        from fluxgrpo.bench.heldout_plot import heldout_png

        Path(plot).write_bytes(heldout_png(document))
        err_console.print(f"wrote {plot}", highlight=False, markup=False)
    if json_output:
        print_json(document)
    else:
        _render_efficiency(document)


def _check_plot(cfg: EfficiencyConfig, path: Path) -> None:
    """Before anything trains: the runs will evaluate, matplotlib is there, and the PNG's folder exists."""

    if not trains_in_the_world(cfg.config, cfg.base_overrides):
        raise UsageError(
            f"--plot draws the held-out score, and --config {cfg.config} does not evaluate in the bench: "
            "use --config shapes-cpu (or another shapes config), or drop --plot"
        )
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot draws with matplotlib: pip install 'fluxgrpo[report]', or drop --plot") from None
    if not path.parent.is_dir():
        raise UsageError(f"--plot {path}: the folder {path.parent} does not exist")


def _render_efficiency(document: dict[str, Any]) -> None:
    console = out_console if out_console.is_terminal else Console(width=160)
    settings = document["config"]["training"]
    repeats = document["config"]["repeats"]
    runs = "1 run" if repeats == 1 else f"{repeats} runs in interleaved rounds"
    console.print(
        f"[bold]fluxgrpo bench --algorithms[/]: {document['config']['iterations']} iterations each, {runs}, "
        f"--config {escape(document['config']['config'])} ({settings['height']}x{settings['width']}, "
        f"{settings['sampling_steps']} steps, G {settings['num_generations']}, reward {escape(settings['reward'])}, "
        f"{document['config']['text_tokens']} text tokens) on {settings['device']}; × = ratio to {BASELINE}",
        highlight=False,
    )
    reused = next((row for row in document["algorithms"] if row.get("baseline_from")), None)
    if reused is not None:
        from fluxgrpo.bench.baseline_probe import speed_note

        speed = speed_note(document["config"].get("baseline_probe"))
        console.print(
            f"{BASELINE}'s row is from {reused['baseline_from']} (--baseline-from: the same settings, not trained "
            f"again; its times were measured in that run): {speed}",
            highlight=False,
            markup=False,
        )
    # (header, cell); the spread and the verdict need repeats: with one run the table is the single-run one.
    columns: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("algorithm", lambda row: row["algorithm"]),
        ("trained", lambda row: str(row["trained_timesteps"])),
        ("calls", lambda row: str(row["rollout_model_calls"])),
        ("s/iter", lambda row: f"{row['seconds_per_iteration']:.3g}"),
        ("min–max", _spread),
        ("×", lambda row: _ratio(row["seconds_per_iteration_ratio"])),
        (f"vs {BASELINE}", lambda row: row["time_verdict"] or "-"),
        ("rollout s", lambda row: f"{row['phase_seconds']['rollout']:.3g}"),
        ("update s", lambda row: f"{row['phase_seconds']['update']:.3g}"),
        ("reward first→last", lambda row: f"{row['reward_first']:.4f}→{row['reward_last']:.4f}"),
        ("gain", lambda row: f"{row['reward_gain']:.3g}" + ("" if row["rewards_identical"] else " [red]![/]")),
        ("gain min–max", lambda row: "{:.3g}–{:.3g}".format(*row["reward_gain_spread"])),
        ("×", lambda row: _ratio(row["reward_gain_ratio"])),
        ("gain/s", lambda row: f"{row['reward_gain_per_second']:.3g}"),
        ("×", lambda row: _ratio(row["reward_gain_per_second_ratio"])),
    ]
    rows = document["algorithms"]
    varied = document["config"].get("vary_seed", False)
    keep = [
        column
        for column in columns
        if (repeats > 1 or column[0] not in ("min–max", f"vs {BASELINE}")) and (varied or column[0] != "gain min–max")
    ]
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for index, (header, _) in enumerate(keep):
        table.add_column(header, justify="left" if index == 0 else "right", no_wrap=True)
    for row in rows:
        table.add_row(*(cell(row) for _, cell in keep))
    console.print(table)
    median = "median of rollout + decode/reward + update"
    if repeats > 1:
        median += (
            f" per run, then the median over the {repeats} runs; min–max: over the runs; vs {BASELINE}: faster or "
            f"slower where every run was faster or slower than every run of {BASELINE}, else within noise"
        )
    console.print(
        "trained: transitions trained per trajectory; calls: transformer forwards per trajectory in a rollout; "
        f"s/iter: {median}; gain: rise of the least-squares line through the iterations' mean rewards; gain/s: "
        "gain over s/iter × iterations",
        highlight=False,
    )
    _render_heldout_and_work(console, rows, repeats)
    for row in rows:
        if not row["rewards_identical"]:
            gains = ", ".join(f"{gain:.4g}" for gain in row["reward_gain_runs"])
            console.print(
                f"[red]![/] {escape(row['algorithm'])}: the rewards differ between its runs (gains {gains}): training "
                "was not deterministic, so its gain is their median",
                highlight=False,
            )


def _reached_baseline_final(row: dict[str, Any]) -> str:
    if row["algorithm"] == BASELINE or row.get("heldout_gain") is None:
        return "-"
    if row.get("seconds_to_baseline_final") is None:
        return "not reached"
    share = row["time_to_baseline_final_ratio"]
    reached = f"it {row['iteration_to_baseline_final']}, {row['seconds_to_baseline_final']:.0f} s ({share:.0%})"
    # A document from before the field was added has no `held_baseline_final`: say only when it was reached.
    return reached + (", then fell below" if row.get("held_baseline_final") is False else "")


def _render_heldout_and_work(console: Console, rows: list[dict[str, Any]], repeats: int) -> None:
    """The held-out gain (with evaluation on) and the work per iteration, one row per algorithm."""

    reward = next((row["heldout_reward"] for row in rows if row.get("heldout_gain") is not None), None)
    counted = any(row.get("work_per_iteration") for row in rows)
    if reward is None and not counted:
        return
    columns: list[tuple[str, Callable[[dict[str, Any]], str]]] = [("algorithm", lambda row: row["algorithm"])]
    if reward is not None:

        def measured(cell: Callable[[dict[str, Any]], str]) -> Callable[[dict[str, Any]], str]:
            return lambda row: "-" if row.get("heldout_gain") is None else cell(row)

        columns += [
            (f"held-out {reward} first→last", measured(lambda r: f"{r['heldout_first']:.4f}→{r['heldout_last']:.4f}")),
            ("gain", measured(lambda r: f"{r['heldout_gain']:+.4f}")),
            ("gain min–max", measured(lambda r: "{:+.4f}–{:+.4f}".format(*r["heldout_gain_spread"]))),
            (f"vs {BASELINE}", lambda r: r.get("heldout_verdict") or "-"),
            ("gain/s", measured(lambda r: f"{r['heldout_gain_per_second']:.3g}")),
            (f"{BASELINE}'s final at", _reached_baseline_final),
        ]
        if repeats < 2:
            columns = [c for c in columns if c[0] not in ("gain min–max", f"vs {BASELINE}")]
    if counted:

        def work(key: str) -> Callable[[dict[str, Any]], str]:
            return lambda r: "-" if not r.get("work_per_iteration") else f"{r['work_per_iteration'][key]:.4g}"

        columns += [("forwards/it", work("forwards")), ("backwards/it", work("backwards"))]
        columns.append(("optimizer steps/it", work("optimizer_steps")))
        if reward is not None:
            per_work = "heldout_gain_per_kilo_forward_equivalent"
            columns.append(("gain/1k fwd-eq", lambda r: "-" if r.get(per_work) is None else f"{r[per_work]:.3g}"))
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for index, (header, _) in enumerate(columns):
        table.add_column(header, justify="left" if index == 0 else "right", no_wrap=True)
    for row in rows:
        table.add_row(*(cell(row) for _, cell in columns))
    console.print(table)
    notes = []
    if reward is not None:
        notes.append(
            f"held-out: eval_{reward}_mean on the held-out prompts, last evaluation − iteration 0's (median over the "
            f"runs); vs {BASELINE}: better or worse where every run's gain was above or below every run of "
            f"{BASELINE}'s, else within noise; gain/s: over s/iter × iterations; {BASELINE}'s final at: the first "
            f"evaluation where the median score reached {BASELINE}'s final median, its seconds of training and their "
            f"share of {BASELINE}'s run ('not reached' within the evaluations)"
        )
    if counted:
        notes.append(
            "forwards, backwards: images through the transformer per iteration (rollout, update, reference and "
            "drift probe; not the held-out evaluation); optimizer steps per iteration"
            + (
                "; gain/1k fwd-eq: the held-out gain per 1,000 forward-equivalents (a backward counts as 2 forwards)"
                if reward is not None
                else ""
            )
        )
    console.print("; ".join(notes), highlight=False, markup=False)


def _spread(row: dict[str, Any]) -> str:
    low, high = row["seconds_per_iteration_spread"]
    return f"{low:.3g}–{high:.3g}"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _bytes(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f} GiB" if value >= 2**28 else f"{value / 2**20:.1f} MiB"


def _ratio(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _phase(figure: dict[str, Any]) -> str:
    checkpointing = figure["activation_checkpointing"]
    return figure["phase"] + ("" if checkpointing is None else (" ckpt" if checkpointing else " no-ckpt"))


def _render_compile(console: Console, records: list[dict[str, Any]]) -> None:
    """The --compile comparison: one row per mode, then the regional/whole-model compile-time ratio."""

    rows = [r for r in records if r["record"] == "compile"]
    summary = next((r for r in records if r["record"] == "compile_summary"), None)
    if not rows or summary is None:
        return
    first = rows[0]
    table = Table(
        title=f"torch.compile, {first['resolution']}: one iteration (rollout batch {first['rollout_batch_size']}, "
        f"micro-batch {first['micro_batch_size']}, checkpointing {'on' if first['activation_checkpointing'] else 'off'})"
        f", modes interleaved in each of {summary['repeats']} rounds",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    for index, header in enumerate(
        ("mode", "compile s", "graphs", "s/iter", "×", "break-even iter", "rel |Δ x̂0|", "|log ρ|")
    ):
        table.add_column(header, justify="left" if index == 0 else "right", no_wrap=True)
    for row in rows:
        compiled = row["mode"] != "eager"
        table.add_row(
            row["mode"],
            _seconds(row["compile_seconds"]) if compiled else "-",
            str(row["compiles"]) if compiled else "-",
            _seconds(row["iteration_seconds"]),
            _ratio(row["speedup"]),
            _ratio(row["break_even_iterations"], 1) if compiled else "-",
            f"{row['max_relative_x0_difference']:.1e}" if compiled else "-",
            f"{row['max_abs_log_ratio']:.0e}",
        )
    console.print(table)
    ratio = summary["regional_over_whole_model_compile_seconds"]
    console.print(
        f"regional compile time = {_ratio(ratio)} × whole-model's; recompiles in the timed rounds: "
        f"{summary['recompiles_in_timed_rounds']}; break-even: compile s ÷ s saved per iteration (- saves nothing)",
        highlight=False,
    )


def _render(records: list[dict[str, Any]]) -> None:

    # A pipe or a CI log has no width of its own: do not squeeze the table into rich's 80-column default.
    console = out_console if out_console.is_terminal else Console(width=160)

    device = next(r for r in records if r["record"] == "device")
    model = next(r for r in records if r["record"] == "model")
    config = next(r for r in records if r["record"] == "config")
    peak = device["peak_source"]
    if device["peak_tflops"]:
        peak = f"{device['peak_tflops']:g} TFLOPS ({peak})"
    console.print(
        f"[bold]fluxgrpo bench[/]: {model['name']} ({model['double_blocks']}+{model['single_blocks']} blocks, width "
        f"{model['hidden']}, {model['transformer_parameters'] / 1e6:.1f} M parameters), {config['dtype']} on "
        f"{device['type']} × {device['world_size']} ({escape(device['name'])}); peak {peak}\n"
        f"B = {model['trajectories']} trajectories, N = {model['steps']} steps, T = {model['train_timesteps']} trained "
        f"timesteps, {model['text_tokens']} text tokens, reward {model['reward']}; median of {config['repeats']} runs",
        highlight=False,
    )
    _render_compile(console, records)
    figures = [r for r in records if r["record"] == "figure"]
    console.print(
        "rate: images/s (rollout, decode, reward), trained samples/s (update), steps/s (optimizer); "
        "× = rate over the same phase's rate at its smallest batch size",
        highlight=False,
    )
    for summary in (r for r in records if r["record"] == "summary"):
        _render_resolution(console, summary, [f for f in figures if f["resolution"] == summary["resolution"]])


def _render_resolution(console: Console, summary: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """One resolution: its table of measured rows, then the whole iteration and what checkpointing saves."""

    # (header, cell); a column that is empty in every row (MFU and memory on cpu) is left out.
    columns: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("phase", _phase),
        ("batch", lambda f: str(f["batch_size"] or "-")),
        (
            "seconds",
            lambda f: _seconds(f["seconds"]) if f["seconds"] is not None else f"[red]{escape(f['error'])}[/]",
        ),
        ("rate", lambda f: _seconds(f["per_second"])),
        ("×", lambda f: _ratio(f["speedup"])),
        ("TFLOP/s", lambda f: "-" if f["tflops"] is None else f"{f['tflops']:.3g}"),
        ("MFU", lambda f: "-" if f["mfu"] is None else f"{f['mfu']:.1%}"),
        ("peak mem", lambda f: _bytes(f["peak_memory_bytes"])),
        ("act mem", lambda f: _bytes(f["activation_bytes"])),
        ("|log ρ|", lambda f: "-" if f["max_abs_log_ratio"] is None else f"{f['max_abs_log_ratio']:.0e}"),
    ]
    cells = [[cell(f) for _, cell in columns] for f in rows]
    keep = [i for i in range(len(columns)) if i < 3 or any(row[i] != "-" for row in cells)]
    table = Table(
        title=f"{summary['resolution']}, {rows[0]['work'] if rows else 0} images per iteration",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    for i in keep:
        table.add_column(columns[i][0], justify="left" if i == 0 else "right", no_wrap=True)
    for row in cells:
        table.add_row(*(row[i] for i in keep))
    console.print(table)
    for it in summary["iterations"]:
        mode = "checkpointing on" if it["activation_checkpointing"] else "checkpointing off"
        same = it["smallest"]["batch_sizes"] == it["largest"]["batch_sizes"]
        for end in ("smallest",) if same else ("smallest", "largest"):
            part = it[end]
            shares = ", ".join(f"{phase} {share:.0%}" for phase, share in part["share"].items())
            sizes = ", ".join(f"{phase} {size}" for phase, size in part["batch_sizes"].items())
            console.print(
                f"iteration ({mode}; {sizes}): {part['seconds']:.3g} s, "
                f"{part['images_per_second']:.3g} images/s: {shares}",
                highlight=False,
            )
        if not same:
            console.print(
                f"iteration speed-up, largest vs smallest batches ({mode}): {it['speedup']:.2f}×", highlight=False
            )
    for size, saved in summary["activation_checkpointing_by_micro_batch"].items():
        savings = [f"{_bytes(saved['activation_bytes_saved'])} of activations held for backward"]
        if saved["peak_memory_saved_bytes"] is not None:
            savings.insert(0, f"{_bytes(saved['peak_memory_saved_bytes'])} of peak memory")
        console.print(
            f"activation checkpointing at micro-batch {size}: saves {' and '.join(savings)}; update "
            f"time × {_ratio(saved['time_ratio_on_over_off'])}",
            highlight=False,
        )
