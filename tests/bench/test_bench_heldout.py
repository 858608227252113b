"""`bench --algorithms` beside the training reward: the held-out gain, its spread and verdict, and the work per
iteration (transformer forwards, backwards, optimizer steps) counted while the real loop trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fluxgrpo.bench.efficiency import EfficiencyConfig, Workspace, base_training_config, compare, training_prompts
from fluxgrpo.bench.heldout import (
    WorkCounter,
    counted,
    heldout_gain,
    heldout_reward,
    heldout_summary,
    heldout_verdict,
)
from fluxgrpo.shapes import world


def test_heldout_gain_is_the_last_evaluation_minus_the_base_models():
    assert heldout_gain([(0, 0.40), (2, 0.45), (4, 0.55)]) == pytest.approx(0.15)
    assert heldout_gain([(0, 0.40)]) is None  # one evaluation: no gain
    assert heldout_gain([(2, 0.40), (4, 0.50)]) is None  # no base-model evaluation to start from


def test_heldout_summary_takes_the_median_over_runs_and_the_gain_per_second():
    runs = [[(0, 0.4), (4, 0.5)], [(0, 0.4), (4, 0.7)], [(0, 0.4), (4, 0.45)]]
    summary = heldout_summary("shapes", runs, seconds_per_iteration=2.0, iterations=4)
    assert summary["heldout_gain"] == pytest.approx(0.1)  # median of 0.1, 0.3, 0.05
    assert summary["heldout_gain_spread"] == pytest.approx([0.05, 0.3])
    assert summary["heldout_gain_per_second"] == pytest.approx(0.1 / 8.0)
    assert (summary["heldout_first"], summary["heldout_last"]) == (0.4, 0.5)
    assert heldout_summary(None, [[]], 1.0, 4)["heldout_gain"] is None


def test_heldout_verdict_needs_spreads_clear_of_the_baselines():
    def row(name, low, high, repeats=3):
        return {
            "algorithm": name,
            "repeats": repeats,
            "heldout_gain": (low + high) / 2,
            "heldout_gain_spread": [low, high],
        }

    dance = row("dance", 0.0, 0.1)
    assert heldout_verdict(row("nft", 0.2, 0.3), dance) == "better"
    assert heldout_verdict(row("awm", -0.3, -0.1), dance) == "worse"
    assert heldout_verdict(row("cps", 0.05, 0.3), dance) == "within noise"
    assert heldout_verdict(dance, dance) is None
    assert heldout_verdict(row("nft", 0.2, 0.3, repeats=1), dance) is None


def test_the_heldout_reward_is_the_worlds_checker_when_evaluated():
    from fluxgrpo.config import build_config

    assert heldout_reward(build_config("tiny-cpu", {"eval_every": 0})) is None  # no evaluation
    cfg = build_config("tiny-cpu", {"eval_every": 2, "eval_rewards": "shapes,exposure"})
    assert heldout_reward(cfg) == "shapes"
    assert heldout_reward(build_config("tiny-cpu", {"eval_every": 2, "eval_rewards": "exposure"})) == "brightness"


def test_a_config_scored_by_the_checker_trains_on_the_worlds_captions():
    from fluxgrpo.data.benchmarks import shipped_set_path
    from fluxgrpo.data.prompts import bundled_prompts_path

    assert training_prompts("tiny-cpu", {}) == bundled_prompts_path()
    assert training_prompts("tiny-cpu", {"reward": "shapes"}) == shipped_set_path("shapes-train")
    assert training_prompts("tiny-cpu", {"eval_every": 2, "eval_rewards": "shapes"}) == shipped_set_path("shapes-train")


def test_prompts_names_the_training_list_and_a_weighted_set_keeps_its_repeats(tmp_path):
    from fluxgrpo.bench.efficiency import prepare_workspace, trains_in_the_world
    from fluxgrpo.data.benchmarks import shipped_set_path

    balanced = shipped_set_path("shapes-train-balanced")
    assert training_prompts("shapes-cpu", {}, "shapes-train-balanced") == balanced
    assert trains_in_the_world("shapes-cpu", {}) and not trains_in_the_world("tiny-cpu", {})
    own = tmp_path / "mine.txt"
    own.write_text("a red circle\n")
    assert training_prompts("tiny-cpu", {}, str(own)) == own
    problems = EfficiencyConfig(prompts=str(tmp_path / "missing.txt")).problems()
    assert any("--prompts" in problem and "shapes-train-balanced" in problem for problem in problems)

    lines = [line for line in balanced.read_text().splitlines() if line.strip()]
    space = prepare_workspace(tmp_path / "w", 0, 12, lambda line: None, balanced, True, keep_repeats=True)
    listed = json.loads(space.index_path.read_text())
    assert len(listed) == len(lines) > len(set(lines))  # one entry per line: repeated captions drawn more often


def test_a_world_config_keeps_its_evaluation_and_others_train_without_one(tmp_path):
    workspace = Workspace(tmp_path / "flux", tmp_path / "hps", tmp_path / "index.json", tmp_path / "runs")
    cfg = EfficiencyConfig(config="shapes-cpu", iterations=16)
    assert base_training_config(cfg, workspace, evaluate=True).eval_every == 16  # the config's own
    assert heldout_reward(base_training_config(cfg, workspace, evaluate=True)) == "shapes"
    assert base_training_config(EfficiencyConfig(config="tiny-cpu"), workspace).eval_every == 0


def test_a_world_workspace_holds_the_worlds_pretrained_weights_not_random_ones(tmp_path):
    from fluxgrpo.bench.efficiency import prepare_workspace
    from fluxgrpo.data.benchmarks import shipped_set_path
    from fluxgrpo.weights.manifest import read_manifest

    world_space = prepare_workspace(tmp_path / "w", 0, 12, lambda line: None, shipped_set_path("shapes-train"), True)
    assert read_manifest(world_space.flux_dir).source == "shapes"
    assert json.loads(world_space.index_path.read_text())
    random_space = prepare_workspace(tmp_path / "r", 0, 12, lambda line: None)
    assert read_manifest(random_space.flux_dir).source == "tiny"


# Held-out curves of hand-made runs: algorithm → one curve per repeat. dance gains 0.00–0.10; dance-t2 0.20–0.30.
CURVES = {
    "dance": [[0.40, 0.45], [0.40, 0.40], [0.40, 0.50]],
    "dance-t2": [[0.40, 0.70], [0.40, 0.60], [0.40, 0.65]],
}


def _stand_in_trainer(cfg):
    """Two iterations of one second each, and an evaluation at 0 and 2 written to the run's metrics.jsonl."""
    folder = Path(cfg.output_dir)
    name, repeat = folder.parent.name, int(folder.name.removeprefix("repeat-"))
    first, last = CURVES[name][repeat - 1]
    folder.mkdir(parents=True)
    evals = [{"iteration": 0, "eval_shapes_mean": first}, {"iteration": 2, "eval_shapes_mean": last}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    clock = {"seconds_rollout": 0.5, "seconds_decode_reward": 0.1, "seconds_update": 0.4}
    return [{"reward_mean": 0.1, **clock}, {"reward_mean": 0.2, **clock}]


def _stand_in_comparison(tmp_path, log) -> list[dict]:
    """dance and dance-t2, 3 repeats of 2 iterations each, trained by the stand-in (CURVES), evaluated at 0 and 2."""
    workspace = Workspace(tmp_path / "flux", tmp_path / "hps", tmp_path / "index.json", tmp_path / "runs")
    cfg = EfficiencyConfig(
        algorithms=("dance-t2",),
        iterations=2,
        repeats=3,
        base_overrides={"reward": "shapes", "eval_every": 2, "eval_prompts": "shapes-heldout"},
    )
    return compare(cfg, base_training_config(cfg, workspace), _stand_in_trainer, log)


def test_compare_reports_the_heldout_gain_spread_and_verdict_per_algorithm(tmp_path):
    lines: list[str] = []
    rows = {row["algorithm"]: row for row in _stand_in_comparison(tmp_path, lines.append)}
    dance, short = rows["dance"], rows["dance-t2"]
    assert dance["heldout_reward"] == "shapes"
    assert dance["heldout_gain_runs"] == pytest.approx([0.05, 0.0, 0.10])
    assert dance["heldout_gain"] == pytest.approx(0.05) and dance["heldout_gain_spread"] == pytest.approx([0.0, 0.1])
    assert short["heldout_gain"] == pytest.approx(0.25)
    assert short["heldout_gain_per_second"] == pytest.approx(0.25 / (1.0 * 2))
    assert (dance["heldout_verdict"], short["heldout_verdict"]) == (None, "better")
    assert short["heldout_curves"][0] == [[0, 0.4], [2, pytest.approx(0.7)]]
    assert dance["work_per_iteration"] is None  # no counter: a stand-in trains nothing
    assert any("held-out shapes gain 0.3" in line for line in lines)


def test_the_plot_puts_each_evaluation_at_its_training_seconds_with_the_repeats_band(tmp_path):
    from fluxgrpo.bench.heldout_plot import curve_points, heldout_png
    from fluxgrpo.errors import UsageError

    rows = _stand_in_comparison(tmp_path, lambda _: None)
    dance = next(row for row in rows if row["algorithm"] == "dance")
    # 1 s per iteration (0.5 + 0.1 + 0.4): iteration 2 at 2 s; dance's three runs end at 0.45, 0.40, 0.50
    assert curve_points(dance) == [(0.0, 0.4, 0.4, 0.4), (2.0, pytest.approx(0.45), 0.4, pytest.approx(0.5))]
    png = heldout_png({"config": {"config": "shapes-cpu"}, "algorithms": rows})
    assert png.startswith(b"\x89PNG") and len(png) > 5000
    unevaluated = [{**row, "heldout_curves": []} for row in rows]
    with pytest.raises(UsageError, match="did not evaluate"):
        heldout_png({"config": {"config": "tiny-cpu"}, "algorithms": unevaluated})


def test_bench_plot_is_refused_before_training_where_it_cannot_be_drawn(tmp_path):
    from typer.testing import CliRunner

    from fluxgrpo.cli.app import app

    runner = CliRunner()
    tiny = runner.invoke(app, ["bench", "--algorithms", "dance", "--plot", str(tmp_path / "a.png")])
    assert tiny.exit_code == 2 and "--config tiny-cpu does not evaluate" in tiny.stderr
    missing = tmp_path / "no-such-folder" / "a.png"
    world = runner.invoke(app, ["bench", "--algorithms", "dance", "--config", "shapes-cpu", "--plot", str(missing)])
    assert world.exit_code == 2 and "does not exist" in world.stderr
    phase = runner.invoke(app, ["bench", "--plot", str(tmp_path / "a.png")])
    assert phase.exit_code == 2 and "--algorithms only" in phase.stderr


def test_the_table_shows_the_heldout_gain_and_the_work_per_iteration(tmp_path, capsys):
    from fluxgrpo.cli.bench import _render_heldout_and_work

    base = {"repeats": 3, "heldout_reward": "shapes", "heldout_first": 0.4, "heldout_gain_per_second": 0.01}
    rows = [
        {**base, "algorithm": "dance", "heldout_last": 0.45, "heldout_gain": 0.05, "heldout_gain_spread": [0.0, 0.1]},
        {**base, "algorithm": "nft", "heldout_last": 0.65, "heldout_gain": 0.25, "heldout_gain_spread": [0.2, 0.3]},
    ]
    rows[0]["work_per_iteration"] = {"forwards": 22.0, "backwards": 4.0, "optimizer_steps": 2.0}
    rows[1]["work_per_iteration"] = {"forwards": 50.0, "backwards": 36.0, "optimizer_steps": 4.0}
    rows[1]["heldout_verdict"] = "better"
    rows[1].update(iteration_to_baseline_final=4, seconds_to_baseline_final=20.0, time_to_baseline_final_ratio=0.25)
    rows[0]["heldout_gain_per_kilo_forward_equivalent"] = None
    rows[1]["heldout_gain_per_kilo_forward_equivalent"] = 0.0205
    from rich.console import Console

    _render_heldout_and_work(Console(width=200), rows, repeats=3)
    lines = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]
    assert (
        "algorithm held-out shapes first→last gain gain min–max vs dance gain/s dance's final at forwards/it "
        "backwards/it optimizer steps/it gain/1k fwd-eq" in lines
    )
    assert "nft 0.4000→0.6500 +0.2500 +0.2000–+0.3000 better 0.01 it 4, 20 s (25%) 50 36 4 0.0205" in lines
    assert "dance 0.4000→0.4500 +0.0500 +0.0000–+0.1000 - 0.01 - 22 4 2 -" in lines


