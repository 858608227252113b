"""Issue #23.3-5: an output never replaces an input, a checkpoint or a file we did not write; a torn metrics line
and a failed start do not block the run that follows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fluxgrpo.cli.app import app
from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.run_folder import CONFIG_FILE, LOCK_FILE, METRICS_FILE, move_previous_run, replaced_folder

runner = CliRunner()


def _bare_run(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / METRICS_FILE).write_text(json.dumps({"iteration": 1, "reward_mean": 0.5}) + "\n")
    return folder


def test_report_never_writes_over_the_runs_metrics_or_a_foreign_file(tmp_path):
    pytest.importorskip("matplotlib")
    run = _bare_run(tmp_path / "run")
    metrics = (run / METRICS_FILE).read_text()
    refused = runner.invoke(app, ["report", str(run), "--out", str(run / METRICS_FILE)])
    assert refused.exit_code == 1, refused.output
    assert "--out" in refused.stderr and "not a fluxgrpo report" in refused.stderr
    assert (run / METRICS_FILE).read_text() == metrics
    notes = tmp_path / "notes.png"
    notes.write_bytes(b"\x89PNG my own figure")
    fresh = runner.invoke(app, ["report", str(run), "--png", "--out", str(tmp_path / "r.html")])
    assert fresh.exit_code == 0, fresh.output  # report.png beside r.html is new
    again = runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "r.html"), "--png"])
    assert again.exit_code == 0, again.output  # its own earlier files are replaced
    (tmp_path / "r.html").unlink()
    (tmp_path / "report.png").rename(tmp_path / "kept.png")
    notes.rename(tmp_path / "report.png")
    refused = runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "r.html"), "--png"])
    assert refused.exit_code == 1 and "--png" in refused.stderr
    assert (tmp_path / "report.png").read_bytes() == b"\x89PNG my own figure"
    assert not (tmp_path / "r.html").exists()  # refused before anything was written


def test_score_out_replaces_only_its_own_csv(tmp_path):
    from fluxgrpo.score import CSV_COLUMNS, check_csv_destination

    weights = tmp_path / "checkpoint-2" / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(FluxgrpoError, match="not a CSV that `fluxgrpo score` wrote"):
        check_csv_destination(weights)
    link = tmp_path / "scores.csv"
    link.symlink_to(weights)
    with pytest.raises(FluxgrpoError, match="not a regular file"):
        check_csv_destination(link)
    own = tmp_path / "old.csv"
    own.write_text(",".join(CSV_COLUMNS) + "\n")
    assert check_csv_destination(own) == own
    assert check_csv_destination(tmp_path / "new.csv") == tmp_path / "new.csv"


def test_overwrite_moves_only_the_runs_own_files(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    for name in (CONFIG_FILE, METRICS_FILE, LOCK_FILE, "my_notes.txt", "train.py"):
        (work / name).write_text(name)
    for folder in ("checkpoint-2", "checkpoint-4.tmp", "eval", "images", "logs", "my_data"):
        (work / folder).mkdir()
    monkeypatch.chdir(work)
    moved = move_previous_run(".")
    assert moved.parent == tmp_path and moved.name.startswith("work.replaced-")
    assert sorted(p.name for p in moved.iterdir()) == sorted(
        [CONFIG_FILE, METRICS_FILE, "checkpoint-2", "checkpoint-4.tmp", "eval", "images", "logs"]
    )
    assert sorted(p.name for p in work.iterdir()) == sorted([LOCK_FILE, "my_notes.txt", "train.py", "my_data"])
    # The same second again: a new name beside the first instead of a FileExistsError.
    (work / CONFIG_FILE).write_text("second")
    second = move_previous_run(work)
    assert second != moved and (second / CONFIG_FILE).read_text() == "second"
    assert replaced_folder(work) not in (moved, second)
