"""`fluxgrpo bench --algorithms`: the learning-efficiency comparison. Its arithmetic by hand, each algorithm's
overrides, the interleaved rounds and the repeats' median, spread and verdicts on hand-made timings from a stand-in
trainer, and a real run of two algorithms × two repeats × two iterations on the tiny model (structure, the shared
start and the repeats' identical rewards only: no time is asserted)."""

from __future__ import annotations

import dataclasses
import json
import statistics
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
    compare,
    parse_algorithms,
    reward_gain,
    training_rounds,
    with_ratios,
)
from fluxgrpo.cli.app import app
from fluxgrpo.cli.bench import _render_efficiency
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
        assert Path(dance.output_dir) == Path(base.output_dir, BASELINE, "repeat-1")
        assert Path(algorithm_config(base, BASELINE, repeat=2).output_dir) == Path(
            base.output_dir, BASELINE, "repeat-2"
        )
        assert algorithm_config(base, "dance-t2").train_timesteps == 2
        assert algorithm_config(base, "dance-t4").train_timesteps == 4
    # every algorithm is a valid config on the shipped tiny settings (validate() lists what is not)
    base = base_training_config(EfficiencyConfig(), _workspace(tmp_path))
    for name in ALGORITHMS:
        assert Path(algorithm_config(base, name).output_dir).parent.name == name
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
    with pytest.raises(UsageError, match="--repeats 0"):
        EfficiencyConfig(repeats=0).validate()
    result = runner.invoke(app, ["bench", "--algorithms", "dance", "--repeats", "0"])
    assert result.exit_code == 2 and "--repeats 0" in result.output  # --repeats is --algorithms' too
    result = runner.invoke(app, ["bench", "--algorithms", "dance", "--warmup", "2"])
    assert result.exit_code == 2 and "--warmup" in result.output  # ... but --warmup is the phase bench's only


def test_rounds_alternate_the_order_so_a_drift_weighs_on_every_algorithm_alike():
    runs = ("dance", "dance-t2", "mixgrpo")
    assert training_rounds(runs, 1) == (runs,)
    assert training_rounds(runs, 4) == (runs, runs[::-1], runs, runs[::-1])
    # over two rounds every algorithm's mean place in the queue is the same: a linear drift costs each alike
    for size in (2, 3, 8):
        names = tuple(f"a{i}" for i in range(size))
        first, second = training_rounds(names, 2)
        assert {first.index(name) + second.index(name) for name in names} == {size - 1}
    assert EfficiencyConfig(algorithms=("mixgrpo", "dance-t2"), repeats=3).rounds == (
        ("dance", "mixgrpo", "dance-t2"),
        ("dance-t2", "mixgrpo", "dance"),
        ("dance", "mixgrpo", "dance-t2"),
    )
    assert EfficiencyConfig().repeats == 3  # the default: a median that outvotes one disturbed run


# Hand-made per-run clocks: algorithm → one (rollout, decode/reward, update) list per repeat; each iteration's
# seconds are their sum, and the per-run median is the middle iteration's (three iterations, sorted by design).
CLOCKS = {
    # per-run medians 1.0, 1.4, 1.2 → median 1.2, spread 1.0–1.4
    "dance": [
        [(0.2, 0.1, 0.5), (0.3, 0.1, 0.6), (0.9, 0.1, 0.9)],
        [(0.3, 0.1, 0.6), (0.4, 0.2, 0.8), (0.5, 0.2, 0.9)],
        [(0.2, 0.1, 0.6), (0.4, 0.1, 0.7), (0.4, 0.2, 0.7)],
    ],
    # 0.6, 0.5, 0.7 → median 0.6, spread 0.5–0.7: clear of dance's 1.0–1.4, faster
    "dance-t2": [
        [(0.1, 0.1, 0.2), (0.2, 0.1, 0.3), (0.3, 0.1, 0.3)],
        [(0.1, 0.1, 0.2), (0.1, 0.1, 0.3), (0.2, 0.1, 0.3)],
        [(0.2, 0.1, 0.3), (0.2, 0.1, 0.4), (0.3, 0.1, 0.4)],
    ],
    # 1.1, 0.9, 1.5 → median 1.1 (0.92×) but spread 0.9–1.5 overlaps dance's: within noise
    "cps": [
        [(0.3, 0.1, 0.6), (0.3, 0.1, 0.7), (0.4, 0.1, 0.7)],
        [(0.2, 0.1, 0.5), (0.3, 0.1, 0.5), (0.3, 0.1, 0.6)],
        [(0.4, 0.1, 0.8), (0.5, 0.2, 0.8), (0.5, 0.2, 0.9)],
    ],
    # 1.6, 1.5, 1.7 → slower
    "dance-t4": [
        [(0.4, 0.2, 0.9), (0.5, 0.2, 0.9), (0.5, 0.2, 1.0)],
        [(0.4, 0.1, 0.9), (0.4, 0.2, 0.9), (0.5, 0.2, 1.0)],
        [(0.5, 0.2, 0.9), (0.5, 0.2, 1.0), (0.6, 0.2, 1.0)],
    ],
}
REWARDS = {"dance": [0.5, 0.6, 0.6], "dance-t2": [0.5, 0.55, 0.6], "cps": [0.4, 0.4, 0.5], "dance-t4": [0.5, 0.6, 0.7]}


