"""Held-out evaluation during `train` on the tiny weights: when it runs, what it writes, that its images are what
`fluxgrpo sample` makes for the same weights, that its scores are `fluxgrpo score`'s, that it survives a resume
without duplicates, and that it changes no training number. Also the TensorBoard / wandb logs of such a run."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from training_helpers import run, tiny_config

from fluxgrpo.config import build_config
from fluxgrpo.metrics import WANDB_ID_FILE, read_metrics
from fluxgrpo.runtime.launch import LaunchSpec
from fluxgrpo.training.launch_plan import launch_training, plan_training

EVAL_PROMPTS = ["a lighthouse in a storm, oil painting", "a cat on a windowsill, photo", "a castle, anime style"]
NOT_TIMING = ("seconds_", "images_per_second", "peak_memory")


def eval_config(tiny_weights, tiny_embeddings, output_dir: Path, prompts_file: Path, **overrides):
    values = {
        "sampling_steps": 4,
        "use_ema": True,
        "ema_decay": 0.9,
        "eval_every": 2,
        "eval_prompts": str(prompts_file),
        "eval_images_per_prompt": 2,
        "eval_steps": 2,
        "eval_rewards": "hpsv2",
        **overrides,
    }
    return tiny_config(tiny_weights, tiny_embeddings, output_dir, **values)


def pixels(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def training_numbers(records):
    return [{k: v for k, v in r.items() if not k.startswith(NOT_TIMING)} for r in records if "reward_mean" in r]


@pytest.fixture(scope="module")
def eval_run(tiny_weights, tiny_embeddings, tmp_path_factory):
    """One 4-iteration run evaluating at 0, 2, 4 (weights and EMA), with TensorBoard and offline wandb."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    root = tmp_path_factory.mktemp("eval-run")
    prompts = root / "eval_prompts.txt"
    prompts.write_text("\n".join(EVAL_PROMPTS) + "\n")
    cfg = eval_config(
        tiny_weights, tiny_embeddings, root / "out", prompts, tensorboard=True, wandb=True, wandb_mode="offline"
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_SILENT", "true")
        run(cfg)
    return cfg, root / "out", prompts


def test_evaluates_at_zero_every_k_and_writes_sample_indexes(eval_run):
    from fluxgrpo.sampling.folder import read_index

    _, out, _ = eval_run
    evals = [r for r in read_metrics(out) if "eval_brightness_mean" in r]
    assert [r["iteration"] for r in evals] == [0, 2, 4]
    for record in evals:
        assert record["eval_images"] == record["eval_ema_images"] == 3 * 2  # each mean's count, for its noise
        for key in ("eval_brightness", "eval_hpsv2", "eval_ema_brightness", "eval_ema_hpsv2"):
            assert np.isfinite(record[f"{key}_mean"]) and record[f"{key}_std"] >= 0
        for suffix in ("", "-ema"):
            index = read_index(out / "eval" / f"iteration-{record['iteration']}{suffix}")
            assert index.prompts == EVAL_PROMPTS
            assert [(i.prompt_index, i.image_index) for i in index.images] == [
                (p, j) for p in range(3) for j in range(2)
            ]
            assert index.settings["steps"] == 2 and index.settings["seed"] == 0
    # each later evaluation logs its paired noise against iteration 0's images (the same seeds), worked from the
    # per-image scores both index.json files hold
    from fluxgrpo.metrics import paired_change_noise

    assert "eval_change_from" not in evals[0]
    first = json.loads((out / "eval/iteration-0/index.json").read_text())["scores"]
    for record in evals[1:]:
        later = json.loads((out / f"eval/iteration-{record['iteration']}/index.json").read_text())["scores"]
        assert record["eval_change_from"] == 0
        for name in ("brightness", "hpsv2"):
            expected = paired_change_noise(first[name]["per_image"], later[name]["per_image"])
            assert record[f"eval_{name}_change_noise"] == pytest.approx(expected)
        assert not any(key.startswith("eval_ema_") and key.endswith("change_noise") for key in record)
    # at iteration 0 the EMA is the base model, so both evaluations are the same images
    for name in ("0000_00.png", "0002_01.png"):
        assert np.array_equal(pixels(out / "eval/iteration-0" / name), pixels(out / "eval/iteration-0-ema" / name))
    # training moved the weights, so iteration 4 differs from the base model's images
    assert not np.array_equal(
        pixels(out / "eval/iteration-0/0000_00.png"), pixels(out / "eval/iteration-4/0000_00.png")
    )


def test_eval_scores_equal_fluxgrpo_score_on_the_saved_images(eval_run):
    from fluxgrpo.score import ScoreRequest, score

    cfg, out, _ = eval_run
    records = {r["iteration"]: r for r in read_metrics(out) if "eval_hpsv2_mean" in r}
    for iteration, suffix, key in ((2, "", "eval"), (4, "-ema", "eval_ema")):
        for reward in ("brightness", "hpsv2"):
            report = score(
                ScoreRequest(
                    index=str(out / "eval" / f"iteration-{iteration}{suffix}"),
                    reward=reward,
                    hps_dir=cfg.hps_dir,
                    device="cpu",
                )
            )
            assert records[iteration][f"{key}_{reward}_mean"] == report.overall.mean
            assert records[iteration][f"{key}_{reward}_std"] == report.overall.std


def test_eval_images_are_the_images_sample_makes_from_the_same_weights(eval_run, tmp_path):
    from fluxgrpo.sample import build_request, sample
    from fluxgrpo.sampling.request import SampleSettings
    from fluxgrpo.training.eval import training_text_length

    cfg, out, _ = eval_run
    # the same batches as the evaluation (rollout_batch_size): a batch of one can round differently in the last bit;
    # the prompts padded as the training embeddings were (32 T5 tokens, tests/conftest.py)
    settings = SampleSettings(
        height=64, width=64, steps=2, guidance=cfg.guidance, seed=0, images_per_prompt=2, batch_size=4,
        max_sequence_length=training_text_length(cfg),
    )  # fmt: skip
    assert settings.max_sequence_length == 32
    for iteration, checkpoint, ema in (
        (0, None, False),
        (4, out / "checkpoint-4", False),
        (4, out / "checkpoint-4", True),
    ):
        folder = tmp_path / f"sample-{iteration}-{ema}"
        request = build_request(
            model=cfg.model,
            prompts=EVAL_PROMPTS,
            out_dir=folder,
            checkpoint=None if checkpoint is None else str(checkpoint),
            ema=ema,
            settings=settings,
            device="cpu",
        )
        sample(request, show_progress=False)
        evaluated = out / "eval" / f"iteration-{iteration}{'-ema' if ema else ''}"
        for name in ("0000_00.png", "0001_01.png", "0002_00.png"):
            here, there = pixels(folder / name).astype(int), pixels(evaluated / name).astype(int)
            # The same weights and noise in another process: on cpu the matmul kernels may differ in the last bit
            # (the training weights sit in other memory, EMA weights are swapped in rather than loaded), which
            # moves an odd pixel one step of 255 across a rounding edge (CI saw 2 of 12,288 values at iteration 0).
            # Other weights or other noise change nearly every pixel, by far more than one step.
            assert np.abs(here - there).max() <= 1 and (here != there).mean() < 0.01, f"{evaluated.name}/{name}"


def test_resume_neither_repeats_nor_misses_an_evaluation(eval_run, tmp_path):
    """A run that died after evaluating iteration 4 but before checkpoint 4 was complete: the resumed run
    (from checkpoint 2) keeps evaluations 0 and 2, redoes 4 once, and ends with the same weights and images."""
    cfg, out, _ = eval_run
    dead = tmp_path / "dead"
    shutil.copytree(out, dead, ignore=shutil.ignore_patterns("wandb", "tensorboard"))
    shutil.rmtree(dead / "checkpoint-4")
    (dead / WANDB_ID_FILE).unlink()
    before = (dead / "eval/iteration-2/index.json").stat().st_mtime_ns
    run(derived_config(cfg, output_dir=str(dead)), resume="latest")
    records = read_metrics(dead)
    assert [r["iteration"] for r in records if "eval_brightness_mean" in r] == [0, 2, 4]
    assert [r["iteration"] for r in records if "reward_mean" in r] == [1, 2, 3, 4]
    assert (dead / "eval/iteration-2/index.json").stat().st_mtime_ns == before  # not redone
    for name in ("0000_00.png", "0002_01.png"):
        assert np.array_equal(pixels(out / "eval/iteration-4" / name), pixels(dead / "eval/iteration-4" / name))
    original = {r["iteration"]: r for r in read_metrics(out) if "eval_hpsv2_mean" in r}
    again = {r["iteration"]: r for r in records if "eval_hpsv2_mean" in r}
    assert again[4]["eval_hpsv2_mean"] == original[4]["eval_hpsv2_mean"]
    # the resumed run read its reference (iteration 0) back from disk: the same paired noise
    assert again[4]["eval_change_from"] == 0
    assert again[4]["eval_hpsv2_change_noise"] == original[4]["eval_hpsv2_change_noise"]


def test_evaluation_changes_no_training_number(eval_run, tmp_path):
    from safetensors.torch import load_file

    cfg, out, _ = eval_run
    records = run(derived_config(cfg, output_dir=str(tmp_path / "plain"), eval_every=0))
    assert not (tmp_path / "plain" / "eval").exists()
    assert training_numbers(records) == training_numbers(read_metrics(out))
    for file in sorted((out / "checkpoint-4" / "transformer").glob("*.safetensors")):
        a, b = load_file(file), load_file(tmp_path / "plain" / "checkpoint-4" / "transformer" / file.name)
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_two_workers_split_the_prompts_and_make_the_same_images(eval_run, tmp_path):
    """3 prompts over 2 FSDP2 ranks: rank 0 samples prompts 0 and 2 (2 batches of 2 images), rank 1 prompt 1
    (1 batch) plus 1 padding batch, so both run the same sharded forwards. The base model's images equal the
    single-process run's."""
    cfg, out, _ = eval_run
    two = derived_config(
        cfg, output_dir=str(tmp_path / "two"), max_train_steps=2, rollout_batch_size=2, eval_rewards="", use_ema=False
    )
    launch_training(plan_training(two, LaunchSpec(nproc_per_node=2)), log=lambda _: None)
    records = read_metrics(tmp_path / "two")
    assert [r["iteration"] for r in records if "eval_brightness_mean" in r] == [0, 2]
    for name in ("0000_00.png", "0001_01.png", "0002_00.png"):
        assert np.array_equal(pixels(out / "eval/iteration-0" / name), pixels(tmp_path / "two/eval/iteration-0" / name))
    index = json.loads((tmp_path / "two/eval/iteration-2/index.json").read_text())
    assert index["settings"]["world_size"] == 2 and len(index["images"]) == 6


def test_tensorboard_has_scalars_eval_grids_and_reward_histograms(eval_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, out, _ = eval_run
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"images": 0, "histograms": 0})
    events.Reload()
    tags = events.Tags()
    assert [e.step for e in events.Scalars("reward_mean")] == [1, 2, 3, 4]
    assert [e.step for e in events.Scalars("eval_hpsv2_mean")] == [0, 2, 4]
    assert [e.step for e in events.Images("eval_grid")] == [0, 2, 4]
    assert "eval_ema_grid" in tags["images"]
    assert {"reward", "eval_brightness", "eval_hpsv2"} <= set(tags["histograms"])
    first = events.Images("eval_grid")[0]
    assert first.width > 64 and first.height > 3 * 64  # the contact sheet: 3 prompts × 2 images


