"""Multi-node runs that survive: bounded collectives, the rank at fault named on every node, elastic restarts
that resume exactly, Slurm's environment, and the checks before launch.

The end-to-end tests run two "nodes" as two ``fluxgrpo train --nnodes 2 --node-rank 0|1`` process trees on this
host (one CPU worker each, gloo), with timeouts of seconds.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_runs import alive, descendants
from training_helpers import run as run_training
from training_helpers import tiny_config, tiny_train_argv

from fluxgrpo.errors import UsageError
from fluxgrpo.runtime import launch, liveness, nodes
from fluxgrpo.runtime.dist import CollectiveTimeout

# --- Slurm, flags, the torchrun command -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("gpu01", ["gpu01"]),
        ("a3-[01-03,07]", ["a3-01", "a3-02", "a3-03", "a3-07"]),
        ("n[8-10],login,x[2]", ["n8", "n9", "n10", "login", "x2"]),
    ],
)
def test_slurm_nodelist_expands_as_scontrol_does(nodelist, hosts):
    assert nodes.expand_nodelist(nodelist) == hosts


def test_slurm_job_gives_nnodes_node_rank_and_node0():
    env = {"SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "a3-[07-08]"}
    assert nodes.slurm_job(env) == nodes.SlurmJob(2, 1, "a3-07")
    assert nodes.slurm_job({**env, "SLURM_NNODES": "1"}) is None  # one node: nothing to meet
    assert nodes.slurm_job({}) is None


def test_launch_spec_from_slurm_and_flags(tiny_weights, tiny_embeddings, tmp_path, monkeypatch):
    from fluxgrpo.training.launch_plan import launch_spec

    cfg = tiny_config(tiny_weights, tiny_embeddings, tmp_path / "out")
    monkeypatch.setenv("SLURM_NNODES", "2")
    monkeypatch.setenv("SLURM_NODEID", "1")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "a3-[07-08]")
    static = launch_spec(cfg, dies=16, log=lambda _: None)
    assert (static.nnodes, static.node_rank, static.master_addr, static.rdzv_endpoint) == (2, 1, "a3-07", None)
    elastic = launch_spec(cfg, dies=16, max_restarts=2, log=lambda _: None)
    assert elastic.rdzv_endpoint == "a3-07:29500" and elastic.master_addr is None
    own = launch_spec(cfg, dies=1, nnodes=1, log=lambda _: None)  # flags win over Slurm's
    assert (own.nnodes, own.rdzv_endpoint, own.master_addr) == (1, None, None)
    assert static.run_id == launch.run_id_for(tmp_path / "out") != launch.run_id_for(tmp_path / "other")


def test_collective_timeout_flag():
    assert CollectiveTimeout.parse("300,100") == CollectiveTimeout(300, 100)
    assert CollectiveTimeout.parse("20") == CollectiveTimeout(20, 20)
    for bad in ("", "a,b", "1,2,3", "0,5"):
        with pytest.raises(UsageError, match="--collective-timeout"):
            CollectiveTimeout.parse(bad)
    with pytest.raises(UsageError, match="at least the steady one"):
        CollectiveTimeout(10, 100).validate()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (launch.LaunchSpec(nnodes=2, master_addr="a", rdzv_endpoint="a:1"), "pass one of them"),
        (launch.LaunchSpec(nnodes=2, master_addr="a", max_restarts=1), "--rdzv-endpoint HOST:PORT instead"),
        (launch.LaunchSpec(nnodes=2, rdzv_endpoint="a:port"), "not HOST:PORT"),
        (launch.LaunchSpec(max_restarts=-1), "--max-restarts"),
    ],
)
def test_elastic_launch_spec_validation(spec, message):
    with pytest.raises(UsageError, match=message):
        spec.validate()


def test_elastic_torchrun_argv_is_torchruns_own():
    from torch.distributed.run import parse_args

    spec = launch.LaunchSpec(
        nproc_per_node=8,
        nnodes=2,
        node_rank=1,
        rdzv_endpoint="10.0.0.1:29600",
        run_id="fluxgrpo-abc",
        max_restarts=3,
        collective_timeout=CollectiveTimeout(120, 30),
    )
    argv = launch.build_torchrun_argv("m", [], spec, python="py")
    args = parse_args(argv[3:])
    assert (args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id) == ("c10d", "10.0.0.1:29600", "fluxgrpo-abc")
    assert (args.nnodes, args.max_restarts, args.nproc_per_node) == ("2", 3, "8")
    assert args.rdzv_conf == "join_timeout=120,is_host=false"  # node 0 hosts the store; nodes wait the start-up value


def test_collective_env_per_backend_and_the_users_values_win(monkeypatch, tmp_path):
    timeouts = CollectiveTimeout(300, 100)
    assert launch.collective_env("cpu", None) == {}
    assert launch.collective_env("cpu", timeouts) == {"FLUXGRPO_COLLECTIVE_TIMEOUT": "300,100"}
    cuda = launch.collective_env("cuda", timeouts, tmp_path)
    assert cuda["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and int(cuda["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
    assert cuda["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"].startswith(str(tmp_path))
    assert launch.collective_env("npu", timeouts)["HCCL_EXEC_TIMEOUT"] == "300"  # fixed per process: the longer
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "900")
    assert launch.collective_env("npu", timeouts)["HCCL_EXEC_TIMEOUT"] == "900"


def test_an_agent_that_lost_node0s_rendezvous_says_so(tmp_path):
    record = {"failures": [], "rendezvous": "RendezvousConnectionError: store failed", "endpoint": "10.0.0.1:29500"}
    (tmp_path / "agent.json").write_text(json.dumps(record))
    assert launch.failure_message(tmp_path, 1).startswith("lost node 0's rendezvous at 10.0.0.1:29500")


def test_failure_lines_name_node_host_and_rank(tmp_path):
    failures = [{"rank": 17, "exitcode": -9, "time": 1.0, "node": 1, "host": "a3-08"}]
    (tmp_path / "agent.json").write_text(json.dumps({"failures": failures}))
    assert launch.failure_message(tmp_path, 1).startswith("node 1 (host a3-08) rank 17 was killed by signal 9")
    (tmp_path / "agent.json").unlink()
    peer = {"rank": 0, "error": "node 1 (host b) rank 1 stopped responding", "peer": True, "time": 1.0}
    (tmp_path / "rank0.json").write_text(json.dumps(peer))
    assert launch.failure_message(tmp_path, 1) == "node 1 (host b) rank 1 stopped responding"
    # a restart's records replace the last start's
    own = {"rank": 3, "where": "node 0 (host a) rank 3", "error": "disk full", "attempt": 1, "time": 2.0}
    (tmp_path / "rank3.json").write_text(json.dumps(own))
    assert launch.failure_message(tmp_path, 1) == "node 0 (host a) rank 3 failed: disk full"


def test_unreachable_endpoint_is_one_line_within_the_timeout():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    began = time.monotonic()
    with pytest.raises(launch.FluxgrpoError, match=rf"cannot reach node 0's rendezvous at 127.0.0.1:{port}"):
        launch.wait_for_endpoint("127.0.0.1", port, timeout_s=1.5, flag="--rdzv-endpoint", retry_s=0.2)
    assert time.monotonic() - began < 1.5 + 5


# --- heartbeats in the store ------------------------------------------------------------------------------


@pytest.fixture
def store_pair(monkeypatch):
    """Two ranks' Liveness on one real TCPStore, beating every 0.1 s."""
    monkeypatch.setattr(liveness, "HEARTBEAT_SECONDS", 0.1)
    server = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))
    client = torch.distributed.TCPStore("127.0.0.1", server.port, is_master=False)
    ranks = [liveness.Liveness(store, rank, 2, node=rank) for rank, store in enumerate((server, client))]
    for rank in ranks:
        rank.start()
    yield ranks
    for rank in ranks:
        rank.stop()


