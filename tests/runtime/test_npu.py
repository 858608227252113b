"""The Ascend adaptations of FLUX (fluxgrpo/runtime/npu.py), run on cpu through the stand-in torch_npu.

The stand-in (tests/fake_torch_npu) implements npu_rms_norm and npu_fusion_attention in plain torch, refuses the
dtype pairs the device refuses, and counts its calls, so these tests prove the fused paths ran and kept the
numbers of the unpatched model. It is put on sys.path per test (fixture below); no other test sees torch_npu.
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# diffusers decides at import whether torch_npu exists; import it while the stand-in is not on sys.path.
from diffusers import FluxTransformer2DModel
from diffusers.models import attention_dispatch
from diffusers.models.embeddings import get_1d_rotary_pos_embed
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm

from fluxgrpo.errors import FluxgrpoError, UsageError
from fluxgrpo.models.tiny import TINY_TRANSFORMER_CONFIG
from fluxgrpo.runtime import cann, npu
from fluxgrpo.runtime import device as rt
from fluxgrpo.runtime.device import NpuImportStatus
from fluxgrpo.runtime.npu_env import NPU_ENV_DEFAULTS, apply_npu_env_defaults

FAKE_TORCH_NPU = Path(__file__).resolve().parents[1] / "fake_torch_npu"
DIFFUSERS_VERSION = importlib.metadata.version("diffusers")
TINY_CONFIG = {**TINY_TRANSFORMER_CONFIG, "in_channels": 16}  # narrower input: these tests feed raw tokens
TINY_NORM_COUNT = 2 * 4 + 2 * 2  # 4 q/k norms per double block, 2 per single block


def _torch_npu_module_names() -> list[str]:
    return [name for name in sys.modules if name == "torch_npu" or name.startswith("torch_npu.")]


def _drop_torch_npu_modules() -> None:
    for name in _torch_npu_module_names():
        del sys.modules[name]


def _hide_torch_npu_modules(monkeypatch) -> None:
    """Unload torch_npu for this test; monkeypatch puts back whatever was loaded before (a real one, on NPU hosts)."""
    for name in _torch_npu_module_names():
        monkeypatch.delitem(sys.modules, name)


@pytest.fixture
def fake_torch_npu(monkeypatch):
    """The stand-in torch_npu, importable for this test only; yields the imported module (with CALLS)."""
    _hide_torch_npu_modules(monkeypatch)
    monkeypatch.syspath_prepend(str(FAKE_TORCH_NPU))
    rt._reset_npu_status_for_tests()
    import torch_npu

    torch_npu.reset_calls()
    yield torch_npu
    _drop_torch_npu_modules()
    rt._reset_npu_status_for_tests()


@pytest.fixture
def no_torch_npu(monkeypatch):
    for module in (npu, cann):
        monkeypatch.setattr(module, "npu_import_status", lambda: NpuImportStatus(False, False, None, None))


@pytest.fixture
def restore_attention_backend(monkeypatch):
    """diffusers' set_attention_backend also sets a process-wide default; put it back after the test."""
    registry = attention_dispatch._AttentionBackendRegistry
    monkeypatch.setattr(registry, "_active_backend", registry._active_backend)


def tiny_flux(seed: int = 0) -> FluxTransformer2DModel:
    torch.manual_seed(seed)
    model = FluxTransformer2DModel(**TINY_CONFIG)
    # The q/k norm weights start at 1; spread them so a swap that lost or copied them would change the output.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".attn.norm_" in name:
                param.uniform_(0.5, 1.5)
    return model


def tiny_inputs(dtype: torch.dtype = torch.float32) -> dict:
    g = torch.Generator().manual_seed(1)
    return dict(
        hidden_states=torch.randn(2, 16, 16, generator=g).to(dtype),  # [B, image tokens, in_channels]
        encoder_hidden_states=torch.randn(2, 8, 32, generator=g).to(dtype),  # [B, text tokens, joint dim]
        pooled_projections=torch.randn(2, 32, generator=g).to(dtype),
        timestep=torch.tensor([0.5, 0.25], dtype=dtype),
        img_ids=torch.stack(
            torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), indexing="ij"), -1
        ).reshape(16, 3),  # a 4x4 latent grid
        txt_ids=torch.zeros(8, 3),
        guidance=torch.tensor([3.5, 3.5], dtype=dtype),
        return_dict=False,
    )


