"""What the Ascend software stack and hardware are: the CANN install and version, whether torch_npu imports and
matches torch, the NPU environment variables, and each die's peak FLOPs. ``env-check`` and the bench report it.

This module imports without torch: with torch-npu installed and no CANN, ``import torch`` itself fails, and
``npu_runtime_report`` has to be able to say so.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from fluxgrpo.runtime.device import NpuImportStatus, npu_import_status
from fluxgrpo.runtime.npu_env import NPU_ENV_DEFAULTS, NPU_ENV_INFORMATIONAL

# --- environment report -------------------------------------------------------------------------------------

CANN_DEFAULT_HOMES = ("/usr/local/Ascend/cann", "/usr/local/Ascend/ascend-toolkit/latest")


def cann_home_candidates(environ: Mapping[str, str] | None = None) -> list[Path]:
    """Where CANN may live, in probe order: $ASCEND_HOME_PATH, $ASCEND_TOOLKIT_HOME (both set by set_env.sh),
    the 8.5+ and <= 8.3 root installs, then the same two under $HOME/Ascend (non-root installs)."""
    environ = os.environ if environ is None else environ
    candidates = [environ.get("ASCEND_HOME_PATH"), environ.get("ASCEND_TOOLKIT_HOME"), *CANN_DEFAULT_HOMES]
    if environ.get("HOME"):
        home = Path(environ["HOME"]) / "Ascend"
        candidates += [str(home / "cann"), str(home / "ascend-toolkit" / "latest")]
    seen: list[Path] = []
    for candidate in candidates:
        if candidate and Path(candidate) not in seen:
            seen.append(Path(candidate))
    return seen


def _read_key(path: Path, key: str) -> str | None:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        name, sep, value = line.partition("=")
        if sep and name.strip() == key and value.strip():
            return value.strip()
    return None


def read_cann_version(home: Path) -> tuple[str, Path] | None:
    """The CANN version recorded under one install directory, and the file it came from.

    ``<arch>-linux/ascend_toolkit_install.info`` (``version=8.3.RC1``) first, then any other
    ``ascend_*_install.info``, then the older ``version.cfg`` (``runtime_running_version=[7.3.0.1.231:8.0.RC2]``,
    i.e. [inner:public]).
    """
    if not home.is_dir():
        return None
    info_files = [
        *sorted(home.glob("ascend_toolkit_install.info")),
        *sorted(home.glob("*-linux/ascend_toolkit_install.info")),
        *sorted(home.glob("ascend_*_install.info")),
        *sorted(home.glob("*-linux/ascend_*_install.info")),
    ]
    for info in info_files:
        version = _read_key(info, "version")
        if version:
            return version, info
    version_cfg = home / "version.cfg"
    running = _read_key(version_cfg, "runtime_running_version")
    if running:
        match = re.fullmatch(r"\[?[^:\]]*:([^\]]+)\]?", running)
        return (match.group(1) if match else running), version_cfg
    return None


def find_cann_version(environ: Mapping[str, str] | None = None) -> tuple[str, Path] | None:
    """The first CANN version found over ``cann_home_candidates``; None when there is no install."""
    for home in cann_home_candidates(environ):
        found = read_cann_version(home)
        if found:
            return found
    return None


def _installed_torch_npu_version() -> str | None:
    for distribution in ("torch-npu", "torch_npu"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _release(version: str | None) -> str | None:
    match = re.match(r"\d+\.\d+\.\d+", version or "")
    return match.group(0) if match else None


def npu_runtime_report(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Everything env-check shows about the Ascend stack, as plain data; never raises.

    Keys: torch_npu_installed, torch_npu_importable, torch_npu_version, torch_npu_error, torch_version,
    cann_version, cann_version_source, devices ([{index, name, peak_tflops}]), env (the NPU variables as set),
    notes (what is wrong and what to do, one sentence each), explanation (the notes on why torch / torch_npu
    cannot be used, joined; None when nothing stands in the way).
    """
    environ = os.environ if environ is None else environ
    report: dict[str, Any] = {
        "torch_npu_installed": False,
        "torch_npu_importable": False,
        "torch_npu_version": None,
        "torch_npu_error": None,
        "torch_version": None,
        "cann_version": None,
        "cann_version_source": None,
        "devices": [],
        "env": {},
        "notes": [],
        "explanation": None,
    }
    notes: list[str] = report["notes"]
    try:
        _fill_runtime_report(report, environ)
    except Exception as exc:  # the report is for diagnosing broken installs: it must survive them
        notes.append(f"report incomplete ({type(exc).__name__}: {exc}); run with FLUXGRPO_DEBUG=1 to see more")
    return report


