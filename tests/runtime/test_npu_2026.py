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
from diffusers import FluxTransformer2DModel  # noqa: F401

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
