"""The Ascend adaptations of FLUX, applied at runtime to the installed diffusers instead of patching it.

The Atlas A3 recipe (shared/reference/000_c7ab4aa6d08776b6.txt §2.3, dancegrpo-spec.md §10) git-am's a patch into
diffusers 0.32 that runs FLUX's q/k RMSNorm on ``torch_npu.npu_rms_norm`` and computes RoPE frequencies in float32
with contiguous cos/sin. ``adapt_flux_for_npu`` does the same on a built model (before FSDP wraps it), and can also
put attention on torch_npu's fused kernel. Which diffusers needs what:

=================  ===============================================  =============================================
diffusers          q/k norms in FLUX attention                      RoPE frequencies on npu
=================  ===============================================  =============================================
<= 0.32            ``Attention`` + diffusers ``RMSNorm`` (no npu    ``FluxPosEmbed`` picks float64 (only mps gets
                   path): swap                                      float32): replace ``pos_embed``
0.33 - 0.34        ``Attention`` + diffusers ``RMSNorm``, which     float32 (an ``is_npu`` check)
                   calls npu_rms_norm itself once the torch_npu
                   package is installed: the swap is harmless
0.35 - 0.38        ``FluxAttention`` + ``torch.nn.RMSNorm``, which  float32 (an ``is_npu`` check)
                   has no NPU fusion: swap
>= 0.39            as 0.35                                          float32 (``maybe_adjust_dtype_for_device``)
=================  ===============================================  =============================================

The ``_native_npu`` attention backend (``torch_npu.npu_fusion_attention``, bf16/fp16 only) exists from 0.35.

What the Ascend software stack and hardware are (CANN, torch_npu, peak FLOPs) is ``runtime/cann.py``.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch
from torch import nn

from fluxgrpo.errors import FluxgrpoError, UsageError
from fluxgrpo.runtime.device import npu_import_status

if TYPE_CHECKING:
    from collections.abc import Iterable

logger = logging.getLogger(__name__)

FLUX_QK_NORM_NAMES = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")
# diffusers' AttentionBackendName values: torch's SDPA (torch_npu routes it to FlashAttentionScore when the mask
# allows), and diffusers' wrapper of torch_npu.npu_fusion_attention.
DIFFUSERS_BACKEND_FOR_ATTENTION = {"sdpa": "native", "npu-fusion": "_native_npu"}

_TORCH_RMSNORM = "torch.nn.RMSNorm"
_DIFFUSERS_RMSNORM = "diffusers RMSNorm"


def _diffusers_version() -> str:
    try:
        return importlib.metadata.version("diffusers")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _diffusers_rmsnorm_class() -> type | None:
    try:
        from diffusers.models.normalization import RMSNorm
    except ImportError:
        return None
    return RMSNorm


def _flux_attention_classes() -> tuple[type, ...]:
    """``FluxAttention`` (diffusers >= 0.35) and the generic ``Attention`` FLUX used before it."""
    classes: list[type] = []
    try:
        from diffusers.models.transformers.transformer_flux import FluxAttention

        classes.append(FluxAttention)
    except ImportError:
        pass
    try:
        from diffusers.models.attention_processor import Attention

        classes.append(Attention)
    except ImportError:
        pass
    return tuple(classes)


@functools.cache
def _autocast_runs_rms_norm_in_fp32(device_type: str) -> bool:
    """Whether autocast on ``device_type`` registers ``aten::rms_norm`` (always in its fp32 list when it does).

    torch 2.x lists it for CUDA and XPU, not for cpu; torch_npu's AutocastPrivateUse1 list does not name it.
    """
    dispatch_key = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA", "xpu": "AutocastXPU", "mps": "AutocastMPS"}.get(
        device_type,
        "AutocastPrivateUse1",  # npu registers itself as the PrivateUse1 backend
    )
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key("aten::rms_norm", dispatch_key))
    except Exception:  # a private API; without it, assume no policy (true for cpu and torch_npu)
        return False


class NpuFusedRMSNorm(nn.Module):
    """A FLUX q/k RMSNorm that runs ``torch_npu.npu_rms_norm``, built around the norm it replaces.

    It holds the replaced norm's ``weight`` Parameter itself (the same object, and diffusers' optional ``bias``),
    so state_dict keys, optimizer parameter groups and checkpoints are unchanged, and a state dict saved from a
    patched model loads strictly into an unpatched one. Swap before FSDP wraps the model.

    Output dtype and numerics follow the replaced module:

    - ``torch.nn.RMSNorm`` (diffusers >= 0.35) returns x's dtype. In training, q/k come out of a bf16 linear
      (autocast) while the weight is an fp32 master. (bf16 x, fp32 weight) is a kernel pair, so both go in as
      they are: the kernel normalises in fp32, applies the fp32 weight and rounds once to bf16. torch's composite
      path rounds twice (after normalising, then after the weight), so the two agree to one bf16 rounding, ours
      being the nearer to the fp32 result. Casting x to the weight's dtype, as the recipe does, would return
      fp32 q/k next to a bf16 v (npu_fusion_attention refuses mixed dtypes); casting the weight down would
      change the weights. Where autocast lists ``rms_norm`` as an fp32 op (CUDA and XPU; not cpu, not
      torch_npu) torch computes and returns fp32; npu_rms_norm is not an autocast op, so that policy is applied
      here by hand. A half weight with another x dtype is not a kernel pair; the weight is raised to fp32,
      which is what torch computes with.
    - diffusers' ``RMSNorm`` (diffusers <= 0.34) casts x to the weight's dtype, as the recipe's NpuFusedRMSNorm
      does: fp32 out for an fp32 weight, as 0.32 (the recipe's base) returns on every device, and the weight's
      dtype for a half weight. (0.33-0.34's own npu branch keeps x's dtype for an fp32 weight instead.)
    - Without a weight (``elementwise_affine=False``) the kernel gets a unit fp32 gamma and x keeps its dtype.
    """

    def __init__(self, norm: nn.Module):
        super().__init__()
        diffusers_rmsnorm = _diffusers_rmsnorm_class()
        if isinstance(norm, torch.nn.RMSNorm):
            self.replaces = _TORCH_RMSNORM
            self.normalized_shape = tuple(norm.normalized_shape)
            self.eps = norm.eps  # None means finfo(x.dtype).eps, as torch.nn.RMSNorm
        elif diffusers_rmsnorm is not None and isinstance(norm, diffusers_rmsnorm):
            self.replaces = _DIFFUSERS_RMSNORM
            self.normalized_shape = tuple(norm.dim)  # type: ignore[arg-type]  # diffusers RMSNorm's attribute, via nn.Module.__getattr__
            self.eps = norm.eps  # type: ignore[assignment]  # diffusers RMSNorm's attribute, via nn.Module.__getattr__
        else:
            raise TypeError(f"NpuFusedRMSNorm wraps torch.nn.RMSNorm or diffusers' RMSNorm, not {type(norm).__name__}")
        weight = getattr(norm, "weight", None)
        bias = getattr(norm, "bias", None)
        self.register_parameter("weight", weight)  # the same Parameter object, not a copy
        self.register_parameter("bias", bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        import torch_npu

        x = hidden_states
        weight = self.weight
        if (
            self.replaces == _TORCH_RMSNORM
            and torch.is_autocast_enabled(x.device.type)
            and _autocast_runs_rms_norm_in_fp32(x.device.type)
        ):
            x = x.float()
            weight = None if weight is None else weight.float()
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        if weight is None:
            gamma = torch.ones(self.normalized_shape, dtype=torch.float32, device=x.device)
        elif self.replaces == _DIFFUSERS_RMSNORM:
            x = x.to(weight.dtype)  # type: ignore[arg-type]  # a Parameter, via nn.Module.__getattr__
            gamma = weight
        elif weight.dtype == x.dtype or weight.dtype == torch.float32:
            gamma = weight
        else:  # a half weight with another x dtype: raise the weight, as torch's own path computes with it
            gamma = weight.float()
        out = torch_npu.npu_rms_norm(x, gamma, epsilon=eps)[0]
        if self.bias is not None:
            out = out + self.bias
        return out

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, replaces={self.replaces}"


def swap_flux_rmsnorm(transformer: nn.Module) -> int:
    """Run every FLUX attention q/k RMSNorm on ``torch_npu.npu_rms_norm``; returns how many now do.

    ``norm_q``/``norm_k`` of every FLUX attention module, plus ``norm_added_q``/``norm_added_k`` where present:
    4 per double-stream block and 2 per single-stream block (152 for FLUX.1-dev's 19 + 38). Idempotent: norms
    already swapped are counted, not wrapped again.

    Raises:
        FluxgrpoError: the model has no FLUX attention norms this knows (names the installed diffusers).
    """
    attention_classes = _flux_attention_classes()
    replaceable = tuple(cls for cls in (torch.nn.RMSNorm, _diffusers_rmsnorm_class()) if cls is not None)
    newly_swapped = already_swapped = 0
    for module in list(transformer.modules()):
        if not isinstance(module, attention_classes):
            continue
        for name in FLUX_QK_NORM_NAMES:
            norm = getattr(module, name, None)
            if isinstance(norm, NpuFusedRMSNorm):
                already_swapped += 1
            elif isinstance(norm, replaceable):
                setattr(module, name, NpuFusedRMSNorm(norm))  # type: ignore[arg-type]  # isinstance against a runtime tuple of classes leaves `object`
                newly_swapped += 1
    total = newly_swapped + already_swapped
    if total == 0:
        raise FluxgrpoError(
            f"no FLUX attention q/k RMSNorm found in {type(transformer).__name__} (diffusers {_diffusers_version()}): "
            "the NPU adaptation knows FluxAttention (diffusers >= 0.35) and Attention with qk_norm='rms_norm' "
            "(diffusers <= 0.34); pass a FluxTransformer2DModel, or install a diffusers it knows "
            "(pip install 'diffusers>=0.35')"
        )
    logger.info(
        "q/k RMSNorm on torch_npu.npu_rms_norm: %d modules (%d swapped now, %d already)",
        total,
        newly_swapped,
        already_swapped,
    )
    return total


def rope_float32(
    ids: torch.Tensor, axes_dim: Iterable[int], theta: float = 10000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """FLUX's rotary (cos, sin) with every step in float32, laid out as the recipe's NPU patch does.

    Args:
        ids: [S, n_axes] positions (text ids then image ids), any real or integer dtype.
        axes_dim: rotary width of each axis, each even, summing to the head dim (FLUX.1: 16, 56, 56).
        theta: the RoPE base.

    Returns:
        cos, sin: [S, sum(axes_dim)] float32, contiguous; each angle appears twice in a row (cos θ0, cos θ0,
        cos θ1, cos θ1, ...), the interleaved form diffusers' ``apply_rotary_emb`` expects.
    """
    axes_dim = tuple(int(d) for d in axes_dim)
    if ids.ndim != 2 or ids.shape[-1] != len(axes_dim):
        raise ValueError(f"ids must be [S, {len(axes_dim)}] for axes {axes_dim}, got {tuple(ids.shape)}")
    positions = ids.to(torch.float32)
    cos_axes, sin_axes = [], []
    for axis, dim in enumerate(axes_dim):
        if dim % 2:
            raise ValueError(f"every rotary axis width must be even, got {axes_dim}")
        exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=ids.device) / dim  # [dim/2]
        inv_freq = 1.0 / (theta**exponents)  # [dim/2]
        angles = torch.outer(positions[:, axis], inv_freq)  # [S, dim/2]
        # The recipe's layout: repeat along the leading axis of the transposed angles, transpose back, and make
        # the result contiguous, for a memory layout the NPU kernels accept. The values are those of
        # repeat_interleave over the last axis.
        cos_axes.append(angles.cos().T.repeat_interleave(2, dim=0).T)  # [S, dim]
        sin_axes.append(angles.sin().T.repeat_interleave(2, dim=0).T)
    return torch.cat(cos_axes, dim=-1).contiguous(), torch.cat(sin_axes, dim=-1).contiguous()


class Float32FluxPosEmbed(nn.Module):
    """Drop-in for diffusers' ``FluxPosEmbed`` (same ``theta``/``axes_dim``, same (cos, sin)) that stays in float32."""

    def __init__(self, theta: float, axes_dim: Iterable[int]):
        super().__init__()
        self.theta = theta
        self.axes_dim = list(axes_dim)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_float32(ids, self.axes_dim, self.theta)


def diffusers_rope_is_float32_on_npu(pos_embed: nn.Module) -> bool:
    """Whether this ``FluxPosEmbed`` already computes its frequencies in float32 when ids are on npu.

    Read from the forward's bytecode, so it works where no source is installed: diffusers >= 0.39 calls
    ``maybe_adjust_dtype_for_device`` (asked directly what it gives float64 on npu); 0.33 - 0.38 compare the
    device type with "npu"; 0.32 and older only exempt mps.
    """
    forward = getattr(type(pos_embed), "forward", None)
    code = getattr(forward, "__code__", None)
    if code is None:
        return False
    if "maybe_adjust_dtype_for_device" in code.co_names:
        adjust = forward.__globals__.get("maybe_adjust_dtype_for_device")  # type: ignore[union-attr]  # it has a __code__, so it is a function
        try:  # it reads only device.type; a real npu device cannot be made without torch_npu
            return adjust(torch.float64, SimpleNamespace(type="npu")) == torch.float32
        except Exception:
            return False
    return "npu" in code.co_consts


def _patch_rope(transformer: nn.Module, force: bool) -> tuple[bool, str]:
    pos_embed = getattr(transformer, "pos_embed", None)
    if isinstance(pos_embed, Float32FluxPosEmbed):
        return False, "pos_embed already float32"
    if pos_embed is None or not hasattr(pos_embed, "theta") or not hasattr(pos_embed, "axes_dim"):
        raise FluxgrpoError(
            f"{type(transformer).__name__} has no FLUX pos_embed (theta, axes_dim) to run in float32 "
            f"(diffusers {_diffusers_version()}): pass a FluxTransformer2DModel"
        )
    if not force and diffusers_rope_is_float32_on_npu(pos_embed):
        return False, f"diffusers {_diffusers_version()} already computes RoPE in float32 on npu"
    transformer.pos_embed = Float32FluxPosEmbed(pos_embed.theta, pos_embed.axes_dim)
    return True, "pos_embed replaced by the float32 FluxPosEmbed"


def patch_rope(transformer: nn.Module, force: bool = False) -> bool:
    """Compute FLUX's RoPE in float32 with contiguous cos/sin; True if ``transformer.pos_embed`` was replaced.

    Without ``force`` the model is left alone when the installed diffusers already uses float32 on npu (0.33 and
    later). ``force`` replaces it anyway (the values are the same; on cpu it makes the float32 path testable).
    """
    replaced, reason = _patch_rope(transformer, force)
    logger.info("RoPE: %s", reason)
    return replaced


_HALF_DTYPES = (torch.bfloat16, torch.float16)


def _refuse_half_position_ids(module: nn.Module, args: tuple) -> None:
    """``pos_embed``'s forward pre-hook: FLUX's position ids must reach RoPE in float32 or an integer dtype."""
    ids = args[0] if args else None
    if isinstance(ids, torch.Tensor) and ids.dtype in _HALF_DTYPES:
        raise FluxgrpoError(
            f"FLUX's position ids reach RoPE in {str(ids.dtype).removeprefix('torch.')}: positions above 256 are "
            "no longer whole numbers there and every rotation drifts (verl-omni's rollout/trainer log-prob "
            "correlation fell to 0.13 this way): keep img_ids and txt_ids in float32 or int64; this is a fluxgrpo "
            "bug, please report it with FLUXGRPO_DEBUG=1's traceback"
        )


def guard_position_ids(transformer: nn.Module) -> None:
    """Refuse half-precision position ids at ``transformer.pos_embed`` (once per module; survives FSDP)."""
    pos_embed = getattr(transformer, "pos_embed", None)
    if pos_embed is not None and not getattr(pos_embed, "_fluxgrpo_ids_guard", False):
        pos_embed.register_forward_pre_hook(_refuse_half_position_ids)
        pos_embed._fluxgrpo_ids_guard = True


def _validate_attention(name: str, compute_dtype: torch.dtype) -> None:
    # The name itself is checked once, with the config (``adapt.ATTENTION_BACKENDS``, --attention's choices).
    if name == "npu-fusion" and compute_dtype not in (torch.bfloat16, torch.float16):
        raise UsageError(
            f"--attention npu-fusion runs torch_npu.npu_fusion_attention through diffusers' _native_npu backend, "
            f"which takes bf16/fp16 only, but the compute dtype is {compute_dtype}: use --attention sdpa "
            "(torch_npu runs SDPA on the same fused kernel), or compute in bf16"
        )


def set_attention_backend(transformer: nn.Module, name: str, compute_dtype: torch.dtype) -> str:
    """Select FLUX's attention kernel: "sdpa" (torch SDPA) or "npu-fusion" (diffusers' ``_native_npu``).

    Returns the diffusers backend name that was set. diffusers also makes it the process-wide default for
    attention modules that have no backend of their own.

    Raises:
        UsageError: npu-fusion with a compute dtype other than bf16/fp16.
        FluxgrpoError: npu-fusion without an importable torch_npu, or a diffusers that cannot select it.
    """
    _validate_attention(name, compute_dtype)
    backend = DIFFUSERS_BACKEND_FOR_ATTENTION[name]
    if name == "npu-fusion":
        status = npu_import_status()
        if not status.importable:
            why = "is not installed" if not status.installed else f"does not import ({status.error})"
            raise FluxgrpoError(
                f"--attention npu-fusion needs torch_npu, which {why}: use --attention sdpa, or run "
                "`fluxgrpo env-check` to see what is missing"
            )
    if not hasattr(transformer, "set_attention_backend"):
        if name == "sdpa":  # diffusers before 0.35: SDPA is what its default processors run
            return backend
        raise FluxgrpoError(
            f"--attention npu-fusion needs diffusers >= 0.35 (attention backends); diffusers "
            f"{_diffusers_version()} is installed: pip install 'diffusers>=0.35', or use --attention sdpa"
        )
    try:
        transformer.set_attention_backend(backend)  # type: ignore[operator]  # a peft/diffusers method reached through nn.Module.__getattr__
    except (RuntimeError, ValueError) as exc:
        raise FluxgrpoError(
            f"diffusers {_diffusers_version()} refused attention backend {backend!r} ({exc}): use --attention sdpa"
        ) from exc
    logger.info("attention: %s (diffusers backend %s)", name, backend)
    return backend


@dataclass(frozen=True)
class NpuAdaptReport:
    """What ``adapt_flux_for_npu`` did to the transformer."""

    rmsnorm_modules: int  # q/k norms now on npu_rms_norm: 4 per double block + 2 per single block
    rope_replaced: bool  # pos_embed replaced by Float32FluxPosEmbed in this call
    rope_reason: str  # why it was or was not replaced
    attention: str  # the choice: sdpa | npu-fusion
    attention_backend: str  # the diffusers backend set: native | _native_npu
    diffusers_version: str
    torch_npu_version: str | None


def adapt_flux_for_npu(
    transformer: nn.Module, *, attention: str = "sdpa", compute_dtype: torch.dtype, force: bool = False
) -> NpuAdaptReport:
    """Apply the recipe's NPU adaptations to a FLUX transformer, in place: fused q/k RMSNorm, float32 RoPE,
    the chosen attention kernel. Call it once the model is built and before FSDP wraps it.

    The trainer and sampler call it when the device type is npu. It needs an importable torch_npu, not an NPU,
    so tests run it on cpu with a stand-in torch_npu.

    Args:
        attention: "sdpa" or "npu-fusion" (bf16/fp16 compute only).
        compute_dtype: the autocast dtype of the forward passes.
        force: replace ``pos_embed`` even when diffusers already computes RoPE in float32 on npu.

    Raises:
        UsageError: a bad attention choice (checked before the model is touched).
        FluxgrpoError: torch_npu does not import, or the model is not a FLUX transformer this knows.
    """
    _validate_attention(attention, compute_dtype)
    status = npu_import_status()
    if not status.importable:
        why = "is not installed" if not status.installed else f"is installed but does not import ({status.error})"
        raise FluxgrpoError(
            f"the NPU adaptation of FLUX calls torch_npu, which {why}: run `fluxgrpo env-check` for details"
        )
    rmsnorm_modules = swap_flux_rmsnorm(transformer)
    rope_replaced, rope_reason = _patch_rope(transformer, force)
    logger.info("RoPE: %s", rope_reason)
    guard_position_ids(transformer)  # bf16 ids broke RL on NPUs in 2026: refused where they would enter RoPE
    backend = set_attention_backend(transformer, attention, compute_dtype)
    return NpuAdaptReport(
        rmsnorm_modules=rmsnorm_modules,
        rope_replaced=rope_replaced,
        rope_reason=rope_reason,
        attention=attention,
        attention_backend=backend,
        diffusers_version=_diffusers_version(),
        torch_npu_version=status.version,
    )
