"""``fluxgrpo env-check``: the report a user pastes into a bug, and the answer to "could training start?".

The report is one dict with stable keys (printed as JSON with ``--json``); ``checks`` lists each condition
with status ``ok`` / ``warn`` / ``fail`` and, when not ok, the command or flag that fixes it. Training
could start exactly when no check fails.

Reward weights come from the reward registry (``rewards.reward_names`` / ``reward_weights_status``), so a new reward
is reported with no change here. Each weights part is checked once, however many rewards read it (``clip`` serves
hpsv2 and clipscore), and says which rewards need it. Parts the run's ``--reward`` needs fail when missing; the
other rewards' parts only warn.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fluxgrpo import __version__, rewards
from fluxgrpo.config import TrainConfig, build_config
from fluxgrpo.errors import UsageError
from fluxgrpo.paths import DEFAULT_EMBEDDINGS_DIR, DEFAULT_FLUX_DIR, DEFAULT_HPS_DIR, EMBEDDINGS_INDEX
from fluxgrpo.rewards.reward_set import reward_spec_names, run_reward_names
from fluxgrpo.runtime.report import (
    accelerator_env_report,
    cann_pairing_check,
    device_report,
    package_versions,
    stack_warnings,
)
from fluxgrpo.weights.layout import PartStatus, check_flux_dir

# torchrun workers exchange tensors through shared memory; containers often default to 64 MiB.
MIN_SHM_BYTES = 1 << 30


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail
    detail: str
    fix: str | None = None


def embeddings_status(embeddings_dir: str | Path) -> dict[str, Any]:
    """Cheap completeness check of a DanceGRPO-layout embeddings folder (files exist; contents not loaded)."""
    root = Path(embeddings_dir)
    index = root / EMBEDDINGS_INDEX
    status: dict[str, Any] = {"path": str(index), "complete": False, "prompts": 0, "problems": []}
    if not index.is_file():
        status["problems"].append(f"{index} not found")
        return status
    try:
        entries = json.loads(index.read_text())
    except ValueError as exc:
        status["problems"].append(f"{index} is not valid JSON ({exc})")
        return status
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        status["problems"].append(f"{index} is not a list of prompt entries (DanceGRPO's videos2caption.json layout)")
        return status
    files = (
        ("prompt_embed", "prompt_embed_path"),
        ("pooled_prompt_embeds", "pooled_prompt_embeds_path"),
        ("text_ids", "text_ids"),
    )
    needed = [key for _, key in files] + ["caption"]
    malformed = [i for i, e in enumerate(entries) if not all(isinstance(e.get(key), str) for key in needed)]
    if malformed:
        status["problems"].append(
            f"{index} is malformed: {len(malformed)} of {len(entries)} entries lack one of {', '.join(needed)} "
            f"(the first is entry {malformed[0]})"
        )
        return status
    missing = 0
    first_missing = None
    for position, entry in enumerate(entries):
        for folder, key in files:
            name = entry[key]
            if name in ("", ".", "..") or Path(name).name != name or "\\" in name:  # outside, whether it exists or not
                status["problems"].append(
                    f"{index} entry {position} names {name!r} for {key}, which is not a file in {root / folder}: an "
                    "index lists only the files beside it"
                )
                return status
            path = root / folder / name
            if not path.is_file():
                missing += 1
                first_missing = first_missing or path
    status["prompts"] = len(entries)
    if not entries:
        status["problems"].append(f"{index} lists no prompts")
    if missing:
        status["problems"].append(f"{missing} embedding file(s) missing, e.g. {first_missing}")
    status["complete"] = not status["problems"]
    return status


@dataclass
class WeightsPart:
    """One weights part as env-check reports it: its status, which rewards read it, and whether the run needs it."""

    status: PartStatus
    used_by: list[str]  # reward names, in registry order; [] for flux
    run_uses: list[str]  # those of ``used_by`` that the run's --reward names
    always_needed: bool = False  # flux: every run needs it

    @property
    def required(self) -> bool:
        return self.always_needed or bool(self.run_uses)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self.status), "used_by": self.used_by, "required": self.required}

    def check(self) -> Check:
        part, name = self.status, f"weights: {self.status.name}"
        if part.complete:
            detail = f"{part.path} ({part.source or 'placed by hand'})"
            return Check(name, "ok", f"{detail}; read by {', '.join(self.used_by)}" if self.used_by else detail)
        problems = "; ".join(part.problems)
        if self.always_needed:
            return Check(name, "fail", problems, part.fix)
        if self.run_uses:
            return Check(name, "fail", f"{problems}; this run's reward {', '.join(self.run_uses)} needs it", part.fix)
        # Another reward's weights: this run can start without them.
        return Check(name, "warn", f"{problems}; only {_reward_flags(self.used_by)} needs it", part.fix)


def _reward_flags(names: list[str]) -> str:
    return " or ".join(f"--reward {name}" for name in names)


def weights_parts(flux_dir: str | Path, hps_dir: str | Path, run_rewards: list[str]) -> list[WeightsPart]:
    """FLUX, then every reward's weights parts in registry order, each part once however many rewards read it."""
    parts = [WeightsPart(check_flux_dir(flux_dir), [], [], always_needed=True)]
    by_name: dict[str, WeightsPart] = {}
    for reward in rewards.reward_names():
        for status in rewards.reward_weights_status(reward, hps_dir):
            part = by_name.get(status.name)
            if part is None:
                part = by_name[status.name] = WeightsPart(status, [], [])
                parts.append(part)
            part.used_by.append(reward)
            if reward in run_rewards:
                part.run_uses.append(reward)
    return parts


