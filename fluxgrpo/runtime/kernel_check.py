"""Check 1 of ``env-check --deep``: each kernel the runtime swaps in on an accelerator against the plain PyTorch op,
on FLUX.1-dev's shapes (24 heads × 128, the run's image + text tokens), in bf16 and fp32.

What is compared, on the device:

- ``rms_norm``: ``npu.NpuFusedRMSNorm`` (``torch_npu.npu_rms_norm``) against the ``torch.nn.RMSNorm`` it replaces,
  x [1, T, 24, 128] in the dtype, an fp32 master weight spread over [0.5, 1.5]. Fused rounds once, torch twice:
  they agree to one rounding, so the tolerance is 2 ulps: 2⁻⁷ (bf16), 1e-5 (fp32 accumulation order).
  Against float64 as well: a kernel that normalises in low precision shows there (clearest in fp32). The same
  without a weight (``rms_norm (no weight)``): npu_rms_norm has no weightless form and crashes without a gamma
  (diffusers issue 14380), so the swap must hand it a unit one.
- ``layer_norm``: FLUX's block LayerNorm (3072 wide, no affine) under the device's autocast against float64, on
  inputs far from 0 (offset 4, spread 0.25) where statistics taken in low precision lose the variance
  (vllm-omni PR 2364: low-precision LayerNorm broke RL): 2⁻⁷ (bf16), 1e-5 (fp32).
- ``rope``: the FLUX position embedding the adaptation leaves on the model (diffusers' own when it already works in
  float32 on npu, else ``npu.Float32FluxPosEmbed``; on the stand-in path always the latter) against diffusers'
  float64 one on the host. The table must come out float32 (the recipe's requirement: float64 is not supported on
  the device) within 1e-5 of the float64 table; then q [1, T, 24, 128] in the dtype is rotated with both tables
  (diffusers' ``apply_rotary_emb``) and compared: 2⁻⁷ (bf16), 1e-5 (fp32). Position ids in bf16 must be refused
  where they enter RoPE (``npu.guard_position_ids``; verl-omni's rollout/trainer log-prob correlation fell to 0.13
  with bf16 position ids).
- ``attention (sdpa)``: torch's scaled_dot_product_attention on the device (FlashAttentionScore under torch_npu,
  flash/memory-efficient on CUDA) against softmax(q·kᵀ/√d)·v written out in fp32 with TF32/HF32 off;
  tolerance 2⁻⁶ (bf16: the kernel rounds P and the output) and 2⁻⁸ (fp32: training allows TF32/HF32 matmuls,
  10-bit mantissas).
- ``attention (npu-fusion)``: ``torch_npu.npu_fusion_attention`` called as diffusers' ``_native_npu`` backend calls
  it (BSND, scale 1/√d), bf16 only (the backend refuses fp32): 2⁻⁶.

Errors are normwise: max |fused − plain| / max |plain|. On npu, or anywhere with ``FLUXGRPO_FORCE_NPU_ADAPT=1`` and an
importable torch_npu (the tests' stand-in), the norm and RoPE swaps are checked; on CUDA only attention (nothing else
is swapped there); on a cpu without that, nothing: ``kernel_check_skip_reason`` says why.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import FluxPosEmbed

from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.runtime import device as rt_device
from fluxgrpo.runtime import npu
from fluxgrpo.runtime.adapt import FORCE_NPU_ADAPT_ENV
from fluxgrpo.runtime.npu import NpuFusedRMSNorm, patch_rope

FLUX_HEADS, FLUX_HEAD_DIM = 24, 128
FLUX_ROPE_AXES = (16, 56, 56)
FLUX_ROPE_THETA = 10000
TOLERANCE = {
    "rms_norm": {"bf16": 2**-7, "fp32": 1e-5},
    "layer_norm": {"bf16": 2**-7, "fp32": 1e-5},
    "rope": {"bf16": 2**-7, "fp32": 1e-5},
    "attention": {"bf16": 2**-6, "fp32": 2**-8},
}
ROPE_TABLE_TOLERANCE = 1e-5
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class KernelComparison:
    """One kernel in one dtype: its normwise max error against the plain op, and the tolerance it must meet."""

    op: str
    dtype: str
    max_error: float | None
    tolerance: float
    kernel: str  # what ran, against what
    shape: str
    problem: str | None = None  # why it failed besides the error (wrong output dtype, an exception)

    @property
    def ok(self) -> bool:
        return self.problem is None and self.max_error is not None and self.max_error <= self.tolerance

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"ok": self.ok}


def _swaps_norm_and_rope(device_type: str) -> bool:
    return device_type == "npu" or (
        os.environ.get(FORCE_NPU_ADAPT_ENV) == "1" and rt_device.npu_import_status().importable
    )


def kernel_check_skip_reason(device_type: str) -> str | None:
    """None when this device has swapped kernels to check; else why the check is skipped."""
    if _swaps_norm_and_rope(device_type) or device_type == "cuda":
        return None
    return (
        f"no accelerator kernels to check on {device_type}: the fused RMSNorm, float32 RoPE and fused attention "
        "are swapped in on Ascend only (stand-in runs need FLUXGRPO_FORCE_NPU_ADAPT=1 and torch_npu)"
    )


def _normwise(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _rms_norm(device: torch.device, tokens: int, dtype: str, affine: bool = True) -> KernelComparison:
    """The fused q/k norm against torch.nn.RMSNorm and against float64 (a kernel that normalises in low precision
    is caught by the latter); ``affine=False``: a norm without weight, which npu_rms_norm cannot take as such (it
    crashes without a gamma, diffusers issue 14380): the swap must hand it a unit one."""

    generator = torch.Generator().manual_seed(0)
    plain = torch.nn.RMSNorm(FLUX_HEAD_DIM, eps=1e-6, elementwise_affine=affine)
    if affine:
        with torch.no_grad():
            plain.weight.copy_(torch.rand(FLUX_HEAD_DIM, generator=generator) + 0.5)
    plain = plain.to(device)
    fused = NpuFusedRMSNorm(plain)
    x = torch.randn(1, tokens, FLUX_HEADS, FLUX_HEAD_DIM, generator=generator).to(device=device, dtype=_DTYPES[dtype])
    op, shape = "rms_norm" if affine else "rms_norm (no weight)", f"[1, {tokens}, {FLUX_HEADS}, {FLUX_HEAD_DIM}]"
    kernel = "torch_npu.npu_rms_norm vs torch.nn.RMSNorm and float64"
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's "cannot dispatch to fused implementation" for bf16 x, fp32 weight
            got, want = fused(x), plain(x)
    except Exception as exc:  # a kernel that refuses what the swap hands it: the check's answer, not a crash
        return KernelComparison(op, dtype, None, TOLERANCE["rms_norm"][dtype], kernel, shape, _first_line(exc))
    x64 = x.double()
    exact = x64 * torch.rsqrt(x64.pow(2).mean(dim=-1, keepdim=True) + 1e-6)
    if affine:
        exact = exact * plain.weight.detach().double()
    problem = None if got.dtype == want.dtype else f"returns {got.dtype}, torch.nn.RMSNorm {want.dtype}"
    return KernelComparison(
        op,
        dtype,
        max(_normwise(got, want), _normwise(got, exact)),
        TOLERANCE["rms_norm"][dtype],
        kernel,
        shape,
        problem,
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


FLUX_HIDDEN = FLUX_HEADS * FLUX_HEAD_DIM  # 3072: the width of FLUX's AdaLayerNorm LayerNorms


def _layer_norm(device: torch.device, tokens: int, dtype: str) -> KernelComparison:
    """FLUX's block LayerNorm (no affine, eps 1e-6) as the forward runs it, on bf16 hidden states under the
    device's autocast, against float64. The input sits far from 0 (offset 4, spread 0.25), as FLUX's hidden states
    do: statistics taken in low precision lose the variance there (E[x²] − E[x]² cancels), one rounding of the
    output does not."""
    generator = torch.Generator().manual_seed(3)
    x = 4 + 0.25 * torch.randn(1, tokens, FLUX_HIDDEN, generator=generator)
    x = x.to(device=device, dtype=_DTYPES[dtype])
    norm = torch.nn.LayerNorm(FLUX_HIDDEN, elementwise_affine=False, eps=1e-6).to(device)
    shape, kernel = f"[1, {tokens}, {FLUX_HIDDEN}]", f"LayerNorm on {device.type} under autocast vs float64"
    try:
        with torch.no_grad(), rt_device.autocast(device.type, _DTYPES[dtype]):
            got = norm(x)
    except Exception as exc:
        return KernelComparison(
            "layer_norm", dtype, None, TOLERANCE["layer_norm"][dtype], kernel, shape, _first_line(exc)
        )
    x64 = x.double()
    exact = (x64 - x64.mean(-1, keepdim=True)) / torch.sqrt(x64.var(-1, unbiased=False, keepdim=True) + 1e-6)
    return KernelComparison("layer_norm", dtype, _normwise(got, exact), TOLERANCE["layer_norm"][dtype], kernel, shape)


def _flux_ids(height: int, width: int, text_tokens: int) -> torch.Tensor:
    rows, cols = height // 16, width // 16
    image = torch.zeros(rows, cols, 3)
    image[..., 1] = torch.arange(rows)[:, None]
    image[..., 2] = torch.arange(cols)[None, :]
    return torch.cat([torch.zeros(text_tokens, 3), image.reshape(-1, 3)])  # [T, 3] text ids then image ids


def _rope(device: torch.device, device_type: str, ids: torch.Tensor, dtypes: tuple[str, ...]) -> list[KernelComparison]:
    holder = torch.nn.Module()
    holder.pos_embed = FluxPosEmbed(theta=FLUX_ROPE_THETA, axes_dim=list(FLUX_ROPE_AXES))
    patch_rope(holder, force=device_type != "npu")  # off the device, diffusers' own would run in float64
    reference = FluxPosEmbed(theta=FLUX_ROPE_THETA, axes_dim=list(FLUX_ROPE_AXES))
    with torch.no_grad():
        pos_embed: Any = holder.pos_embed  # replaced by patch_rope, so typed by what it returns
        cos, sin = pos_embed(ids.to(device))
        ref_cos, ref_sin = reference(ids.double())  # float64 on the host
    table_error = max(_normwise(cos, ref_cos), _normwise(sin, ref_sin))
    table_problem = None
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        table_problem = f"the RoPE table comes out {cos.dtype}, not torch.float32"
    elif table_error > ROPE_TABLE_TOLERANCE:
        table_problem = f"the RoPE table is {table_error:.1e} from float64 (> {ROPE_TABLE_TOLERANCE:g})"
    elif (accepted := _accepts_half_ids(holder, ids.to(device))) is not None:
        table_problem = accepted
    out = []
    tokens = ids.shape[0]
    generator = torch.Generator().manual_seed(1)
    for dtype in dtypes:
        q = torch.randn(1, tokens, FLUX_HEADS, FLUX_HEAD_DIM, generator=generator)
        with torch.no_grad():
            got = apply_rotary_emb(q.to(device=device, dtype=_DTYPES[dtype]), (cos, sin), sequence_dim=1)
            want = apply_rotary_emb(q.double(), (ref_cos, ref_sin), sequence_dim=1)
        out.append(
            KernelComparison(
                "rope",
                dtype,
                max(_normwise(got, want), table_error),
                TOLERANCE["rope"][dtype],
                f"{type(holder.pos_embed).__name__} on the device vs diffusers FluxPosEmbed in float64",
                f"ids [{tokens}, 3], q [1, {tokens}, {FLUX_HEADS}, {FLUX_HEAD_DIM}]",
                table_problem,
            )
        )
    return out


def _accepts_half_ids(holder: torch.nn.Module, ids: torch.Tensor) -> str | None:
    """None when the adapted model refuses position ids in bf16 (``npu.guard_position_ids``); else the problem:
    bf16 ids would reach RoPE unnoticed."""

    npu.guard_position_ids(holder)  # as adapt_flux_for_npu guards the run's model
    pos_embed: Any = holder.pos_embed  # a module set by the caller, so typed by what it returns
    try:
        with torch.no_grad():
            pos_embed(ids.to(torch.bfloat16))
    except FluxgrpoError:
        return None
    return "position ids in bfloat16 reach RoPE unrefused"


def _plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, device_type: str) -> torch.Tensor:
    """softmax(q·kᵀ/√d)·v in fp32 with reduced-precision matmuls off; [B, N, S, D] in, out."""
    rt_device.set_matmul_precision(device_type, allow_reduced=False)
    try:
        q, k, v = q.float(), k.float(), v.float()
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        return torch.matmul(scores.softmax(dim=-1), v)
    finally:
        rt_device.set_matmul_precision(device_type, allow_reduced=True)  # what training runs with


def _attention(device: torch.device, device_type: str, tokens: int, dtypes: tuple[str, ...]) -> list[KernelComparison]:
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, FLUX_HEADS, tokens, FLUX_HEAD_DIM, generator=generator) for _ in range(3))
    q, k, v = (t.to(device) for t in (q, k, v))
    want = _plain_attention(q, k, v, device_type)
    shape = f"q, k, v [1, {FLUX_HEADS}, {tokens}, {FLUX_HEAD_DIM}]"
    out = []
    for dtype in dtypes:
        cq, ck, cv = (t.to(_DTYPES[dtype]) for t in (q, k, v))
        with torch.no_grad():
            got = torch.nn.functional.scaled_dot_product_attention(cq, ck, cv)
        out.append(
            KernelComparison(
                "attention (sdpa)",
                dtype,
                _normwise(got, want),
                TOLERANCE["attention"][dtype],
                f"scaled_dot_product_attention on {device_type} vs softmax(qkᵀ/√d)v in fp32",
                shape,
            )
        )
    if _swaps_norm_and_rope(device_type) and "bf16" in dtypes:
        import torch_npu

        bsnd = [t.to(torch.bfloat16).transpose(1, 2).contiguous() for t in (q, k, v)]
        with torch.no_grad():
            fused = torch_npu.npu_fusion_attention(
                *bsnd,
                FLUX_HEADS,
                input_layout="BSND",
                pse=None,
                atten_mask=None,
                scale=1.0 / math.sqrt(FLUX_HEAD_DIM),
                pre_tockens=65536,
                next_tockens=65536,
                keep_prob=1.0,
                sync=False,
                inner_precise=0,
            )[0]
        out.append(
            KernelComparison(
                "attention (npu-fusion)",
                "bf16",
                _normwise(fused.transpose(1, 2), want),
                TOLERANCE["attention"]["bf16"],
                "torch_npu.npu_fusion_attention (BSND) vs softmax(qkᵀ/√d)v in fp32",
                shape,
            )
        )
    return out


def compare_swapped_kernels(
    device: torch.device, height: int, width: int, text_tokens: int, dtypes: tuple[str, ...] = ("bf16", "fp32")
) -> list[KernelComparison]:
    """Every swapped kernel of this device against its plain op at a ``height``×``width`` image with
    ``text_tokens`` text tokens (call only when ``kernel_check_skip_reason`` is None)."""
    device_type = device.type
    ids = _flux_ids(height, width, text_tokens)
    tokens = ids.shape[0]
    out: list[KernelComparison] = []
    if _swaps_norm_and_rope(device_type):
        out += [_rms_norm(device, tokens, dtype) for dtype in dtypes]
        out += [_rms_norm(device, tokens, dtype, affine=False) for dtype in dtypes]
        out += [_layer_norm(device, tokens, dtype) for dtype in dtypes]
        out += _rope(device, device_type, ids, dtypes)
    out += _attention(device, device_type, tokens, dtypes)
    return out