def test_the_table_says_when_a_row_reached_the_baselines_final_and_then_fell_below_it(capsys):
    """A row that passed dance's final score at iteration 4 and ended below it says so beside the time; one that
    held it, or a document from before the field existed, shows the time alone."""
    from rich.console import Console

    from fluxgrpo.cli.bench import _render_heldout_and_work

    base = {"repeats": 3, "heldout_reward": "shapes", "heldout_first": 0.4, "heldout_gain_per_second": 0.01}
    reached = {
        "iteration_to_baseline_final": 4,
        "seconds_to_baseline_final": 20.0,
        "time_to_baseline_final_ratio": 0.25,
    }
    rows = [
        {**base, "algorithm": "dance", "heldout_last": 0.45, "heldout_gain": 0.05, "heldout_gain_spread": [0.0, 0.1]},
        {
            **base,
            **reached,
            "algorithm": "fell",
            "heldout_last": 0.35,
            "heldout_gain": -0.05,
            "held_baseline_final": False,
        },
        {
            **base,
            **reached,
            "algorithm": "held",
            "heldout_last": 0.65,
            "heldout_gain": 0.25,
            "held_baseline_final": True,
        },
        {**base, **reached, "algorithm": "older", "heldout_last": 0.65, "heldout_gain": 0.25},
    ]
    for row in rows[1:]:
        row["heldout_gain_spread"] = [row["heldout_gain"], row["heldout_gain"]]
    _render_heldout_and_work(Console(width=250), rows, repeats=3)
    lines = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]
    assert any(line.startswith("fell ") and "it 4, 20 s (25%), then fell below" in line for line in lines)
    for name in ("held", "older"):
        line = next(line for line in lines if line.startswith(name + " "))
        assert "it 4, 20 s (25%)" in line and "fell below" not in line


