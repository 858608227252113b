"""Issue #23.7-8: nonsense settings are refused before a run starts, a run that cannot learn stops, and `score`
never pairs an image with another image's prompt."""

from __future__ import annotations

import math

import pytest
import torch
from training_helpers import run, tiny_config

from fluxgrpo.config import build_config
from fluxgrpo.errors import FluxgrpoError, UsageError
from fluxgrpo.training.stats import SkippedUpdateWatch


@pytest.mark.parametrize(
    "name, value, says",
    [
        ("learning_rate", math.inf, "--learning-rate must be a finite number"),
        ("weight_decay", math.inf, "--weight-decay must be a finite number"),
        ("eta", math.inf, "--eta must be a finite number"),
        ("eta", 1e9, "--eta 1000000000.0 is out of range"),
        ("kl_beta", math.inf, "--kl-beta must be a finite number"),
        ("shift", math.nan, "--shift must be a finite number"),
        ("guidance", math.nan, "--guidance must be a finite number"),
        ("guidance", -1.0, "--guidance and --kl-beta cannot be negative"),
        ("clip_range", math.nan, "--clip-range must be a finite number"),
    ],
)
def test_non_finite_and_out_of_range_settings_are_refused(name, value, says):
    with pytest.raises(UsageError) as caught:
        build_config("tiny-cpu", {name: value})
    assert says in str(caught.value)


def test_the_watch_stops_at_the_kth_iteration_in_a_row_without_a_step():
    watch = SkippedUpdateWatch(limit=3)
    stepped = {"iteration": 1, "optimizer_steps": 2, "update_skipped": False, "loss": 0.1}
    skipped = {"optimizer_steps": 0, "update_skipped": False, "loss": math.nan}
    watch.observe(stepped)
    watch.observe({**skipped, "iteration": 2})
    watch.observe({**skipped, "iteration": 3})
    watch.observe({**stepped, "iteration": 4})  # a step in between starts the count over
    watch.observe({**skipped, "iteration": 5})
    watch.observe({**skipped, "iteration": 6})
    with pytest.raises(FluxgrpoError, match=r"iterations 5-7 all skipped their update because the loss \(nan\)"):
        watch.observe({**skipped, "iteration": 7})


def test_a_run_whose_updates_are_all_skipped_stops_naming_the_reward(
    tiny_weights, tiny_embeddings, tmp_path, monkeypatch
):
    import fluxgrpo.rewards as reward_module

    def load_failing(*args, **kwargs):
        return lambda images, prompts: torch.full((images.shape[0],), float("nan"))

    monkeypatch.setattr(reward_module, "load_reward", load_failing)
    cfg = tiny_config(
        tiny_weights, tiny_embeddings, tmp_path / "out", max_train_steps=5, checkpointing_steps=5, sampling_steps=4
    )
    with pytest.raises(FluxgrpoError) as caught:
        run(cfg)
    message = str(caught.value)
    assert "iterations 1-3 all skipped their update because the reward" in message, message
    assert not list((tmp_path / "out").glob("checkpoint-*"))


# --------------------------------------------------------------------------------------------- 8: score's pairing


def _gray_images(folder, count: int) -> None:
    from PIL import Image

    folder.mkdir()
    for k in range(count):
        Image.new("RGB", (8, 8), (40 * k, 40 * k, 40 * k)).save(folder / f"img{k}.png")


def test_a_blank_prompt_line_between_prompts_is_refused_not_dropped(tmp_path):
    from fluxgrpo.score import images_from_folder

    _gray_images(tmp_path / "imgs", 3)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n\na dog\na bird\n")  # 3 prompts for 3 images, but the blank shifts "a dog" onto img2
    with pytest.raises(FluxgrpoError, match=r"prompts.txt line 2 is blank"):
        images_from_folder(tmp_path / "imgs", prompts)
    prompts.write_text("a cat\na dog\na bird\n\n\n")
    assert [item.prompt for item in images_from_folder(tmp_path / "imgs", prompts)] == ["a cat", "a dog", "a bird"]


def _index(folder, entries: list[dict]) -> None:
    import json

    document = {
        "format": "fluxgrpo-sample-index",
        "format_version": 1,
        "model": "m",
        "prompts": ["a cat", "a dog"],
        "images": [{"prompt": "a cat", "prompt_index": 0, "image_index": 0, "seed": 0, **e} for e in entries],
    }
    (folder / "index.json").write_text(json.dumps(document))