class StandInTrainer:
    """``train`` without training: hands out the hand-made clocks and rewards, and notes the order it was called in."""

    def __init__(self, rewards_of=lambda name, repeat: REWARDS[name]):
        self.calls: list[tuple[str, int]] = []
        self.rewards_of = rewards_of

    def __call__(self, cfg):
        folder = Path(cfg.output_dir)
        name, repeat = folder.parent.name, int(folder.name.removeprefix("repeat-"))
        self.calls.append((name, repeat))
        return [
            {"reward_mean": reward, "seconds_rollout": r, "seconds_decode_reward": d, "seconds_update": u}
            for reward, (r, d, u) in zip(self.rewards_of(name, repeat), CLOCKS[name][repeat - 1], strict=True)
        ]


def _compare(tmp_path, repeats, trainer, algorithms=("dance-t2", "cps", "dance-t4"), log=None):
    cfg = EfficiencyConfig(algorithms=algorithms, iterations=3, repeats=repeats)
    return compare(cfg, base_training_config(cfg, _workspace(tmp_path)), trainer, log or (lambda line: None))


def test_repeats_train_in_interleaved_rounds_and_report_the_median_of_run_medians_with_its_spread(tmp_path):
    trainer = StandInTrainer()
    lines: list[str] = []
    rows = {row["algorithm"]: row for row in _compare(tmp_path, 3, trainer, log=lines.append)}
    forward = ["dance", "dance-t2", "cps", "dance-t4"]
    assert trainer.calls == [
        *((name, 1) for name in forward),
        *((name, 2) for name in reversed(forward)),
        *((name, 3) for name in forward),
    ]
    assert [line for line in lines if line.startswith("round")] == [
        "round 1 of 3: dance, dance-t2, cps, dance-t4",
        "round 2 of 3: dance-t4, cps, dance-t2, dance",
        "round 3 of 3: dance, dance-t2, cps, dance-t4",
    ]
    dance, fast, cps = rows["dance"], rows["dance-t2"], rows["cps"]
    assert dance["seconds_per_iteration_runs"] == pytest.approx([1.0, 1.4, 1.2])  # in round order
    assert dance["seconds_per_iteration"] == pytest.approx(1.2)
    assert dance["seconds_per_iteration_spread"] == pytest.approx([1.0, 1.4])
    # each phase: the median over the runs of the run's median (dance rollout: 0.3, 0.4, 0.4 → 0.4)
    assert dance["phase_seconds"] == pytest.approx({"rollout": 0.4, "decode_reward": 0.1, "update": 0.7})
    assert fast["seconds_per_iteration"] == pytest.approx(0.6)
    assert fast["seconds_per_iteration_spread"] == pytest.approx([0.5, 0.7])
    assert fast["seconds_per_iteration_ratio"] == pytest.approx(0.5)
    assert cps["seconds_per_iteration_spread"] == pytest.approx([0.9, 1.5])
    assert cps["seconds_per_iteration_ratio"] == pytest.approx(1.1 / 1.2)
    verdicts = {name: row["time_verdict"] for name, row in rows.items()}
    assert verdicts == {"dance": None, "dance-t2": "faster", "cps": "within noise", "dance-t4": "slower"}
    for name, row in rows.items():
        assert row["repeats"] == 3 and row["rewards_identical"]
        assert row["rewards"] == REWARDS[name]
        assert row["reward_gain_runs"] == [reward_gain(REWARDS[name])] * 3
        assert row["reward_gain"] == reward_gain(REWARDS[name])
        assert row["reward_gain_per_second"] == pytest.approx(row["reward_gain"] / (row["seconds_per_iteration"] * 3))
    assert not any(line.startswith("warning") for line in lines)