def test_the_time_to_the_baselines_final_score_reads_the_median_curves():
    """Hand-worked: dance's three runs end at 0.50, 0.46, 0.48 (median 0.48) after 8 iterations of 10 s (80 s). The
    row's median curve is 0.42 at 2, 0.47 at 4 and 0.49 at 6: it first reaches 0.48 at iteration 6, 6 × 5 s = 30 s,
    0.375 of dance's 80 s. A row whose median never reaches it has no time."""
    from fluxgrpo.bench.heldout import median_curve, time_to_baseline_final

    dance = {
        "algorithm": "dance",
        "iterations": 8,
        "seconds_per_iteration": 10.0,
        "heldout_curves": [[[0, 0.4], [8, 0.50]], [[0, 0.4], [8, 0.46]], [[0, 0.4], [8, 0.48]]],
    }
    curves = [
        [[0, 0.4], [2, 0.42], [4, 0.47], [6, 0.49], [8, 0.3]],
        [[0, 0.4], [2, 0.50], [4, 0.40], [6, 0.49], [8, 0.3]],
        [[0, 0.4], [2, 0.41], [4, 0.48], [6, 0.60], [8, 0.3]],
    ]
    assert median_curve(curves) == [(0, 0.4), (2, 0.42), (4, 0.47), (6, 0.49), (8, 0.3)]
    row = {"algorithm": "vgrpo", "iterations": 8, "seconds_per_iteration": 5.0, "heldout_curves": curves}
    assert time_to_baseline_final(row, dance) == {
        "iteration_to_baseline_final": 6,
        "seconds_to_baseline_final": 30.0,
        "time_to_baseline_final_ratio": pytest.approx(0.375),
        "held_baseline_final": False,  # its median ends at 0.3, below dance's 0.48
    }
    kept = {**row, "heldout_curves": [[*curve[:-1], [8, 0.48]] for curve in curves]}
    assert time_to_baseline_final(kept, dance)["held_baseline_final"] is True  # ends at 0.48 = the target: held
    low = {**row, "heldout_curves": [[[0, 0.4], [8, 0.45]]]}
    assert time_to_baseline_final(low, dance)["seconds_to_baseline_final"] is None
    assert time_to_baseline_final(dance, dance)["time_to_baseline_final_ratio"] is None