@pytest.mark.parametrize(
    "entries, says",
    [
        ([{"file": "../outside.png"}], "outside the index's folder"),
        ([{"file": "link.png"}], "outside the index's folder"),
        ([{"file": "img0.png"}, {"file": "img0.png", "image_index": 1}], "image entry 1 .* repeats entry 0"),
        ([{"file": "img0.png"}, {"file": "img1.png"}], "image entry 1 .* repeats entry 0"),
    ],
)
def test_an_index_entry_outside_its_folder_or_listed_twice_is_refused(tmp_path, entries, says):
    from PIL import Image

    from fluxgrpo.sampling.folder import read_index

    _gray_images(tmp_path / "run", 2)
    Image.new("RGB", (8, 8)).save(tmp_path / "outside.png")
    (tmp_path / "run" / "link.png").symlink_to(tmp_path / "outside.png")
    _index(tmp_path / "run", entries)
    with pytest.raises(FluxgrpoError, match=says):
        read_index(tmp_path / "run")


def test_reward_weights_that_overflow_their_sum_are_refused_before_anything_starts():
    with pytest.raises(UsageError, match="the weights add up past the largest float"):
        build_config("tiny-cpu", {"reward": "brightness:1e308,hpsv2:1e308"})


def test_fluxgrpo_debug_changes_what_is_printed_not_the_exit_code(monkeypatch):
    from typer.testing import CliRunner

    from fluxgrpo.cli.app import app

    argv = ["train", "--config", "tiny-cpu", "--eta", "inf", "--dry-run"]
    quiet = CliRunner().invoke(app, argv)
    monkeypatch.setenv("FLUXGRPO_DEBUG", "1")
    debug = CliRunner().invoke(app, argv)
    assert quiet.exit_code == debug.exit_code == 2, (quiet.output, debug.output)
    assert "Traceback" in debug.output and "Traceback" not in quiet.output


def test_a_cpu_run_whose_estimate_exceeds_host_memory_is_refused(tiny_weights, tiny_embeddings, tmp_path, monkeypatch):
    from fluxgrpo.training import memory

    cfg = tiny_config(tiny_weights, tiny_embeddings, tmp_path / "out")
    assert memory.plan_memory(cfg, 1, "cpu").peak < memory.host_memory_per_worker(1)  # the tiny run fits
    monkeypatch.setattr(memory, "host_memory_per_worker", lambda workers: 2**20 // workers)
    with pytest.raises(UsageError, match=r"of host memory each of the 1 cpu worker\(s\) can have; change one of"):
        memory.plan_memory(cfg, 1, "cpu")


def test_an_image_side_past_any_device_is_refused():
    with pytest.raises(UsageError, match="--height 1048576 is out of range: at most 8192 pixels"):
        build_config("tiny-cpu", {"height": 1048576})


def test_a_yaml_config_with_aliases_is_refused_without_expanding_them(tmp_path):
    from fluxgrpo.config import read_yaml

    levels = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for depth in range(1, 9):
        previous = chr(ord("a") + depth - 1)
        name = chr(ord("a") + depth)
        levels.append(f"{name}: &{name} [{', '.join([f'*{previous}'] * 9)}]")
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(levels) + "\n")  # 9**9 strings once expanded
    with pytest.raises(UsageError, match="uses YAML aliases"):
        read_yaml(bomb)
    plain = tmp_path / "plain.yaml"
    plain.write_text("eta: 0.5\nreward: hpsv2\n")
    assert read_yaml(plain) == {"eta": 0.5, "reward": "hpsv2"}


def test_a_dry_run_plans_for_a_device_and_die_count_this_machine_lacks(tiny_weights, tiny_embeddings, tmp_path):
    import json

    from training_helpers import tiny_train_argv
    from typer.testing import CliRunner

    from fluxgrpo.cli.app import app
    from fluxgrpo.runtime import device as rt_device

    if rt_device.npu_available():
        pytest.skip("this machine has an NPU")
    argv = tiny_train_argv(tiny_weights, tiny_embeddings, "--device", "npu", "--dies", "16")
    argv += ["--output-dir", str(tmp_path / "out")]
    planned = CliRunner().invoke(app, [*argv, "--dry-run"])
    assert planned.exit_code == 0, planned.output
    document = json.loads(planned.stdout)
    assert document["device_type"] == "npu" and document["memory_per_die"]
    assert "npu × 16 on this machine" in document["skipped_checks"][0]
    assert "not checked (dry run): npu × 16" in planned.stderr
    launched = CliRunner().invoke(app, argv)  # without --dry-run the device is required
    assert launched.exit_code == 1 and "--device npu requested" in launched.stderr


