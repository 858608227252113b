"""Issue #50.10: each CPU worker's intra-op threads come from the cores free for it (affinity, a container's quota,
the cores other work keeps busy now), the start-up line says the choice, and the user's OMP_NUM_THREADS wins."""

from __future__ import annotations

import pytest
import torch
from training_helpers import tiny_train_argv
from typer.testing import CliRunner

from fluxgrpo.cli.app import app
from fluxgrpo.runtime import cpu_threads
from fluxgrpo.runtime.cpu_threads import THREADS_ENV, choose_threads, plan_cpu_threads

runner = CliRunner()


@pytest.fixture
def fresh_plan(monkeypatch):
    """No user setting, no cached choice; the test process's own thread count put back afterwards."""
    for name in (THREADS_ENV, "OMP_NUM_THREADS"):  # set, then removed: put back as they were afterwards
        monkeypatch.setenv(name, "0")
        monkeypatch.delenv(name)
    plan_cpu_threads.cache_clear()
    before = torch.get_num_threads()
    yield
    plan_cpu_threads.cache_clear()
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    "workers, cores, load, threads",
    [
        (1, 2, 0.2, 2),  # an idle laptop: both cores
        (1, 2, 7.9, 1),  # the busy 2-core machine of the report: one thread, not two spinning against the jobs
        (2, 2, 0.0, 1),  # the 2-worker quickstart: one each
        (4, 16, 0.0, 4),
        (1, 16, 3.4, 13),
        (8, 4, 0.0, 1),  # more workers than cores: still one each
    ],
)
def test_threads_are_the_free_cores_shared_out(workers, cores, load, threads):
    assert choose_threads(workers, cores, load) == threads


def test_a_containers_quota_caps_the_cores(tmp_path):
    (tmp_path / "cpu.max").write_text("200000 100000\n")
    assert cpu_threads._quota_cores(tmp_path) == 2
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpu_threads._quota_cores(tmp_path) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("150000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_threads._quota_cores(tmp_path) == 2
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_threads._quota_cores(tmp_path) is None
    assert cpu_threads.available_cores(tmp_path) >= 1


def _stat(ticks_per_cpu: dict[int, tuple[int, int]]) -> str:
    """A /proc/stat text whose CPUs have these (busy, idle) ticks, split over its fields as the kernel does."""
    lines = ["cpu  1 2 3 4 5 6 7 8 0 0"]
    for cpu, (busy, idle) in ticks_per_cpu.items():
        user, system, iowait = busy - busy // 3, busy // 3, idle // 4
        lines.append(f"cpu{cpu} {user} 0 {system} {idle - iowait} {iowait} 0 0 0 0 0")
    return "\n".join([*lines, "intr 12345 0 0", "ctxt 999", "btime 1700000000", "procs_running 3"]) + "\n"


def test_busy_cores_are_read_now_on_this_processs_cores(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    stat.write_text(_stat({0: (1000, 5000), 1: (2000, 4000), 2: (0, 9000)}))
    # over the sample: cpu0 busy 80 of 100 ticks, cpu1 20 of 100, cpu2 (not ours) fully busy
    later = _stat({0: (1080, 5020), 1: (2020, 4080), 2: (100, 9000)})
    monkeypatch.setattr(cpu_threads.time, "sleep", lambda seconds: stat.write_text(later))
    assert cpu_threads.busy_cores_now({0, 1}, stat) == pytest.approx(1.0)
    stat.write_text(_stat({0: (1000, 5000), 1: (2000, 4000), 2: (0, 9000)}))
    assert cpu_threads.busy_cores_now({2}, stat) == pytest.approx(1.0)
    assert cpu_threads.busy_cores_now({0}, tmp_path / "missing") is None  # not Linux: the load average instead


def test_a_job_that_just_ended_does_not_cost_a_thread(monkeypatch, fresh_plan):
    """The load average still counts a job that ended seconds ago; the cores read now do not."""
    monkeypatch.setattr(cpu_threads, "available_cores", lambda root=None: 2)
    monkeypatch.setattr(cpu_threads, "busy_cores_now", lambda cpus, stat=None, seconds=None: 0.1)
    monkeypatch.setattr(cpu_threads.os, "getloadavg", lambda: (0.9, 1.5, 1.2))
    plan = plan_cpu_threads(1)
    assert plan.threads == 2 and plan.text() == "2 CPU threads per worker (2 cores, 0.1 busy now)"
    plan_cpu_threads.cache_clear()
    monkeypatch.setattr(cpu_threads, "busy_cores_now", lambda cpus, stat=None, seconds=None: None)
    plan = plan_cpu_threads(1)
    assert plan.threads == 1 and plan.text() == "1 CPU thread per worker (2 cores, load 0.9)"


def test_the_users_omp_num_threads_wins(fresh_plan, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert plan_cpu_threads(1).threads == 3 and "OMP_NUM_THREADS=3" in plan_cpu_threads(1).text()


def test_train_says_the_threads_in_its_start_up_line_and_runs_with_them(
    fresh_plan, tiny_weights, tiny_embeddings, tmp_path, monkeypatch
):
    monkeypatch.setattr(cpu_threads, "choose_threads", lambda workers, cores, load: 1)
    torch.set_num_threads(2)
    argv = tiny_train_argv(tiny_weights, tiny_embeddings, "--output-dir", str(tmp_path / "out"), "--json")
    result = runner.invoke(
        app, [*argv, "--max-train-steps", "1", "--checkpointing-steps", "1", "--sampling-steps", "4"]
    )
    assert result.exit_code == 0, result.output
    start_up = next(line for line in result.stderr.splitlines() if line.startswith("fluxgrpo train:"))
    assert "cpu × 1, 1 CPU thread per worker (" in start_up and " busy now)" in start_up, start_up
    assert torch.get_num_threads() == 1  # the one worker ran in this process, with the launcher's choice