def test_a_rank_waiting_for_rank0_sees_its_error_at_once(store_pair):
    rank0, rank1 = store_pair
    rank0.publish_failure("disk full writing checkpoint-2")
    with pytest.raises(liveness.PeerFailed, match=r"node 0 \(host .*\) rank 0 failed while finishing checkpoint-2"):
        rank1.wait_for_rank0("finishing checkpoint-2", timeout_s=30)


def test_a_rank_waiting_for_rank0_goes_on_while_it_beats_and_stops_when_it_is_silent(store_pair):
    rank0, rank1 = store_pair
    rank0.wait_for_rank0("x", 1)  # rank 0 arrives first: the other rank passes
    rank1.wait_for_rank0("x", 1)
    rank0.stop()  # rank 0 silent (killed, stopped, its host lost)
    began = time.monotonic()
    with pytest.raises(liveness.PeerFailed, match="rank 0 stopped responding while finishing"):
        rank1.wait_for_rank0("finishing checkpoint-4", timeout_s=0.5)
    assert time.monotonic() - began < 0.5 + 5


def test_a_failed_collective_is_explained_by_the_silent_peer(store_pair):
    rank0, rank1 = store_pair
    rank1.mark("iteration 42")
    rank1.mark("iteration 42", phase_done="rollout")
    time.sleep(0.3)
    rank0.mark("iteration 42")
    assert rank0.explain_failure("Connection closed by peer", 100) is None  # both beat: nobody else to blame
    rank1.stop()
    hung = rank0.explain_failure("Timed out waiting 100000ms for recv operation to complete", 100)
    assert (
        hung.startswith("node 1 (host ") and "rank 1 did not reach the collective of iteration 42 within 100 s" in hung
    )
    assert "last seen at 'iteration 42, rollout done'" in hung
    lost = rank0.explain_failure("Connection closed by peer", 100)
    assert "rank 1 was lost at iteration 42: its connection closed" in lost


