"""The runtime: device detection (accelerators faked), torch_npu import safety, env defaults, launch argv."""

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from fluxgrpo.errors import FluxgrpoError, UsageError
from fluxgrpo.runtime import device as rt
from fluxgrpo.runtime import dist, launch
from fluxgrpo.runtime.npu_env import NPU_ENV_DEFAULTS, apply_npu_env_defaults


@pytest.fixture
def fake_accelerators(monkeypatch):
    def set_available(npu: bool, cuda: bool):
        monkeypatch.setattr(rt, "npu_available", lambda: npu)
        monkeypatch.setattr(rt, "cuda_available", lambda: cuda)

    return set_available


@pytest.mark.parametrize(
    ("npu", "cuda", "expected"),
    [(True, True, "npu"), (True, False, "npu"), (False, True, "cuda"), (False, False, "cpu")],
)
def test_detection_order_is_npu_cuda_cpu(fake_accelerators, npu, cuda, expected):
    fake_accelerators(npu, cuda)
    assert rt.resolve_device_type(None) == expected
    assert rt.resolve_device_type("auto") == expected
    assert rt.available_device_types()[-1] == "cpu"


def test_override_and_errors(fake_accelerators):
    fake_accelerators(False, True)
    assert rt.resolve_device_type("cpu") == "cpu"
    assert rt.resolve_device_type("CUDA") == "cuda"
    with pytest.raises(UsageError, match="--device"):
        rt.resolve_device_type("tpu")
    with pytest.raises(FluxgrpoError, match="not installed"):
        rt.resolve_device_type("npu")
    fake_accelerators(False, False)
    with pytest.raises(FluxgrpoError, match="--device cpu"):
        rt.resolve_device_type("cuda")


def test_backend_for_each_device():
    assert [rt.backend_for(t) for t in rt.DEVICE_TYPES] == ["hccl", "nccl", "gloo"]