def fused_modules(model: torch.nn.Module) -> list[npu.NpuFusedRMSNorm]:
    return [m for m in model.modules() if isinstance(m, npu.NpuFusedRMSNorm)]


# --- the stand-in itself -------------------------------------------------------------------------------------


def test_stand_in_refuses_what_the_device_refuses(fake_torch_npu):
    x = torch.randn(2, 3, 8)
    with pytest.raises(RuntimeError, match="dtype pair"):
        fake_torch_npu.npu_rms_norm(x, torch.ones(8, dtype=torch.bfloat16))
    # x = [3, 4]: mean of squares (9 + 16) / 2 = 12.5, rstd = 1/sqrt(12.5 + 0) = 0.28284; y = [0.84853, 1.13137]
    y, rstd = fake_torch_npu.npu_rms_norm(torch.tensor([[3.0, 4.0]]), torch.ones(2), epsilon=0.0)
    assert torch.allclose(y, torch.tensor([[3 / math.sqrt(12.5), 4 / math.sqrt(12.5)]]))
    assert rstd.shape == (1, 1) and rstd.dtype == torch.float32


# --- RMSNorm swap --------------------------------------------------------------------------------------------


def test_swap_counts_and_is_idempotent_on_tiny_flux(fake_torch_npu):
    model = tiny_flux()
    params_before = dict(model.named_parameters())
    assert npu.swap_flux_rmsnorm(model) == TINY_NORM_COUNT
    swapped = fused_modules(model)
    assert len(swapped) == TINY_NORM_COUNT
    assert npu.swap_flux_rmsnorm(model) == TINY_NORM_COUNT  # counted again, not wrapped again
    assert fused_modules(model) == swapped
    assert not any(isinstance(m.weight, npu.NpuFusedRMSNorm) for m in swapped)
    params_after = dict(model.named_parameters())
    assert params_after.keys() == params_before.keys()
    assert all(params_after[name] is param for name, param in params_before.items())  # shared, not copied
    attn = model.transformer_blocks[0].attn
    assert {type(getattr(attn, n)) for n in npu.FLUX_QK_NORM_NAMES} == {npu.NpuFusedRMSNorm}


def test_swap_counts_on_flux1_dev_shape_on_meta(fake_torch_npu):
    with torch.device("meta"):
        model = FluxTransformer2DModel(guidance_embeds=True)  # the defaults are FLUX.1-dev's widths
    assert (model.config.num_layers, model.config.num_single_layers) == (19, 38)
    assert npu.swap_flux_rmsnorm(model) == 19 * 4 + 38 * 2 == 152
    assert npu.swap_flux_rmsnorm(model) == 152
    assert all(m.weight.is_meta and m.weight.shape == (128,) for m in fused_modules(model))


def test_swapped_model_matches_unpatched_forward_and_gradients(fake_torch_npu):
    reference = tiny_flux()
    patched = copy.deepcopy(reference)
    npu.swap_flux_rmsnorm(patched)

    out_ref = reference(**tiny_inputs())[0]
    out_patched = patched(**tiny_inputs())[0]
    assert fake_torch_npu.CALLS["npu_rms_norm"] == TINY_NORM_COUNT  # one kernel call per swapped norm
    assert out_patched.abs().max() > 0.1  # a real signal, not a zero-initialised output
    assert torch.allclose(out_patched, out_ref, rtol=0, atol=1e-6)

    out_ref.square().mean().backward()
    out_patched.square().mean().backward()
    ref_params = dict(reference.named_parameters())
    for name, param in patched.named_parameters():
        if ".attn.norm_" in name:
            assert param.grad is not None and param.grad.abs().sum() > 0, name
            assert torch.allclose(param.grad, ref_params[name].grad, rtol=1e-4, atol=1e-7), name