# --------------------------------------------------------------------------------------------- #50.5-6


@pytest.mark.parametrize(
    "settings, says",
    [
        ({"lora_rank": 4, "lora_alpha": 1e30}, "--lora-alpha 1e+30 must be in (0, 4096]"),
        ({"objective": "nft", "nft_beta": 1e30}, "--nft-beta 1e+30 must be in (0, 10]"),
        ({"objective": "awm", "awm_ghuber_power": 1e30}, "--awm-ghuber-power 1e+30 must be in (0, 2]"),
        ({"objective": "awm", "awm_ema_beta": 1e30}, "--awm-ema-beta 1e+30 must be in [0, 10000]"),
        ({"objective": "vgrpo", "vgrpo_adv_soft_clip": 1e30}, "--vgrpo-adv-soft-clip 1e+30 must be in [0, 100]"),
        ({"objective": "neighbor", "neighbor_temperature": 1e30}, "--neighbor-temperature 1e+30 must be in (0, 10000]"),
    ],
)
def test_finite_but_absurd_objective_settings_are_refused_with_their_range(settings, says):
    with pytest.raises(UsageError) as caught:
        build_config("tiny-cpu", settings)
    assert says in str(caught.value), str(caught.value)


def test_a_run_shorter_than_the_stop_whose_updates_are_all_skipped_fails(
    tiny_weights, tiny_embeddings, tmp_path, monkeypatch
):
    """Two iterations, both skipped: the "3 in a row" stop never came, and the run exited 0 having trained nothing."""
    import fluxgrpo.rewards as reward_module

    def load_failing(*args, **kwargs):
        return lambda images, prompts: torch.full((images.shape[0],), float("nan"))

    monkeypatch.setattr(reward_module, "load_reward", load_failing)
    cfg = tiny_config(
        tiny_weights, tiny_embeddings, tmp_path / "out", max_train_steps=2, checkpointing_steps=2, sampling_steps=4
    )
    with pytest.raises(FluxgrpoError, match=r"all 2 iterations skipped their update because the reward"):
        run(cfg)
    watch = SkippedUpdateWatch(last_iteration=2)  # a resumed run's only iteration: not the whole run, no failure
    watch.observe({"iteration": 2, "optimizer_steps": 0, "update_skipped": True})


@pytest.mark.parametrize(
    "typed, switch",
    [
        ({"lora_alpha": 64.0}, "--lora-rank"),
        ({"lora_dropout": 0.1}, "--lora-rank"),
        ({"lora_targets": "attn.to_q"}, "--lora-rank"),
        ({"ema_decay": 0.9}, "--use-ema"),
        ({"sde_window_policy": "random"}, "--sde-window"),
        ({"ode_compress_ratio": 0.5}, "--ode-solver dpm2"),
        ({"eval_steps": 4}, "--eval-every"),
        ({"guard_action": "stop"}, "--guard"),
        ({"wandb_mode": "offline"}, "--wandb"),
    ],
)
def test_a_typed_flag_that_another_setting_must_turn_on_is_refused_without_it(typed, switch):
    with pytest.raises(UsageError) as caught:
        build_config("tiny-cpu", {"lora_rank": 0, "use_ema": False, "eval_every": 0, **typed})
    name = next(iter(typed)).replace("_", "-")
    assert f"--{name} " in str(caught.value) and f"does not read it without {switch}" in str(caught.value)


def test_the_switched_settings_are_read_with_their_switch_and_allowed_from_a_file(tmp_path):
    build_config("tiny-cpu", {"lora_rank": 4, "lora_alpha": 8.0, "use_ema": True, "ema_decay": 0.9})
    config = tmp_path / "run.yaml"
    config.write_text("lora_rank: 0\nlora_alpha: 8.0\nuse_ema: false\nema_decay: 0.9\n")
    build_config(str(config), {"learning_rate": 1e-4})  # a file's values stay allowed, as for --objective