def test_broken_torch_npu_is_reported_not_raised(tmp_path, monkeypatch):
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('libhccl.so: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    rt._reset_npu_status_for_tests()
    try:
        status = rt.npu_import_status()
        assert status.installed and not status.importable
        assert "libhccl.so" in status.error
        assert not rt.npu_available()
        with pytest.raises(FluxgrpoError, match="does not import"):
            rt.resolve_device_type("npu")
    finally:
        rt._reset_npu_status_for_tests()


def test_guard_torch_import_acts_only_when_torch_npu_present(tmp_path, monkeypatch):
    import os

    from fluxgrpo.runtime.report import AUTOLOAD_ENV, guard_torch_import

    for name in (AUTOLOAD_ENV, *(v.name for v in NPU_ENV_DEFAULTS)):
        monkeypatch.delenv(name, raising=False)
    guard_torch_import()
    assert AUTOLOAD_ENV not in os.environ  # no torch_npu here
    assert "TASK_QUEUE_ENABLE" not in os.environ
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("COMBINED_ENABLE", "0")
    guard_torch_import()
    assert os.environ[AUTOLOAD_ENV] == "0"
    assert os.environ["HCCL_CONNECT_TIMEOUT"] == "1200"  # the recipe's defaults, before torch_npu loads
    assert os.environ["COMBINED_ENABLE"] == "0"  # never over the user's value
    monkeypatch.setenv(AUTOLOAD_ENV, "1")
    guard_torch_import()
    assert os.environ[AUTOLOAD_ENV] == "1"  # the user's choice wins


def test_npu_env_defaults_never_override_user_values():
    env = {"TASK_QUEUE_ENABLE": "0"}
    applied = apply_npu_env_defaults(env)
    assert env["TASK_QUEUE_ENABLE"] == "0"
    assert "TASK_QUEUE_ENABLE" not in applied
    assert env["HCCL_CONNECT_TIMEOUT"] == "1200"
    assert set(applied) == {v.name for v in NPU_ENV_DEFAULTS} - {"TASK_QUEUE_ENABLE"}
    assert apply_npu_env_defaults(env) == {}  # idempotent


def test_single_process_context_on_cpu(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    ctx = dist.init_distributed("cpu")
    assert (ctx.rank, ctx.local_rank, ctx.world_size, ctx.backend) == (0, 0, 1, "gloo")
    assert ctx.is_main and not ctx.distributed
    t = torch.arange(3.0)
    assert torch.equal(dist.all_gather_tensor(ctx, t), t)
    assert dist.all_gather_object(ctx, {"a": 1}) == [{"a": 1}]


def test_local_rank_picks_device_never_rank(fake_accelerators, monkeypatch):
    calls = []

    class FakeModule:
        @staticmethod
        def device_count():
            return 8

        @staticmethod
        def set_device(i):
            calls.append(i)

    monkeypatch.setattr(rt, "device_module", lambda t: FakeModule)
    monkeypatch.setenv("RANK", "11")
    monkeypatch.setenv("LOCAL_RANK", "3")
    device = rt.device_for_local_rank("cuda", 3)
    assert device == torch.device("cuda", 3) and calls == [3]
    with pytest.raises(FluxgrpoError, match="LOCAL_RANK 9"):
        rt.device_for_local_rank("cuda", 9)


def test_cpu_autocast_is_a_no_op_and_accelerators_use_bf16():
    assert rt.compute_dtype("cpu") == torch.float32
    assert rt.compute_dtype("cuda") == torch.bfloat16
    with rt.autocast("cpu"):
        assert not torch.is_autocast_enabled("cpu")


def test_rng_state_round_trip():
    device = torch.device("cpu")
    rt.seed_everything(3)
    state = rt.rng_state(device)
    a = torch.rand(4)
    rt.set_rng_state(device, state)
    assert torch.equal(torch.rand(4), a)


# --- launch -------------------------------------------------------------------------------------------


def test_torchrun_argv_single_node():
    argv = launch.build_torchrun_argv(
        "fluxgrpo.worker", ["--x", "1"], launch.LaunchSpec(nproc_per_node=16), python="py"
    )
    assert argv == [
        "py",
        "-m",
        "fluxgrpo.runtime.agent",  # torchrun itself, dying with its parent and reporting failures as data
        "--standalone",
        "--nproc-per-node=16",
        "-m",
        "fluxgrpo.worker",
        "--x",
        "1",
    ]


def test_torchrun_argv_multi_node_and_logs(tmp_path):
    spec = launch.LaunchSpec(nproc_per_node=8, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29600)
    argv = launch.build_torchrun_argv("m", [], spec, python="py", log_dir=tmp_path)
    assert argv[3:7] == ["--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.1", "--master-port=29600"]
    assert "--nproc-per-node=8" in argv and "--local-ranks-filter=0" in argv and f"--log-dir={tmp_path}" in argv
    assert spec.world_size == 16
    from torch.distributed.run import parse_args

    args = parse_args(argv[3:])  # what the agent hands torchrun: its own arguments, unchanged
    assert (args.role, args.log_line_prefix_template, args.module) == ("", "${role_name}", True)


def test_failure_message_names_what_really_happened(tmp_path):
    def agent_record(*failures):
        (tmp_path / "agent.json").write_text(
            json.dumps({"failures": [dict(zip(("rank", "exitcode", "time"), f, strict=True)) for f in failures]})
        )

    assert "exited with code 3 and recorded no error" in launch.failure_message(tmp_path, 3)
    assert launch.failure_message(tmp_path, -9).startswith("the torchrun agent was killed by signal 9 (SIGKILL)")
    assert launch.failure_message(tmp_path, 130).startswith("the torchrun agent was killed by signal 2 (SIGINT)")
    agent_record((1, 7, 1.0), (0, -15, 2.0))
    assert launch.failure_message(tmp_path, 1).startswith("rank 1 exited with code 7 without recording an error")
    (tmp_path / "rank0.json").write_text(json.dumps({"rank": 0, "error": "Connection closed by peer", "time": 0.5}))
    assert launch.failure_message(tmp_path, 1) == "rank 0 failed: Connection closed by peer"
    # killed from outside (not torchrun's own SIGTERM): that is the cause, not the peer's lost connection
    agent_record((1, -9, 1.0), (0, 1, 2.0))
    assert launch.failure_message(tmp_path, 1).startswith("rank 1 was killed by signal 9 (SIGKILL)")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (launch.LaunchSpec(nproc_per_node=0), "--dies"),
        (launch.LaunchSpec(nnodes=2), "--master-addr"),
        (launch.LaunchSpec(nnodes=2, node_rank=2, master_addr="a"), "--node-rank"),
        (launch.LaunchSpec(master_port=70000), "--master-port"),
    ],
)
def test_launch_spec_validation(spec, message):
    with pytest.raises(UsageError, match=message):
        spec.validate()


