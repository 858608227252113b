"""Issue #50, what Ascend users hit in 2026, on cpu through the stand-in torch_npu (tests/fake_torch_npu):

- the torch-npu pip version is not the Ascend product version: env-check names the CANN a wheel needs (Ascend's
  compatibility table) and warns when the installed CANN is another;
- numerics that silently break RL on NPUs: position ids / RoPE inputs in bf16, npu_rms_norm without a gamma,
  low-precision norms: the adapted model refuses the first, the deep check's kernel comparisons catch the others.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# diffusers decides at import whether torch_npu exists; import it while the stand-in is not on sys.path.
from diffusers import FluxTransformer2DModel

from fluxgrpo.runtime import device as rt
from fluxgrpo.runtime.npu_versions import cann_matches, cann_note, normalise_wheel, release_of

FAKE_TORCH_NPU = Path(__file__).resolve().parents[1] / "fake_torch_npu"


@pytest.fixture
def stand_in(monkeypatch):
    """The stand-in torch_npu, importable for this test only."""
    for name in [n for n in sys.modules if n == "torch_npu" or n.startswith("torch_npu.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(FAKE_TORCH_NPU))
    rt._reset_npu_status_for_tests()
    import torch_npu

    torch_npu.reset_calls()
    yield torch_npu
    for name in [n for n in sys.modules if n == "torch_npu" or n.startswith("torch_npu.")]:
        del sys.modules[name]
    rt._reset_npu_status_for_tests()


# --------------------------------------------------------------------------------------------- versions


@pytest.mark.parametrize(
    "wheel, product, cann",
    [
        ("2.7.1.post8", "26.1.0", "9.1.0"),  # MindSpeed-MM 26.1.0's manual install
        ("2.7.1post8", "26.1.0", "9.1.0"),  # as MindSpeed spells it
        ("2.7.1.post4", "26.0.0", "9.0.0"),
        ("2.12.0", "26.1.0", "9.1.0"),  # the current recommendation
        ("2.12.0.post2", "26.1.1", "9.1.x"),
        ("2.6.0.post5", "7.3.0", "8.5.0"),
        ("2.7.1", "7.2.0", "8.3.RC1"),
        ("2.7.1+cpu", "7.2.0", "8.3.RC1"),
    ],
)
def test_each_wheel_names_its_release_and_cann(wheel, product, cann):
    assert release_of(wheel) == (product, cann)


def test_versions_outside_the_table_are_not_guessed():
    assert release_of("2.14.0") is None and release_of("2.7.2") is None
    note = cann_note("2.14.0", "9.1.0")
    assert note is not None and not note[1] and "not in Ascend/pytorch COMPATIBILITY.md" in note[0]
    assert normalise_wheel("2.9.0post6") == "2.9.0.post6"


def test_matching_reads_patch_releases_and_builds():
    assert cann_matches("9.1.x", "9.1.1") and not cann_matches("9.1.x", "9.0.0")
    assert cann_matches("9.1.0", "9.1.0") and cann_matches("8.3.RC1", "8.3.RC1.alpha001")
    assert not cann_matches("9.1.0", "9.1.1") and not cann_matches("9.0.0", "9.0.01")


def test_env_check_warns_when_the_installed_cann_is_not_the_wheels(stand_in, monkeypatch):
    from fluxgrpo.envcheck import collect_report

    def pairing() -> dict:
        rt._reset_npu_status_for_tests()
        report = collect_report(requested_device="cpu", reward="brightness")
        return next(c for c in report["checks"] if c["name"] == "torch-npu / CANN")

    matched = pairing()  # the stand-in: torch-npu 2.7.1 on CANN 8.3.RC1, as 7.2.0 pairs them
    assert matched["status"] == "ok" and "needs CANN 8.3.RC1" in matched["detail"], matched
    monkeypatch.setattr(stand_in, "__version__", "2.7.1.post8")  # TorchNPU 26.1.0 on the same CANN 8.3.RC1
    mismatched = pairing()
    assert mismatched["status"] == "warn", mismatched
    assert "torch-npu 2.7.1.post8 is TorchNPU 26.1.0 and needs CANN 9.1.0" in mismatched["detail"]
    assert "but CANN 8.3.RC1 is installed" in mismatched["detail"] and "2.7.1" in mismatched["detail"]


# --------------------------------------------------------------------------------------------- numerics


def _tiny_flux() -> FluxTransformer2DModel:
    from fluxgrpo.models.tiny import TINY_TRANSFORMER_CONFIG

    torch.manual_seed(0)
    return FluxTransformer2DModel(**{**TINY_TRANSFORMER_CONFIG, "in_channels": 16})


def _tiny_inputs(ids_dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(1)
    rows = torch.arange(17.0)  # a 17 × 17 latent grid
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), rows, rows, indexing="ij"), -1).reshape(-1, 3)
    return dict(
        hidden_states=torch.randn(1, 289, 16, generator=g),
        encoder_hidden_states=torch.randn(1, 8, 32, generator=g),
        pooled_projections=torch.randn(1, 32, generator=g),
        timestep=torch.tensor([0.5]),
        img_ids=img_ids.to(ids_dtype),
        txt_ids=torch.zeros(8, 3, dtype=ids_dtype),
        guidance=torch.tensor([3.5]),
        return_dict=False,
    )


def test_position_ids_in_bf16_are_refused_where_they_enter_rope(stand_in):
    from fluxgrpo.errors import FluxgrpoError
    from fluxgrpo.runtime.npu import adapt_flux_for_npu

    model = _tiny_flux()
    adapt_flux_for_npu(model, compute_dtype=torch.bfloat16, force=True)
    with torch.no_grad():
        model(**_tiny_inputs(torch.float32))  # float32 (or int64) ids: as the run builds them
        with pytest.raises(FluxgrpoError, match=r"position ids reach RoPE in bfloat16: .* float32 or int64"):
            model(**_tiny_inputs(torch.bfloat16))


def _kernels(height: int = 64) -> dict[str, list]:
    from fluxgrpo.runtime.kernel_check import compare_swapped_kernels

    out: dict[str, list] = {}
    for comparison in compare_swapped_kernels(torch.device("cpu"), height, height, 12):
        out.setdefault(comparison.op, []).append(comparison)
    return out


@pytest.fixture
def deep_on_stand_in(stand_in, monkeypatch):
    """The deep check's kernel comparisons as they run on an NPU, on the stand-in."""
    monkeypatch.setenv("FLUXGRPO_FORCE_NPU_ADAPT", "1")
    return stand_in