def test_the_gain_per_forward_equivalent_counts_a_backward_as_two_forwards():
    """Hand-worked: 50 forwards and 36 backwards per iteration are 50 + 2·36 = 122 forward-equivalents; 10
    iterations of them, 1,220, bought a gain of +0.25: 0.25 / 1.22 per thousand."""
    from fluxgrpo.bench.heldout import gain_per_kilo_forward_equivalent

    work = {"forwards": 50.0, "backwards": 36.0, "forward_equivalents": 122.0, "optimizer_steps": 4.0}
    row = {"heldout_gain": 0.25, "iterations": 10, "work_per_iteration": work}
    assert gain_per_kilo_forward_equivalent(row) == pytest.approx(0.25 / 1.22)
    assert gain_per_kilo_forward_equivalent({**row, "heldout_gain": None}) is None
    assert gain_per_kilo_forward_equivalent({**row, "work_per_iteration": None}) is None


# --- the work counter on the real loop ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world_embeddings(tiny_weights, tmp_path_factory):
    from fluxgrpo.preprocess import preprocess

    root = tmp_path_factory.mktemp("world-embeddings")
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(world.prompt_set("shapes-train")[:4]) + "\n")
    eval_prompts = root / "eval.txt"
    eval_prompts.write_text("\n".join(world.prompt_set("shapes-heldout")[:2]) + "\n")
    return Path(
        preprocess(prompts, tiny_weights.flux_dir, root / "embeddings", 16, device="cpu").index_path
    ), eval_prompts


