"""A run owns its processes: killing any of them (or Ctrl-C) stops all of them, and the CLI says what happened.

Each test starts ``python -m fluxgrpo train`` on the tiny weights as a real process tree (fluxgrpo → torchrun
agent → workers), waits for the first iteration, then kills one member and checks who is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from training_helpers import tiny_train_argv
from typer.testing import CliRunner

from fluxgrpo.cli.app import app
from fluxgrpo.errors import FluxgrpoError, UsageError

runner = CliRunner()
STARTUP_SECONDS = 300  # first iteration of a 2-worker tiny run on a loaded 2-core machine
GONE_SECONDS = 90


def process_table() -> dict[int, int]:
    """pid → parent pid for every process (Linux /proc)."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            table[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return table


def descendants(pid: int) -> list[int]:
    table = process_table()
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        children = [p for p, pp in table.items() if pp == parent]
        found += children
        frontier += children
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in environ:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


class Run:
    """``fluxgrpo train`` in a child process, with its output in files."""

    def __init__(self, tiny_weights, tiny_embeddings, tmp_path: Path, dies: int):
        self.out = tmp_path / "out"
        self.stderr_path = tmp_path / "stderr.txt"
        args = [
            sys.executable,
            "-m",
            "fluxgrpo",
            *tiny_train_argv(tiny_weights, tiny_embeddings, "--dies", str(dies)),
            "--output-dir",
            str(self.out),
            "--max-train-steps",
            "10000",
            "--checkpointing-steps",
            "10000",
            "--save-images-every",
            "0",
            "--num-generations",
            "4",
            "--rollout-batch-size",
            "4",
            "--train-micro-batch-size",
            "2",
            "--sampling-steps",
            "4",
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("FLUXGRPO_DEBUG", None)
        with self.stderr_path.open("w") as stderr:
            self.process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=stderr, env=env, text=True)
        self.seen: set[int] = set()

    def wait_for_first_iteration(self) -> None:
        metrics = self.out / "metrics.jsonl"
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            self.seen.update(descendants(self.process.pid))
            if metrics.is_file() and metrics.read_text().strip():
                self.seen.update(descendants(self.process.pid))
                return
            if self.process.poll() is not None:
                pytest.fail(f"the run ended early: {self.stderr()}")
            time.sleep(0.5)
        pytest.fail(f"no iteration after {STARTUP_SECONDS} s: {self.stderr()}")

    def workers(self) -> dict[int, int]:
        """rank → pid of the worker processes."""
        return {rank_of(pid): pid for pid in self.seen if alive(pid) and rank_of(pid) is not None}

    def agent(self) -> int:
        (agent,) = [pid for pid in descendants(self.process.pid) if process_table().get(pid) == self.process.pid]
        return agent

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def wait_exit(self) -> int:
        return self.process.wait(timeout=GONE_SECONDS)

    def assert_all_gone(self) -> None:
        deadline = time.monotonic() + GONE_SECONDS
        while time.monotonic() < deadline and any(alive(pid) for pid in self.seen):
            time.sleep(0.5)
        left = [pid for pid in self.seen if alive(pid)]
        self.kill_everything()
        assert not left, f"processes left running: {left}"

    def kill_everything(self) -> None:
        for pid in [self.process.pid, *self.seen]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.process.wait()


@pytest.fixture
def start_run(tiny_weights, tiny_embeddings, tmp_path):
    runs: list[Run] = []

    def start(dies: int) -> Run:
        run = Run(tiny_weights, tiny_embeddings, tmp_path, dies)
        runs.append(run)
        return run

    yield start
    for run in runs:
        run.kill_everything()


@pytest.mark.slow
def test_a_killed_worker_stops_the_run_and_is_named(start_run):
    run = start_run(dies=2)
    run.wait_for_first_iteration()
    workers = run.workers()
    assert sorted(workers) == [0, 1]
    os.kill(workers[1], signal.SIGKILL)
    assert run.wait_exit() == 1
    stderr = run.stderr()
    cause = "rank 1 was killed by signal 9 (SIGKILL)"
    lines = stderr.splitlines()
    launched = next(i for i, line in enumerate(lines) if line.startswith("resolved config saved to "))
    assert not any(line.startswith("launching: ") for line in lines)  # the internal command: FLUXGRPO_DEBUG=1 only
    after_progress = [line for line in lines[launched + 1 :] if line.strip() and not line.startswith("iteration ")]
    # The cause is the one line after the progress. Rank 0's own "connection reset" from gloo is only a consequence:
    # logs/errors.txt keeps it after the cause, marked so (when rank 0 got to record it before torchrun stopped it).
    assert len(after_progress) == 1 and after_progress[0].startswith(f"error: {cause}"), stderr
    errors = (run.out / "logs" / "errors.txt").read_text()
    assert errors.startswith(f"cause: {cause}"), errors
    assert "rank 0 failed" not in errors or "rank 0 failed after the cause" in errors, errors
    assert "Traceback" not in stderr and "ChildFailedError" not in stderr
    assert "iteration 1/" in stderr and "[default0]" not in stderr  # rank 0's lines as it wrote them
    run.assert_all_gone()


@pytest.mark.slow
def test_killing_the_agent_stops_the_workers(start_run):
    run = start_run(dies=2)
    run.wait_for_first_iteration()
    os.kill(run.agent(), signal.SIGKILL)
    assert run.wait_exit() == 1
    assert "the torchrun agent was killed by signal 9 (SIGKILL)" in run.stderr()
    run.assert_all_gone()


