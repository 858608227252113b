"""What ``fluxgrpo bench`` needs to know about the device it measures: its name, its dense peak throughput for model
FLOPs utilisation (MFU), the accelerator stack's version, and whether an exception means "out of device memory".

Peaks are dense (no 2:4 sparsity) tensor-core figures of one device, in TFLOPS. NVIDIA's come from the H100/H200,
A100 and L40S datasheets, which print the sparse figure: dense is half of it. fp32 compute on these GPUs runs its
matmuls in TF32 (``device.set_matmul_precision`` allows it, as the recipe does), so the fp32 peak is the TF32 one.
Ascend's come from ``npu.peak_tflops`` (cube cores × clock); its fp32 (HF32) peak is not published, so there is none.
A device missing from the table gets no MFU unless ``fluxgrpo bench --peak-tflops`` supplies the peak.
"""

from __future__ import annotations

import contextlib
import platform
from dataclasses import dataclass
from typing import Any

import torch

from fluxgrpo.runtime import device as rt_device
from fluxgrpo.runtime.cann import peak_tflops

# (fragment of torch.cuda.get_device_name(), dense bf16 TFLOPS, dense tf32 TFLOPS). The first fragment contained
# in the name wins, so the more specific variants (PCIe, NVL) come before the family name.
NVIDIA_DENSE_TFLOPS: tuple[tuple[str, float, float], ...] = (
    ("H100 PCIe", 756.5, 378.0),
    ("H100 NVL", 835.5, 417.5),
    ("H200 NVL", 835.5, 417.5),
    ("GH200", 989.4, 494.7),
    ("H200", 989.4, 494.7),  # H200 SXM: the H100 SXM's compute with more, faster memory
    ("H100", 989.4, 494.7),  # H100 SXM ("NVIDIA H100 80GB HBM3")
    ("A100", 312.0, 156.0),
    ("L40S", 362.05, 183.0),
)

COMPUTE_DTYPES = ("bf16", "fp32")


@dataclass(frozen=True)
class PeakThroughput:
    """A device's dense peak for one compute dtype, and where the number came from."""

    tflops: float | None  # None: unknown, so no MFU
    source: str  # e.g. "datasheet: H200 bf16 dense", "--peak-tflops", "unknown"


def peak_throughput(
    device_type: str, device_name: str, compute_dtype: str, override: float | None = None
) -> PeakThroughput:
    """Dense peak TFLOPS of one device for ``compute_dtype`` ("bf16" or "fp32"); ``override`` wins when given."""
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute dtype must be one of {COMPUTE_DTYPES}, got {compute_dtype!r}")
    if override is not None:
        return PeakThroughput(float(override), "--peak-tflops")
    if device_type == "cuda":
        lowered = device_name.lower()
        for fragment, bf16, tf32 in NVIDIA_DENSE_TFLOPS:
            if fragment.lower() in lowered:
                if compute_dtype == "bf16":
                    return PeakThroughput(bf16, f"datasheet: {fragment} bf16 dense")
                return PeakThroughput(tf32, f"datasheet: {fragment} tf32 dense (fp32 matmuls run in TF32)")
        return PeakThroughput(None, f"unknown: {device_name!r} is not in the table; pass --peak-tflops")
    if device_type == "npu":
        if compute_dtype == "fp32":
            return PeakThroughput(None, "unknown: Ascend publishes no fp32 (HF32) cube peak; pass --peak-tflops")
        tflops = peak_tflops(device_name)
        if tflops is None:
            return PeakThroughput(None, f"unknown: {device_name!r} is not in the cube table; pass --peak-tflops")
        return PeakThroughput(tflops, f"cube cores × clock of {device_name} (fp16 rate; bf16 assumed equal)")
    return PeakThroughput(None, "unknown for a host CPU; pass --peak-tflops")


def device_name(device: torch.device) -> str:
    """The marketing name of ``device`` (the CPU model for cpu)."""
    if device.type == "cpu":
        with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
            for line in info:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
        return platform.processor() or platform.machine() or "cpu"
    module = rt_device.device_module(device.type)
    index = device.index if device.index is not None else module.current_device()
    return str(module.get_device_name(index))


def accelerator_stack(device_type: str) -> dict[str, Any]:
    """Versions of the accelerator stack torch runs on (empty for cpu)."""

    if device_type == "cuda":
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        return {"cuda": torch.version.cuda, "cudnn": cudnn}
    if device_type == "npu":
        status = rt_device.npu_import_status()
        cann = None
        with contextlib.suppress(Exception):
            import torch_npu

            cann = torch_npu.utils.get_cann_version() or None
        return {"torch_npu": status.version, "cann": cann}
    return {}


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is a device allocator running out of memory (torch's own error, or torch_npu's message)."""

    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
