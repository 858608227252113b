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


# --------------------------------------------------------------------------------------------- 4: torn metrics line


def _metrics_with(tmp_path: Path, text: str) -> Path:
    (tmp_path / METRICS_FILE).write_text(text)
    return tmp_path


def test_resume_drops_a_torn_last_metrics_line_and_says_so(tmp_path, capsys):
    from fluxgrpo.metrics import MetricsLogger, read_metrics

    whole = "".join(json.dumps({"iteration": k, "reward_mean": 0.1 * k}) + "\n" for k in (1, 2, 3))
    folder = _metrics_with(tmp_path, whole + '{"iteration": 4, "reward_me')
    with pytest.raises(FluxgrpoError, match=rf"{METRICS_FILE} line 4 is not a JSON record"):
        read_metrics(folder)
    logger = MetricsLogger(folder, enabled=True, resume_after=2)
    logger.close()
    assert f"dropped the torn last line of {folder / METRICS_FILE} line 4" in capsys.readouterr().err
    assert [r["iteration"] for r in read_metrics(folder)] == [1, 2]


def test_a_torn_line_in_the_middle_of_metrics_is_refused_in_one_line(tmp_path):
    from fluxgrpo.metrics import MetricsLogger

    folder = _metrics_with(tmp_path, '{"iteration": 1}\n{"iterat\n{"iteration": 3}\n')
    with pytest.raises(FluxgrpoError) as caught:
        MetricsLogger(folder, enabled=True, resume_after=3)
    assert f"{folder / METRICS_FILE} line 2 is not a JSON record" in str(caught.value)
    assert "\n" not in str(caught.value)
    assert (folder / METRICS_FILE).read_text() == '{"iteration": 1}\n{"iterat\n{"iteration": 3}\n'


def test_report_reads_a_run_whose_last_line_is_being_written(tmp_path):
    from fluxgrpo.report.run import read_run

    folder = _metrics_with(tmp_path, json.dumps({"iteration": 1, "reward_mean": 0.5}) + '\n{"iteration": 2, "rew')
    assert [r["iteration"] for r in read_run(folder).records] == [1]


# --------------------------------------------------------------------------------------------- 5: a failed start


def test_a_start_that_never_finished_an_iteration_does_not_block_its_rerun(tiny_weights, tiny_embeddings, tmp_path):
    from training_helpers import tiny_train_argv

    from fluxgrpo.run_folder import RUN_INFO_FILE, previous_run

    out = tmp_path / "run"
    out.mkdir()
    (out / CONFIG_FILE).write_text("")  # a full disk at start left it empty
    (out / METRICS_FILE).write_text("")  # opened, never written: the first forward ran out of memory
    (out / RUN_INFO_FILE).write_text("{}")
    assert previous_run(out) == []
    argv = tiny_train_argv(tiny_weights, tiny_embeddings, "--output-dir", str(out), "--dry-run")
    rerun = runner.invoke(app, argv)
    assert rerun.exit_code == 0, rerun.output
    (out / METRICS_FILE).write_text(json.dumps({"iteration": 1}) + "\n")
    assert previous_run(out) == [CONFIG_FILE, METRICS_FILE, RUN_INFO_FILE]
    assert runner.invoke(app, argv).exit_code == 2
    (out / METRICS_FILE).write_text("")
    (out / "checkpoint-1").mkdir()
    assert "checkpoint-1" in previous_run(out)


def test_the_resume_from_hint_names_flags_that_exist(tmp_path):
    from fluxgrpo.checkpoint.layout import resolve_resume

    (tmp_path / "checkpoint-2").mkdir()  # no COMPLETE marker
    with pytest.raises(FluxgrpoError) as caught:
        resolve_resume(tmp_path, "checkpoint-2")
    message = str(caught.value)
    assert "drop --resume-from to start a new run" in message and "with no value" not in message


