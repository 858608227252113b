"""`fluxgrpo train` end to end on the tiny weights: learning, exact resume, 2-process FSDP2, failures, bad input."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from training_helpers import TOY_REWARD_RUN, run, tiny_config, tiny_train_argv
from typer.testing import CliRunner

from fluxgrpo.cli.app import app
from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.metrics import read_metrics, reward_trend
from fluxgrpo.runtime.launch import LaunchSpec
from fluxgrpo.training.launch_plan import plan_training

runner = CliRunner()


def exported_weights(checkpoint: Path, folder: str = "transformer") -> dict[str, torch.Tensor]:
    files = sorted((checkpoint / folder).glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(f))
    return out


def initial_weights(tiny_weights) -> dict[str, torch.Tensor]:
    return exported_weights(tiny_weights.flux_dir)


def test_ratio_is_one_before_the_first_update_and_metrics_are_complete(tiny_weights, tiny_embeddings, tmp_path):
    records = run(tiny_config(tiny_weights, tiny_embeddings, tmp_path / "out", max_train_steps=2))
    assert [r["iteration"] for r in records] == [1, 2]
    first = records[0]
    assert first["first_abs_log_ratio"] < 1e-5
    for key in (
        "reward_mean",
        "reward_std",
        "reward_min",
        "reward_max",
        "group_std_mean",
        "zero_std_group_fraction",
        "advantage_abs_mean",
        "ratio_mean",
        "ratio_min",
        "ratio_max",
        "clip_fraction",
        "loss",
        "grad_norm_mean",
        "lr",
        "seconds_rollout",
        "seconds_decode_reward",
        "seconds_update",
        "images_per_second",
        "peak_memory_gib",
        "nonfinite_rewards",
        "skipped_steps",
    ):
        assert key in first, key
    assert read_metrics(tmp_path / "out") == records
    config_text = (tmp_path / "out" / "config.yaml").read_text()
    assert "images_per_iteration: 4" in config_text and "num_generations: 4" in config_text


def test_exact_resume_matches_an_uninterrupted_run(tiny_weights, tiny_embeddings, tmp_path):
    straight = tiny_config(tiny_weights, tiny_embeddings, tmp_path / "straight", use_ema=True, ema_decay=0.9)
    run(straight)
    interrupted = tiny_config(
        tiny_weights, tiny_embeddings, tmp_path / "resumed", use_ema=True, ema_decay=0.9, max_train_steps=2
    )
    run(interrupted)
    resumed = tiny_config(tiny_weights, tiny_embeddings, tmp_path / "resumed", use_ema=True, ema_decay=0.9)
    records = run(resumed, resume="latest")
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]  # metrics.jsonl reads as one run
    for folder in ("transformer", "transformer_ema"):
        a = exported_weights(tmp_path / "straight" / "checkpoint-4", folder)
        b = exported_weights(tmp_path / "resumed" / "checkpoint-4", folder)
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), f"{folder}/{name} differs after resume"
    straight_metrics = read_metrics(tmp_path / "straight")
    resumed_metrics = read_metrics(tmp_path / "resumed")
    assert [r["reward_mean"] for r in straight_metrics] == [r["reward_mean"] for r in resumed_metrics]


def test_checkpoint_loads_with_diffusers_and_holds_the_last_iteration(tiny_weights, tiny_embeddings, tmp_path):
    from diffusers import FluxTransformer2DModel

    run(tiny_config(tiny_weights, tiny_embeddings, tmp_path / "out", max_train_steps=3, checkpointing_steps=2))
    names = sorted(p.name for p in (tmp_path / "out").iterdir() if p.name.startswith("checkpoint-"))
    assert names == ["checkpoint-2", "checkpoint-3"]  # every 2 iterations, and always after the last one
    last, previous = tmp_path / "out" / "checkpoint-3", tmp_path / "out" / "checkpoint-2"
    assert json.loads((last / "COMPLETE").read_text())["iteration"] == 3
    assert json.loads((last / "state" / "trainer_state.json").read_text())["iteration"] == 3
    loaded = FluxTransformer2DModel.from_pretrained(last / "transformer").state_dict()
    exported, earlier = exported_weights(last), exported_weights(previous)
    assert loaded.keys() == exported.keys() == initial_weights(tiny_weights).keys()
    for name, value in loaded.items():
        assert torch.equal(value, exported[name]), name
    # the third update moved the weights, so checkpoint-3 is not a copy of checkpoint-2
    assert any(not torch.equal(exported[name], earlier[name]) for name in exported)


def test_reward_rises_on_a_fixed_seed(tiny_weights, tiny_embeddings, tmp_path):
    # The shipped tiny-cpu settings (brightness reward, lr 3e-3, clip 1e-2) on one process.
    cfg = tiny_config(
        tiny_weights,
        tiny_embeddings,
        tmp_path / "out",
        **TOY_REWARD_RUN,
    )
    records = run(cfg)
    trend = reward_trend(records, window=4)
    assert trend["last"] > trend["first"], trend


def test_nonfinite_rewards_get_zero_advantage_and_training_goes_on(
    tiny_weights, tiny_embeddings, tmp_path, monkeypatch
):
    import fluxgrpo.rewards as reward_module

    real_load = reward_module.load_reward

    def load_with_failures(name, hps_dir, device="cpu", reward_dtype="fp32"):
        inner = real_load(name, hps_dir, device, reward_dtype)

        def score(images, prompts):
            rewards = inner(images, prompts).clone()
            rewards[0] = float("nan")
            rewards[-1] = float("inf")
            return rewards

        return score

    monkeypatch.setattr(reward_module, "load_reward", load_with_failures)
    records = run(tiny_config(tiny_weights, tiny_embeddings, tmp_path / "out", max_train_steps=2))
    assert all(r["nonfinite_rewards"] == 2 for r in records)
    assert all(r["reward_mean"] is not None for r in records)
    weights = exported_weights(tmp_path / "out" / "checkpoint-2")
    assert all(torch.isfinite(t).all() for t in weights.values())


@pytest.mark.slow
def test_two_workers_every_parameter_changes(tiny_weights, tiny_embeddings, tmp_path):
    result = runner.invoke(
        app,
        [
            *tiny_train_argv(tiny_weights, tiny_embeddings, "--dies", "2", "--json"),
            "--output-dir",
            str(tmp_path / "out"),
            "--max-train-steps",
            "2",
            "--checkpointing-steps",
            "2",
            "--num-generations",
            "4",
            "--rollout-batch-size",
            "4",
            "--train-micro-batch-size",
            "2",
            "--sampling-steps",
            "6",
            "--save-images-every",
            "1",
            "--images-per-save",
            "2",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    records = read_metrics(tmp_path / "out")
    assert summary["iterations"] == 2 and summary["final"] == records[-1]
    assert summary["reward_trend"] == reward_trend(records) and summary["reward_trend"]["iterations"] == 2
    assert records[0]["first_abs_log_ratio"] < 1e-5
    assert records[0]["images_per_second"] > 0
    before = initial_weights(tiny_weights)
    after = exported_weights(tmp_path / "out" / "checkpoint-2")
    assert before.keys() == after.keys()
    unchanged = [name for name in before if torch.equal(before[name], after[name])]
    assert not unchanged, f"parameters that did not train: {unchanged}"
    images = sorted(p.name for p in (tmp_path / "out" / "images").iterdir())
    # every save keeps its own set: flux_<iteration>_<rank>_<index>.png
    assert images == [f"flux_{k}_{rank}_{i}.png" for k in (1, 2) for rank in (0, 1) for i in (0, 1)]
    assert (tmp_path / "out" / "logs").is_dir()


@pytest.mark.slow
def test_a_failing_rank_stops_the_run_and_is_named(tiny_weights, tiny_embeddings, tmp_path):
    # Only rank 1 fails: the file its first image would be saved as is a folder. (A damaged embedding no longer
    # reaches a worker: preflight reads every embedding header before launch.)
    (tmp_path / "out" / "images" / "flux_1_1_0.png").mkdir(parents=True)  # iteration 1, rank 1, image 0
    cfg = tiny_config(
        tiny_weights,
        tiny_embeddings,
        tmp_path / "out",
        max_train_steps=1,
        save_images_every=1,
        images_per_save=1,
    )
    with pytest.raises(FluxgrpoError, match=r"rank 1 failed"):
        run(cfg, dies=2)
    assert not any(p.name.startswith("checkpoint-") for p in (tmp_path / "out").iterdir())


def test_stand_in_npu_kernels_run_when_forced(tiny_weights, tiny_embeddings, tmp_path, monkeypatch):
    from fluxgrpo.runtime import device as rt_device

    fake = Path(__file__).parents[1] / "fake_torch_npu"
    monkeypatch.syspath_prepend(str(fake))
    saved = sys.modules.pop("torch_npu", None)
    monkeypatch.setenv("FLUXGRPO_FORCE_NPU_ADAPT", "1")
    rt_device._reset_npu_status_for_tests()
    try:
        import torch_npu

        before = dict(torch_npu.CALLS)
        run(tiny_config(tiny_weights, tiny_embeddings, tmp_path / "out", max_train_steps=1, checkpointing_steps=1))
        calls = torch_npu.CALLS.get("npu_rms_norm", 0) - before.get("npu_rms_norm", 0)
        assert calls > 0
        # the swapped modules keep the state-dict keys: the export matches the base model's keys
        assert exported_weights(tmp_path / "out" / "checkpoint-1").keys() == initial_weights(tiny_weights).keys()
    finally:
        sys.modules.pop("torch_npu", None)
        if saved is not None:
            sys.modules["torch_npu"] = saved
        rt_device._reset_npu_status_for_tests()


# --- checks before any worker starts ------------------------------------------------------------------


def test_missing_weights_say_which_command_fixes_them(tiny_weights, tiny_embeddings, tmp_path):
    cfg = tiny_config(tiny_weights, tiny_embeddings, tmp_path / "out", model=str(tmp_path / "nothing"))
    with pytest.raises(FluxgrpoError, match="fluxgrpo fetch-weights"):
        run(cfg)


def test_missing_embeddings_say_which_command_fixes_them(tiny_weights, tiny_embeddings, tmp_path):
    cfg = tiny_config(
        tiny_weights, tiny_embeddings, tmp_path / "out", data_json_path=str(tmp_path / "emb" / "videos2caption.json")
    )
    with pytest.raises(FluxgrpoError, match="fluxgrpo preprocess"):
        run(cfg)


def test_embeddings_for_another_model_are_refused(tiny_weights, tiny_embeddings, tmp_path):
    emb = tmp_path / "emb"
    shutil.copytree(tiny_embeddings.out_dir, emb)
    first = json.loads((emb / "videos2caption.json").read_text())[0]
    torch.save(torch.zeros(32, 4096), emb / "prompt_embed" / first["prompt_embed_path"])
    cfg = tiny_config(tiny_weights, tiny_embeddings, tmp_path / "out", data_json_path=str(emb / "videos2caption.json"))
    with pytest.raises(FluxgrpoError, match="made for another model"):
        run(cfg)


def test_unwritable_output_dir_is_refused_before_anything_runs(tiny_weights, tiny_embeddings, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cfg = tiny_config(tiny_weights, tiny_embeddings, blocker / "out")
    with pytest.raises(FluxgrpoError, match="--output-dir"):
        plan_training(cfg, LaunchSpec())


def test_cli_dry_run_and_usage_errors(tiny_weights, tiny_embeddings, tmp_path):
    result = runner.invoke(
        app,
        [
            *tiny_train_argv(tiny_weights, tiny_embeddings, "--dies", "2", "--dry-run"),
            "--output-dir",
            str(tmp_path / "out"),
        ],
    )
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["derived"]["images_per_iteration"] == 16 and plan["device_type"] == "cpu"
    bad = runner.invoke(app, ["train", "--config", "tiny-cpu", "--rollout-batch-size", "3"])
    assert bad.exit_code == 2 and "does not divide" in bad.output
    assert runner.invoke(app, ["train", "--config", "nope"]).exit_code == 2
    listing = runner.invoke(app, ["train", "--list-configs"])
    assert listing.exit_code == 0 and "a3-16die" in listing.stdout


def test_resume_refuses_changed_algorithm_settings_before_loading_anything(tiny_weights, tiny_embeddings, tmp_path):
    from fluxgrpo.errors import UsageError

    run(tiny_config(tiny_weights, tiny_embeddings, tmp_path / "out", max_train_steps=1, checkpointing_steps=1))
    config_before = (tmp_path / "out" / "config.yaml").read_text()
    changed = tiny_config(tiny_weights, tiny_embeddings, tmp_path / "out", max_train_steps=2, learning_rate=1e-4)
    with pytest.raises(UsageError, match=r"--learning-rate was 0.003, now 0.0001"):
        plan_training(changed, LaunchSpec(), "latest")
    with pytest.raises(UsageError, match=r"written by 1 worker\(s\), this run has 2: use --dies 1"):
        plan_training(
            tiny_config(tiny_weights, tiny_embeddings, tmp_path / "out", max_train_steps=2),
            LaunchSpec(nproc_per_node=2),
            "latest",
        )
    assert (tmp_path / "out" / "config.yaml").read_text() == config_before  # nothing overwritten
    longer = plan_training(
        tiny_config(tiny_weights, tiny_embeddings, tmp_path / "out", max_train_steps=2), LaunchSpec(), "latest"
    )
    assert longer.resume_checkpoint.endswith("checkpoint-1")


def test_cli_resume_flags_and_dry_run_checks_inputs(tiny_weights, tiny_embeddings, tmp_path):
    common = tiny_train_argv(tiny_weights, tiny_embeddings, "--dry-run")
    fresh = runner.invoke(app, [*common, "--output-dir", str(tmp_path / "new"), "--resume"])
    assert fresh.exit_code == 0, fresh.output
    assert json.loads(fresh.stdout)["resume_from"] is None  # --resume with nothing to resume starts fresh
    assert not (tmp_path / "new").exists()  # a dry run creates nothing
    missing = runner.invoke(app, [*common, "--output-dir", str(tmp_path / "x"), "--resume-from", "checkpoint-9"])
    assert missing.exit_code == 2 and "checkpoint-9" in missing.output  # a wrong flag value: usage (#50.9)
    nope = runner.invoke(app, [*common, "--output-dir", str(tmp_path / "x"), "--resume-from", "nope"])
    assert nope.exit_code == 2 and "nope is not a complete checkpoint (it does not exist)" in nope.stderr
    no_weights = runner.invoke(app, [*common[:3], "--model", str(tmp_path / "none")])
    assert no_weights.exit_code == 1 and "fetch-weights" in no_weights.output
    # a dry run plans without weights (from the model the config names) and says what a launch would refuse
    planned = runner.invoke(app, [*common[:3], "--model", str(tmp_path / "none"), "--dry-run"])
    assert planned.exit_code == 0, planned.output
    assert "not checked (dry run): FLUX weights" in planned.stderr and "fetch-weights" in planned.stderr
    offload = runner.invoke(app, [*common, "--cpu-offload"])
    assert offload.exit_code == 2 and "--dies 2" in offload.output


def test_reward_statistics_by_hand():
    from fluxgrpo.runtime.dist import DistContext
    from fluxgrpo.training.stats import reward_statistics

    ctx = DistContext(0, 0, 1, "cpu", torch.device("cpu"), "gloo")
    # Groups of 2: [1, 3] and [2, NaN]. Finite rewards 1, 3, 2: mean 2, unbiased std √((1+1+0)/2) = 1.
    # Group stds: √((1+1)/1) = √2 and 0 (one finite reward) → mean √2/2 ≈ 0.7071; half the groups have zero std.
    stats = reward_statistics(ctx, torch.tensor([1.0, 3.0, 2.0, float("nan")]), 2)
    assert stats["reward_mean"] == pytest.approx(2.0) and stats["reward_std"] == pytest.approx(1.0)
    assert (stats["reward_min"], stats["reward_max"]) == (1.0, 3.0)
    assert stats["group_std_mean"] == pytest.approx(2**0.5 / 2)
    assert stats["zero_std_group_fraction"] == 0.5 and stats["nonfinite_rewards"] == 1.0


def test_the_held_out_change_is_told_apart_from_the_noise_of_a_redraw():
    from fluxgrpo.cli.train import _against_noise
    from fluxgrpo.metrics import held_out_trend

    first = {"iteration": 0, "eval_seconds": 1.0, "eval_images": 100, "eval_shapes_mean": 0.5, "eval_shapes_std": 0.3}
    last = {**first, "iteration": 8, "eval_shapes_mean": 0.58, "eval_shapes_std": 0.4}
    trend = held_out_trend([first, {"iteration": 1, "reward_mean": 0.1}, last])["shapes"]
    # 2·√(0.3²/100 + 0.4²/100) = 2·√0.0025 = 0.1
    assert trend["change"] == pytest.approx(0.08) and trend["noise"] == pytest.approx(0.1)
    assert _against_noise(trend).startswith(", within noise (±0.1000: 2 standard errors")
    assert _against_noise(held_out_trend([first, {**last, "eval_shapes_mean": 0.65}])["shapes"]).startswith(
        ", beyond noise"
    )
    older = {key: value for key, value in first.items() if key != "eval_images"}  # a run from before the count
    assert "noise" not in held_out_trend([older, last])["shapes"]
    assert _against_noise(held_out_trend([older, last])["shapes"]) == ""


def test_the_paired_noise_of_the_same_seeds_is_worked_by_hand_and_preferred_when_it_is_against_the_first():
    from fluxgrpo.cli.train import _against_noise
    from fluxgrpo.metrics import held_out_trend, paired_change_noise

    # d = (1, 0, 0, −1): mean 0, sd (n − 1) = √(2/3), 2·sd/√4 = √(2/3) = 0.8165
    assert paired_change_noise([0.0, 1.0, 0.5, 1.0], [1.0, 1.0, 0.5, 0.0]) == pytest.approx((2 / 3) ** 0.5)
    # a constant change has no spread: every image moved alike, the noise is 0
    assert paired_change_noise([0.2, 0.4, 0.6], [0.3, 0.5, 0.7]) == pytest.approx(0.0, abs=1e-12)
    # non-finite pairs are left out; fewer than two pairs give none
    assert paired_change_noise([0.0, float("nan"), 1.0], [1.0, 0.0, 1.0]) == pytest.approx(1.0)
    assert paired_change_noise([0.0, float("nan")], [1.0, 0.0]) is None
    with pytest.raises(ValueError, match="as many images"):
        paired_change_noise([0.0], [0.0, 1.0])

    first = {"iteration": 0, "eval_seconds": 1.0, "eval_images": 100, "eval_shapes_mean": 0.5, "eval_shapes_std": 0.3}
    last = {**first, "iteration": 8, "eval_shapes_mean": 0.58, "eval_shapes_std": 0.4}
    paired = {**last, "eval_shapes_change_noise": 0.05, "eval_change_from": 0}
    trend = held_out_trend([first, paired])["shapes"]
    assert trend["noise"] == 0.05 and trend["paired"] == 1.0
    assert _against_noise(trend) == (
        ", beyond noise (±0.0500: 2 standard errors of the per-image change, the same seeds at both)"
    )
    # measured against another evaluation than the first: the unpaired figure from the two means
    elsewhere = held_out_trend([first, {**paired, "eval_change_from": 4}])["shapes"]
    assert elsewhere["noise"] == pytest.approx(0.1) and "paired" not in elsewhere
