"""Several rewards (#15.5): the --reward spec, the RewardSet, sum-rewards / sum-advantages, per-reward metrics."""

from __future__ import annotations

import dataclasses
import math
import shutil

import pytest
import torch

from fluxgrpo.errors import UsageError
from fluxgrpo.grpo.advantages import aggregate_rewards, group_advantages
from fluxgrpo.rewards.reward_set import parse_reward_spec, reward_spec_problems

REWARDS = torch.tensor([0.31, 0.27, 0.35, float("nan"), 0.22, 0.22, 0.29, 0.40])


def test_the_config_offers_exactly_the_aggregations_the_algorithm_implements():
    from fluxgrpo.config.choices import AGGREGATIONS as offered
    from fluxgrpo.grpo.advantages import AGGREGATIONS as implemented

    assert offered == implemented


# --- the spec ----------------------------------------------------------------------------------------------------


def test_spec_names_weights_and_default_weight():
    terms = parse_reward_spec("hpsv2:1.0, pickscore:0.5,clipscore")
    assert [(t.name, t.weight) for t in terms] == [("hpsv2", 1.0), ("pickscore", 0.5), ("clipscore", 1.0)]


def test_every_spec_problem_is_listed():
    problems = reward_spec_problems("hpsv2:x,nope:1,pickscore:0,hpsv2:2,clipscore:-1")
    assert len(problems) == 4, problems
    assert any("'x'" in p for p in problems) and any("'nope'" in p for p in problems)
    assert any("pickscore must be a positive" in p for p in problems)
    assert any("clipscore must be a positive" in p for p in problems)
    assert reward_spec_problems("hpsv2,") and reward_spec_problems("")
    with pytest.raises(UsageError, match="unknown reward 'nope'"):
        parse_reward_spec("nope")


def test_config_validation_reports_spec_and_aggregation_problems():
    from fluxgrpo.config import TrainConfig

    problems = TrainConfig(reward="hpsv2:0", advantage_aggregation="mean").problems()
    assert any("--reward" in p for p in problems) and any("--advantage-aggregation 'mean'" in p for p in problems)
    assert not TrainConfig(reward="hpsv2:1,pickscore:0.5", advantage_aggregation="sum-advantages").problems()