def _fill_runtime_report(report: dict[str, Any], environ: Mapping[str, str]) -> None:
    notes: list[str] = report["notes"]
    blockers: list[str] = []  # the notes that say why torch or torch_npu cannot run here

    def blocker(note: str) -> None:
        notes.append(note)
        blockers.append(note)
        report["explanation"] = " ".join(blockers)

    names = [var.name for var in NPU_ENV_DEFAULTS] + list(NPU_ENV_INFORMATIONAL)
    report["env"] = {name: environ.get(name) for name in names}

    try:
        import torch as torch_module

        report["torch_version"] = torch_module.__version__
    except Exception as exc:
        blocker(
            f"`import torch` fails ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). With "
            "torch-npu installed and CANN missing, torch autoloads torch_npu and fails: export "
            "TORCH_DEVICE_BACKEND_AUTOLOAD=0 to use torch without the NPU, or source CANN's set_env.sh"
        )

    status = npu_import_status()
    report["torch_npu_installed"] = status.installed
    report["torch_npu_importable"] = status.importable
    report["torch_npu_error"] = status.error
    report["torch_npu_version"] = status.version or _installed_torch_npu_version()
    torch_npu = importlib.import_module("torch_npu") if status.importable else None
    _fill_cann_version(report, torch_npu, environ)
    device_count_error = None if torch_npu is None else _fill_devices(report, torch_npu)
    _note_what_blocks_the_npu(report, status, device_count_error, environ, notes, blocker)

    from fluxgrpo.runtime.npu_versions import cann_note

    pairing = cann_note(report["torch_npu_version"], report["cann_version"])
    if pairing is not None and pairing[1]:  # built for another CANN than the one installed (or none found)
        notes.append(pairing[0])
    torch_release, npu_release = _release(report["torch_version"]), _release(report["torch_npu_version"])
    if torch_release and npu_release and torch_release != npu_release:
        notes.append(
            f"torch {report['torch_version']} with torch_npu {report['torch_npu_version']}: torch-npu X.Y.Z needs "
            f"exactly torch X.Y.Z (a cpu build); install torch=={npu_release}"
        )


def _fill_cann_version(report: dict[str, Any], torch_npu: Any, environ: Mapping[str, str]) -> None:
    """The CANN version as torch_npu reports it, else from the install's version files."""
    if torch_npu is not None:
        try:
            cann = importlib.import_module("torch_npu.utils").get_cann_version()
        except Exception:  # absent before torch_npu 2.5-era releases; '' before CANN 8.1.RC1
            cann = ""
        if cann:
            report["cann_version"] = cann
            report["cann_version_source"] = "torch_npu.utils.get_cann_version()"
    if report["cann_version"] is None:
        found = find_cann_version(environ)
        if found:
            report["cann_version"], source = found[0], found[1]
            report["cann_version_source"] = str(source)


def _fill_devices(report: dict[str, Any], torch_npu: Any) -> str | None:
    """Each visible NPU with its name and peak; returns why counting them failed (None: it did not)."""
    device_api = torch_npu.npu
    try:
        device_count, error = int(device_api.device_count()), None
    except Exception as exc:
        device_count, error = 0, f"{type(exc).__name__}: {exc}"
    for index in range(device_count):
        try:
            name = str(device_api.get_device_name(index))
        except Exception as exc:
            name = f"unknown ({type(exc).__name__})"
        report["devices"].append({"index": index, "name": name, "peak_tflops": peak_tflops(name)})
    return error


