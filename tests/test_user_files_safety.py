"""Issue #30.1–2: no user file is ever replaced. A ``config.yaml`` fluxgrpo did not write is never taken for a
failed start's, and a folder inside a training run (its ``eval/iteration-<k>``) is never a sample's ``--out``
unless ``--overwrite`` says so, and then it is moved, not deleted."""

from __future__ import annotations

import json
from pathlib import Path

from training_helpers import tiny_train_argv
from typer.testing import CliRunner

from fluxgrpo.cli.app import app
from fluxgrpo.run_folder import CONFIG_FILE, enclosing_run, foreign_run_files

runner = CliRunner()
USER_CONFIG = "# mine\nlearning_rate: 0.001\n"


def _train(tiny_weights, tiny_embeddings, out: Path, *extra: str):
    argv = tiny_train_argv(
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
        *extra,
    )
    return runner.invoke(app, argv)


def test_a_users_config_yaml_is_refused_and_overwrite_moves_it(tiny_weights, tiny_embeddings, tmp_path):
    out = tmp_path / "p"
    out.mkdir()
    (out / CONFIG_FILE).write_text(USER_CONFIG)
    assert foreign_run_files(out) == [CONFIG_FILE]
    for extra in ((), ("--dry-run",), ("--resume",)):
        refused = _train(tiny_weights, tiny_embeddings, out, *extra)
        assert refused.exit_code == 2, refused.output
        assert "Traceback" not in refused.output
        message = " ".join(refused.stderr.split())
        assert "config.yaml that fluxgrpo did not write" in message and "--overwrite" in message
        assert (out / CONFIG_FILE).read_text() == USER_CONFIG

    moved = _train(tiny_weights, tiny_embeddings, out, "--overwrite")
    assert moved.exit_code == 0, moved.output
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("p.replaced-")]
    assert (aside / CONFIG_FILE).read_text() == USER_CONFIG
    assert (out / CONFIG_FILE).read_text().startswith("# Resolved fluxgrpo training config")
    assert foreign_run_files(out) == []


def test_a_failed_starts_own_config_still_does_not_block_its_rerun(tmp_path):
    out = tmp_path / "p"
    out.mkdir()
    (out / CONFIG_FILE).write_text("# Resolved fluxgrpo training config (load it again with --config <this file>).\n")
    (out / "run_info.json").write_text(json.dumps({"versions": {}, "hardware": {}}))
    assert foreign_run_files(out) == []
    (out / "run_info.json").write_text("my notes\n")
    assert foreign_run_files(out) == ["run_info.json"]


def _fake_evaluated_run(root: Path) -> Path:
    """A run folder as training leaves it: checkpoint-2/, metrics.jsonl and eval/iteration-2/ in sample format."""
    (root / "checkpoint-2").mkdir(parents=True)
    (root / "metrics.jsonl").write_text('{"iteration": 1}\n{"iteration": 2}\n')
    evaluation = root / "eval" / "iteration-2"
    evaluation.mkdir(parents=True)
    (evaluation / "0000_00.png").write_bytes(b"the trained model's image")
    (evaluation / "index.json").write_text(json.dumps({"format": "fluxgrpo-sample", "iteration": 2}))
    return evaluation


def _sample(tiny_weights, out: Path, *extra: str):
    argv = ["sample", "--model", str(tiny_weights.flux_dir), "--prompt", "a red cat", "--out", str(out)]
    settings = ["--height", "32", "--width", "32", "--steps", "2", "--max-sequence-length", "16", "--device", "cpu"]
    return runner.invoke(app, [*argv, *settings, *extra])


def test_sample_refuses_an_out_inside_a_training_run(tiny_weights, tmp_path):
    run = tmp_path / "RUN"
    evaluation = _fake_evaluated_run(run)
    assert enclosing_run(evaluation) == run and enclosing_run(tmp_path / "elsewhere") is None
    for out in (evaluation, run / "samples"):
        refused = _sample(tiny_weights, out)
        assert refused.exit_code == 2, refused.output
        assert "Traceback" not in refused.output
        message = " ".join(refused.stderr.split())
        assert f"inside the training run {run}" in message and "--overwrite" in message
    assert (evaluation / "0000_00.png").read_bytes() == b"the trained model's image"
    assert not (run / "samples").exists()


def test_sample_overwrite_moves_a_runs_evaluation_aside_never_deletes_it(tiny_weights, tmp_path):
    evaluation = _fake_evaluated_run(tmp_path / "RUN")
    done = _sample(tiny_weights, evaluation, "--overwrite")
    assert done.exit_code == 0, done.output
    (aside,) = [p for p in evaluation.parent.iterdir() if p.name.startswith("iteration-2.replaced-")]
    assert (aside / "0000_00.png").read_bytes() == b"the trained model's image"
    assert json.loads((aside / "index.json").read_text())["iteration"] == 2
    assert (evaluation / "index.json").is_file() and "iteration" not in json.loads(
        (evaluation / "index.json").read_text()
    )