def test_run_torchrun_names_first_failing_rank():
    def runner(argv, env):
        error_dir = Path(env[launch.ERROR_DIR_ENV])
        (error_dir / "rank1.json").write_text(json.dumps({"rank": 1, "error": "OOM on rank 1", "time": time.time()}))
        (error_dir / "rank0.json").write_text(json.dumps({"rank": 0, "error": "peer gone", "time": time.time() + 5}))
        return 1

    with pytest.raises(FluxgrpoError, match="rank 1 failed: OOM on rank 1"):
        launch.run_torchrun(["x"], runner=runner)
    with pytest.raises(FluxgrpoError, match="exited with code 7 and recorded no error"):
        launch.run_torchrun(["x"], runner=lambda argv, env: 7)
    launch.run_torchrun(["x"], runner=lambda argv, env: 0)


def test_a_killed_rank_is_the_cause_and_its_peers_errors_follow_it_in_the_errors_file(tmp_path):
    gloo = "RuntimeError: [../gloo/transport/tcp/pair.cc:545] Read error: Connection reset by peer"

    def runner(argv, env):
        error_dir = Path(env[launch.ERROR_DIR_ENV])
        # rank 0 lost its connection and recorded that before the agent noticed rank 1's SIGKILL
        record = {"rank": 0, "error": gloo, "time": 1.0, "expected": False, "traceback": "Traceback: in all_reduce"}
        (error_dir / "rank0.json").write_text(json.dumps(record))
        failures = [{"rank": 1, "exitcode": -9, "time": 2.0}, {"rank": 0, "exitcode": 1, "time": 2.5}]
        (error_dir / "agent.json").write_text(json.dumps({"failures": failures}))
        return 1

    errors_file = tmp_path / "logs" / "errors.txt"
    with pytest.raises(FluxgrpoError) as caught:
        launch.run_torchrun(["x"], runner=runner, errors_file=errors_file)
    assert str(caught.value).startswith("rank 1 was killed by signal 9 (SIGKILL)")
    assert "Connection reset" not in str(caught.value)
    report = errors_file.read_text().splitlines()
    assert report[0] == f"cause: {caught.value}"
    assert report[2:4] == [f"rank 0 failed after the cause, as a consequence: {gloo}", "Traceback: in all_reduce"]
    launch.run_torchrun(["x"], runner=lambda argv, env: 0, errors_file=errors_file)
    assert not errors_file.exists()  # a later run that succeeds leaves no stale errors behind


def test_the_first_recorded_error_is_the_cause_and_a_bug_points_at_its_traceback(tmp_path):
    for rank, error, time_, expected in ((1, "ValueError: bad shape", 1.0, False), (0, "peer gone", 2.0, True)):
        record = {"rank": rank, "error": error, "time": time_, "expected": expected, "traceback": f"tb {rank}"}
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(record))
    message = launch.failure_message(tmp_path, 1)
    assert message == "rank 1 failed: ValueError: bad shape (FLUXGRPO_DEBUG=1 shows the traceback)"
    assert launch.errors_report(tmp_path, 1).splitlines() == [
        f"cause: {message}",
        "",
        "rank 1 failed (the cause): ValueError: bad shape",
        "tb 1",
        "",
        "rank 0 failed after the cause, as a consequence: peer gone",
        "tb 0",
    ]


def test_worker_errors_records_and_reraises(tmp_path, monkeypatch):
    from fluxgrpo.runtime.worker_errors import worker_errors

    monkeypatch.setenv(launch.ERROR_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "2")

    @worker_errors
    def worker():
        raise ValueError("bad shape")

    with pytest.raises(ValueError):
        worker()
    record = json.loads((tmp_path / "rank2.json").read_text())
    assert record["rank"] == 2 and record["error"] == "ValueError: bad shape" and "Traceback" in record["traceback"]
    assert record["expected"] is False  # not a FluxgrpoError: the launcher points at the traceback


ECHO_WORKER = """
import os

from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.runtime import dist
from fluxgrpo.runtime.worker import worker_session


def worker_entry(payload):
    with worker_session("cpu") as ctx:
        if payload.get("fail_rank") == ctx.rank:
            raise FluxgrpoError(f"rank {ctx.rank} cannot go on")
        import torch

        ranks = dist.all_gather_object(ctx, ctx.rank)
        return {"payload": payload, "ranks": ranks, "threads": torch.get_num_threads(), "pid": os.getpid()}
"""


