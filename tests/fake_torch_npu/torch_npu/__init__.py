"""A CPU stand-in for ``torch_npu``: the few ops fluxgrpo and diffusers call, written in plain torch.

Tests put ``tests/fake_torch_npu`` on ``sys.path`` through ``monkeypatch`` for one test at a time, so no other
test ever sees a ``torch_npu`` module. It does not touch ``torch`` (no ``torch.npu``, no PrivateUse1 backend):
tensors stay on the cpu, and ``fluxgrpo.runtime.device.npu_available()`` stays False.

What it models, from the op documentation (shared/reference/torch-npu-api.md §4):

- ``npu_rms_norm(x, gamma, epsilon)`` returns ``(y, rstd)``; ``y`` has ``x``'s dtype and is computed in float32
  with one rounding at the end; only the (x, gamma) dtype pairs the A2/A3 kernel accepts are allowed, so a caller
  that sends (float32, bfloat16) fails here as it would on the device, and so does one without a gamma.
- ``npu_fusion_attention(q, k, v, head_num, input_layout, ...)`` for the ``BSND`` and ``BNSD`` layouts, with the
  inverted mask (True = masked out) and ``scale`` defaulting to 1.0 as on the device; dropout is not modelled.

Every call is counted in ``CALLS`` so a test can prove the fused path really ran.
"""

from __future__ import annotations

import math
from collections import Counter

import torch

from . import npu, utils  # noqa: F401  (the real package exposes both after `import torch_npu`)

__version__ = "2.7.1+fake"

CALLS: Counter[str] = Counter()

# (x dtype, gamma dtype) pairs the A2/A3 RmsNorm kernel accepts; (float32, bfloat16) is the notable absentee.
RMS_NORM_DTYPE_PAIRS = frozenset(
    {
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
    }
)

FUSION_ATTENTION_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})


def reset_calls() -> None:
    CALLS.clear()


def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """y = x / sqrt(mean(x², over gamma's dims) + epsilon) · gamma, in float32, returned in x's dtype.

    rstd is float32 with x's shape and size-1 in gamma's dims.
    """
    CALLS["npu_rms_norm"] += 1
    if gamma is None:  # the kernel has no weightless form: it crashes (diffusers issue 14380)
        raise RuntimeError("npu_rms_norm: gamma is required (got None)")
    if (self.dtype, gamma.dtype) not in RMS_NORM_DTYPE_PAIRS:
        raise RuntimeError(f"npu_rms_norm: unsupported dtype pair (x={self.dtype}, gamma={gamma.dtype})")
    if not 2 <= self.dim() <= 8:
        raise RuntimeError(f"npu_rms_norm: x must have 2 to 8 dims, got {self.dim()}")
    if tuple(self.shape[self.dim() - gamma.dim() :]) != tuple(gamma.shape):
        raise RuntimeError(
            f"npu_rms_norm: gamma shape {tuple(gamma.shape)} must equal x's trailing dims {tuple(self.shape)}"
        )
    reduced_dims = tuple(range(self.dim() - gamma.dim(), self.dim()))
    x32 = self.float()
    rstd = torch.rsqrt(x32.pow(2).mean(dim=reduced_dims, keepdim=True) + epsilon)
    y = (x32 * rstd * gamma.float()).to(self.dtype)
    return y, rstd


def npu_fusion_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    scale: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = 2147483647,
    next_tockens: int = 2147483647,
    inner_precise: int = 0,
    prefix=None,
    actual_seq_qlen=None,
    actual_seq_kvlen=None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
    softmax_layout: str = "",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """softmax(q·kᵀ·scale, masked) · v for BSND / BNSD inputs.

    Returns (out, softmax_max, softmax_sum, reserved, 0, 0, 0) like the device. softmax_max and softmax_sum are
    per row ([B, N, Sq, 1]); the device returns them in its own tiled layout, which only its backward reads.
    """
    CALLS["npu_fusion_attention"] += 1
    if input_layout not in ("BSND", "BNSD"):
        raise NotImplementedError(f"fake npu_fusion_attention models BSND and BNSD only, not {input_layout}")
    if len({query.dtype, key.dtype, value.dtype}) != 1 or query.dtype not in FUSION_ATTENTION_DTYPES:
        raise RuntimeError(
            f"npu_fusion_attention: q/k/v dtypes must match, got {query.dtype}, {key.dtype}, {value.dtype}"
        )
    if pse is not None or padding_mask is not None or keep_prob != 1.0:
        raise NotImplementedError("fake npu_fusion_attention does not model pse, padding_mask or dropout")
    if input_layout == "BSND":
        query, key, value = (t.transpose(1, 2) for t in (query, key, value))  # → [B, N, S, D]
    if query.shape[1] != head_num:
        raise RuntimeError(f"npu_fusion_attention: head_num {head_num} but q has {query.shape[1]} heads")
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale  # [B, N, Sq, Skv]
    if atten_mask is not None:
        scores = scores.masked_fill(atten_mask.to(torch.bool), -math.inf)
    softmax_max = scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(scores - softmax_max)
    softmax_sum = weights.sum(dim=-1, keepdim=True)
    out = torch.matmul(weights / softmax_sum, value.float()).to(query.dtype)  # [B, N, Sq, D]
    if input_layout == "BSND":
        out = out.transpose(1, 2)
    return out, softmax_max, softmax_sum, torch.empty(0), 0, 0, 0
