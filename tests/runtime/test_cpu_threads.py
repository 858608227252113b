"""Issue #50.10: each CPU worker's intra-op threads come from the cores free for it (affinity, a container's quota,
the load other work puts on them), the start-up line says the choice, and the user's OMP_NUM_THREADS wins."""

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
    assert "cpu × 1, 1 CPU thread per worker (" in start_up and "load " in start_up, start_up
    assert torch.get_num_threads() == 1  # the one worker ran in this process, with the launcher's choice