def test_state_dict_unchanged_and_loads_strictly_into_unpatched(fake_torch_npu):
    patched = tiny_flux(seed=1)
    keys_before = list(patched.state_dict())
    npu.swap_flux_rmsnorm(patched)
    assert list(patched.state_dict()) == keys_before
    unpatched = tiny_flux(seed=2)
    unpatched.load_state_dict(patched.state_dict(), strict=True)
    for (name, a), b in zip(patched.state_dict().items(), unpatched.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    patched.load_state_dict(tiny_flux(seed=3).state_dict(), strict=True)  # and back


# (x dtype, weight dtype): the training pair (bf16 activations, fp32 master weight), pure fp32, pure bf16, and
# the pairs the kernel refuses ((fp32, bf16), (bf16, fp16)), which must still return what torch returns.
DTYPE_PAIRS = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float16),
]


def _rms_norm_fp64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # torch's own path, not ours
@pytest.mark.parametrize(("x_dtype", "w_dtype"), DTYPE_PAIRS)
def test_fused_norm_dtype_and_values_follow_torch_rmsnorm(fake_torch_npu, x_dtype, w_dtype):
    torch.manual_seed(0)
    original = torch.nn.RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        original.weight.uniform_(0.5, 1.5)
    original = original.to(w_dtype)
    fused = npu.NpuFusedRMSNorm(original)
    x = torch.randn(2, 5, 3, 16).to(x_dtype)  # [B, S, heads, head_dim] as FLUX feeds it
    expected = original(x)
    got = fused(x)
    assert got.dtype == expected.dtype
    # One rounding to the output dtype (half an ulp: 2^-9 relative for bf16, 2^-12 for fp16, 2^-25 for fp32) on
    # top of the fp32 computation; allow two.
    relative = {torch.float32: 2e-6, torch.float16: 2**-11, torch.bfloat16: 2**-8}[got.dtype]
    exact = _rms_norm_fp64(x, original.weight, 1e-6)
    assert torch.allclose(got.double(), exact, rtol=relative, atol=relative)
    assert torch.allclose(got.double(), expected.double(), rtol=2 * relative, atol=2 * relative)


def test_fused_norm_under_autocast_keeps_bf16_for_fp32_master_weights(fake_torch_npu):
    original = torch.nn.RMSNorm(16, eps=1e-6)
    fused = npu.NpuFusedRMSNorm(original)
    linear = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q = linear(x)  # bf16 under autocast, as FLUX's to_q output
        assert q.dtype == torch.bfloat16
        assert fused(q).dtype == original(q).dtype == torch.bfloat16
    assert original.weight.dtype == torch.float32  # the master weight was never cast down


def test_fused_norm_applies_an_fp32_autocast_policy_by_hand(fake_torch_npu, monkeypatch):
    # CUDA's autocast lists rms_norm as fp32: torch.nn.RMSNorm then computes and returns fp32. npu_rms_norm is
    # no autocast op, so the wrapper must do the same by hand where a device's policy says so.
    monkeypatch.setattr(npu, "_autocast_runs_rms_norm_in_fp32", lambda device_type: True)
    fused = npu.NpuFusedRMSNorm(torch.nn.RMSNorm(16, eps=1e-6))
    q = torch.randn(4, 16).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused(q)
    assert out.dtype == torch.float32
    assert torch.allclose(out.double(), _rms_norm_fp64(q, fused.weight, 1e-6), rtol=1e-6, atol=1e-6)


def test_cpu_autocast_has_no_rms_norm_policy():
    # What the autocast test above relies on: on cpu, torch.nn.RMSNorm keeps x's dtype under autocast.
    assert npu._autocast_runs_rms_norm_in_fp32("cpu") is False


def test_fused_norm_without_weight(fake_torch_npu):
    original = torch.nn.RMSNorm(16, eps=1e-6, elementwise_affine=False)
    fused = npu.NpuFusedRMSNorm(original)
    assert fused.weight is None and list(fused.state_dict()) == []
    x = torch.randn(3, 16).bfloat16()
    assert fused(x).dtype == original(x).dtype == torch.bfloat16
    assert torch.allclose(fused(x).double(), _rms_norm_fp64(x, torch.ones(16), 1e-6), rtol=2**-8, atol=2**-8)
    assert fake_torch_npu.CALLS["npu_rms_norm"] == 2