def test_wandb_run_id_is_kept_and_offline_run_logged(eval_run):
    _, out, _ = eval_run
    run_id = (out / WANDB_ID_FILE).read_text().strip()
    assert len(run_id) == 8
    offline = list((out / "wandb").glob(f"offline-run-*-{run_id}"))
    assert offline, sorted(p.name for p in (out / "wandb").iterdir())


def test_resumed_wandb_run_continues_the_same_run(eval_run, tmp_path):
    pytest.importorskip("wandb")
    from fluxgrpo.metrics import MetricsLogger, WandbRun

    _, out, _ = eval_run
    folder = tmp_path / "again"
    folder.mkdir()
    (folder / WANDB_ID_FILE).write_text((out / WANDB_ID_FILE).read_text())
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_SILENT", "true")
        logger = MetricsLogger(folder, enabled=True, wandb=WandbRun(mode="offline", name="named"), resume_after=2)
        try:
            assert logger._wandb.id == (out / WANDB_ID_FILE).read_text().strip()
            assert logger._wandb.name == "named"
            assert logger._wandb.project == "fluxgrpo"
        finally:
            logger.close()


def test_eval_settings_are_validated_together():
    from fluxgrpo.errors import UsageError

    with pytest.raises(UsageError) as caught:
        build_config(
            None,
            {
                "eval_every": -1,
                "eval_steps": 0,
                "eval_images_per_prompt": 0,
                "eval_prompts": "/nonexistent/prompts.txt",
                "eval_rewards": "hpsv2,nosuchreward",
                "wandb_mode": "sometimes",
            },
        )
    message = str(caught.value)
    for flag in (
        "--eval-every",
        "--eval-steps",
        "--eval-images-per-prompt",
        "--eval-prompts",
        "nosuchreward",
        "--wandb-mode",
    ):
        assert flag in message