def test_the_deep_check_passes_the_swapped_norms_rope_and_layer_norm(deep_on_stand_in):
    kernels = _kernels()
    for op in ("rms_norm", "rms_norm (no weight)", "layer_norm", "rope"):
        assert [c.ok for c in kernels[op]] == [True, True], (op, kernels[op])


def test_the_deep_check_catches_npu_rms_norm_called_without_a_gamma(deep_on_stand_in, monkeypatch):
    import torch_npu

    from fluxgrpo.runtime import npu

    def without_gamma(self, hidden_states):  # what diffusers issue 14380 did: the weightless norm's None as gamma
        return torch_npu.npu_rms_norm(hidden_states, self.weight, epsilon=self.eps or 1e-6)[0]

    monkeypatch.setattr(npu.NpuFusedRMSNorm, "forward", without_gamma)
    kernels = _kernels()
    assert [c.ok for c in kernels["rms_norm"]] == [True, True]
    weightless = kernels["rms_norm (no weight)"]
    assert not any(c.ok for c in weightless) and "gamma is required" in (weightless[0].problem or ""), weightless


def test_the_deep_check_catches_low_precision_norms(deep_on_stand_in, monkeypatch):
    import torch_npu

    def bf16_layer_norm(x, shape, weight=None, bias=None, eps=1e-5):  # statistics in bf16
        x = x.to(torch.bfloat16)
        mean = x.mean(-1, keepdim=True)
        return (x - mean) * torch.rsqrt(((x * x).mean(-1, keepdim=True) - mean * mean).clamp_min(0) + eps)

    def bf16_rms_norm(x, gamma, epsilon=1e-6):
        low = x.to(torch.bfloat16)
        mean_square = (low * low).mean(-1, keepdim=True)
        return (low * torch.rsqrt(mean_square + epsilon) * gamma.to(torch.bfloat16)).to(x.dtype), mean_square.float()

    assert all(c.ok for c in _kernels()["layer_norm"])
    monkeypatch.setattr(torch.nn.functional, "layer_norm", bf16_layer_norm)
    monkeypatch.setattr(torch_npu, "npu_rms_norm", bf16_rms_norm)
    kernels = _kernels()
    assert not any(c.ok for c in kernels["layer_norm"]), kernels["layer_norm"]
    fp32 = {c.dtype: c for c in kernels["rms_norm"]}["fp32"]  # the fp32 comparison shows a bf16 kernel plainly
    assert not fp32.ok and fp32.max_error is not None and fp32.max_error > 100 * fp32.tolerance