def test_older_diffusers_rmsnorm_is_swapped_with_its_own_dtype_rule(fake_torch_npu):
    # diffusers <= 0.34 built FLUX's q/k norms from its own RMSNorm; rebuild the tiny model that way.
    reference = tiny_flux()
    for module in reference.modules():
        for name in npu.FLUX_QK_NORM_NAMES:
            norm = getattr(module, name, None)
            if isinstance(norm, torch.nn.RMSNorm):
                old_style = DiffusersRMSNorm(norm.normalized_shape[0], eps=norm.eps)
                old_style.weight = norm.weight
                setattr(module, name, old_style)
    patched = copy.deepcopy(reference)
    assert npu.swap_flux_rmsnorm(patched) == TINY_NORM_COUNT
    assert {m.replaces for m in fused_modules(patched)} == {"diffusers RMSNorm"}
    with torch.no_grad():
        assert torch.allclose(patched(**tiny_inputs())[0], reference(**tiny_inputs())[0], rtol=0, atol=1e-6)

    old_style = DiffusersRMSNorm(16, eps=1e-6)
    x = torch.randn(3, 16).bfloat16()
    assert npu.NpuFusedRMSNorm(old_style)(x).dtype == old_style(x).dtype == torch.float32  # fp32 weight wins


def test_model_without_flux_attention_norms_raises(fake_torch_npu):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.RMSNorm(8))
    with pytest.raises(FluxgrpoError, match=f"diffusers {DIFFUSERS_VERSION}"):
        npu.swap_flux_rmsnorm(model)
    with pytest.raises(TypeError):
        npu.NpuFusedRMSNorm(torch.nn.LayerNorm(8))


# --- RoPE ----------------------------------------------------------------------------------------------------


def test_rope_float32_hand_worked():
    # axes (2, 4), theta 1e4, one token at position (1, 3):
    #   axis 0, width 2: inverse frequencies 1e4^-(0/2) = [1]            → angle [1]
    #   axis 1, width 4: inverse frequencies 1e4^-(0/4), 1e4^-(2/4) = [1, 0.01] → angles [3, 0.03]
    # each angle twice in a row: cos = [cos 1, cos 1, cos 3, cos 3, cos 0.03, cos 0.03]
    cos, sin = npu.rope_float32(torch.tensor([[1.0, 3.0]]), (2, 4), theta=10000)
    angles = [1.0, 1.0, 3.0, 3.0, 0.03, 0.03]
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (1, 6)
    assert torch.allclose(cos, torch.tensor([[math.cos(a) for a in angles]]), atol=1e-7)
    assert torch.allclose(sin, torch.tensor([[math.sin(a) for a in angles]]), atol=1e-7)


def test_rope_float32_matches_the_float64_path_at_flux1_scale():
    # FLUX.1 axes at 1024 px: 512 text tokens at 0 and a 64x64 latent grid. Largest angle 63 rad; three float32
    # roundings on the way (power, division, product: 3 x 2^-24 relative) move it by at most 63 x 1.8e-7
    # = 1.1e-5, and cos/sin by no more than that plus an ulp of the result: tolerance 2e-5.
    grid = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(64.0), torch.arange(64.0), indexing="ij"), -1)
    ids = torch.cat([torch.zeros(512, 3), grid.reshape(-1, 3)])
    axes = (16, 56, 56)
    cos, sin = npu.rope_float32(ids, axes, theta=10000)
    per_axis = [
        get_1d_rotary_pos_embed(dim, ids[:, i], theta=10000, use_real=True, freqs_dtype=torch.float64)
        for i, dim in enumerate(axes)
    ]
    cos64 = torch.cat([c for c, _ in per_axis], -1)
    sin64 = torch.cat([s for _, s in per_axis], -1)
    assert cos.is_contiguous() and sin.is_contiguous() and cos.shape == (512 + 4096, 128)
    assert torch.allclose(cos, cos64, rtol=0, atol=2e-5)
    assert torch.allclose(sin, sin64, rtol=0, atol=2e-5)


class Diffusers032FluxPosEmbed(torch.nn.Module):
    """FluxPosEmbed as diffusers 0.32 wrote it: float64 frequencies everywhere but mps (so also on npu)."""

    def __init__(self, theta: int, axes_dim):
        super().__init__()
        self.theta, self.axes_dim = theta, axes_dim

    def forward(self, ids):
        freqs_dtype = torch.float32 if ids.device.type == "mps" else torch.float64
        parts = [
            get_1d_rotary_pos_embed(dim, ids[:, i].float(), self.theta, use_real=True, freqs_dtype=freqs_dtype)
            for i, dim in enumerate(self.axes_dim)
        ]
        return torch.cat([c for c, _ in parts], -1), torch.cat([s for _, s in parts], -1)


