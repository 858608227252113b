"""The device half of ``env-check``: accelerators, backends, torch_npu/CANN, NPU environment variables.

Never raises: a broken accelerator stack is exactly what a user runs env-check to explain.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from typing import Any

from fluxgrpo.runtime import device as rt_device
from fluxgrpo.runtime.npu_env import NPU_ENV_DEFAULTS, NPU_ENV_INFORMATIONAL, apply_npu_env_defaults

AUTOLOAD_ENV = "TORCH_DEVICE_BACKEND_AUTOLOAD"


def guard_torch_import() -> None:
    """Keep a broken torch_npu from breaking ``import torch`` in this process and its workers, and set the NPU
    environment defaults before torch_npu first loads.

    torch ≥ 2.5 auto-loads installed device backends on ``import torch``; with torch-npu installed and CANN
    missing that import raises. We import torch_npu ourselves, inside a try (``device.npu_import_status``),
    so automatic loading is switched off unless the user chose a value.
    """
    if importlib.util.find_spec("torch_npu") is None:
        return
    if AUTOLOAD_ENV not in os.environ:
        os.environ[AUTOLOAD_ENV] = "0"
    # torch_npu reads its variables when it initialises, so the recipe's defaults must be in place before the
    # first import, in this process and in every worker it starts (the user's own values win).
    apply_npu_env_defaults()


def _npu_section() -> dict[str, Any]:
    status = rt_device.npu_import_status()
    section: dict[str, Any] = {
        "torch_npu_installed": status.installed,
        "torch_npu_importable": status.importable,
        "torch_npu_version": status.version,
        "torch_npu_error": status.error,
        "cann_version": None,
        "explanation": None,
    }
    try:
        from fluxgrpo.runtime import cann

        extra = cann.npu_runtime_report()
        section["cann_version"] = extra.get("cann_version")
        section["torch_npu_version"] = section["torch_npu_version"] or extra.get("torch_npu_version")
        if extra.get("explanation"):
            section["explanation"] = extra["explanation"]
    except Exception as exc:  # the report must never fail
        section["explanation"] = section["explanation"] or f"could not read CANN details: {exc}"
    if status.installed and not status.importable and not section["explanation"]:
        section["explanation"] = (
            f"torch-npu is installed but does not load ({status.error}). Usually CANN is missing or its "
            "set_env.sh was not sourced: `source /usr/local/Ascend/cann/set_env.sh` (or ascend-toolkit/set_env.sh). "
            f"Until then a plain `import torch` fails in other programs unless {AUTOLOAD_ENV}=0 "
            "(fluxgrpo sets it for itself)."
        )
    section["cann_for_torch_npu"] = None
    if status.installed:  # the CANN the wheel is built for, from Ascend's compatibility table
        from fluxgrpo.runtime.npu_versions import cann_note

        note = cann_note(section["torch_npu_version"], section["cann_version"])
        if note is not None:
            section["cann_for_torch_npu"] = {"detail": note[0], "mismatch": note[1]}
    return section


def device_report(requested: str | None = None) -> dict[str, Any]:
    """Device type that would be used, its backend, each device's memory, and the NPU stack state."""
    import torch

    report: dict[str, Any] = {
        "torch_version": torch.__version__,
        "torch_cuda_build": torch.version.cuda,
        "accelerator_stack": _npu_section(),
        "cuda_available": False,
        "available_types": [],
        "type": None,
        "backend": None,
        "count": 0,
        "devices": [],
        "error": None,
    }
    try:
        report["cuda_available"] = rt_device.cuda_available()
        report["available_types"] = rt_device.available_device_types()
        dtype = rt_device.resolve_device_type(requested)
        report["type"] = dtype
        report["backend"] = rt_device.backend_for(dtype)
        report["count"] = rt_device.device_count(dtype)
        report["devices"] = [
            {"index": d.index, "name": d.name, "total_bytes": d.total_bytes, "free_bytes": d.free_bytes}
            for d in rt_device.describe_devices(dtype)
        ]
    except Exception as exc:
        report["error"] = str(exc)
    return report


PACKAGES = (
    "torch",
    "torchvision",
    "torch-npu",
    "diffusers",
    "transformers",
    "open_clip_torch",
    "huggingface_hub",
    "modelscope",
    "modelscope-hub",
    "safetensors",
    "typer",
    "rich",
)


def package_versions() -> dict[str, str | None]:
    """Installed versions (None when absent), read from metadata without importing anything."""

    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def stack_warnings(dev: dict[str, Any]) -> list[tuple[str, str]]:
    """(detail, fix) for an accelerator stack that is installed but unusable."""
    stack = dev["accelerator_stack"]
    if stack["torch_npu_installed"] and not stack["torch_npu_importable"]:
        return [
            (
                stack["explanation"] or "torch-npu does not load",
                "source CANN's set_env.sh, or `pip uninstall torch-npu` on machines without one",
            )
        ]
    return []


CANN_PAIRING_CHECK = "torch-npu / CANN"


def cann_pairing_check(dev: dict[str, Any]) -> tuple[str, str, str, str | None] | None:
    """(check name, status, detail, fix) of the installed torch-npu against the CANN it needs; None without one."""
    pairing = dev["accelerator_stack"].get("cann_for_torch_npu")
    if not pairing:
        return None
    if pairing["mismatch"]:
        fix = "install the matched set: torch X.Y.Z, torch-npu X.Y.Z[.postN] and its CANN"
        return CANN_PAIRING_CHECK, "warn", pairing["detail"], fix
    return CANN_PAIRING_CHECK, "ok", pairing["detail"], None


def accelerator_env_report() -> list[dict[str, Any]]:
    """Each recommended NPU variable (value or None, and what we would set) and the informational ones."""
    rows = [
        {"name": v.name, "value": os.environ.get(v.name), "recommended": v.recommended, "purpose": v.purpose}
        for v in NPU_ENV_DEFAULTS
    ]
    rows += [
        {"name": name, "value": os.environ.get(name), "recommended": None, "purpose": "cluster-specific; not set by us"}
        for name in NPU_ENV_INFORMATIONAL
    ]
    return rows