# --- two nodes on this host --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """One node's ``fluxgrpo train`` as a process tree, its output in files."""

    def __init__(self, argv: list[str], folder: Path, name: str):
        self.stderr_path = folder / f"{name}.stderr"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("FLUXGRPO_DEBUG", None)
        with self.stderr_path.open("w") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "fluxgrpo", *argv], stdout=subprocess.PIPE, stderr=stderr, env=env, text=True
            )
        self.seen: set[int] = set()

    def watch(self) -> None:
        self.seen.update(descendants(self.process.pid))

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def kill_tree(self, sig: int = signal.SIGKILL) -> None:
        self.watch()
        for pid in [self.process.pid, *self.seen]:
            if alive(pid):
                os.kill(pid, sig)

    def left(self) -> list[int]:
        return [pid for pid in [self.process.pid, *self.seen] if alive(pid)]


@pytest.fixture
def two_nodes(tiny_weights, tiny_embeddings, tmp_path):
    started: list[Node] = []
    port = free_port()

    def start(node_rank: int, out: Path, *extra: str, name: str | None = None) -> Node:
        argv = tiny_train_argv(
            tiny_weights,
            tiny_embeddings,
            "--output-dir",
            str(out),
            "--save-images-every",
            "0",
            "--nnodes",
            "2",
            "--node-rank",
            str(node_rank),
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            *extra,
        )
        node = Node(argv, tmp_path, name or f"node{node_rank}")
        started.append(node)
        return node

    yield start
    for node in started:
        node.kill_tree()
        node.process.wait()