def test_a_repeat_with_other_rewards_is_reported_not_averaged_away(tmp_path, capsys):
    def rewards_of(name, repeat):  # cps's second run drifts: a non-deterministic kernel
        return [0.4, 0.4, 0.9] if (name, repeat) == ("cps", 2) else REWARDS[name]

    lines: list[str] = []
    rows = {row["algorithm"]: row for row in _compare(tmp_path, 3, StandInTrainer(rewards_of), log=lines.append)}
    cps = rows["cps"]
    assert not cps["rewards_identical"]
    gains = [reward_gain(REWARDS["cps"]), reward_gain([0.4, 0.4, 0.9]), reward_gain(REWARDS["cps"])]
    assert cps["reward_gain_runs"] == gains  # every run's gain, in round order
    assert cps["reward_gain"] == reward_gain(REWARDS["cps"])  # their median, flagged
    assert [row["rewards_identical"] for name, row in rows.items() if name != "cps"] == [True, True, True]
    assert [line for line in lines if line.startswith("warning")] == [
        # x = 0,1,2: [0.4, 0.4, 0.5] rises by Σ(x−1)(y−ȳ)/Σ(x−1)² × 2 = (0.0333… + 0.0666…)/2 × 2 = 0.1,
        # [0.4, 0.4, 0.9] by (0.1666… + 0.3333…)/2 × 2 = 0.5
        "warning: cps's rewards differ between its repeats (gains 0.1, 0.5, 0.1): training is not deterministic "
        "on this machine, so its gain is their median (the JSON lists each); its times stand"
    ]
    document = {
        "config": {"repeats": 3, "iterations": 3, "config": "tiny-cpu", "text_tokens": 8, "training": _settings()},
        "algorithms": list(rows.values()),
    }
    _render_efficiency(document)
    table = capsys.readouterr().out
    assert "cps: the rewards differ between its runs (gains 0.1, 0.5, 0.1)" in table
    assert "min–max" in table and "within noise" in table and "faster" in table and "slower" in table
    assert "1–1.4" in table  # dance's spread


def _settings():
    return {
        "height": 64,
        "width": 64,
        "sampling_steps": 8,
        "num_generations": 8,
        "reward": "brightness",
        "device": "cpu",
    }


# The row keys of the bench before --repeats: one run per algorithm keeps every one of them, and their meaning.
SINGLE_RUN_KEYS = {
    "algorithm",
    "overrides",
    "iterations",
    "trained_timesteps",
    "rollout_model_calls",
    "seconds_per_iteration",
    "phase_seconds",
    "reward_first",
    "reward_last",
    "reward_gain",
    "reward_gain_per_second",
    "rewards",
    "seconds_per_iteration_ratio",
    "reward_gain_ratio",
    "reward_gain_per_second_ratio",
}


