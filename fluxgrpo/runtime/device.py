"""The one place that knows about accelerators: detection, torch_npu import, autocast, precision, memory.

Everything outside ``fluxgrpo/runtime/`` asks this module (or ``dist``) for the device, the autocast
context and the backend; it never names a device type itself.

Detection order is npu → cuda → cpu. ``--device`` overrides it, and asking for a device that is not
there is an error that says why.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fluxgrpo.errors import FluxgrpoError, UsageError

if TYPE_CHECKING:
    import torch

DEVICE_TYPES = ("npu", "cuda", "cpu")
BACKEND_FOR_DEVICE = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}


@dataclass(frozen=True)
class NpuImportStatus:
    """What happened when we tried to import torch_npu."""

    installed: bool  # the torch_npu package is on sys.path
    importable: bool  # ``import torch_npu`` succeeded
    error: str | None  # the import error, one line, when installed but not importable
    version: str | None


_npu_status: NpuImportStatus | None = None


def npu_import_status() -> NpuImportStatus:
    """Import torch_npu once, never raising; a broken install is reported, not a traceback.

    Without CANN, ``import torch_npu`` fails on ``libhccl.so``; with torch's backend autoload it can even
    make ``import torch`` fail (see ``TORCH_DEVICE_BACKEND_AUTOLOAD`` in docs/hardware.md).
    """
    global _npu_status
    if _npu_status is not None:
        return _npu_status
    if importlib.util.find_spec("torch_npu") is None:
        _npu_status = NpuImportStatus(installed=False, importable=False, error=None, version=None)
        return _npu_status
    try:
        import torch_npu
    except Exception as exc:  # ImportError / OSError / RuntimeError without CANN
        message = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        _npu_status = NpuImportStatus(installed=True, importable=False, error=message, version=None)
        return _npu_status
    _npu_status = NpuImportStatus(
        installed=True, importable=True, error=None, version=getattr(torch_npu, "__version__", None)
    )
    return _npu_status


def _reset_npu_status_for_tests() -> None:
    global _npu_status
    _npu_status = None


def npu_available() -> bool:
    """True when torch_npu imports and at least one NPU is visible."""
    if not npu_import_status().importable:
        return False
    import torch

    return hasattr(torch, "npu") and bool(torch.npu.is_available())


def cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def available_device_types() -> list[str]:
    """Device types usable here, best first; cpu is always last."""
    found = []
    if npu_available():
        found.append("npu")
    if cuda_available():
        found.append("cuda")
    found.append("cpu")
    return found


def resolve_device_type(requested: str | None = None) -> str:
    """The device type to run on: ``requested`` if given and present, else the best one found.

    Raises:
        UsageError: ``requested`` is not a known device type.
        FluxgrpoError: ``requested`` is known but not usable on this machine.
    """
    if requested is None or requested == "auto":
        return available_device_types()[0]
    requested = requested.lower()
    if requested not in DEVICE_TYPES:
        raise UsageError(f"unknown device {requested!r}: use --device with one of {', '.join(DEVICE_TYPES)}")
    if requested == "cpu":
        return "cpu"
    if requested == "npu" and not npu_available():
        status = npu_import_status()
        if not status.installed:
            why = "torch_npu is not installed (pip install 'fluxgrpo[npu]' with a torch/torch-npu/CANN matched set)"
        elif not status.importable:
            why = f"torch_npu is installed but does not import ({status.error}); source CANN's set_env.sh"
        else:
            why = "torch_npu imports but sees no NPU (check ASCEND_RT_VISIBLE_DEVICES and npu-smi info)"
        raise FluxgrpoError(f"--device npu requested but {why}; run `fluxgrpo env-check` for details")
    if requested == "cuda" and not cuda_available():
        raise FluxgrpoError(
            "--device cuda requested but torch sees no CUDA device (CPU-only torch build, or CUDA_VISIBLE_DEVICES "
            "hides them); run `fluxgrpo env-check`, or use --device cpu"
        )
    return requested


def is_ascend(*device_types: str | None) -> bool:
    """True when any of the given device types (detected, asked for) is an Ascend NPU."""
    return "npu" in device_types


def backend_for(device_type: str) -> str:
    """The torch.distributed backend for a device type: hccl, nccl or gloo."""
    return BACKEND_FOR_DEVICE[device_type]


def device_module(device_type: str) -> Any:
    """``torch.npu`` / ``torch.cuda`` for accelerators, None for cpu."""
    import torch

    if device_type == "npu":
        return torch.npu  # type: ignore[attr-defined]  # torch.npu exists once torch_npu is imported
    if device_type == "cuda":
        return torch.cuda
    return None


def device_for_local_rank(device_type: str, local_rank: int = 0) -> torch.device:
    """The device this process uses; LOCAL_RANK picks it (never the global RANK, which breaks multi-node)."""
    import torch

    if device_type == "cpu":
        return torch.device("cpu")
    module = device_module(device_type)
    count = module.device_count()
    if local_rank >= count:
        raise FluxgrpoError(
            f"LOCAL_RANK {local_rank} but only {count} {device_type} device(s) are visible: lower --dies "
            f"or widen the visible-device mask ({'ASCEND_RT_VISIBLE_DEVICES' if device_type == 'npu' else 'CUDA_VISIBLE_DEVICES'})"
        )
    module.set_device(local_rank)
    return torch.device(device_type, local_rank)


def device_count(device_type: str) -> int:
    if device_type == "cpu":
        return 1
    return int(device_module(device_type).device_count())


@dataclass(frozen=True)
class DeviceMemory:
    index: int
    name: str
    total_bytes: int
    free_bytes: int | None


def host_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """What the kernel can hand out without swapping (``MemAvailable``: free memory plus the reclaimable page
    cache); None where there is no /proc (then the free pages are all there is to say)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    return None