def wait_for(condition, nodes_: list[Node], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for node in nodes_:
            node.watch()
        if condition():
            return
        for node in nodes_:
            if node.process.poll() is not None:
                pytest.fail(f"a node ended before {what}: {node.stderr()}")
        time.sleep(0.1)
    pytest.fail(f"no {what} after {seconds} s: " + " | ".join(n.stderr()[-2000:] for n in nodes_))


STARTUP_SECONDS = 300  # two nodes' first iteration on a loaded 2-core machine
RUN = ("--num-generations", "4", "--rollout-batch-size", "4", "--train-micro-batch-size", "2", "--sampling-steps", "4")


def one_error_line(node: Node) -> str:
    errors = [line for line in node.stderr().splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in node.stderr(), node.stderr()
    return errors[0]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["killed", "stopped", "rank0-fails-in-a-checkpoint"])
def test_a_node_killed_or_a_rank_stopped_is_named_on_every_node_and_nothing_is_left(two_nodes, tmp_path, how):
    out = tmp_path / "out"
    steady = 10
    saves = "4" if how == "rank0-fails-in-a-checkpoint" else "10000"
    flags = ("--max-train-steps", "10000", "--checkpointing-steps", saves, "--collective-timeout", f"120,{steady}")
    node0, node1 = two_nodes(0, out, *RUN, *flags), two_nodes(1, out, *RUN, *flags)
    metrics = out / "metrics.jsonl"
    wait_for(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 1, [node0, node1], 300, "iteration")
    (worker,) = [pid for pid in descendants(node1.process.pid) if not descendants(pid)]  # node 1's one worker
    if how == "killed":
        node1.kill_tree()  # the whole node: launcher, agent, worker
    elif how == "stopped":
        os.kill(worker, signal.SIGSTOP)  # hung: alive, silent
    else:  # rank 0 fails alone publishing checkpoint-4, after the others wrote their shards: moving the folder
        # already there aside onto a file (a planted file is never deleted) is NotADirectoryError
        (out / "checkpoint-4").mkdir()
        (out / "checkpoint-4.trash").write_text("")
    began = time.monotonic()
    assert node0.process.wait(timeout=steady + 10 + 60) == 1
    assert time.monotonic() - began < steady + 10 + 30  # bounded by the collective timeout (plus start-up slack)
    line = one_error_line(node0)
    if how == "killed":
        assert "node 1 (host " in line and "rank 1 was lost at iteration" in line, line
    elif how == "rank0-fails-in-a-checkpoint":
        assert line.startswith("error: node 0 (host ") and "rank 0 failed: NotADirectoryError" in line, line
        assert node1.process.wait(timeout=steady + 30) == 1  # waiting on rank 0's heartbeat, not a timeout
        assert "rank 0 failed while finishing checkpoint-4: NotADirectoryError" in one_error_line(node1)
    else:
        assert "rank 1 did not reach the collective of iteration" in line and f"within {steady} s" in line, line
        assert "node 1 (host " in line
        os.kill(worker, signal.SIGCONT)  # its peer is gone: node 1 stops too, and says why in its own line
        assert node1.process.wait(timeout=60) == 1
        assert "node 0" in one_error_line(node1), node1.stderr()
        assert "[W" not in node1.stderr()  # no C++ store warnings with stack frames: the one line says it
    if how == "rank0-fails-in-a-checkpoint":  # each node keeps its details in the shared log folder
        assert "rank 0 failed (the cause): NotADirectoryError" in (out / "logs" / "errors.txt").read_text()
        assert "failed while finishing checkpoint-4" in (out / "logs" / "errors-node1.txt").read_text()
    else:
        assert "node 1 (host" in (out / "logs" / "errors.txt").read_text()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (node0.left() or node1.left()):
        time.sleep(0.5)
    assert node0.left() == [] and node1.left() == [], "processes of the run left running"


def exported(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted((checkpoint / "transformer").glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


@pytest.mark.slow
def test_a_restarted_node_rejoins_and_the_run_resumes_bitwise_as_one_node_uninterrupted(
    two_nodes, tiny_weights, tiny_embeddings, tmp_path
):
    steps = 6  # killed after checkpoint-2, so 4 iterations on the restarted workers
    out = tmp_path / "elastic"
    flags = ("--max-train-steps", str(steps), "--checkpointing-steps", "2", "--max-restarts", "1")
    flags += ("--collective-timeout", "120,20")
    node0, node1 = two_nodes(0, out, *RUN, *flags), two_nodes(1, out, *RUN, *flags)
    wait_for((out / "checkpoint-2" / "COMPLETE").is_file, [node0, node1], 300, "checkpoint-2")
    node1.kill_tree()  # the whole node, mid-run
    node1.process.wait()
    again = two_nodes(1, out, *RUN, *flags, name="node1-again")  # the same command, as Slurm or a user would
    assert node0.process.wait(timeout=STARTUP_SECONDS) == 0, node0.stderr()
    assert again.process.wait(timeout=60) == 0, again.stderr()
    assert "the workers started again (--max-restarts): continuing from" in node0.stderr(), node0.stderr()
    assert "resumed from" in node0.stderr()  # a restart, not a run from scratch
    lost = [line for line in node0.stderr().splitlines() if line.startswith("warning: node 1 (host ")]
    assert lost and "rank 1 was lost at iteration" in lost[0] and "torchrun restarts the workers" in lost[0], lost

    reference = tiny_config(
        tiny_weights,
        tiny_embeddings,
        tmp_path / "one-node",
        max_train_steps=steps,
        checkpointing_steps=steps,
        num_generations=4,
        rollout_batch_size=4,
        train_micro_batch_size=2,
        sampling_steps=4,
    )
    run_training(reference, dies=2)  # one node, the same world size, never interrupted
    a, b = exported(out / f"checkpoint-{steps}"), exported(tmp_path / "one-node" / f"checkpoint-{steps}")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[name], b[name]) for name in a), "the restarted run's weights differ"
    iterations = [json.loads(line)["iteration"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert iterations == list(range(1, steps + 1))  # metrics.jsonl reads as one run


def test_env_check_rendezvous_and_interfaces(monkeypatch):
    port = free_port()
    (rendezvous, interface) = nodes.rendezvous_checks("cpu", 2, f"127.0.0.1:{port}", environ={})
    assert rendezvous[:2] == ("rendezvous", "ok") and "this machine" in rendezvous[2]  # node 0: the port is free
    with socket.socket() as busy:
        busy.bind(("", port))
        busy.listen()
        held = nodes.rendezvous_checks("cpu", 2, f"127.0.0.1:{port}", environ={})[0]
    assert held[1] == "fail" and "--rdzv-endpoint" in held[3]
    assert interface[0] == "network interface" and interface[1] == "warn"  # loopback: nothing to infer
    named = nodes.rendezvous_checks("cpu", 2, f"127.0.0.1:{port}", environ={"GLOO_SOCKET_IFNAME": "eth0"})[1]
    assert named[1] == "ok" and "GLOO_SOCKET_IFNAME=eth0" in named[2]
    monkeypatch.setattr(nodes, "_is_local", lambda host: False)  # another node: node 0 must be listening
    unreachable = nodes.rendezvous_checks("cpu", 2, f"127.0.0.1:{port}", environ={})[0]
    assert unreachable[1] == "fail" and "is not reachable" in unreachable[2] and "node 0 first" in unreachable[3]
    assert nodes.rendezvous_checks("cpu", 2, None)[0][1] == "fail"  # several nodes need an endpoint
    assert nodes.rendezvous_checks("cpu", 1, None) == []


def test_an_output_folder_the_nodes_do_not_share_is_refused_naming_the_blind_nodes(tmp_path, monkeypatch):
    """The check's logic on one rank at a time; the collectives hand it what the other node would say."""
    from fluxgrpo.errors import FluxgrpoError
    from fluxgrpo.runtime import dist as rt_dist
    from fluxgrpo.runtime.dist import DistContext

    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("GROUP_RANK", "1")
    node0_folder, node1_folder = tmp_path / "node0-disk", tmp_path / "node1-disk"  # two disks: not shared
    node1 = DistContext(1, 0, 2, "cpu", torch.device("cpu"), "gloo")
    written: dict[str, str] = {}

    def node0_writes(ctx, token, src=0):  # rank 0 on node 0 wrote its token on its own disk
        node0_folder.mkdir(exist_ok=True)
        written["token"] = "token-of-node-0"
        (node0_folder / nodes.SHARED_CHECK_FILE).write_text(written["token"])
        return written["token"]

    monkeypatch.setattr(rt_dist, "broadcast_object", node0_writes)
    monkeypatch.setattr(
        rt_dist, "all_gather_object", lambda ctx, mine: [{"seen": True, "node": "0", "host": "a"}, mine]
    )
    with pytest.raises(FluxgrpoError, match=r"is not shared between the nodes: node 1 \(host .*\) cannot see the file"):
        nodes.check_shared_folder(node1, node1_folder, wait_s=0.3)
    nodes.check_shared_folder(node1, node0_folder, wait_s=0.3)  # one folder that both see: accepted
    single = DistContext(0, 0, 2, "cpu", torch.device("cpu"), "gloo")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")  # one node: nothing to check, nothing written
    nodes.check_shared_folder(single, tmp_path / "one-node")
    assert not (tmp_path / "one-node").exists()


def test_train_on_a_node_that_cannot_reach_node0_says_so_in_one_line_within_the_start_up_timeout(
    tiny_weights, tiny_embeddings, tmp_path
):
    from typer.testing import CliRunner

    from fluxgrpo.cli.app import app

    port = free_port()
    argv = tiny_train_argv(tiny_weights, tiny_embeddings, "--output-dir", str(tmp_path / "out"), "--nnodes", "2")
    argv += ["--node-rank", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--collective-timeout", "2"]
    began = time.monotonic()
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 1, result.output
    assert time.monotonic() - began < 2 + 30  # the start-up timeout, plus the checks before launch
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    message = " ".join(" ".join(errors).split())
    assert f"cannot reach node 0's rendezvous at 127.0.0.1:{port} (--rdzv-endpoint) within 2 s" in message, message
    assert "Traceback" not in result.output