def _counted_run(tiny_weights, index_path, output_dir, **overrides):
    from fluxgrpo.config import build_config
    from fluxgrpo.training.loop import train

    values = {
        "model": str(tiny_weights.flux_dir),
        "hps_dir": str(tiny_weights.hps_dir),
        "data_json_path": str(index_path),
        "output_dir": str(output_dir),
        "reward": "shapes",
        "max_train_steps": 2,
        "checkpointing_steps": 2,
        "save_images_every": 0,
        "num_generations": 4,
        "rollout_batch_size": 4,
        "train_micro_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "sampling_steps": 4,
        "eval_every": 0,  # tiny-cpu evaluates every 10 iterations; the evaluated run asks for it
        **overrides,
    }
    cfg = build_config("tiny-cpu", values)
    counter = WorkCounter()
    records = counted(train, counter)(cfg)
    return cfg, records, counter.reset()


def test_the_work_counter_counts_the_loops_transformer_calls_and_leaves_the_evaluation_out(
    tiny_weights, world_embeddings, tmp_path
):
    from fluxgrpo.bench.heldout import evaluation_forwards, work_per_iteration
    from fluxgrpo.metrics import read_metrics

    index_path, eval_prompts = world_embeddings
    cfg, records, counts = _counted_run(tiny_weights, index_path, tmp_path / "plain")
    plain = work_per_iteration(counts, records, cfg, evaluations=0, prompts=0)
    trajectories = cfg.num_generations * cfg.train_batch_size
    # DanceGRPO: every trained transition of every trajectory is one forward with grad and one backward.
    assert plain["backwards"] == trajectories * cfg.train_timesteps
    assert plain["forward_equivalents"] == plain["forwards"] + 2 * plain["backwards"]
    assert plain["forwards"] >= trajectories * (cfg.rollout_model_calls + cfg.train_timesteps)
    assert plain["optimizer_steps"] == cfg.derived(1)["optimizer_steps_per_iteration"]

    evaluated = {"eval_every": 1, "eval_prompts": str(eval_prompts), "eval_steps": 2}
    cfg_eval, records_eval, counts_eval = _counted_run(tiny_weights, index_path, tmp_path / "eval", **evaluated)
    evaluations = sum("eval_shapes_mean" in r for r in read_metrics(tmp_path / "eval"))
    assert evaluations == 3  # iterations 0, 1, 2
    assert counts_eval.forwards - counts.forwards == evaluation_forwards(cfg_eval, evaluations, 2) == 12
    assert work_per_iteration(counts_eval, records_eval, cfg_eval, evaluations, 2) == plain