def test_launch_folders_left_by_a_killed_cli_are_removed_on_the_next_start(tmp_path):
    import os
    import subprocess
    import sys

    from fluxgrpo.runtime.launch import ERRORS_TEMP_PREFIX, WORKERS_TEMP_PREFIX, remove_stale_temp_folders

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = [tmp_path / f"{WORKERS_TEMP_PREFIX}{dead.pid}-abc", tmp_path / f"{ERRORS_TEMP_PREFIX}{dead.pid}-def"]
    live = tmp_path / f"{WORKERS_TEMP_PREFIX}{os.getpid()}-ghi"
    other = tmp_path / "fluxgrpo-workers-old-style"
    for folder in (*stale, live, other):
        folder.mkdir()
        (folder / "payload.json").write_text("{}")
    victim = tmp_path / "elsewhere"
    victim.mkdir()
    (tmp_path / f"{ERRORS_TEMP_PREFIX}{dead.pid}-lnk").symlink_to(victim, target_is_directory=True)
    assert sorted(remove_stale_temp_folders(tmp_path)) == sorted(stale)
    assert live.is_dir() and other.is_dir() and victim.is_dir()


def test_resuming_with_other_eval_prompts_is_refused(tmp_path):
    from fluxgrpo.config import build_config
    from fluxgrpo.errors import UsageError
    from fluxgrpo.training.launch_plan import check_eval_prompts_unchanged

    first, other = tmp_path / "first.txt", tmp_path / "other.txt"
    first.write_text("a red cube\na blue ball\n")
    other.write_text("a red cube\na green tree\n")
    out = tmp_path / "run"
    evaluation = out / "eval" / "iteration-0"
    evaluation.mkdir(parents=True)
    (evaluation / "index.json").write_text(json.dumps({"prompts": ["a red cube", "a blue ball"], "images": []}))
    (out / "eval" / "iteration-2").mkdir()
    (out / "eval" / "iteration-2" / "index.json").write_text("{garbage")  # says nothing: skipped

    def cfg(prompts: Path):
        return build_config("tiny-cpu", {"eval_every": 2, "eval_prompts": str(prompts), "output_dir": str(out)})

    check_eval_prompts_unchanged(cfg(first), out)
    with pytest.raises(UsageError, match=r"--eval-prompts: .*other.txt holds other prompts .*\(iteration-0: 2 prompts"):
        check_eval_prompts_unchanged(cfg(other), out)


def test_report_warns_about_an_evaluation_it_leaves_out(tmp_path):
    pytest.importorskip("matplotlib")
    run = _bare_run(tmp_path / "run")
    (run / "eval" / "iteration-2").mkdir(parents=True)
    (run / "eval" / "iteration-2" / "index.json").write_text("[1, 2")
    result = runner.invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    assert f"warning: left out {run / 'eval' / 'iteration-2' / 'index.json'}" in result.stderr


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "link"])
def test_an_embeddings_entry_outside_its_folder_is_refused(tiny_embeddings, tmp_path, kind):
    import shutil

    from fluxgrpo.data.embeddings import EmbeddingDataset

    folder = tmp_path / "emb"
    shutil.copytree(tiny_embeddings.out_dir, folder)
    index = folder / tiny_embeddings.index_path.name
    entries = json.loads(index.read_text())
    outside = tmp_path / "precious.pt"
    outside.write_bytes(b"not yours")
    name = entries[0]["prompt_embed_path"]
    if kind == "dotdot":
        entries[0]["prompt_embed_path"] = "../../precious.pt"
    elif kind == "absolute":
        entries[0]["prompt_embed_path"] = str(outside)
    else:
        link = next(folder.glob(f"*/{name}"))
        link.unlink()
        link.symlink_to(outside)
    index.write_text(json.dumps(entries))
    with pytest.raises(FluxgrpoError, match="entry 0 names .* which is not a file in"):
        EmbeddingDataset(index)
    assert outside.read_bytes() == b"not yours"