def test_shipped_eval_prompts_are_held_out_and_cover_the_four_styles():
    from fluxgrpo.data.prompts import bundled_prompts_path, read_prompts
    from fluxgrpo.training.eval import shipped_eval_prompts_path

    held_out = read_prompts(shipped_eval_prompts_path())
    assert 32 <= len(held_out) <= 64
    assert not set(held_out) & set(read_prompts(bundled_prompts_path()))
    text = " ".join(held_out).lower()
    for style in ("anime", "concept art", "painting", "photo"):
        assert text.count(style) >= 8, style


def derived_config(cfg, **changes):
    """The fixture run's config with ``changes``, without the trackers (they are tested on the fixture run)."""
    return dataclasses.replace(cfg, tensorboard=False, wandb=False, **changes).validate()


def test_is_due_marks_zero_every_k_and_the_last_iteration():
    from fluxgrpo.config import TrainConfig
    from fluxgrpo.training.eval import is_due

    cfg = TrainConfig(eval_every=3, max_train_steps=7)
    assert [k for k in range(8) if is_due(cfg, k)] == [0, 3, 6, 7]
    assert not any(is_due(TrainConfig(eval_every=0), k) for k in range(5))
    assert json.dumps(cfg.to_dict())  # the new fields serialise into the resolved config


def test_preflight_checks_the_weights_of_the_eval_rewards(tiny_weights, tiny_embeddings, tmp_path):
    from fluxgrpo.errors import FluxgrpoError
    from fluxgrpo.weights.layout import pickscore_dir

    hps = tmp_path / "hps"
    shutil.copytree(tiny_weights.hps_dir, hps)
    shutil.rmtree(pickscore_dir(hps))
    values = {
        "model": str(tiny_weights.flux_dir),
        "hps_dir": str(hps),
        "data_json_path": str(tiny_embeddings.index_path),
        "output_dir": str(tmp_path / "out"),
        "eval_rewards": "pickscore",
    }
    with pytest.raises(FluxgrpoError, match="PickScore"):
        plan_training(build_config("tiny-cpu", {**values, "eval_every": 5}), LaunchSpec(nproc_per_node=1), dry_run=True)
    # without evaluation the extra reward is never loaded, so its weights are not needed (a config file's
    # eval_rewards with evaluation off; typed, the flag would be refused as unread)
    quiet = dataclasses.replace(build_config("tiny-cpu", {**values, "eval_every": 5}), eval_every=0)
    plan_training(quiet, LaunchSpec(nproc_per_node=1), dry_run=True)
