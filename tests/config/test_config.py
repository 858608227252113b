"""Training config: defaults = the A3 16-die recipe, YAML → flags precedence, batch arithmetic, shipped configs."""

import pytest
import yaml

from fluxgrpo.config import TrainConfig, build_config, save_resolved, shipped_configs
from fluxgrpo.errors import UsageError


def test_defaults_are_the_a3_16die_recipe():
    cfg = TrainConfig()
    assert (cfg.height, cfg.width, cfg.sampling_steps, cfg.eta, cfg.shift, cfg.guidance) == (
        720,
        720,
        16,
        0.3,
        3.0,
        3.5,
    )
    assert (cfg.num_generations, cfg.train_batch_size, cfg.timestep_fraction, cfg.clip_range) == (12, 1, 0.6, 1e-4)
    assert (cfg.adv_clip_max, cfg.learning_rate, cfg.weight_decay, cfg.max_grad_norm) == (5.0, 1e-5, 1e-4, 1.0)
    assert (cfg.gradient_accumulation_steps, cfg.rollout_batch_size, cfg.train_micro_batch_size) == (4, 4, 1)
    assert cfg.init_same_noise and cfg.gradient_checkpointing
    assert (cfg.seed, cfg.checkpointing_steps, cfg.max_train_steps) == (42, 40, 300)


def test_derived_numbers_match_the_recipe_tables():
    # dancegrpo-spec §8: 16 ranks × 1 prompt × 12 = 192 images; 12/(1·4) = 3 optimizer steps of 16·1·4 = 64
    # trajectories; T_train = int(15·0.6) = 9; 12·16 = 192 rollout forwards and 12·9 = 108 trained steps per rank.
    d = TrainConfig().derived(16)
    assert d["images_per_iteration"] == 192
    assert d["optimizer_steps_per_iteration"] == 3
    assert d["trajectories_per_optimizer_step"] == 64
    assert d["train_timesteps_per_trajectory"] == 9
    assert (d["rollout_forwards_per_rank"], d["train_forward_backward_per_rank"]) == (192, 108)
    assert d["total_optimizer_steps"] == 900
    # 8-die: 2 prompts × 12 = 24 per rank, GA 12 → 2 steps of 8·12 = 96 trajectories.
    d8 = build_config("a3-8die").derived(8)
    assert (
        d8["trajectories_per_rank"],
        d8["optimizer_steps_per_iteration"],
        d8["trajectories_per_optimizer_step"],
    ) == (24, 2, 96)


def test_leftover_micro_batches_still_make_an_optimizer_step():
    # 12 micro-batches with GA 5 → steps after 5, 10 and the 2 left over: ceil(12/5) = 3.
    assert TrainConfig(gradient_accumulation_steps=5).derived(1)["optimizer_steps_per_iteration"] == 3


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"height": 720 + 8}, "--height 728 must be a positive multiple of 16"),
        ({"num_generations": 1, "rollout_batch_size": 1}, "GRPO needs at least 2"),
        ({"rollout_batch_size": 5}, "--rollout-batch-size 5 does not divide the 12 trajectories per rank"),
        ({"train_micro_batch_size": 5}, "use one of [1, 2, 3, 4, 6, 12]"),
        ({"timestep_fraction": 0.05}, "trains no timestep"),
        ({"lr_scheduler": "step"}, "--lr-scheduler"),
        ({"attention": "flash"}, "--attention"),
        ({"device": "tpu"}, "--device"),
        ({"ema_decay": 1.0}, "--ema-decay"),
    ],
)
def test_inconsistent_settings_say_which_numbers_and_how_to_fix(overrides, needle):
    with pytest.raises(UsageError) as info:
        build_config(None, overrides)
    assert needle in str(info.value)


def test_all_problems_are_reported_together():
    with pytest.raises(UsageError) as info:
        build_config(None, {"height": 100, "width": 30, "num_generations": 1, "rollout_batch_size": 1})
    text = str(info.value)
    assert "--height 100" in text and "--width 30" in text and "--num-generations 1" in text


def test_yaml_then_flags_precedence_and_unknown_keys(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"num_generations": 6, "rollout_batch_size": 2, "learning-rate": 3e-4}))
    cfg = build_config(str(path), {"num_generations": 4, "eta": None})
    assert cfg.num_generations == 4  # the flag wins
    assert cfg.rollout_batch_size == 2 and cfg.learning_rate == 3e-4  # the file wins over defaults
    assert cfg.eta == 0.3  # None means "flag not given"
    path.write_text(yaml.safe_dump({"num_generation": 6, "height": "big"}))
    with pytest.raises(UsageError) as info:
        build_config(str(path))
    assert "unknown key 'num_generation'" in str(info.value) and "height" in str(info.value)


def test_unknown_config_name_lists_shipped_ones():
    with pytest.raises(UsageError, match="tiny-cpu"):
        build_config("no-such-config")


def test_shipped_configs_validate_and_start_with_their_launch_command():
    configs = shipped_configs()
    assert {"tiny-cpu", "a3-8die", "a3-16die"} <= set(configs)
    for name, path in configs.items():
        build_config(name)
        first = path.read_text().splitlines()[0]
        assert first.startswith("# fluxgrpo ") and f"--config {name}" in first, name


def test_resolved_config_round_trips(tmp_path):
    cfg = build_config("tiny-cpu", {"seed": 7})
    path = tmp_path / "config.yaml"
    save_resolved(cfg, path, cfg.derived(2))
    assert build_config(str(path)) == cfg  # what `--config <resolved config.yaml>` loads
    assert "images_per_iteration: 16" in path.read_text()


@pytest.mark.parametrize(
    ("objective", "flags", "named"),
    [
        ("vgrpo", {"eta": 0.05}, "--eta 0.05"),  # V-GRPO rolls out with the ODE: no SDE noise to set
        ("vgrpo", {"timestep_fraction": 0.3}, "--timestep-fraction 0.3"),  # its N_MC pairs are its trained timesteps
        ("nft", {"clip_range": 0.01}, "--clip-range 0.01"),  # no probability ratio to clip
        ("neighbor", {"sampler": "cps"}, "--sampler cps"),
    ],
)
def test_a_flag_the_objective_does_not_read_is_refused_naming_it(objective, flags, named):
    with pytest.raises(UsageError, match=f"{named}: --objective {objective} does not read it; leave it out"):
        build_config("shapes-cpu", {"objective": objective, **flags})


def test_a_config_files_settings_for_another_objective_stay_allowed_and_read_ones_pass_as_flags():
    # shapes-cpu.yaml sets dance's eta 0.5 and timestep_fraction 0.6: switching the objective keeps the file usable
    cfg = build_config("shapes-cpu", {"objective": "vgrpo"})
    assert cfg.objective == "vgrpo" and cfg.eta == 0.5
    # the same flags for an objective that reads them
    assert build_config("shapes-cpu", {"eta": 0.7, "timestep_fraction": 0.3}).eta == 0.7
    assert build_config("shapes-cpu", {"objective": "nft", "timestep_fraction": 0.3}).timestep_fraction == 0.3


def test_a_typed_flag_left_unread_by_the_config_files_settings_is_refused(tmp_path):
    # the file trains nft on 2 timesteps per image, so a typed --timestep-fraction would change nothing
    path = tmp_path / "nft2.yaml"
    path.write_text("objective: nft\nfm_timesteps: 2\n")
    with pytest.raises(UsageError, match="--timestep-fraction 0.3: --objective nft does not read it"):
        build_config(str(path), {"timestep_fraction": 0.3})
    assert build_config(str(path), {"learning_rate": 3e-4}).fm_timesteps == 2
