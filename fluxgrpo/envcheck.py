"""``fluxgrpo env-check``: the report a user pastes into a bug, and the answer to "could training start?".

The report is one dict with stable keys (printed as JSON with ``--json``); ``checks`` lists each condition
with status ``ok`` / ``warn`` / ``fail`` and, when not ok, the command or flag that fixes it. Training
could start exactly when no check fails.
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

from fluxgrpo import __version__
from fluxgrpo.paths import DEFAULT_EMBEDDINGS_DIR, DEFAULT_FLUX_DIR, DEFAULT_HPS_DIR, EMBEDDINGS_INDEX
from fluxgrpo.weights.layout import check_flux_dir, check_hps_dir, check_pickscore_dir, pickscore_dir

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
    for entry in entries:
        for folder, key in files:
            path = root / folder / entry[key]
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
) -> dict[str, Any]:
    """Everything env-check shows, as a JSON-able dict with stable keys."""
    from fluxgrpo.runtime.report import accelerator_env_report, device_report, package_versions, stack_warnings

    dev = device_report(requested_device)
    flux = check_flux_dir(flux_dir)
    hps, clip = check_hps_dir(hps_dir)
    pick = check_pickscore_dir(pickscore_dir(hps_dir))
    emb = embeddings_status(embeddings_dir)
    report: dict[str, Any] = {
        "fluxgrpo_version": __version__,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "packages": package_versions(),
        "device": dev,
        "accelerator_env": accelerator_env_report(),
        "weights": {p.name: asdict(p) for p in (flux, hps, clip, pick)},
        "embeddings": emb,
        "disk": _disk(Path(data_dir)),
        "shm": _shm(),
    }
    checks = [
        _device_check(dev),
        *[
            Check(
                f"weights: {p.name}",
                "ok" if p.complete else "fail",
                f"{p.path} ({p.source or 'placed by hand'})" if p.complete else "; ".join(p.problems),
                p.fix,
            )
            for p in (flux, hps, clip)
        ],
        # Only `--reward pickscore` needs these weights, so their absence is a warning.
        Check(
            "weights: pickscore",
            "ok" if pick.complete else "warn",
            f"{pick.path} ({pick.source or 'placed by hand'})" if pick.complete else "; ".join(pick.problems),
            pick.fix,
        ),
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
    report["checks"] = [asdict(c) for c in checks]
    report["ready"] = all(c.status != "fail" for c in checks)
    return report


def _device_check(dev: dict[str, Any]) -> Check:
    if dev["error"]:
        return Check("device", "fail", dev["error"], "run with --device cpu, or fix the accelerator stack above")
    names = ", ".join(sorted({d["name"] for d in dev["devices"]}))
    return Check("device", "ok", f"{dev['type']} × {dev['count']} ({names}), backend {dev['backend']}")
