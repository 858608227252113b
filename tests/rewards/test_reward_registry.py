"""A reward is one record: a toy reward declared and registered here, with no edit anywhere in fluxgrpo, is fetched
(tiny), checked by env-check, trained with, scored with and counted by the memory estimate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from training_helpers import tiny_train_argv
from typer.testing import CliRunner

from fluxgrpo.cli.app import app
from fluxgrpo.rewards.registry import RewardRecord, WeightsPart, register_reward, unregister_reward
from fluxgrpo.weights.layout import PartStatus, check_subfolders_part
from fluxgrpo.weights.manifest import read_manifest
from fluxgrpo.weights.tiny_writing import fresh_subfolders, write_subfolder_manifests

runner = CliRunner()
TOY_PARAMETERS = 123_456_789
TOY_SCALE_FILE = "scale.json"


class ToyReward:
    """``scale`` × the mean pixel value, the scale read from the toy's weights folder."""

    name = "toy"

    def __init__(self, folder: Path) -> None:
        self.scale = json.loads((folder / "model" / TOY_SCALE_FILE).read_text())["scale"]

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        return self.scale * images.float().mean(dim=(1, 2, 3))


def _check(hps_dir: Path) -> PartStatus:
    return check_subfolders_part("toy", "Toy", hps_dir / "toy", {"model": (TOY_SCALE_FILE,)})


def _write_tiny(hps_dir: Path, seed: int) -> dict[str, int]:
    model = hps_dir / "toy" / "model"
    fresh_subfolders(model)
    (model / TOY_SCALE_FILE).write_text(json.dumps({"scale": 0.5 + seed}) + "\n")
    return {"toy": write_subfolder_manifests("toy", model)}


TOY = RewardRecord(
    "toy",
    lambda hps_dir, device, dtype: ToyReward(hps_dir / "toy"),
    parts=(WeightsPart("toy", _check),),
    write_tiny=_write_tiny,
    parameters=TOY_PARAMETERS,
)


@pytest.fixture
def toy_reward():
    register_reward(TOY)
    yield TOY
    unregister_reward(TOY.name)


def test_a_registered_reward_is_fetched_checked_trained_scored_and_estimated(
    toy_reward, tiny_weights, tiny_embeddings, tmp_path
):
    hps_dir = tmp_path / "hps"
    fetched = runner.invoke(
        app, ["fetch-weights", "--source", "tiny", "--only", "toy", "--hps-dir", str(hps_dir), "--json"]
    )
    assert fetched.exit_code == 0, fetched.output
    (row,) = json.loads(fetched.stdout)["parts"]
    assert (row["part"], row["source"], row["complete"]) == ("toy", "tiny", True)
    assert read_manifest(hps_dir / "toy" / "model").files[0].path == TOY_SCALE_FILE
    assert not (hps_dir / "HPS_v2.1_compressed.pt").exists()  # only the part asked for

    env_argv = ["env-check", "--flux-dir", str(tiny_weights.flux_dir), "--hps-dir", str(hps_dir)]
    env_argv += ["--embeddings", str(tiny_embeddings.out_dir), "--reward", "toy", "--json"]
    checked = runner.invoke(app, env_argv)
    report = json.loads(checked.stdout)
    assert report["rewards"]["toy"] == {"weights": ["toy"], "ready": True, "in_run": True}
    assert report["weights"]["toy"]["complete"] and report["weights"]["hps"]["complete"] is False
    assert checked.exit_code == 0, checked.output  # hpsv2's missing weights only warn: this run reads toy's

    out = tmp_path / "run"
    trained = runner.invoke(
        app,
        [
            *tiny_train_argv(tiny_weights, tiny_embeddings, "--reward", "toy", "--json"),
            *("--hps-dir", str(hps_dir), "--output-dir", str(out), "--max-train-steps", "1"),
            *("--checkpointing-steps", "1", "--num-generations", "2", "--rollout-batch-size", "2"),
            *("--train-micro-batch-size", "2", "--sampling-steps", "4", "--save-images-every", "0"),
        ],
    )
    assert trained.exit_code == 0, trained.output
    # tiny-cpu's images are 64², so every reward the toy gives is 0.5 × a mean pixel in [0, 1]
    assert 0 < json.loads(trained.stdout)["final"]["reward_mean"] <= 0.5

    images, prompts = tmp_path / "images", tmp_path / "prompts.txt"
    images.mkdir()
    for i, level in enumerate((51, 204)):
        Image.new("RGB", (8, 8), (level, level, level)).save(images / f"{i}.png")
    prompts.write_text("a\nb\n")
    score_argv = ["score", "--images", str(images), "--prompts", str(prompts), "--reward", "toy"]
    scored = runner.invoke(app, [*score_argv, "--hps-dir", str(hps_dir), "--device", "cpu", "--json"])
    assert scored.exit_code == 0, scored.output
    values = [image["score"] for image in json.loads(scored.stdout)["images"]]
    assert values == pytest.approx([0.5 * 51 / 255, 0.5 * 204 / 255], abs=1e-6)

    from fluxgrpo.config import build_config
    from fluxgrpo.models.tiny import TINY_TRANSFORMER_CONFIG
    from fluxgrpo.training.memory import RunShape, VaeShape, estimate, transformer_shape

    run = RunShape.from_config(build_config("tiny-cpu", {"reward": "toy,brightness"}), 1)
    assert estimate(transformer_shape(dict(TINY_TRANSFORMER_CONFIG)), VaeShape(0, 0), run).persistent["reward"] == (
        4 * TOY_PARAMETERS
    )
