"""``env-check --deep`` (fluxgrpo/deepcheck/): the quick run on the tiny weights passes, and each planted fault
fails its own check with one line: a wrong RoPE dtype under the stand-in torch_npu, a rollout dtype that breaks the
PPO ratio, a memory estimate that is too low."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fluxgrpo.cli.app import app
from fluxgrpo.deepcheck import iteration
from fluxgrpo.deepcheck.result import FAILED, PASSED, SKIPPED, CheckResult, DeepReport
from fluxgrpo.runtime import device as rt_device
from fluxgrpo.runtime.adapt import FORCE_NPU_ADAPT_ENV

FAKE_TORCH_NPU = Path(__file__).resolve().parents[1] / "fake_torch_npu"
runner = CliRunner()


@pytest.fixture
def stand_in_accelerator(monkeypatch):
    """The stand-in torch_npu importable for this test, with the runtime's swaps forced on cpu."""
    for name in [n for n in sys.modules if n == "torch_npu" or n.startswith("torch_npu.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(FAKE_TORCH_NPU))
    monkeypatch.setenv(FORCE_NPU_ADAPT_ENV, "1")
    rt_device._reset_npu_status_for_tests()
    yield
    for name in [n for n in sys.modules if n == "torch_npu" or n.startswith("torch_npu.")]:
        del sys.modules[name]
    rt_device._reset_npu_status_for_tests()


def test_quick_deep_check_on_tiny_weights(tiny_weights, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    report_file = tmp_path / "deep.json"
    result = runner.invoke(
        app,
        [
            "env-check", "--deep", "--quick", "--json", "--device", "cpu", "--dies", "2",
            "--flux-dir", str(tiny_weights.flux_dir), "--hps-dir", str(tiny_weights.hps_dir),
            "--report-file", str(report_file),
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    written = json.loads(report_file.read_text())
    assert printed == written
    assert "NaN" not in report_file.read_text()  # strict JSON
    report = DeepReport.from_dict(written)
    assert report.to_dict() == written  # round trip
    by_name = {check.name: check for check in report.checks}
    for check in report.checks:
        assert check.status in (PASSED, SKIPPED), (check.name, check.detail)
        if check.status == SKIPPED:
            assert check.detail and check.figure is None
    # What runs on a cpu with tiny weights must have run.
    for name in ("on-policy start (dance)", "on-policy start (flow-grpo)", "on-policy start (cps)", "memory model"):
        assert by_name[name].status == PASSED
    assert by_name["loading"].status == PASSED and by_name["reward hpsv2"].status == PASSED
    assert by_name["kernels"].status == SKIPPED and "Ascend" in by_name["kernels"].detail
    collectives = by_name["collectives"]  # two gloo workers through the one launcher
    assert collectives.status == PASSED and collectives.measured["bus_gbps"]["all_gather"] > 0
    assert [rank["rank"] for rank in report.environment["collectives_and_loading_raw"]["ranks"]] == [0, 1]
    assert by_name["memory model"].measured["measured_peak_bytes"] > 0
    assert report.environment["device_type"] == "cpu"


def test_failed_check_exits_1(monkeypatch, tmp_path):
    from fluxgrpo.deepcheck import run

    failing = DeepReport({"mode": "quick", "device_type": "cpu", "dies": 1, "device_name": "cpu"}, [
        CheckResult("memory model", FAILED, 0.5, "×", "estimate ≥ measured peak", "estimate too low"),
    ])  # fmt: skip
    monkeypatch.setattr(run, "run_deep_check", lambda settings, log: failing)
    result = runner.invoke(app, ["env-check", "--deep", "--report-file", str(tmp_path / "r.json")])
    assert result.exit_code == 1
    assert "failed" in result.stdout and "memory model" in result.output


def test_deep_only_flags_need_deep():
    result = runner.invoke(app, ["env-check", "--quick"])
    assert result.exit_code == 2 and "--deep" in result.output


def test_kernels_pass_under_the_stand_in_and_a_wrong_rope_dtype_fails(stand_in_accelerator, monkeypatch):
    from fluxgrpo.deepcheck.kernels import check_kernels
    from fluxgrpo.runtime import npu

    cpu = torch.device("cpu")
    results = check_kernels(cpu, 32, 32, 8)
    names = [r.name for r in results]
    assert names == [
        "kernel rms_norm bf16", "kernel rms_norm fp32", "kernel rms_norm (no weight) bf16",
        "kernel rms_norm (no weight) fp32", "kernel layer_norm bf16", "kernel layer_norm fp32",
        "kernel rope bf16", "kernel rope fp32",
        "kernel attention (sdpa) bf16", "kernel attention (sdpa) fp32", "kernel attention (npu-fusion) bf16",
    ]  # fmt: skip
    assert all(r.status == PASSED for r in results), [(r.name, r.detail) for r in results]

    rope = npu.rope_float32

    def rope_in_bf16(ids, axes_dim, theta=10000.0):  # the planted fault: the table comes out in bf16
        return tuple(t.to(torch.bfloat16) for t in rope(ids, axes_dim, theta))

    monkeypatch.setattr(npu, "rope_float32", rope_in_bf16)
    failed = [r for r in check_kernels(cpu, 32, 32, 8) if r.status == FAILED]
    assert [r.name for r in failed] == ["kernel rope bf16", "kernel rope fp32"]
    assert all("\n" not in r.detail and "comes out torch.bfloat16" in r.detail for r in failed)


def _tiny_iteration(samplers=("dance", "cps")) -> iteration.IterationSettings:
    return iteration.IterationSettings(
        model="tiny", blocks=None, height=32, width=32, sampling_steps=4, rollout_batch_size=4, micro_batch_size=2,
        text_tokens=8, samplers=samplers, eta=0.3, guidance=3.5, shift=3.0, clip_range=1e-4, max_grad_norm=1.0,
        gradient_checkpointing=False, attention="sdpa",
    )  # fmt: skip


def test_rollout_dtype_mismatch_and_low_estimate_fail(monkeypatch):
    from fluxgrpo.runtime.dist import init_distributed

    estimate = iteration.estimate_for_iteration

    def too_low(*args, **kwargs):  # the planted fault: an estimate that forgets every term
        low = estimate(*args, **kwargs)
        low.persistent = dict.fromkeys(low.persistent, 0)
        low.phases = {phase: dict.fromkeys(terms, 0) for phase, terms in low.phases.items()}
        low.reserve = 0
        return low

    monkeypatch.setattr(iteration, "estimate_for_iteration", too_low)
    ctx = init_distributed("cpu")
    results = iteration.run_iteration(_tiny_iteration(), ctx, rollout_dtype=torch.bfloat16)
    statuses = {r.name: r.status for r in results}
    assert statuses == {"on-policy start (dance)": FAILED, "on-policy start (cps)": FAILED, "memory model": FAILED}
    for result in results:
        assert "\n" not in result.detail
    dance = results[0]
    assert dance.figure > dance.measured["tolerance"] and "rollout in bfloat16" in dance.detail
    memory = results[-1]
    assert memory.figure < 1 and memory.measured["estimate_peak_bytes"] < memory.measured["measured_peak_bytes"]


def test_rewards_compare_the_reward_dtype_and_skip_missing_weights(tiny_weights, tmp_path):
    from fluxgrpo.deepcheck.rewards import check_rewards, reference_images

    images = reference_images(64)
    assert images.shape == (2, 3, 64, 64) and images.min() >= 0 and images.max() <= 1
    assert not torch.equal(images[0], images[1])
    [bf16] = check_rewards(["hpsv2"], tiny_weights.hps_dir, torch.device("cpu"), "bf16")
    assert bf16.status == PASSED, bf16.detail
    assert len(bf16.measured["bf16_scores"]) == 2 and bf16.figure <= 1e-2
    [missing] = check_rewards(["pickscore"], tmp_path, torch.device("cpu"), "fp32")
    assert missing.status == SKIPPED and "fetch-weights" in missing.detail
    assert check_rewards(["brightness"], tmp_path, torch.device("cpu"), "fp32") == []  # no model, nothing to check


def _rank(rank: int, node: int, rise_gib: float, bus: float = 400.0, exact: bool = True) -> dict:
    gib = 2**30
    return {
        "rank": rank,
        "node": node,
        "join_seconds": 1.0,
        "first_barrier_seconds": 0.5,
        "collectives": {
            "bytes": 256 << 20,
            "world_size": 4,
            "all_reduce": {"seconds": 0.01, "bus_gbps": bus, "exact": exact},
            "all_gather": {"seconds": 0.01, "bus_gbps": bus, "exact": True},
        },
        "load": {
            "seconds": 3.0,
            "host": {"start_bytes": gib, "peak_bytes": gib + int(rise_gib * gib), "rise_bytes": int(rise_gib * gib)},
            "materialised": True,
            "finite": True,
            "local_parameter_bytes": 6 * gib,
            "host_resident_parameter_bytes": 0,
            "largest_tensor_bytes": gib // 4,
        },
    }


def test_collective_and_loading_rules():
    from fluxgrpo.deepcheck.run import NOT_NODE_ZERO, _collective_results, _load_result

    def summary(ranks):
        return {"device_type": "cuda", "device_name": "NVIDIA H200", "ranks": ranks}

    # 4 ranks on 2 nodes at 400 GB/s of H200's nominal 450: passes (89 %).
    good = summary([_rank(r, r // 2, 0.5) for r in range(4)])
    collectives = _collective_results(good, 4)
    assert collectives.status == PASSED and collectives.measured["fraction_of_nominal"] == pytest.approx(400 / 450)
    assert _collective_results(summary([_rank(r, 0, 0.5, bus=100.0) for r in range(4)]), 4).status == FAILED  # 22 %
    assert _collective_results(summary([_rank(r, 0, 0.5, exact=r != 2) for r in range(4)]), 4).status == FAILED
    # Each node may rise by its ranks' in-flight tensors (2 × 0.25 GiB) + 1 GiB = 1.5 GiB.
    assert _load_result(good, None).status == PASSED  # 2 × 0.5 = 1 GiB per node
    per_rank_copy = summary([_rank(r, r // 2, 0.5 if r < 2 else 6.0) for r in range(4)])  # node 1: 12 GiB
    loading = _load_result(per_rank_copy, None)
    assert loading.status == FAILED and loading.measured["node_host_rise_bytes"] == 12 * 2**30
    # A node other than 0 gets no figures back, and says where they are.
    assert _collective_results(None, 4).status == SKIPPED and _collective_results(None, 4).detail == NOT_NODE_ZERO
    assert _load_result(None, None).status == SKIPPED
    assert _load_result(good, "no FLUX weights").detail == "no FLUX weights"