def test_patch_rope_detects_what_diffusers_already_does():
    model = tiny_flux()
    assert npu.diffusers_rope_is_float32_on_npu(model.pos_embed)  # 0.42: maybe_adjust_dtype_for_device
    assert npu.patch_rope(model) is False
    assert type(model.pos_embed).__name__ == "FluxPosEmbed"

    model.pos_embed = Diffusers032FluxPosEmbed(10000, TINY_CONFIG["axes_dims_rope"])
    assert not npu.diffusers_rope_is_float32_on_npu(model.pos_embed)
    assert npu.patch_rope(model) is True  # replaced without force
    assert isinstance(model.pos_embed, npu.Float32FluxPosEmbed)
    assert npu.patch_rope(model, force=True) is False  # already float32


def test_forced_patch_rope_gives_the_same_transformer_output():
    reference = tiny_flux()
    patched = copy.deepcopy(reference)
    assert npu.patch_rope(patched, force=True) is True
    assert isinstance(patched.pos_embed, npu.Float32FluxPosEmbed)
    assert list(patched.state_dict()) == list(reference.state_dict())
    with torch.no_grad():
        # positions ≤ 3 here: angle errors ≤ 3 x 1.8e-7, far inside 1e-5 after the network
        assert torch.allclose(patched(**tiny_inputs())[0], reference(**tiny_inputs())[0], rtol=0, atol=1e-5)


def test_patch_rope_refuses_a_model_without_pos_embed():
    with pytest.raises(FluxgrpoError, match="pos_embed"):
        npu.patch_rope(torch.nn.Linear(2, 2), force=True)


# --- attention -----------------------------------------------------------------------------------------------


def test_npu_fusion_needs_a_half_precision_compute_dtype(fake_torch_npu):
    # The --attention name itself is checked once, by each command's config (test_config, test_sample).
    with pytest.raises(UsageError, match="--attention sdpa"):
        npu.set_attention_backend(tiny_flux(), "npu-fusion", torch.float32)


def test_npu_fusion_refused_without_torch_npu(no_torch_npu):
    with pytest.raises(FluxgrpoError, match=r"not installed.*--attention sdpa"):
        npu.set_attention_backend(tiny_flux(), "npu-fusion", torch.bfloat16)


def test_sdpa_sets_diffusers_native_backend(restore_attention_backend):
    model = tiny_flux()
    assert npu.set_attention_backend(model, "sdpa", torch.float32) == "native"
    backends = {m.processor._attention_backend for m in model.modules() if hasattr(m, "processor")}
    assert backends == {attention_dispatch.AttentionBackendName.NATIVE}


def test_npu_fusion_refusal_by_diffusers_is_explained(fake_torch_npu, restore_attention_backend):
    # diffusers decided at import that torch_npu is absent (true here: it was imported before the stand-in)
    with pytest.raises(FluxgrpoError, match=r"refused attention backend '_native_npu'.*--attention sdpa"):
        npu.set_attention_backend(tiny_flux(), "npu-fusion", torch.bfloat16)


def test_npu_fusion_runs_torch_npu_fusion_attention(fake_torch_npu, monkeypatch, restore_attention_backend):
    # diffusers bound npu_fusion_attention at import, when no torch_npu existed; hand it the stand-in's.
    monkeypatch.setattr(attention_dispatch, "_CAN_USE_NPU_ATTN", True)
    monkeypatch.setattr(attention_dispatch, "npu_fusion_attention", fake_torch_npu.npu_fusion_attention)
    reference = tiny_flux().to(torch.bfloat16)
    fused = copy.deepcopy(reference)
    npu.set_attention_backend(reference, "sdpa", torch.bfloat16)
    report = npu.adapt_flux_for_npu(fused, attention="npu-fusion", compute_dtype=torch.bfloat16)
    assert report.attention_backend == "_native_npu"
    with torch.no_grad():
        out_fused = fused(**tiny_inputs(torch.bfloat16))[0]
        out_reference = reference(**tiny_inputs(torch.bfloat16))[0]
    assert fake_torch_npu.CALLS["npu_fusion_attention"] == 4  # one per block: 2 double + 2 single
    assert fake_torch_npu.CALLS["npu_rms_norm"] == TINY_NORM_COUNT
    assert out_fused.dtype == torch.bfloat16
    # bf16 outputs of magnitude ≤ 2: an ulp there is 2^-7 = 0.0078; allow a few for the differently ordered sums
    assert torch.allclose(out_fused.float(), out_reference.float(), rtol=0, atol=4 * 2**-7)


