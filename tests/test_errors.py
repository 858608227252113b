"""Every failure is one true line: text is never read as rich markup, bad input says what, why and what to do."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from fluxgrpo.cli.app import app
from fluxgrpo.cli.common import handle_errors, log
from fluxgrpo.config import MAX_SEED, build_config
from fluxgrpo.errors import FluxgrpoError, UsageError
from fluxgrpo.paths import DEFAULT_OUTPUT_DIR

runner = CliRunner()


def error_lines(output: str) -> list[str]:
    assert "Traceback" not in output, output
    return [line for line in output.splitlines() if line.startswith("error:")]


# --------------------------------------------------------------------------------------------- text, not markup


def test_a_config_path_with_brackets_is_a_usage_error_naming_it():
    result = runner.invoke(app, ["train", "--config", "my[/run].yaml"])
    assert result.exit_code == 2, result.output
    assert "MarkupError" not in result.output
    assert "'my[/run].yaml' is neither a shipped config" in error_lines(result.output)[0]


def test_a_prompts_path_with_brackets_is_named_as_typed(tmp_path):
    result = runner.invoke(app, ["preprocess", "--prompts", str(tmp_path / "[bold]p.txt")])
    assert result.exit_code == 1, result.output
    assert f"prompt file {tmp_path / '[bold]p.txt'} not found" in error_lines(result.output)[0]


def test_a_library_message_in_brackets_is_shown_whole(capsys):
    gloo = "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:2"

    @handle_errors
    def failing() -> None:
        raise FluxgrpoError(f"rank 1 failed: {gloo}: see logs/")

    with pytest.raises(typer.Exit) as caught:
        failing()
    assert caught.value.exit_code == 1
    assert capsys.readouterr().err.strip() == f"error: rank 1 failed: {gloo}: see logs/"


def test_log_prints_lines_as_text(capsys):
    log("[bold]not bold[/] and [/__w/x.cc:1] stay")
    assert capsys.readouterr().err.strip() == "[bold]not bold[/] and [/__w/x.cc:1] stay"


# --------------------------------------------------------------------------------------------- config files


def test_a_binary_yaml_config_is_one_usage_line(tmp_path):
    config = tmp_path / "weights.yaml"
    config.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe")
    with pytest.raises(UsageError, match=r"weights.yaml is not a text file .*--config"):
        build_config(str(config))
    result = runner.invoke(app, ["train", "--config", str(config), "--dry-run"])
    assert result.exit_code == 2 and len(error_lines(result.output)) == 1, result.output


def test_invalid_yaml_is_one_line_naming_the_file(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("seed: [1, 2\nmodel: x\n")
    with pytest.raises(UsageError, match=r"bad.yaml is not valid YAML") as caught:
        build_config(str(config))
    assert "\n" not in str(caught.value)


def test_yaml_null_means_the_default(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("output_dir: null\nseed:\nlearning_rate: 0.5\n")
    cfg = build_config(str(config))
    assert cfg.output_dir == DEFAULT_OUTPUT_DIR and cfg.seed == 42 and cfg.learning_rate == 0.5


@pytest.mark.parametrize("seed", [-1, MAX_SEED + 1, 2**64])
def test_a_seed_out_of_range_is_a_usage_error(seed):
    with pytest.raises(UsageError, match=rf"--seed {seed} is out of range: use 0 to {MAX_SEED}"):
        build_config(None, {"seed": seed})


def test_the_largest_seed_is_accepted():
    assert build_config(None, {"seed": MAX_SEED}).seed == MAX_SEED


# --------------------------------------------------------------------------------------------- weights


def test_tiny_weights_into_an_unwritable_folder_is_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = runner.invoke(
        app, ["fetch-weights", "--source", "tiny", "--flux-dir", str(blocker / "flux"), "--hps-dir", str(tmp_path)]
    )
    assert result.exit_code == 1, result.output
    (line,) = error_lines(result.output)
    assert f"cannot write FLUX weights to {blocker / 'flux'}" in line and "--flux-dir" in line


def test_tiny_weights_are_written_readable_by_all(tmp_path):
    previous = os.umask(0o022)
    try:
        result = runner.invoke(
            app, ["fetch-weights", "--source", "tiny", "--flux-dir", str(tmp_path / "f"), "--hps-dir", str(tmp_path)]
        )
    finally:
        os.umask(previous)
    assert result.exit_code == 0, result.output
    weights = sorted((tmp_path / "f").rglob("*.safetensors"))
    assert weights
    assert {oct(p.stat().st_mode & 0o777) for p in weights} == {"0o644"}


@pytest.fixture
def hand_placed_flux(tiny_weights, tmp_path) -> Path:
    flux = tmp_path / "flux"
    shutil.copytree(tiny_weights.flux_dir, flux)
    (flux / "manifest.json").unlink()  # placed by hand: nothing records the sizes
    return flux


def test_hand_placed_weights_pass_when_whole(hand_placed_flux):
    from fluxgrpo.weights.layout import check_flux_dir

    assert check_flux_dir(hand_placed_flux).complete


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda data: data[: len(data) // 2], "is truncated"),
        (lambda data: data[:5], "is truncated"),
        (lambda data: b"\xff" * 8 + data[8:], "has a damaged header"),
        (lambda data: data[:8] + b"#" * 16 + data[24:], "has a damaged header"),
    ],
    ids=["half", "five-bytes", "length", "json"],
)
def test_a_damaged_shard_without_a_manifest_is_named(
    hand_placed_flux, tiny_weights, tiny_embeddings, tmp_path, damage, expected
):
    from fluxgrpo.weights.layout import check_flux_dir

    shard = hand_placed_flux / "transformer" / "diffusion_pytorch_model.safetensors"
    shard.write_bytes(damage(shard.read_bytes()))
    status = check_flux_dir(hand_placed_flux)
    assert not status.complete
    assert status.problems == [f"{shard} {expected}" + status.problems[0].split(expected, 1)[1]]
    result = runner.invoke(
        app,
        [
            "train",
            "--config",
            "tiny-cpu",
            "--model",
            str(hand_placed_flux),
            "--hps-dir",
            str(tiny_weights.hps_dir),
            "--data-json-path",
            str(tiny_embeddings.index_path),
            "--output-dir",
            str(tmp_path / "run"),
            "--dry-run",
        ],
    )
    assert result.exit_code == 1
    (line,) = error_lines(result.output)
    assert str(shard) in line and "fetch-weights" in line


def test_sample_refuses_a_checkpoint_whose_export_is_truncated(tmp_path):
    from fluxgrpo.sampling.checkpoints import resolve_checkpoint

    checkpoint = tmp_path / "checkpoint-3"
    (checkpoint / "transformer").mkdir(parents=True)
    (checkpoint / "COMPLETE").write_text(json.dumps({"iteration": 3, "world_size": 1}))
    (checkpoint / "transformer" / "config.json").write_text("{}")
    (checkpoint / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"\x10\x00\x00")
    with pytest.raises(FluxgrpoError, match=r"the checkpoint is damaged: .*safetensors is truncated.*--checkpoint"):
        resolve_checkpoint(checkpoint, ema=False)


# --------------------------------------------------------------------------------------------- embeddings


def test_embedding_index_entries_missing_keys_are_malformed_not_missing(tiny_embeddings, tmp_path):
    from fluxgrpo.envcheck import embeddings_status

    emb = tmp_path / "emb"
    shutil.copytree(tiny_embeddings.out_dir, emb)
    entries = json.loads((emb / "videos2caption.json").read_text())
    del entries[2]["pooled_prompt_embeds_path"]
    (emb / "videos2caption.json").write_text(json.dumps(entries))
    status = embeddings_status(emb)
    assert not status["complete"]
    assert status["problems"] == [
        f"{emb / 'videos2caption.json'} is malformed: 1 of 8 entries lack one of "
        "prompt_embed_path, pooled_prompt_embeds_path, text_ids, caption (the first is entry 2)"
    ]


def test_a_truncated_embedding_file_is_found_at_preflight(tiny_weights, tiny_embeddings, tmp_path):
    from fluxgrpo.runtime.launch import LaunchSpec
    from fluxgrpo.training.launch_plan import plan_training

    emb = tmp_path / "emb"
    shutil.copytree(tiny_embeddings.out_dir, emb)
    last = emb / "prompt_embed" / f"{len(tiny_embeddings.prompts) - 1}.pt"  # drawn last, checked first
    last.write_bytes(last.read_bytes()[:100])
    cfg = build_config(
        "tiny-cpu",
        {
            "model": str(tiny_weights.flux_dir),
            "hps_dir": str(tiny_weights.hps_dir),
            "data_json_path": str(emb / "videos2caption.json"),
            "output_dir": str(tmp_path / "out"),
        },
    )
    with pytest.raises(FluxgrpoError, match=rf"{last} is damaged or not a torch file .*fluxgrpo preprocess") as caught:
        plan_training(cfg, LaunchSpec(), dry_run=True)
    assert "\n" not in str(caught.value)