def rewards_report(parts: list[WeightsPart], run_rewards: list[str]) -> dict[str, dict[str, Any]]:
    """reward → the weights parts it reads, whether they are all in place, and whether this run uses it."""
    report = {}
    for reward in rewards.reward_names():
        reads = [part.status for part in parts if reward in part.used_by]
        report[reward] = {
            "weights": [status.name for status in reads],
            "ready": all(status.complete for status in reads),
            "in_run": reward in run_rewards,
        }
    return report


def _disk(path: Path) -> dict[str, Any]:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    usage = shutil.disk_usage(probe)
    return {"path": str(path), "free_bytes": usage.free, "total_bytes": usage.total}


def _shm() -> dict[str, Any]:
    if not os.path.isdir("/dev/shm"):
        return {"path": "/dev/shm", "total_bytes": None, "free_bytes": None}
    usage = shutil.disk_usage("/dev/shm")
    return {"path": "/dev/shm", "total_bytes": usage.total, "free_bytes": usage.free}


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def collect_report(
    flux_dir: str | Path = DEFAULT_FLUX_DIR,
    hps_dir: str | Path = DEFAULT_HPS_DIR,
    embeddings_dir: str | Path = DEFAULT_EMBEDDINGS_DIR,
    data_dir: str | Path = "data",
    requested_device: str | None = None,
    reward: str = TrainConfig.reward,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    run: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything env-check shows, as a JSON-able dict with stable keys.

    ``reward`` is the run's ``--reward`` spec: the weights of the rewards it names must be in place (a failing
    check), the other rewards' are reported as warnings. A spec that does not parse is a UsageError.
    ``nnodes`` / ``rdzv_endpoint``: the multi-node checks (``runtime.nodes.rendezvous_checks``).
    ``run`` (``run_to_check``): the run a ``--config`` starts, judged instead of a bare ``--reward``: every reward
    it loads (its evaluation's too) and its ``--dies`` workers on this machine.
    """
    from fluxgrpo.runtime.nodes import rendezvous_checks

    run_rewards = list(run["rewards"]) if run else reward_spec_names(reward)
    dev = device_report(requested_device)
    parts = weights_parts(flux_dir, hps_dir, run_rewards)
    emb = embeddings_status(embeddings_dir)
    report: dict[str, Any] = {
        "fluxgrpo_version": __version__,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "packages": package_versions(),
        "device": dev,
        "accelerator_env": accelerator_env_report(),
        "reward": reward,
        "run": run,
        "weights": {part.status.name: part.to_dict() for part in parts},
        "rewards": rewards_report(parts, run_rewards),
        "embeddings": emb,
        "disk": _disk(Path(data_dir)),
        "shm": _shm(),
    }
    checks = [
        _device_check(dev),
        *([_dies_check(dev, run["dies"])] if run and dev["type"] else []),
        *[part.check() for part in parts],
        Check(
            "embeddings",
            "ok" if emb["complete"] else "fail",
            f"{emb['prompts']} prompts in {emb['path']}" if emb["complete"] else "; ".join(emb["problems"]),
            None if emb["complete"] else f"run `fluxgrpo preprocess --model {flux_dir} --out {embeddings_dir}`",
        ),
    ]
    shm = report["shm"]
    if shm["total_bytes"] is not None and shm["total_bytes"] < MIN_SHM_BYTES:
        checks.append(
            Check(
                "shared memory",
                "warn",
                f"/dev/shm is {_gib(shm['total_bytes'])}",
                "multi-worker runs may fail: start the container with --shm-size=16g or more",
            )
        )
    else:
        checks.append(Check("shared memory", "ok", f"/dev/shm {_gib(shm['total_bytes'])}"))
    checks.append(Check("disk", "ok", f"{_gib(report['disk']['free_bytes'])} free at {report['disk']['path']}"))
    checks += [Check("accelerator stack", "warn", detail, fix) for detail, fix in stack_warnings(dev)]
    pairing = cann_pairing_check(dev)  # the accelerator wheel against the runtime release it is built for
    if pairing is not None:
        checks.append(Check(*pairing))
    # several nodes: node 0's rendezvous endpoint and the interface the backends will talk through
    checks += [Check(*check) for check in rendezvous_checks(dev["type"], nnodes, rdzv_endpoint)]
    report["checks"] = [asdict(c) for c in checks]
    report["ready"] = all(c.status != "fail" for c in checks)
    return report


def _device_check(dev: dict[str, Any]) -> Check:
    if dev["error"]:
        return Check("device", "fail", dev["error"], "run with --device cpu, or fix the accelerator stack above")
    names = ", ".join(sorted({d["name"] for d in dev["devices"]}))
    return Check("device", "ok", f"{dev['type']} × {dev['count']} ({names}), backend {dev['backend']}")


def run_to_check(config: str, dies: int | None) -> dict[str, Any]:
    """What ``train --config config [--dies N]`` would load and start: its name, rewards, workers and folders."""

    cfg = build_config(config, {"dies": dies} if dies is not None else None)
    return {
        "config": config,
        "dies": cfg.dies,
        "device": cfg.device,
        "rewards": run_reward_names(cfg.reward, cfg.eval_rewards, cfg.eval_every),
        "flux_dir": cfg.model,
        "hps_dir": cfg.hps_dir,
        "embeddings_dir": str(Path(cfg.data_json_path).parent),
    }


def run_label(report: dict[str, Any]) -> str:
    """How the verdict names the run it judged: ``--config NAME --dies N`` or ``--reward SPEC``."""
    run = report.get("run")
    if not run:
        return f"--reward {report['reward']}"
    return f"--config {run['config']} --dies {run['dies']}: {', '.join(run['rewards'])}"


def _dies_check(dev: dict[str, Any], dies: int) -> Check:
    """The run's workers on this machine: a CPU core or an accelerator each."""
    from fluxgrpo.runtime.cpu_threads import available_cores
    from fluxgrpo.runtime.launch import check_dies_fit

    try:
        check_dies_fit(dev["type"], dies)
    except UsageError as exc:
        return Check("workers", "fail", str(exc).split(":")[0], "pass a smaller --dies (train's and env-check's)")
    if dev["type"] == "cpu":
        return Check("workers", "ok", f"{dies} CPU worker(s) on {available_cores()} available core(s)")
    return Check("workers", "ok", f"{dies} worker(s) on {dev['count']} {dev['type']} device(s)")