# --- aggregation -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("aggregation", ["sum-rewards", "sum-advantages"])
def test_one_reward_with_weight_one_is_todays_advantage_bit_for_bit(aggregation):
    today = group_advantages(REWARDS, group_size=4, adv_clip_max=5.0)
    result = aggregate_rewards(REWARDS[:, None], torch.tensor([1.0]), aggregation, 4, 5.0)
    assert torch.allclose(result.rewards, REWARDS, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(result.advantages.advantages, today.advantages)
    assert result.advantages.num_nonfinite == today.num_nonfinite == 1


def test_sum_rewards_by_hand():
    # Two rewards, weights 0.75 / 0.25 (spec 3:1), one group of 2: r = 0.75·[1, 3] + 0.25·[10, 2] = [3.25, 2.75].
    scores = torch.tensor([[1.0, 10.0], [3.0, 2.0]])
    result = aggregate_rewards(scores, torch.tensor([0.75, 0.25]), "sum-rewards", 2, 5.0)
    assert result.rewards.tolist() == [3.25, 2.75]
    # mean 3.0, unbiased std √((0.0625 + 0.0625) / 1) = 0.35355 → ±0.7071
    torch.testing.assert_close(
        result.advantages.advantages, torch.tensor([1.0, -1.0]) / math.sqrt(2), atol=1e-6, rtol=0
    )


def test_sum_advantages_by_hand_and_scale_free():
    # Per reward, a group of 2 standardises to ±1/√2: reward 0 → [−, +], reward 1 → [+, −].
    scores = torch.tensor([[1.0, 10.0], [3.0, 2.0]])
    weights = torch.tensor([0.75, 0.25])
    result = aggregate_rewards(scores, weights, "sum-advantages", 2, 5.0)
    expected = torch.tensor([-0.75 + 0.25, 0.75 - 0.25]) / math.sqrt(2)
    torch.testing.assert_close(result.advantages.advantages, expected, atol=1e-6, rtol=0)
    # Rescaling one reward changes nothing under sum-advantages, but does under sum-rewards.
    rescaled = scores * torch.tensor([1.0, 1000.0])
    again = aggregate_rewards(rescaled, weights, "sum-advantages", 2, 5.0)
    torch.testing.assert_close(again.advantages.advantages, result.advantages.advantages, atol=1e-6, rtol=0)
    summed = aggregate_rewards(rescaled, weights, "sum-rewards", 2, 5.0)
    assert summed.advantages.advantages[0] > 0  # reward 1 (×1000) now decides the sign


def test_a_trajectory_with_any_non_finite_score_gets_zero_advantage():
    scores = torch.tensor([[1.0, 2.0], [2.0, float("inf")], [3.0, 1.0], [4.0, 0.0]])
    for aggregation in ("sum-rewards", "sum-advantages"):
        result = aggregate_rewards(scores, torch.tensor([0.5, 0.5]), aggregation, 4, 5.0)
        assert result.advantages.advantages[1] == 0 and result.advantages.num_nonfinite == 1
        assert torch.isfinite(result.advantages.advantages).all()


# --- the reward set ----------------------------------------------------------------------------------------------


def test_reward_set_scores_one_column_per_reward_with_normalised_weights(tiny_weights):
    from fluxgrpo.rewards import load_reward
    from fluxgrpo.rewards.reward_set import load_reward_set

    reward_set = load_reward_set("brightness:3,clipscore:1", tiny_weights.hps_dir)
    assert reward_set.names == ["brightness", "clipscore"]
    assert reward_set.weights.tolist() == [0.75, 0.25]
    images, prompts = torch.rand(3, 3, 64, 64, generator=torch.Generator().manual_seed(0)), ["a", "b", "c"]
    scores = reward_set(images, prompts)
    assert scores.shape == (3, 2) and scores.dtype == torch.float32
    assert torch.equal(scores[:, 0], load_reward("brightness", tiny_weights.hps_dir)(images, prompts))
    assert torch.equal(scores[:, 1], load_reward("clipscore", tiny_weights.hps_dir)(images, prompts))
    assert load_reward_set("brightness:2", tiny_weights.hps_dir).weights.tolist() == [1.0]


# --- in training -------------------------------------------------------------------------------------------------


def _train(tiny_weights, tiny_embeddings, output_dir, **overrides):
    from training_helpers import run, tiny_config

    values = {"max_train_steps": 2, "checkpointing_steps": 2, "sampling_steps": 4, **overrides}
    return run(tiny_config(tiny_weights, tiny_embeddings, output_dir, **values))


def _weights(checkpoint):
    from safetensors.torch import load_file

    out = {}
    for path in sorted((checkpoint / "transformer").glob("*.safetensors")):
        out.update(load_file(path))
    return out


def test_one_weighted_reward_trains_exactly_like_the_plain_reward(tiny_weights, tiny_embeddings, tmp_path):
    plain = _train(tiny_weights, tiny_embeddings, tmp_path / "plain", reward="brightness")
    weighted = _train(
        tiny_weights,
        tiny_embeddings,
        tmp_path / "weighted",
        reward="brightness:1.0",
        advantage_aggregation="sum-advantages",
    )
    timing = ("seconds_", "images_per_second", "peak_memory")
    strip = [{k: v for k, v in r.items() if not k.startswith(timing)} for r in (*plain, *weighted)]
    assert strip[:2] == strip[2:]
    assert "reward_brightness_mean" not in plain[0]  # one reward: its statistics are reward_mean / reward_std
    a, b = _weights(tmp_path / "plain" / "checkpoint-2"), _weights(tmp_path / "weighted" / "checkpoint-2")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_several_rewards_log_each_ones_statistics(tiny_weights, tiny_embeddings, tmp_path):
    records = _train(
        tiny_weights, tiny_embeddings, tmp_path / "out", reward="brightness:2,clipscore:1", max_train_steps=1
    )
    record = records[0]
    for name in ("brightness", "clipscore"):
        assert math.isfinite(record[f"reward_{name}_mean"]) and record[f"reward_{name}_std"] >= 0
    combined = 2 / 3 * record["reward_brightness_mean"] + 1 / 3 * record["reward_clipscore_mean"]
    assert record["reward_mean"] == pytest.approx(combined, rel=1e-5)


def test_preflight_names_the_fetch_command_of_every_listed_reward(tiny_weights, tiny_embeddings, tmp_path):
    from fluxgrpo.config import build_config
    from fluxgrpo.errors import FluxgrpoError
    from fluxgrpo.training.launch_plan import preflight

    hps_dir = tmp_path / "hps_ckpt"
    shutil.copytree(tiny_weights.hps_dir, hps_dir, ignore=shutil.ignore_patterns("imagereward"))
    values = {
        "model": str(tiny_weights.flux_dir),
        "hps_dir": str(hps_dir),
        "data_json_path": str(tiny_embeddings.index_path),
        "output_dir": str(tmp_path / "out"),
    }
    preflight(build_config("tiny-cpu", {**values, "reward": "brightness:1,clipscore:1"}))  # both are in place
    with pytest.raises(FluxgrpoError, match=r"--reward imagereward .*fetch-weights --only imagereward"):
        preflight(build_config("tiny-cpu", {**values, "reward": "brightness:1,imagereward:1"}))


def test_the_memory_estimate_counts_every_listed_reward():
    from fluxgrpo.config import build_config
    from fluxgrpo.models.tiny import TINY_TRANSFORMER_CONFIG
    from fluxgrpo.rewards.registry import reward_record
    from fluxgrpo.training.memory import RunShape, VaeShape, estimate, transformer_shape

    model = transformer_shape(dict(TINY_TRANSFORMER_CONFIG))

    def reward_term(**overrides):
        run = RunShape.from_config(build_config("tiny-cpu", overrides), 1)
        return estimate(model, VaeShape(0, 0), run).persistent["reward"]

    both = 4 * (reward_record("hpsv2").parameters + reward_record("imagereward").parameters)
    assert reward_term(reward="hpsv2:1,imagereward:0.5") == both
    # bf16 autocast keeps those two rewards' weights in float32; HPSv3's weights are cast to bf16
    assert reward_term(reward="hpsv2:1,imagereward:0.5", reward_dtype="bf16") == both
    assert reward_term(reward="hpsv3") == 4 * reward_record("hpsv3").parameters
    assert (
        reward_term(reward="hpsv3,hpsv2", reward_dtype="bf16")
        == 2 * reward_record("hpsv3").parameters + 4 * reward_record("hpsv2").parameters
    )


def test_the_memory_estimate_counts_the_eval_reward_models_rank_0_keeps():
    from fluxgrpo.config import build_config
    from fluxgrpo.models.tiny import TINY_TRANSFORMER_CONFIG
    from fluxgrpo.rewards.registry import reward_record
    from fluxgrpo.training.memory import RunShape, VaeShape, estimate, transformer_shape

    model = transformer_shape(dict(TINY_TRANSFORMER_CONFIG))

    def eval_term(**overrides):
        run = RunShape.from_config(build_config("tiny-cpu", overrides), 1)
        return estimate(model, VaeShape(0, 0), run).persistent["eval rewards (rank 0)"]

    # no evaluation: nothing loaded (a config file may name eval rewards with evaluation off; a typed flag may not)
    quiet = dataclasses.replace(
        build_config("tiny-cpu", {"reward": "hpsv2", "eval_rewards": "hpsv3", "eval_every": 10}), eval_every=0
    )
    assert estimate(model, VaeShape(0, 0), RunShape.from_config(quiet, 1)).persistent["eval rewards (rank 0)"] == 0
    # The fp32 training reward is shared with the evaluation; the others are float32 copies on rank 0.
    assert eval_term(reward="hpsv2", eval_rewards="hpsv3,imagereward", eval_every=10) == 4 * (
        reward_record("hpsv3").parameters + reward_record("imagereward").parameters
    )
    # A bf16 training reward is not what `fluxgrpo score` loads: the evaluation keeps its own float32 copy.
    assert eval_term(reward="hpsv3", reward_dtype="bf16", eval_every=10) == 4 * reward_record("hpsv3").parameters
    assert eval_term(reward="hpsv3", eval_every=10) == 0


def test_imagereward_parameter_count_is_the_real_architectures():
    from fluxgrpo.rewards.imagereward import VIT_LARGE, build_imagereward_modules
    from fluxgrpo.rewards.registry import reward_record

    med_config = {  # THUDM/ImageReward's med_config.json (BLIP's BERT-base)
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "max_position_embeddings": 512,
        "vocab_size": 30524,
    }
    with torch.device("meta"):
        modules = build_imagereward_modules(med_config, VIT_LARGE)
    assert sum(p.numel() for m in modules for p in m.parameters()) == reward_record("imagereward").parameters