# --- adapt_flux_for_npu --------------------------------------------------------------------------------------


def test_adapt_applies_all_three(fake_torch_npu, restore_attention_backend):
    model = tiny_flux()
    report = npu.adapt_flux_for_npu(model, compute_dtype=torch.float32, force=True)
    assert report == npu.NpuAdaptReport(
        rmsnorm_modules=TINY_NORM_COUNT,
        rope_replaced=True,
        rope_reason="pos_embed replaced by the float32 FluxPosEmbed",
        attention="sdpa",
        attention_backend="native",
        diffusers_version=DIFFUSERS_VERSION,
        torch_npu_version="2.7.1+fake",
    )
    again = npu.adapt_flux_for_npu(model, compute_dtype=torch.float32, force=True)
    assert (again.rmsnorm_modules, again.rope_replaced) == (TINY_NORM_COUNT, False)
    unforced = npu.adapt_flux_for_npu(tiny_flux(), compute_dtype=torch.float32)
    assert not unforced.rope_replaced and "already computes RoPE in float32" in unforced.rope_reason


def test_adapt_checks_before_touching_the_model(fake_torch_npu):
    model = tiny_flux()
    with pytest.raises(UsageError, match="--attention sdpa"):
        npu.adapt_flux_for_npu(model, attention="npu-fusion", compute_dtype=torch.float32)
    assert fused_modules(model) == []


def test_adapt_needs_torch_npu(no_torch_npu):
    model = tiny_flux()
    with pytest.raises(FluxgrpoError, match="env-check"):
        npu.adapt_flux_for_npu(model, compute_dtype=torch.bfloat16)
    assert fused_modules(model) == []


# --- environment report, CANN, peaks -------------------------------------------------------------------------


def test_report_with_working_torch_npu(fake_torch_npu):
    report = cann.npu_runtime_report(environ={"TASK_QUEUE_ENABLE": "2"})
    assert report["torch_npu_importable"] and report["torch_npu_version"] == "2.7.1+fake"
    assert report["cann_version"] == "8.3.RC1"
    assert report["cann_version_source"] == "torch_npu.utils.get_cann_version()"
    assert report["devices"] == [
        {"index": 0, "name": "Ascend910_9391", "peak_tflops": cann.peak_tflops("Ascend910_9391")},
        {"index": 1, "name": "Ascend910_9391", "peak_tflops": cann.peak_tflops("Ascend910_9391")},
    ]
    assert report["env"]["TASK_QUEUE_ENABLE"] == "2" and report["env"]["COMBINED_ENABLE"] is None
    assert report["explanation"] is None
    # the stand-in claims 2.7.1 while torch here is another release: the mismatch is named
    assert any("install torch==2.7.1" in note for note in report["notes"])


def test_report_explains_an_npu_that_sees_no_device(fake_torch_npu, monkeypatch):
    monkeypatch.setattr(fake_torch_npu.npu, "DEVICE_NAMES", [])
    report = cann.npu_runtime_report(environ={})
    assert report["devices"] == []
    assert any("sees no NPU" in note and "ASCEND_RT_VISIBLE_DEVICES" in note for note in report["notes"])


def test_report_reads_cann_from_install_files_when_torch_npu_cannot_tell(fake_torch_npu, monkeypatch, tmp_path):
    monkeypatch.setattr(fake_torch_npu.utils, "CANN_VERSIONS", {})  # '' as for CANN older than 8.1.RC1
    info = tmp_path / "aarch64-linux" / "ascend_toolkit_install.info"
    info.parent.mkdir()
    info.write_text("package_name=Ascend-cann-toolkit\nversion=8.5.0\ninnerversion=V100R001C25\narch=aarch64\n")
    report = cann.npu_runtime_report(environ={"ASCEND_HOME_PATH": str(tmp_path)})
    assert (report["cann_version"], report["cann_version_source"]) == ("8.5.0", str(info))


