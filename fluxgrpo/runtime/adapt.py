"""Device-specific model adaptations, decided here so callers never branch on the device type."""

from __future__ import annotations

import os
from typing import Any

from fluxgrpo.errors import UsageError

# --attention choices: PyTorch's scaled_dot_product_attention, or torch_npu's fused kernel (bf16/fp16 only).
ATTENTION_BACKENDS = ("sdpa", "npu-fusion")

# Apply the Ascend adaptations on any device (with the tests' stand-in torch_npu, or to debug numerics).
FORCE_NPU_ADAPT_ENV = "FLUXGRPO_FORCE_NPU_ADAPT"


def adapt_transformer(transformer: Any, device_type: str, *, attention: str = "sdpa", compute_dtype: Any = None) -> Any:
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
