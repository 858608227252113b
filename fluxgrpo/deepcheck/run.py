"""``env-check --deep``: the settings it runs with, and the run of every check in order."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fluxgrpo.deepcheck.kernels
from fluxgrpo import __version__
from fluxgrpo.bench.config import SHAPED_MODEL, TINY_MODEL
from fluxgrpo.config import SAMPLERS, build_config
from fluxgrpo.deepcheck.iteration import IterationSettings, run_iteration
from fluxgrpo.deepcheck.result import FAILED, PASSED, CheckResult, DeepReport, skipped
from fluxgrpo.deepcheck.rewards import check_rewards
from fluxgrpo.deepcheck.workers import LOAD_SLACK_BYTES, MIN_NOMINAL_FRACTION
from fluxgrpo.errors import UsageError
from fluxgrpo.models.shard_loading import transformer_weight_files
from fluxgrpo.paths import DEFAULT_FLUX_DIR, DEFAULT_HPS_DIR
from fluxgrpo.rewards import reward_names
from fluxgrpo.rewards.reward_set import reward_spec_names
from fluxgrpo.runtime import device as rt_device
from fluxgrpo.runtime import dist as rt_dist
from fluxgrpo.runtime.interconnect import nominal_bus_gbps
from fluxgrpo.runtime.launch import LaunchSpec, check_dies_fit, run_workers
from fluxgrpo.runtime.peak import accelerator_stack, device_name
from fluxgrpo.runtime.report import package_versions
from fluxgrpo.runtime.worker import quiet_library_progress
from fluxgrpo.weights.layout import check_flux_dir

if TYPE_CHECKING:
    from fluxgrpo.config import TrainConfig

DEFAULT_REPORT_FILE = "env-check-deep.json"
NOT_NODE_ZERO = "this node's workers took part; node 0 (--node-rank 0) reports every rank's figures"
# The flux-dev-shaped model's (double, single) blocks: few enough for one die's memory beside a ViT-H-14 reward.
SHAPED_BLOCKS = {"full": (4, 8), "quick": (1, 2)}
QUICK_SAMPLING_STEPS = 4
SHAPED_TEXT_TOKENS, TINY_TEXT_TOKENS = 512, 32
COLLECTIVE_BYTES = {"accelerator": {"full": 256 << 20, "quick": 32 << 20}, "cpu": {"full": 4 << 20, "quick": 1 << 20}}
QUICK_LOAD_LIMIT_BYTES = 4 << 30  # --quick reads the FLUX weights only below this (the tiny ones, not FLUX.1-dev)


@dataclass(frozen=True)
class DeepCheckSettings:
    """What ``env-check --deep`` was asked for (the CLI's flags)."""

    device: str = "auto"
    quick: bool = False
    config: str | None = None  # a train config (shipped name or YAML path); None: tiny-cpu on cpu, defaults else
    flux_dir: str = DEFAULT_FLUX_DIR
    hps_dir: str = DEFAULT_HPS_DIR
    reward: str = "hpsv2"  # --quick checks these rewards; the full run every reward with weights
    dies: int | None = None  # None: every visible accelerator (2 workers on a cpu with 2 cores)
    report_file: str = DEFAULT_REPORT_FILE
    nnodes: int = 1  # the collectives and loading span this many nodes (the same command on each)
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None

    @property
    def mode(self) -> str:
        return "quick" if self.quick else "full"


def _train_config(settings: DeepCheckSettings, device_type: str) -> TrainConfig:
    name = settings.config or ("tiny-cpu" if device_type == "cpu" else None)
    # A folder left at its default does not override the one a --config names.
    overrides = {
        key: value
        for key, value, default in (
            ("model", settings.flux_dir, DEFAULT_FLUX_DIR),
            ("hps_dir", settings.hps_dir, DEFAULT_HPS_DIR),
        )
        if settings.config is None or value != default
    }
    return build_config(name, overrides)


def _dies(settings: DeepCheckSettings, device_type: str) -> int:
    if settings.dies is not None:
        if settings.dies < 1:
            raise UsageError(f"--dies {settings.dies} must be at least 1")
        return settings.dies
    if device_type == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return min(2, cores)
    return max(1, rt_device.device_count(device_type))


def _iteration_settings(settings: DeepCheckSettings, cfg: TrainConfig, device_type: str) -> IterationSettings:
    on_cpu = device_type == "cpu"
    return IterationSettings(
        model=TINY_MODEL if on_cpu else SHAPED_MODEL,
        blocks=None if on_cpu else SHAPED_BLOCKS[settings.mode],
        height=cfg.height,
        width=cfg.width,
        sampling_steps=min(cfg.sampling_steps, QUICK_SAMPLING_STEPS) if settings.quick else cfg.sampling_steps,
        rollout_batch_size=cfg.rollout_batch_size,
        micro_batch_size=cfg.train_micro_batch_size,
        text_tokens=TINY_TEXT_TOKENS if on_cpu else SHAPED_TEXT_TOKENS,
        samplers=SAMPLERS,
        eta=cfg.eta,
        guidance=cfg.guidance,
        shift=cfg.shift,
        clip_range=cfg.clip_range,
        max_grad_norm=cfg.max_grad_norm,
        gradient_checkpointing=cfg.gradient_checkpointing,
        attention=cfg.attention,
        timestep_fraction=cfg.timestep_fraction,
        # --quick spares the minute a random ViT-H-14 takes to build; the memory estimate counts the reward loaded
        reward_model="tiny-clip" if settings.quick else "auto",
        seed=cfg.seed,
    )


def _environment(
    settings: DeepCheckSettings, cfg: TrainConfig, device_type: str, device_name: str, dies: int
) -> dict[str, Any]:
    return {
        "fluxgrpo": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": package_versions(),
        "accelerator": accelerator_stack(device_type),
        "device_type": device_type,
        "device_name": device_name,
        "dies": dies,
        "nnodes": settings.nnodes,
        "node_rank": settings.node_rank,
        "mode": settings.mode,
        "config": settings.config or ("tiny-cpu" if device_type == "cpu" else "defaults"),
        "flux_dir": cfg.model,
        "hps_dir": cfg.hps_dir,
        "reward_dtype": cfg.reward_dtype,
    }


DAMAGED_WEIGHTS = "damaged FLUX weights"  # how a load reason that fails the check (not skips it) begins


def _load_payload(settings: DeepCheckSettings, cfg: TrainConfig) -> tuple[dict[str, Any] | None, str | None]:
    """The train config the load check builds the transformer with, or why it does not run: weights that are
    absent skip it; weights that are there but damaged (a truncated shard) fail it, as `train` would refuse them."""

    status = check_flux_dir(cfg.model)
    if not status.complete:
        found = Path(cfg.model, "transformer").is_dir()
        what = f"{DAMAGED_WEIGHTS} at" if found else "no FLUX weights at"
        return None, f"{what} {cfg.model} ({'; '.join(status.problems)}); {status.fix or 'pass --flux-dir'}"
    size = sum(path.stat().st_size for path in transformer_weight_files(cfg.model))
    if settings.quick and size > QUICK_LOAD_LIMIT_BYTES:
        return None, f"--quick does not read {size / 2**30:.1f} GiB of FLUX weights; the full run does"
    return cfg.to_dict() | {"lora_rank": 0}, None


def _collective_results(summary: dict[str, Any] | None, world_size: int) -> CheckResult:
    rule = f"exact results; all-reduce ≥ {MIN_NOMINAL_FRACTION:.0%} of nominal where known"
    if summary is None:
        return skipped("collectives", rule, NOT_NODE_ZERO)
    ranks = summary["ranks"]
    join = max(rank["join_seconds"] for rank in ranks)
    if world_size == 1:
        return skipped(
            "collectives", rule, f"one process: nothing to exchange (process start {join:.2f} s); use --dies"
        )
    worst = {
        name: min(rank["collectives"][name]["bus_gbps"] for rank in ranks) for name in ("all_reduce", "all_gather")
    }
    exact = all(rank["collectives"][name]["exact"] for rank in ranks for name in ("all_reduce", "all_gather"))
    nominal, source = nominal_bus_gbps(summary["device_type"], summary["device_name"])
    measured = {
        "join_seconds": join,
        "first_barrier_seconds": max(rank["first_barrier_seconds"] for rank in ranks),
        "bus_gbps": worst,
        "bytes": ranks[0]["collectives"]["bytes"],
        "nominal_bus_gbps": nominal,
        "nominal_source": source,
        "per_rank": [rank["collectives"] for rank in ranks],
    }
    fraction = None if nominal is None else worst["all_reduce"] / nominal
    measured["fraction_of_nominal"] = fraction
    line = (
        f"{world_size} ranks, {measured['bytes'] / 2**20:.0f} MiB: all-reduce {worst['all_reduce']:.2f} GB/s, all-gather "
        f"{worst['all_gather']:.2f} GB/s bus; join {join:.2f} s, first barrier {measured['first_barrier_seconds']:.2f} s; "
        + (f"{fraction:.0%} of nominal" if fraction is not None else source)
    )
    if not exact:
        return CheckResult("collectives", FAILED, worst["all_reduce"], "GB/s", rule, "wrong results: " + line, measured)
    if fraction is not None and fraction < MIN_NOMINAL_FRACTION:
        return CheckResult(
            "collectives", FAILED, worst["all_reduce"], "GB/s", rule,
            f"all-reduce below {MIN_NOMINAL_FRACTION:.0%} of nominal (check the interconnect, its variables): " + line,
            measured,
        )  # fmt: skip
    return CheckResult("collectives", PASSED, worst["all_reduce"], "GB/s", rule, line, measured, round(join, 3))


def _load_result(summary: dict[str, Any] | None, reason: str | None) -> CheckResult:
    rule = "all parameters read and finite; node host rise ≤ host-resident weights + one tensor per rank + 1 GiB"
    if reason is not None and reason.startswith(DAMAGED_WEIGHTS):
        return CheckResult("loading", FAILED, None, "", rule, reason)
    if reason is not None:
        return skipped("loading", rule, reason)
    if summary is None:
        return skipped("loading", rule, NOT_NODE_ZERO)
    loads = [rank["load"] | {"node": rank["node"]} for rank in summary["ranks"]]
    seconds = max(load["seconds"] for load in loads)
    # The busiest node's sum over its ranks, against what that node's ranks may hold.
    node_rise, allowed = None, 0
    for node in sorted({load["node"] for load in loads}):
        on_node = [load for load in loads if load["node"] == node]
        rises = [load["host"]["rise_bytes"] for load in on_node]
        node_allowed = (
            sum(load["host_resident_parameter_bytes"] + load["largest_tensor_bytes"] for load in on_node)
            + LOAD_SLACK_BYTES
        )
        if None not in rises and (node_rise is None or sum(rises) - node_allowed > node_rise - allowed):
            node_rise, allowed = sum(rises), node_allowed
    measured = {"seconds": seconds, "node_host_rise_bytes": node_rise, "allowed_bytes": allowed, "per_rank": loads}
    line = f"{len(loads)} rank(s): {seconds:.2f} s, busiest node's host rise " + (
        "unknown" if node_rise is None else f"{node_rise / 2**30:.2f} GiB (allowed {allowed / 2**30:.2f})"
    )
    if not all(load["materialised"] and load["finite"] for load in loads):
        return CheckResult(
            "loading", FAILED, seconds, "s", rule, "parameters left unread or not finite: " + line, measured
        )
    if node_rise is not None and node_rise > allowed:
        return CheckResult(
            "loading", FAILED, seconds, "s", rule, "more host memory than one copy of the weights: " + line, measured
        )
    return CheckResult("loading", PASSED, seconds, "s", rule, line, measured, round(seconds, 3))


def run_deep_check(settings: DeepCheckSettings, log: Callable[[str], None] = lambda line: None) -> DeepReport:
    """Run every check on this machine; the report is also written to ``settings.report_file``."""

    started = time.perf_counter()
    device_type = rt_device.resolve_device_type(settings.device)
    cfg = _train_config(settings, device_type)
    dies = _dies(settings, device_type)
    spec = LaunchSpec(
        nproc_per_node=dies,
        nnodes=settings.nnodes,
        node_rank=settings.node_rank,
        master_addr=settings.master_addr,
        master_port=settings.master_port,
    )
    spec.validate()  # before any check runs
    check_dies_fit(device_type, spec.nproc_per_node)  # the workers' refusal, said before minutes of checks
    reward_list = reward_spec_names(settings.reward) if settings.quick else reward_names()
    load_config, load_reason = _load_payload(settings, cfg)
    ctx = rt_dist.init_distributed(settings.device)
    environment = _environment(settings, cfg, device_type, device_name(ctx.device), dies)
    checks: list[CheckResult] = []

    text_tokens = TINY_TEXT_TOKENS if device_type == "cpu" else SHAPED_TEXT_TOKENS
    log("kernels …")
    checks += fluxgrpo.deepcheck.kernels.check_kernels(ctx.device, cfg.height, cfg.width, text_tokens)
    log("one GRPO iteration per sampler at learning rate 0 …")
    checks += run_iteration(_iteration_settings(settings, cfg, device_type), ctx)
    rt_device.empty_cache(ctx.device)
    log("rewards …")
    with quiet_library_progress():  # the table says what loaded; no per-file bars
        checks += check_rewards(reward_list, cfg.hps_dir, ctx.device, cfg.reward_dtype)
    rt_device.empty_cache(ctx.device)
    log(f"collectives and loading on {spec.world_size} worker(s) …")
    payload = {
        "device": settings.device,
        "collective_bytes": COLLECTIVE_BYTES["cpu" if device_type == "cpu" else "accelerator"][settings.mode],
        "load": load_config,
    }
    summary = run_workers("fluxgrpo.deepcheck.workers", payload, spec, settings.device)
    checks.append(_collective_results(summary, spec.world_size))
    checks.append(_load_result(summary, load_reason))
    environment["collectives_and_loading_raw"] = summary
    report = DeepReport(environment, checks, round(time.perf_counter() - started, 2))
    write_report(report, settings.report_file)
    return report


def write_report(report: DeepReport, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report.to_dict(), indent=2, allow_nan=False) + "\n", encoding="utf-8")


def read_report(path: str | Path) -> DeepReport:
    return DeepReport.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))
