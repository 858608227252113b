"""Issue #30.3: a guard the base model already fails stops the run before training, and says so once, truly."""

from __future__ import annotations

from training_helpers import tiny_train_argv
from typer.testing import CliRunner

from fluxgrpo.checkpoint.layout import list_checkpoints
from fluxgrpo.cli.app import app
from fluxgrpo.metrics import read_metrics
from fluxgrpo.training.guards import GUARD_RECORD, GUARD_STOP_EXIT_CODE

runner = CliRunner()


def test_a_guard_that_fires_at_iteration_0_stops_before_training(tiny_weights, tiny_embeddings, tmp_path):
    prompts = tmp_path / "eval.txt"
    prompts.write_text("a red apple\na blue cube\n")
    out = tmp_path / "out"
    extra = ["--output-dir", str(out), "--max-train-steps", "2", "--checkpointing-steps", "1", "--save-images-every"]
    extra += ["0", "--eval-every", "1", "--eval-prompts", str(prompts), "--eval-images-per-prompt", "1"]
    extra += ["--eval-steps", "2", "--guard", "brightness:max=0.01", "--guard-action", "stop", "--json"]
    result = runner.invoke(app, tiny_train_argv(tiny_weights, tiny_embeddings, *extra))
    assert result.exit_code == GUARD_STOP_EXIT_CODE, result.output
    records = read_metrics(out)
    assert not [r for r in records if "reward_mean" in r]  # no iteration was trained
    assert records[-1]["record"] == GUARD_RECORD and records[-1]["iteration"] == 0 and records[-1]["guard_stop"]
    assert list_checkpoints(out) == []
    line = records[-1]["guard_stop_message"]
    assert "at iteration 0" in line and "the run stops before training" in line and "checkpoint-" not in line
    assert result.stderr.count("stopped by guard") == 1, result.stderr