def test_version_cfg_gives_the_public_version(tmp_path):
    (tmp_path / "version.cfg").write_text("# installed\nruntime_running_version=[7.3.0.1.231:8.0.RC2]\n")
    assert cann.read_cann_version(tmp_path) == ("8.0.RC2", tmp_path / "version.cfg")
    assert cann.read_cann_version(tmp_path / "missing") is None
    env = {"ASCEND_HOME_PATH": str(tmp_path / "missing"), "ASCEND_TOOLKIT_HOME": str(tmp_path), "HOME": "/h"}
    assert cann.cann_home_candidates(env)[:4] == [
        tmp_path / "missing",
        tmp_path,
        Path("/usr/local/Ascend/cann"),
        Path("/usr/local/Ascend/ascend-toolkit/latest"),
    ]
    assert cann.find_cann_version(env) == ("8.0.RC2", tmp_path / "version.cfg")


def test_report_without_torch_npu(no_torch_npu):
    report = cann.npu_runtime_report(environ={})
    assert not report["torch_npu_installed"] and report["devices"] == []
    assert any("not installed" in note for note in report["notes"])
    assert report["explanation"] is None  # nothing is broken: there is just no NPU stack


def test_report_explains_a_torch_npu_that_does_not_import(tmp_path, monkeypatch):
    package = tmp_path / "torch_npu"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('libhccl.so: cannot open shared object file')\n")
    _hide_torch_npu_modules(monkeypatch)
    monkeypatch.syspath_prepend(str(tmp_path))
    rt._reset_npu_status_for_tests()
    try:
        report = cann.npu_runtime_report(environ={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    finally:
        _drop_torch_npu_modules()
        rt._reset_npu_status_for_tests()
    assert report["torch_npu_installed"] and not report["torch_npu_importable"]
    assert "libhccl.so" in report["torch_npu_error"]
    explanation = report["explanation"]
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in explanation and "set_env.sh" in explanation
    assert "no CANN install" in explanation and "torch_npu is installed but does not import" in explanation


def test_report_works_where_torch_itself_does_not_import():
    # torch-npu without CANN makes `import torch` fail; env-check must still import this module and report.
    script = (
        "import json, sys\n"
        "sys.modules['torch'] = None  # any `import torch` now raises ImportError\n"
        "from fluxgrpo.runtime import cann\n"
        "print(json.dumps(cann.npu_runtime_report(environ={})))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["torch_version"] is None
    assert (
        "`import torch` fails" in report["explanation"] and "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in report["explanation"]
    )


def test_report_never_raises(monkeypatch):
    def broken():
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(cann, "npu_import_status", broken)
    report = cann.npu_runtime_report(environ={})
    assert any("driver exploded" in note for note in report["notes"])


def test_peak_tflops_table():
    # cube cores x MHz x 1e6 x (16·16·16 MACs x 2 FLOPs = 8192) per cycle:
    assert cann.peak_tflops("Ascend910_9391") == pytest.approx(24 * 1850e6 * 8192 / 1e12)  # 363.7248 (A3 die)
    assert cann.peak_tflops(" ascend910b2 ") == pytest.approx(353.8944)  # 24 x 1800e6 x 8192
    assert cann.peak_tflops("Ascend910B4-1") == pytest.approx(245.76)  # 20 x 1500e6 x 8192
    assert cann.peak_tflops("Ascend310P3") is None
    assert cann.peak_tflops("") is None


def test_env_defaults_never_override_user_values():
    environ = {"TASK_QUEUE_ENABLE": "1", "HCCL_CONNECT_TIMEOUT": "600"}
    applied = apply_npu_env_defaults(environ)
    assert environ["TASK_QUEUE_ENABLE"] == "1" and environ["HCCL_CONNECT_TIMEOUT"] == "600"
    assert applied == {"COMBINED_ENABLE": "1", "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"}
    assert {var.name for var in NPU_ENV_DEFAULTS} <= environ.keys()
    assert apply_npu_env_defaults(environ) == {}