@pytest.mark.slow
def test_killing_fluxgrpo_stops_the_agent_and_the_workers(start_run):
    run = start_run(dies=2)
    run.wait_for_first_iteration()
    assert len(run.workers()) == 2
    os.kill(run.process.pid, signal.SIGKILL)
    run.process.wait()
    run.assert_all_gone()


@pytest.mark.slow
@pytest.mark.parametrize("dies", [1, 2])
def test_ctrl_c_exits_130_and_stops_everything(start_run, dies):
    run = start_run(dies=dies)
    run.wait_for_first_iteration()
    os.kill(run.process.pid, signal.SIGINT)
    assert run.wait_exit() == 130
    stderr = run.stderr()
    assert "interrupted" in stderr and "Traceback" not in stderr
    run.assert_all_gone()


# --- the output folder: one live run, never another run's files ---------------------------------------------

HOLD_LOCK = """
import sys, time
from fluxgrpo.run_folder import lock_run_folder
with lock_run_folder(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(600)
"""


def hold_lock(folder: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(folder)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_a_second_run_on_a_locked_folder_is_refused_naming_the_holder_and_a_dead_holder_is_taken_over(tmp_path):
    import socket

    from fluxgrpo.run_folder import lock_run_folder

    holder = hold_lock(tmp_path / "out")
    try:
        with (
            pytest.raises(
                FluxgrpoError, match=rf"in use by another run \(pid {holder.pid} on host {socket.gethostname()}"
            ),
            lock_run_folder(tmp_path / "out"),
        ):
            pass
    finally:
        holder.kill()
        holder.wait()
    with lock_run_folder(tmp_path / "out") as stale:  # killed with its lock held: taken over
        assert stale["pid"] == holder.pid
    with lock_run_folder(tmp_path / "out") as stale:  # released cleanly: nothing to take over
        assert stale == {}


def train_args(tiny_weights, tiny_embeddings, out: Path, *extra: str) -> list[str]:
    return tiny_train_argv(
        tiny_weights,
        tiny_embeddings,
        "--output-dir",
        str(out),
        "--max-train-steps",
        "1",
        "--checkpointing-steps",
        "1",
        "--save-images-every",
        "0",
        "--num-generations",
        "2",
        "--rollout-batch-size",
        "2",
        "--train-micro-batch-size",
        "2",
        "--sampling-steps",
        "3",
        *extra,
    )


def test_train_refuses_a_folder_in_use(tiny_weights, tiny_embeddings, tmp_path):
    holder = hold_lock(tmp_path / "out")
    try:
        for extra in ([], ["--resume"], ["--dry-run"]):
            result = runner.invoke(app, train_args(tiny_weights, tiny_embeddings, tmp_path / "out", *extra))
            assert result.exit_code == 1 and f"pid {holder.pid}" in result.stderr, result.output
    finally:
        holder.kill()
        holder.wait()


def test_train_never_writes_over_an_earlier_run(tiny_weights, tiny_embeddings, tmp_path):
    out = tmp_path / "out"
    first = runner.invoke(app, train_args(tiny_weights, tiny_embeddings, out))
    assert first.exit_code == 0, first.output
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.name != ".fluxgrpo.lock"}
    metrics = (out / "metrics.jsonl").read_text()

    again = runner.invoke(app, train_args(tiny_weights, tiny_embeddings, out))
    assert again.exit_code == 2
    message = " ".join(again.stderr.split())
    assert "already holds a run" in message and "--resume" in message and "--overwrite" in message
    assert "checkpoint-1" in message
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.name != ".fluxgrpo.lock"} == before
    assert (out / "metrics.jsonl").read_text() == metrics

    done = runner.invoke(app, train_args(tiny_weights, tiny_embeddings, out, "--resume"))
    assert done.exit_code == 2 and "already run 1 iterations" in " ".join(done.stderr.split())
    both = runner.invoke(app, train_args(tiny_weights, tiny_embeddings, out, "--resume", "--overwrite"))
    assert both.exit_code == 2 and "pass one of them" in both.stderr

    replaced = runner.invoke(app, train_args(tiny_weights, tiny_embeddings, out, "--overwrite"))
    assert replaced.exit_code == 0, replaced.output
    (moved,) = [p for p in tmp_path.iterdir() if p.name.startswith("out.replaced-")]
    assert (moved / "metrics.jsonl").read_text() == metrics and (moved / "checkpoint-1").is_dir()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1


def test_more_dies_than_cpu_cores_is_refused_before_launch(monkeypatch):
    from fluxgrpo.runtime import launch

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    launch.check_dies_fit("cpu", 2)  # the tests' --dies 2 on a 2-core machine
    with pytest.raises(UsageError, match=r"--dies 3 but only 2 CPU core\(s\) are available"):
        launch.check_dies_fit("cpu", 3)
    with pytest.raises(UsageError, match="--dies 3"):
        launch.run_workers("fluxgrpo.sample", {}, launch.LaunchSpec(nproc_per_node=3), "cpu")


def test_train_help_is_readable_in_80_columns():
    from fluxgrpo.config import config_fields

    result = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    from rich.cells import cell_len  # columns on screen: a combining mark (the hat of x̂0) takes none

    assert max(cell_len(line) for line in lines) <= 80, [line for line in lines if cell_len(line) > 80]
    names = {word for line in lines for word in line.replace("/", " ").split() if word.startswith("--")}
    for f in config_fields():  # every option name in full, none cut to "--gradient-accumula…"
        assert f"--{f.name.replace('_', '-')}" in names
    assert "--gradient-accumulation-steps" in names and not any("…" in name for name in names)
    wide = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "140"})
    assert "╭─ Algorithm options: objective, sampler, SDE window, KL" in wide.stdout  # the rich panels where they fit