def test_one_repeat_is_one_run_per_algorithm_with_the_single_run_table(tmp_path, capsys):
    trainer = StandInTrainer()
    rows = _compare(tmp_path, 1, trainer, algorithms=("cps",))
    assert trainer.calls == [("dance", 1), ("cps", 1)]
    for row in rows:
        assert row.keys() >= SINGLE_RUN_KEYS
        run = CLOCKS[row["algorithm"]][0]
        assert row["seconds_per_iteration"] == pytest.approx(sorted(sum(phases) for phases in run)[1])
        assert row["seconds_per_iteration_spread"] == [row["seconds_per_iteration"]] * 2
        assert row["time_verdict"] is None  # one run: no spread to judge the noise by
        assert row["reward_first"] == REWARDS[row["algorithm"]][0]
    document = {
        "config": {"repeats": 1, "iterations": 3, "config": "tiny-cpu", "text_tokens": 8, "training": _settings()},
        "algorithms": rows,
    }
    _render_efficiency(document)
    table = capsys.readouterr().out
    header = next(line for line in table.splitlines() if line.lstrip().startswith("algorithm"))
    single_run_header = "algorithm trained calls s/iter × rollout s update s reward first→last gain × gain/s ×"
    assert " ".join(header.split()) == single_run_header


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
    result = runner.invoke(app, [*argv, "--repeats", "2", "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    rows = document["algorithms"]
    assert [row["algorithm"] for row in rows] == ["dance", "dance-t2"]  # the baseline added, and first
    assert document["config"]["rounds"] == [["dance", "dance-t2"], ["dance-t2", "dance"]]
    # the real loop is seeded throughout: a repeat reproduces its rewards bitwise, in the same process
    assert [row["rewards_identical"] for row in rows] == [True, True]
    assert [len(set(row["reward_gain_runs"])) for row in rows] == [1, 1]
    assert document["config"]["training"]["sampling_steps"] == 4
    assert document["config"]["baseline_probe"] is None  # dance trained here: its seconds are this machine's
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
        app,
        [*argv[:2], "dance", *argv[3:], "--repeats", "1"],
    )
    assert table.exit_code == 0, table.output
    assert "dance" in table.stdout and "gain/s" in table.stdout
    # Reusing this run's dance: not trained again, but probed for its iterations' seconds on this machine.
    earlier = tmp_path / "earlier.json"
    earlier.write_text(result.stdout)
    reusing = runner.invoke(app, [*argv, "--repeats", "2", "--baseline-from", str(earlier), "--json"])
    assert reusing.exit_code == 0, reusing.output
    probe = json.loads(reusing.stdout)["config"]["baseline_probe"]
    assert (probe["iterations"], probe["timed_iterations"]) == (2, 1)  # the run's 2 iterations, the first left out
    assert probe["reused_seconds_per_iteration"] == dance["seconds_per_iteration"]
    assert probe["speed_ratio"] == pytest.approx(dance["seconds_per_iteration"] / probe["seconds_per_iteration"])
    told = " ".join(reusing.stderr.split())  # the log wraps its lines
    assert "probing dance's speed here: 2 of its iterations" in told and "s here (one probe iteration)" in told


def test_vary_seed_gives_each_repeat_its_own_seed_and_reports_the_gains_spread(tmp_path):
    seeds: dict[tuple[str, int], int] = {}

    def rewards_of(name, repeat):  # other seeds, other rewards: the gain's spread is what is measured
        return [0.4, 0.5, 0.4 + 0.1 * repeat]

    trainer = StandInTrainer(rewards_of)

    def train(cfg):
        records = trainer(cfg)
        seeds[trainer.calls[-1]] = cfg.seed
        return records

    cfg = EfficiencyConfig(algorithms=("dance-t2",), iterations=3, repeats=3, vary_seed=True)
    base = base_training_config(cfg, _workspace(tmp_path))
    lines: list[str] = []
    rows = {row["algorithm"]: row for row in compare(cfg, base, train, lines.append)}
    assert {seeds[("dance", k)] for k in (1, 2, 3)} == {base.seed, base.seed + 1, base.seed + 2}
    assert seeds[("dance", 2)] == seeds[("dance-t2", 2)]  # a round shares its seed across algorithms
    gains = [reward_gain(rewards_of("dance", k)) for k in (1, 2, 3)]
    row = rows["dance"]
    assert row["reward_gain_runs"] == gains and row["reward_gain"] == statistics.median(gains)
    assert row["reward_gain_spread"] == [min(gains), max(gains)] and row["rewards_identical"]
    assert not any(line.startswith("warning") for line in lines)  # different by design, not a fault


def test_the_final_sample_objectives_are_bench_rows_at_their_own_step_counts(tmp_path):
    base = base_training_config(EfficiencyConfig(), _workspace(tmp_path))
    nft, awm = algorithm_config(base, "nft"), algorithm_config(base, "awm")
    assert (nft.objective, nft.sampling_steps, nft.train_timesteps) == ("nft", 10, 9)
    assert (awm.objective, awm.sampling_steps, awm.train_timesteps) == ("awm", 14, 6)
    # as practitioners run them, and the two newer estimators at their authors' settings
    assert (
        algorithm_config(base, "nft-t2").train_timesteps == 2 and algorithm_config(base, "awm-t4").train_timesteps == 4
    )
    vgrpo, neighbor = algorithm_config(base, "vgrpo"), algorithm_config(base, "neighbor")
    assert (vgrpo.objective, vgrpo.train_timesteps, vgrpo.flow_matching_draws) == ("vgrpo", 4, ("group", "stratified"))
    # NFE_θ = B/G·K = 4/12·4 = 1.33 at the paper's G 12: K = int(7·0.6) = 4 transitions per anchor
    assert (neighbor.objective, neighbor.sampling_steps, neighbor.train_timesteps) == ("neighbor", 8, 4)
    # shapes-balanced's recipe as a row: V-GRPO at the config's own step count
    own = algorithm_config(base, "vgrpo-own-steps")
    assert (own.objective, own.sampling_steps, own.clip_range) == ("vgrpo", base.sampling_steps, 6e-3)
    assert own.sampling_steps != vgrpo.sampling_steps
