"""`fluxgrpo bench --algorithms`: the learning-efficiency comparison. Its arithmetic by hand, each algorithm's
overrides, and a real run of two algorithms × two iterations on the tiny model (structure and the shared start
only: no time is asserted)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from fluxgrpo.bench.efficiency import (
    ALGORITHMS,
    BASELINE,
    EfficiencyConfig,
    Workspace,
    algorithm_config,
    base_training_config,
    parse_algorithms,
    reward_gain,
    with_ratios,
)
from fluxgrpo.cli.app import app
from fluxgrpo.config import build_config, shipped_configs
from fluxgrpo.errors import UsageError

runner = CliRunner()


def test_reward_gain_is_the_least_squares_rise_over_the_run():
    assert reward_gain([1.0, 3.0]) == pytest.approx(2.0)  # two points: last − first
    assert reward_gain([0.0, 1.0, 2.0, 3.0]) == pytest.approx(3.0)  # a straight line: its rise
    # x = 0,1,2, y = 1,0,2: slope = Σ(x−1)(y−1)/Σ(x−1)² = ((−1)(0) + 0 + (1)(1))/2 = ½; rise over 2 steps = 1
    assert reward_gain([1.0, 0.0, 2.0]) == pytest.approx(1.0)
    assert reward_gain([2.0, 2.0, 2.0]) == 0.0


def test_ratios_are_to_dance_and_absent_when_dance_gained_nothing():
    def row(name, seconds, gain):
        return {
            "algorithm": name,
            "seconds_per_iteration": seconds,
            "reward_gain": gain,
            "reward_gain_per_second": gain / seconds,
        }

    rows = with_ratios([row("dance", 2.0, 0.5), row("dance-t2", 1.0, 0.25)])
    assert rows[0]["seconds_per_iteration_ratio"] == rows[0]["reward_gain_ratio"] == 1.0
    assert rows[1]["seconds_per_iteration_ratio"] == 0.5
    assert rows[1]["reward_gain_ratio"] == 0.5
    assert rows[1]["reward_gain_per_second_ratio"] == pytest.approx(1.0)  # half the gain in half the time
    flat = with_ratios([row("dance", 2.0, -0.1), row("dance-t2", 1.0, 0.2)])
    assert flat[1]["reward_gain_ratio"] is None and flat[1]["reward_gain_per_second_ratio"] is None
    assert flat[1]["seconds_per_iteration_ratio"] == 0.5


def _workspace(root: Path) -> Workspace:
    return Workspace(root / "flux", root / "hps", root / "index.json", root / "runs")


def test_dance_overrides_nothing_and_dance_tk_trains_exactly_k_transitions(tmp_path):
    for steps in (6, 8, 16, 17):
        cfg = EfficiencyConfig(iterations=5, base_overrides={"sampling_steps": steps})
        base = base_training_config(cfg, _workspace(tmp_path))
        assert (base.max_train_steps, base.checkpointing_steps, base.save_images_every) == (5, 5, 0)
        dance = algorithm_config(base, BASELINE)
        assert dataclasses.replace(dance, output_dir=base.output_dir) == base  # the neutral setting: nothing else
        assert Path(dance.output_dir) == Path(base.output_dir, BASELINE)
        assert algorithm_config(base, "dance-t2").train_timesteps == 2
        assert algorithm_config(base, "dance-t4").train_timesteps == 4
    # every algorithm is a valid config on the shipped tiny settings (validate() lists what is not)
    base = base_training_config(EfficiencyConfig(), _workspace(tmp_path))
    for name in ALGORITHMS:
        assert algorithm_config(base, name).output_dir.endswith(name)
    # the peers' windows: only the window's steps train; the DPM tail makes fewer model calls than the N steps
    assert algorithm_config(base, "mixgrpo").train_timesteps == 4
    assert algorithm_config(base, "flow-grpo-fast").train_timesteps == 3
    calls = {name: algorithm_config(base, name).rollout_model_calls for name in ("dance", "mixgrpo", "mixgrpo-flash")}
    assert calls["dance"] == calls["mixgrpo"] == base.sampling_steps > calls["mixgrpo-flash"]
    # everything but the run's inputs, length and outputs is --config's
    shipped = build_config("tiny-cpu")
    base = base_training_config(EfficiencyConfig(), _workspace(tmp_path))
    for name in ("reward", "height", "sampling_steps", "num_generations", "learning_rate", "seed", "device"):
        assert getattr(base, name) == getattr(shipped, name)


def test_unknown_or_repeated_algorithms_are_usage_errors_listing_the_known_ones():
    with pytest.raises(UsageError, match="unknown 'mixgrp'; known: " + ", ".join(ALGORITHMS)):
        EfficiencyConfig(algorithms=parse_algorithms("dance,mixgrp")).validate()
    with pytest.raises(UsageError, match="twice"):
        EfficiencyConfig(algorithms=("dance-t2", "dance-t2")).validate()
    with pytest.raises(UsageError, match="--iterations 1"):
        EfficiencyConfig(iterations=1).validate()
    assert EfficiencyConfig(algorithms=("dance-t2",)).runs == (BASELINE, "dance-t2")  # the baseline always runs
    result = runner.invoke(app, ["bench", "--algorithms", "dance,nope"])
    assert result.exit_code == 2 and "known: dance" in result.output
    result = runner.invoke(app, ["bench", "--algorithms", "dance", "--steps", "4"])
    assert result.exit_code == 2 and "--steps" in result.output
    result = runner.invoke(app, ["bench", "--iterations", "4"])
    assert result.exit_code == 2 and "--algorithms" in result.output


def test_two_algorithms_train_from_the_same_start_and_report_ratios(tmp_path):
    settings = yaml.safe_load(shipped_configs()["tiny-cpu"].read_text())
    settings.update(
        sampling_steps=4,
        num_generations=4,
        rollout_batch_size=4,
        train_micro_batch_size=2,
        gradient_accumulation_steps=1,
    )
    config = tmp_path / "small.yaml"
    config.write_text(yaml.safe_dump(settings))
    argv = ["bench", "--algorithms", "dance-t2", "--iterations", "2", "--config", str(config), "--text-tokens", "8"]
    result = runner.invoke(app, [*argv, "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    rows = document["algorithms"]
    assert [row["algorithm"] for row in rows] == ["dance", "dance-t2"]  # the baseline added, and first
    assert document["config"]["training"]["sampling_steps"] == 4
    dance, short = rows
    assert (dance["trained_timesteps"], short["trained_timesteps"]) == (1, 2)  # int(3·0.5) = 1; dance-t2: 2
    assert short["overrides"] == {"timestep_fraction": pytest.approx(2.5 / 3)}
    for row in rows:
        assert row["iterations"] == 2 and len(row["rewards"]) == 2
        assert row["seconds_per_iteration"] > 0
        assert row["reward_gain"] == pytest.approx(row["rewards"][1] - row["rewards"][0])
        assert row["seconds_per_iteration_ratio"] == pytest.approx(
            row["seconds_per_iteration"] / dance["seconds_per_iteration"]
        )
    # Same weights, prompts, noise and sampler, nothing trained yet: the first iteration's rollouts are identical.
    assert short["rewards"][0] == dance["rewards"][0]
    assert short["rewards"][1] != dance["rewards"][1]  # then the algorithms' updates differ
    table = runner.invoke(
        app, ["bench", "--algorithms", "dance", "--iterations", "2", "--config", str(config), "--text-tokens", "8"]
    )
    assert table.exit_code == 0, table.output
    assert "dance" in table.stdout and "gain/s" in table.stdout