def test_the_deep_check_catches_a_model_that_lets_bf16_ids_into_rope(deep_on_stand_in, monkeypatch):
    from fluxgrpo.runtime import npu

    monkeypatch.setattr(npu, "guard_position_ids", lambda transformer: None)
    rope = _kernels()["rope"]
    assert not any(c.ok for c in rope) and "bfloat16 reach RoPE unrefused" in (rope[0].problem or ""), rope


def test_the_first_micro_batch_log_ratio_shows_numerics_that_differ_between_rollout_and_update(
    tiny_weights, tiny_embeddings, tmp_path, monkeypatch
):
    """The training metric: on-policy, the update must recompute the rollout's log-probs, so the first micro-batch's
    |log ρ| is 0 on cpu. A norm or RoPE that runs in low precision in one phase only (a training path that falls
    back to an unfused op, verl PR 6330; bf16 RoPE inputs on one side, verl-omni) moves it by orders of magnitude."""
    from diffusers.models.transformers import transformer_flux
    from training_helpers import run, tiny_config

    def first_ratio(out: str) -> float:
        cfg = tiny_config(tiny_weights, tiny_embeddings, tmp_path / out, max_train_steps=1, checkpointing_steps=1)
        return run(cfg)[0]["first_abs_log_ratio"]

    clean = first_ratio("clean")
    assert clean == 0.0  # the same code and dtype in both phases: exactly the rollout's log-probs on cpu
    real_norm, real_rope = torch.nn.RMSNorm.forward, transformer_flux.FluxPosEmbed.forward

    def norm_low_in_training(self, x):  # the update (train mode) normalises in bf16, the rollout (eval) in fp32
        out = real_norm(self, x)
        return out.to(torch.bfloat16).to(out.dtype) if self.training else out

    monkeypatch.setattr(torch.nn.RMSNorm, "forward", norm_low_in_training)
    norm_ratio = first_ratio("norm")
    monkeypatch.setattr(torch.nn.RMSNorm, "forward", real_norm)

    def rope_low_in_training(self, ids):  # the update's RoPE table in bf16, the rollout's in float32
        cos, sin = real_rope(self, ids)
        if self.training:
            return cos.to(torch.bfloat16).to(cos.dtype), sin.to(torch.bfloat16).to(sin.dtype)
        return cos, sin

    monkeypatch.setattr(transformer_flux.FluxPosEmbed, "forward", rope_low_in_training)
    rope_ratio = first_ratio("rope")
    assert min(norm_ratio, rope_ratio) > 1e-7, (norm_ratio, rope_ratio)  # measured 1.7e-6 and 7e-7