def _note_what_blocks_the_npu(
    report: dict[str, Any],
    status: NpuImportStatus,
    device_count_error: str | None,
    environ: Mapping[str, str],
    notes: list[str],
    blocker: Callable[[str], None],
) -> None:
    """Why an NPU run cannot start here (torch_npu missing, not importing, seeing no NPU) and what fixes it."""
    if not status.installed:
        notes.append(
            "torch_npu is not installed: NPU runs need the matched set torch==X.Y.Z, torch-npu==X.Y.Z[.postN] "
            "(pip install 'fluxgrpo[npu]' pins nothing; match them yourself) and a CANN install"
        )
    elif not status.importable:
        where = (
            f"CANN {report['cann_version']} is at {report['cann_version_source']}, so its environment is "
            "probably not loaded"
            if report["cann_version"]
            else "no CANN install was found under " + ", ".join(str(p) for p in cann_home_candidates(environ))
        )
        version = f" {report['torch_npu_version']}" if report["torch_npu_version"] else ""
        blocker(
            f"torch_npu{version} is installed but does not import ({status.error}); "
            f"{where}: source /usr/local/Ascend/cann/set_env.sh (CANN >= 8.5) or "
            "/usr/local/Ascend/ascend-toolkit/set_env.sh, then rerun `fluxgrpo env-check`"
        )
        autoload = environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD")
        blocker(
            "with torch-npu installed and no CANN, `import torch` itself fails unless TORCH_DEVICE_BACKEND_AUTOLOAD=0 "
            f"(torch autoloads torch_npu as a backend extension); it is {autoload!r} here. Keep it 0 for cpu/cuda "
            "runs on this machine, or uninstall torch-npu"
        )
    elif not report["devices"]:
        failure = f" (counting failed: {device_count_error})" if device_count_error else ""
        notes.append(
            f"torch_npu imports but sees no NPU{failure}: check ASCEND_RT_VISIBLE_DEVICES (ascending, "
            "comma-separated, no spaces) and `npu-smi info`"
        )
    if status.installed and report["cann_version"] is None and status.importable:
        notes.append("CANN version unknown: torch_npu did not report it and no version file was found")


# --- peak throughput ------------------------------------------------------------------------------------------

# (cube cores, cube MHz) per die from CANN's platform_config/<SoC>.ini ([SoCInfo] cube_core_cnt, [AICoreSpec]
# cube_freq); keys are what torch.npu.get_device_name() returns (torch-npu-api.md §8).
ASCEND_CUBE_SPECS: dict[str, tuple[int, int]] = {
    "Ascend910B1": (24, 1850),
    "Ascend910B2": (24, 1800),
    "Ascend910B2C": (24, 1800),
    "Ascend910B3": (20, 1800),
    "Ascend910B4": (20, 1500),
    "Ascend910B4-1": (20, 1500),
    "Ascend910_9391": (24, 1850),
    "Ascend910_9392": (24, 1850),
    "Ascend910_9381": (24, 1800),
    "Ascend910_9382": (24, 1800),
    "Ascend910_9372": (20, 1800),
    "Ascend910_9362": (20, 1500),
}
# Each cube core does one 16x16x16 fp16 multiply-accumulate tile per cycle; 2 FLOPs per MAC.
FLOPS_PER_CUBE_CYCLE = 16 * 16 * 16 * 2


def peak_tflops(device_name: str) -> float | None:
    """Dense fp16/bf16 peak of one die (one torch device) in TFLOPS, or None for a SoC not in the table.

    cores x MHz x 1e6 x 8192 FLOP; e.g. Ascend910_9391 (A3): 24 x 1850e6 x 8192 = 363.7 TFLOPS. That bf16 runs
    at the fp16 rate is not confirmed by Ascend; the bench lets users override the peak.
    """
    lookup = {name.lower(): spec for name, spec in ASCEND_CUBE_SPECS.items()}
    spec = lookup.get(device_name.strip().lower()) if device_name else None
    if spec is None:
        return None
    cores, mhz = spec
    return cores * mhz * 1e6 * FLOPS_PER_CUBE_CYCLE / 1e12