@pytest.fixture
def echo_module(tmp_path, monkeypatch):
    """A worker module importable here and in torchrun workers (which inherit PYTHONPATH)."""
    (tmp_path / "fluxgrpo_echo_worker.py").write_text(ECHO_WORKER)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    yield "fluxgrpo_echo_worker"
    sys.modules.pop("fluxgrpo_echo_worker", None)


def test_a_worker_under_the_launcher_leaves_its_error_line_to_the_launcher(echo_module, tmp_path, monkeypatch, capsys):
    from fluxgrpo.runtime import worker

    payload = tmp_path / "payload.json"
    payload.write_text(json.dumps({"fail_rank": 0}))
    monkeypatch.setattr(worker, "die_with_parent", lambda sig: None)  # not for pytest itself
    monkeypatch.delenv("FLUXGRPO_DEBUG", raising=False)
    monkeypatch.delenv(launch.ERROR_DIR_ENV, raising=False)
    assert worker.main([echo_module, "--payload", str(payload)]) == 1
    assert capsys.readouterr().err == "error: rank 0 cannot go on\n"  # torchrun run by hand: nobody else says it

    error_dir = tmp_path / "errors"
    error_dir.mkdir()
    monkeypatch.setenv(launch.ERROR_DIR_ENV, str(error_dir))
    assert worker.main([echo_module, "--payload", str(payload)]) == 1
    assert capsys.readouterr().err == ""  # it might be a peer's consequence: the launcher names the cause
    assert launch.failure_message(error_dir, 1) == "rank 0 failed: rank 0 cannot go on"


def test_one_worker_runs_in_this_process_and_returns_the_json_form(echo_module):
    summary = launch.run_workers(echo_module, {"items": (1, 2)}, launch.LaunchSpec(), "cpu")
    assert summary["payload"] == {"items": [1, 2]}  # through JSON, as from a torchrun worker
    assert summary["ranks"] == [0] and summary["pid"] == os.getpid()


@pytest.mark.slow
def test_two_workers_run_under_torchrun_and_rank0_reports(echo_module, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("FLUXGRPO_DEBUG", "1")  # the internal launch command is logged for debugging only
    lines = []
    summary = launch.run_workers(echo_module, {"x": 1}, launch.LaunchSpec(nproc_per_node=2), "cpu", log=lines.append)
    assert summary["payload"] == {"x": 1} and summary["ranks"] == [0, 1] and summary["pid"] != os.getpid()
    assert summary["threads"] == 1  # the prologue: one thread per CPU worker
    assert "fluxgrpo.runtime.worker" in lines[0]
    monkeypatch.delenv("FLUXGRPO_DEBUG")
    quiet = []
    with pytest.raises(FluxgrpoError, match="rank 1 failed: rank 1 cannot go on"):
        launch.run_workers(echo_module, {"fail_rank": 1}, launch.LaunchSpec(nproc_per_node=2), "cpu", log=quiet.append)
    assert not any(line.startswith("launching: ") for line in quiet)


def test_worker_session_leaves_the_group_and_filters_the_fsdp_view_warning():
    import warnings

    from fluxgrpo.runtime.worker import worker_session

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with worker_session("cpu") as ctx:
            warnings.warn("FSDP2-wrapped module FluxTransformerBlock returned a view tensor", UserWarning, stacklevel=1)
            warnings.warn("something else", UserWarning, stacklevel=1)
    assert (ctx.world_size, ctx.device_type) == (1, "cpu")
    assert [str(w.message) for w in caught] == ["something else"]


def test_worker_env_shows_the_values_in_force_on_npu_only(monkeypatch):
    monkeypatch.setenv("TASK_QUEUE_ENABLE", "1")
    monkeypatch.delenv("HCCL_CONNECT_TIMEOUT", raising=False)
    env = launch.worker_env_defaults("npu")
    assert env["TASK_QUEUE_ENABLE"] == "1" and env["HCCL_CONNECT_TIMEOUT"] == "1200"
    assert launch.worker_env_defaults("cpu") == {} and launch.worker_env_defaults("cuda") == {}