def describe_devices(device_type: str) -> list[DeviceMemory]:
    """Name and memory of each visible device (host RAM for cpu)."""
    if device_type == "cpu":
        total = free = None
        with contextlib.suppress(OSError, ValueError):
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        available = host_available_bytes()  # free pages leave out the page cache the kernel gives back on demand
        return [DeviceMemory(0, "cpu (host memory)", int(total or 0), free if available is None else available)]
    module = device_module(device_type)
    out = []
    for index in range(module.device_count()):
        props = module.get_device_properties(index)
        free = None
        with contextlib.suppress(Exception):
            free, _ = module.mem_get_info(index)
        out.append(DeviceMemory(index, str(getattr(props, "name", device_type)), int(props.total_memory), free))
    return out


def compute_dtype(device_type: str) -> torch.dtype:
    """Autocast dtype: bf16 on accelerators (weights stay fp32 masters); fp32 on cpu, where bf16 is slow."""
    import torch

    return torch.float32 if device_type == "cpu" else torch.bfloat16


def autocast(device_type: str, dtype: torch.dtype | None = None) -> contextlib.AbstractContextManager:
    """The autocast context for compute on ``device_type``; a no-op when the compute dtype is fp32."""
    import torch

    dtype = dtype or compute_dtype(device_type)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


def set_matmul_precision(device_type: str, allow_reduced: bool = True) -> None:
    """HF32 on NPU, TF32 on CUDA for fp32 matmuls (the recipe's setting); nothing to do on cpu."""
    import torch

    if device_type == "npu":
        torch.npu.matmul.allow_hf32 = allow_reduced  # type: ignore[attr-defined]  # torch.npu exists once torch_npu is imported
        with contextlib.suppress(AttributeError):
            torch.npu.conv.allow_hf32 = allow_reduced  # type: ignore[attr-defined]  # as above
    elif device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = allow_reduced
        torch.backends.cudnn.allow_tf32 = allow_reduced


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (torch.manual_seed also seeds every accelerator)."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def synchronize(device: torch.device) -> None:
    module = device_module(device.type)
    if module is not None:
        module.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    module = device_module(device.type)
    if module is not None:
        module.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int | None:
    """Peak allocated device memory since the last reset; None on cpu (no allocator statistics)."""
    module = device_module(device.type)
    if module is None:
        return None
    return int(module.max_memory_allocated(device))


def empty_cache(device: torch.device) -> None:
    module = device_module(device.type)
    if module is not None:
        module.empty_cache()


def rng_state(device: torch.device) -> dict[str, Any]:
    """Every RNG a training step draws from, for an exact resume."""
    import numpy as np
    import torch

    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    module = device_module(device.type)
    if module is not None:
        state["device"] = module.get_rng_state(device)
    return state


def set_rng_state(device: torch.device, state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    module = device_module(device.type)
    if module is not None and "device" in state:
        module.set_rng_state(state["device"], device)
