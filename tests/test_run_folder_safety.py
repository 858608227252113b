"""Issue #23.2: whoever can write a run folder cannot turn the run against its owner.

The lock and every file the run writes by name are opened without following links and only as regular files; a
link, directory, FIFO or dangling link there is refused in one line, and the file a link points at is never
touched (``--dry-run`` included).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from training_helpers import tiny_train_argv
from typer.testing import CliRunner

from fluxgrpo.cli.app import app
from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.run_folder import (
    CONFIG_FILE,
    LOCK_FILE,
    METRICS_FILE,
    RUN_INFO_FILE,
    check_not_in_use,
    lock_run_folder,
    open_run_file,
    write_run_file,
)

runner = CliRunner()
VICTIM_TEXT = "the owner's precious file\n"


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "elsewhere" / "precious.txt"
    victim.parent.mkdir()
    victim.write_text(VICTIM_TEXT)
    return victim


def _one_error_line(output: str) -> str:
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output
    return errors[0]


def _plant(entry: Path, kind: str, victim: Path) -> None:
    entry.parent.mkdir(parents=True, exist_ok=True)
    if kind == "symlink":
        entry.symlink_to(victim)
    elif kind == "dangling":
        entry.symlink_to(victim.parent / "created-by-the-run")
    elif kind == "directory":
        entry.mkdir()
    elif kind == "fifo":
        os.mkfifo(entry)


@pytest.mark.parametrize("dry_run", [True, False])
@pytest.mark.parametrize("kind", ["symlink", "dangling", "directory", "fifo"])
def test_train_refuses_a_lock_that_is_not_a_regular_file(tiny_weights, tiny_embeddings, tmp_path, kind, dry_run):
    victim = _victim(tmp_path)
    out = tmp_path / "run"
    _plant(out / LOCK_FILE, kind, victim)
    extra = ["--output-dir", str(out), "--max-train-steps", "1", *(["--dry-run"] if dry_run else [])]
    result = runner.invoke(app, tiny_train_argv(tiny_weights, tiny_embeddings, *extra))
    assert result.exit_code == 1, result.output
    line = _one_error_line(result.output)
    assert str(out / LOCK_FILE) in line and "not a regular file" in line
    assert victim.read_text() == VICTIM_TEXT
    assert not (victim.parent / "created-by-the-run").exists()
    assert not (out / CONFIG_FILE).exists()


@pytest.mark.parametrize("name", [CONFIG_FILE, METRICS_FILE, RUN_INFO_FILE])
def test_resume_refuses_a_run_file_that_is_a_link(tiny_weights, tiny_embeddings, tmp_path, name):
    victim = _victim(tmp_path)
    out = tmp_path / "run"
    _plant(out / name, "symlink", victim)
    argv = tiny_train_argv(tiny_weights, tiny_embeddings, "--output-dir", str(out), "--resume", "--dry-run")
    result = runner.invoke(app, argv)
    assert result.exit_code == 1, result.output
    assert str(out / name) in _one_error_line(result.output)
    assert victim.read_text() == VICTIM_TEXT


def test_the_dry_run_probe_of_the_lock_writes_nothing(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    record = json.dumps({"pid": 1, "host": "elsewhere", "started": "then"})
    (out / LOCK_FILE).write_text(record)
    check_not_in_use(out)
    assert (out / LOCK_FILE).read_text() == record
    with lock_run_folder(out), pytest.raises(FluxgrpoError, match="in use by another run"):
        check_not_in_use(out)


def test_run_files_are_written_and_appended_only_as_regular_files(tmp_path):
    victim = _victim(tmp_path)
    link = tmp_path / METRICS_FILE
    link.symlink_to(victim)
    with pytest.raises(FluxgrpoError, match="is a symbolic link"):
        open_run_file(link, "a")
    with pytest.raises(FluxgrpoError, match="is a symbolic link"):
        write_run_file(link, "{}\n")
    assert victim.read_text() == VICTIM_TEXT
    plain = tmp_path / RUN_INFO_FILE
    write_run_file(plain, "{}\n")
    with open_run_file(plain, "a") as f:
        f.write("more\n")
    assert plain.read_text() == "{}\nmore\n"


def test_a_link_at_the_atomic_writes_temporary_name_is_not_followed(tmp_path):
    from fluxgrpo.paths import write_atomic

    victim = _victim(tmp_path)
    target = tmp_path / "index.json"
    (tmp_path / f".index.json.{os.getpid()}.tmp").symlink_to(victim)
    write_atomic(target, "{}\n")
    assert target.read_text() == "{}\n" and not target.is_symlink()
    assert victim.read_text() == VICTIM_TEXT


def test_a_link_named_like_a_checkpoint_leftover_removes_only_the_link(tmp_path):
    from fluxgrpo.checkpoint.layout import remove_leftovers as _remove_leftovers

    victim = _victim(tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoint-2.tmp").symlink_to(victim.parent, target_is_directory=True)
    _remove_leftovers(out)
    assert not (out / "checkpoint-2.tmp").exists() and not (out / "checkpoint-2.tmp").is_symlink()
    assert victim.read_text() == VICTIM_TEXT


def test_metrics_logger_refuses_a_linked_metrics_file_on_resume(tmp_path):
    from fluxgrpo.metrics import MetricsLogger

    victim = _victim(tmp_path)
    (tmp_path / METRICS_FILE).symlink_to(victim)
    with pytest.raises(FluxgrpoError, match="not a regular file"):
        MetricsLogger(tmp_path, enabled=True, resume_after=2)
    assert victim.read_text() == VICTIM_TEXT


@pytest.mark.parametrize("name", ["eval", "images", "logs"])
def test_a_run_subfolder_that_is_a_link_is_refused(tmp_path, name):
    from fluxgrpo.run_folder import check_run_files

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "run"
    out.mkdir()
    (out / name).symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(FluxgrpoError, match=f"{name} is a symbolic link"):
        check_run_files(out)


def test_a_finished_run_leaves_no_lock_file_and_a_stale_opener_locks_the_new_one(tmp_path):
    """Issue #31.7: the 0-byte .fluxgrpo.lock no longer stays in every finished run; removing it while held never
    lets two runs hold the folder."""
    import fcntl
    import os

    out = tmp_path / "run"
    with lock_run_folder(out):
        assert (out / LOCK_FILE).is_file()
        stale = os.open(out / LOCK_FILE, os.O_RDWR)  # a run that opened the file just before this one ended
    assert not (out / LOCK_FILE).exists()
    try:
        fcntl.flock(stale, fcntl.LOCK_EX | fcntl.LOCK_NB)  # it locks the unlinked file: a lock nobody shares
        with lock_run_folder(out):  # so the next run must still get the folder (the file at the path is new)
            assert (out / LOCK_FILE).is_file()
    finally:
        os.close(stale)
