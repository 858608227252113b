"""Device-specific model adaptations, decided here so callers never branch on the device type."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from fluxgrpo.errors import UsageError

if TYPE_CHECKING:
    from torch import nn

    from fluxgrpo.runtime.npu import NpuAdaptReport

# --attention choices: PyTorch's scaled_dot_product_attention, or torch_npu's fused kernel (bf16/fp16 only).
ATTENTION_BACKENDS = ("sdpa", "npu-fusion")

# Why ``--compile`` is refused on Ascend (one line; see compile_backend).
NPU_COMPILE_REFUSAL = (
    "--compile is not available on Ascend NPUs: torch_npu's torch.compile path (inductor through Triton-Ascend, "
    "TorchNPU 7.3.0 and later) is not verified stable for FLUX's blocks, and npu_fusion_attention has no graph "
    "mode; drop --compile (eager is the Ascend default)"
)

# torch.compile backend for --compile instead of inductor (e.g. aot_eager, to debug; the tests' fast compiles).
COMPILE_BACKEND_ENV = "FLUXGRPO_COMPILE_BACKEND"

# Apply the Ascend adaptations on any device (with the tests' stand-in torch_npu, or to debug numerics).
FORCE_NPU_ADAPT_ENV = "FLUXGRPO_FORCE_NPU_ADAPT"


def adapt_transformer(
    transformer: nn.Module, device_type: str, *, attention: str = "sdpa", compute_dtype: Any = None
) -> NpuAdaptReport | None:
    """Swap in the accelerator's kernels; returns the adaptation report (None when nothing applies).

    On npu (or when FLUXGRPO_FORCE_NPU_ADAPT=1): fused RMSNorm for FLUX's q/k norms, float32 RoPE, and the
    fused attention when ``attention == "npu-fusion"``. Elsewhere, asking for npu-fusion is a usage error.
    """
    if device_type == "npu" or os.environ.get(FORCE_NPU_ADAPT_ENV) == "1":
        from fluxgrpo.runtime.npu import adapt_flux_for_npu

        return adapt_flux_for_npu(transformer, attention=attention, compute_dtype=compute_dtype)
    if attention != "sdpa":
        raise UsageError(
            f"--attention {attention} needs an Ascend NPU (torch_npu's fused attention); use --attention sdpa"
        )
    return None


def compile_backend(device_type: str) -> str:
    """``torch.compile``'s backend for ``--compile`` on ``device_type``: inductor on cpu and cuda, or
    ``$FLUXGRPO_COMPILE_BACKEND`` (``aot_eager`` traces and partitions the graphs as inductor would but runs them
    eagerly: it tells a code-generation problem from a tracing one, and compiles in seconds); a UsageError on npu
    (``NPU_COMPILE_REFUSAL``), raised before any worker starts."""
    if device_type == "npu":
        raise UsageError(NPU_COMPILE_REFUSAL)
    if device_type == "cpu":
        _drop_cuda_home_warning()
    return os.environ.get(COMPILE_BACKEND_ENV) or "inductor"


class _DropCudaHomeWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "No CUDA runtime is found" not in record.getMessage()


def _drop_cuda_home_warning() -> None:
    """Inductor imports torch's C++-extension helpers, which warn at import that a CUDA toolkit folder exists but
    no CUDA runtime does: true and irrelevant to a CPU compile, so a CPU run never prints it."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    if not any(isinstance(f, _DropCudaHomeWarning) for f in logger.filters):
        logger.addFilter(_DropCudaHomeWarning())
