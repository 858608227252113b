"""`bench --algorithms ... --baseline-from earlier.json`: the baseline's row from an earlier comparison of the same
settings, instead of training the baseline again; refused where the settings differ."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fluxgrpo.bench.efficiency import WORKSPACE_FIELDS, EfficiencyConfig, Workspace, base_training_config, compare
from fluxgrpo.bench.reused_baseline import load_baseline
from fluxgrpo.errors import UsageError

# Held-out (first, last) per algorithm and repeat: dance gains 0.00–0.10, dance-t2 0.20–0.30, cps 0.05–0.15.
CURVES = {
    "dance": [(0.40, 0.45), (0.40, 0.40), (0.40, 0.50)],
    "dance-t2": [(0.40, 0.70), (0.40, 0.60), (0.40, 0.65)],
    "cps": [(0.40, 0.50), (0.40, 0.45), (0.40, 0.55)],
}
SETTINGS = {"reward": "shapes", "eval_every": 2, "eval_prompts": "shapes-heldout"}


class StandInTrainer:
    """Two iterations of one second each, the held-out evaluations of CURVES; remembers what it trained."""

    def __init__(self) -> None:
        self.trained: list[str] = []

    def __call__(self, cfg):
        folder = Path(cfg.output_dir)
        name, repeat = folder.parent.name, int(folder.name.removeprefix("repeat-"))
        self.trained.append(name)
        first, last = CURVES[name][repeat - 1]
        folder.mkdir(parents=True)
        evals = [{"iteration": 0, "eval_shapes_mean": first}, {"iteration": 2, "eval_shapes_mean": last}]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
        clock = {"seconds_rollout": 0.5, "seconds_decode_reward": 0.1, "seconds_update": 0.4}
        return [{"reward_mean": 0.1, **clock}, {"reward_mean": 0.2 if name == "dance" else 0.4, **clock}]


def _comparison(root: Path, cfg: EfficiencyConfig, baseline_row=None) -> tuple[list[dict], dict, StandInTrainer]:
    """``compare`` with the stand-in, as ``run_efficiency`` does it; returns the rows, the JSON document and the
    trainer."""
    workspace = Workspace(root / "flux", root / "hps", root / "index.json", root / "runs")
    base = base_training_config(cfg, workspace)
    trainer = StandInTrainer()
    rows = compare(cfg, base, trainer, lambda line: None, baseline_row=baseline_row)
    shared = {key: value for key, value in base.to_dict().items() if key not in WORKSPACE_FIELDS}
    document = {"config": {**dataclasses.asdict(cfg), "training": shared}, "algorithms": rows}
    return rows, json.loads(json.dumps(document, default=str)), trainer


def _earlier(tmp_path: Path) -> tuple[Path, list[dict], EfficiencyConfig]:
    """A comparison of dance and dance-t2 (3 repeats), written as `bench --json` writes it."""
    cfg = EfficiencyConfig(algorithms=("dance", "dance-t2"), iterations=2, repeats=3, base_overrides=SETTINGS)
    rows, document, _ = _comparison(tmp_path / "earlier", cfg)
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(document))
    return path, rows, cfg


def _reusing(cfg: EfficiencyConfig, path: Path, **changes) -> EfficiencyConfig:
    return dataclasses.replace(cfg, algorithms=("dance-t2", "cps"), baseline_from=str(path), **changes)


def test_the_reused_baseline_is_not_trained_and_the_comparison_reads_as_if_it_were(tmp_path):
    path, earlier_rows, cfg = _earlier(tmp_path)
    again = _reusing(cfg, path)
    assert again.trained == ("dance-t2", "cps") and again.rounds[1] == ("cps", "dance-t2")
    reused = load_baseline(again, "dance")
    rows, _, trainer = _comparison(tmp_path / "again", again, reused.as_row())
    assert "dance" not in trainer.trained and sorted(trainer.trained) == ["cps"] * 3 + ["dance-t2"] * 3
    by_name = {row["algorithm"]: row for row in rows}
    assert [row["algorithm"] for row in rows] == ["dance", "dance-t2", "cps"]
    assert by_name["dance"]["baseline_from"] == str(path)
    assert by_name["dance"]["heldout_gain"] == pytest.approx(0.05)
    # dance-t2 reads as it did beside a trained dance: the same ratios, verdicts and time to dance's final
    before = next(row for row in earlier_rows if row["algorithm"] == "dance-t2")
    for key in ("reward_gain_ratio", "heldout_verdict", "time_verdict", "time_to_baseline_final_ratio"):
        assert by_name["dance-t2"][key] == pytest.approx(before[key]), key
    assert by_name["cps"]["heldout_verdict"] == "within noise" and by_name["dance-t2"]["heldout_verdict"] == "better"


def test_a_document_made_with_other_bench_or_training_settings_is_refused_naming_what_differs(tmp_path):
    path, _, cfg = _earlier(tmp_path)
    with pytest.raises(UsageError, match=r"--iterations: 2 there, 3 here.*drop --baseline-from"):
        load_baseline(_reusing(cfg, path, iterations=3), "dance")
    with pytest.raises(UsageError, match="--vary-seed: False there, True here"):
        load_baseline(_reusing(cfg, path, vary_seed=True), "dance")
    changed = _reusing(cfg, path, base_overrides={**SETTINGS, "learning_rate": 1e-3})
    with pytest.raises(UsageError, match="--base-overrides"):
        load_baseline(changed, "dance")
    # --config by what it resolves to (below), not by its name: a YAML moved elsewhere still matches
    load_baseline(_reusing(cfg, path, config="elsewhere/tiny-cpu.yaml"), "dance")
    # the training config itself (a --config YAML edited under the same name): compared key by key
    reused = load_baseline(_reusing(cfg, path), "dance")
    workspace = Workspace(tmp_path / "f", tmp_path / "h", tmp_path / "i.json", tmp_path / "r")
    shared = base_training_config(_reusing(cfg, path), workspace).to_dict()
    shared = {key: value for key, value in shared.items() if key not in WORKSPACE_FIELDS}
    reused.check_training(shared)
    with pytest.raises(UsageError, match=r"another training config \(learning_rate: 0.003 there, 0.001 here\)"):
        reused.check_training({**shared, "learning_rate": 1e-3})
    # a key the earlier document lacks (an option added since) matches at its default, and only there
    older = dataclasses.replace(reused, training={k: v for k, v in reused.training.items() if k != "kl_beta"})
    older.check_training(shared)
    with pytest.raises(UsageError, match="kl_beta: 0.0 there, 0.01 here"):
        older.check_training({**shared, "kl_beta": 0.01})


def test_a_file_that_is_not_a_bench_comparison_is_refused(tmp_path):
    cfg = EfficiencyConfig(algorithms=("dance-t2",), iterations=2, base_overrides=SETTINGS)
    for text, why in [
        ("{not json", "not the JSON of `fluxgrpo bench --algorithms"),
        ("[1, 2]", "not the JSON of"),
        (json.dumps({"config": {"training": {}}, "algorithms": [{"algorithm": "nft"}]}), "it has no dance row"),
        (json.dumps({"config": {"training": {}}, "algorithms": [{"algorithm": "dance"}]}), "its dance row lacks"),
    ]:
        path = tmp_path / "doc.json"
        path.write_text(text)
        with pytest.raises(UsageError, match=why):
            load_baseline(dataclasses.replace(cfg, baseline_from=str(path)), "dance")
    assert "no such file" in " ".join(dataclasses.replace(cfg, baseline_from=str(tmp_path / "x")).problems())
    only_dance = EfficiencyConfig(algorithms=("dance",), baseline_from=str(path))
    assert any("name an algorithm to compare" in problem for problem in only_dance.problems())


def test_the_cli_refuses_a_missing_document_and_the_table_says_where_the_row_came_from(tmp_path, capsys):
    from typer.testing import CliRunner

    from fluxgrpo.cli.app import app
    from fluxgrpo.cli.bench import _render_efficiency

    runner = CliRunner()
    missing = runner.invoke(app, ["bench", "--algorithms", "cps", "--baseline-from", str(tmp_path / "no.json")])
    assert missing.exit_code == 2 and "no such file" in missing.stderr
    phase = runner.invoke(app, ["bench", "--baseline-from", str(tmp_path / "no.json")])
    assert phase.exit_code == 2 and "--algorithms only" in phase.stderr

    path, _, cfg = _earlier(tmp_path)
    again = _reusing(cfg, path)
    _, document, _ = _comparison(tmp_path / "again", again, load_baseline(again, "dance").as_row())
    _render_efficiency(document)
    out = " ".join(capsys.readouterr().out.split())
    assert f"dance's row is from {path} (--baseline-from" in out


def test_the_reused_rows_seconds_are_read_against_the_baseline_probed_on_this_machine(tmp_path, capsys):
    """A reusing run trains the baseline for a few iterations here (no evaluation, guards or best/, a folder of its
    own) and the table says how many times as fast this machine ran them: hand-worked, a reused row of 10 s per
    iteration against probe iterations of 9 (the first, left out), 4, 5 and 6 s is 2.00× as fast; 5.2 s against
    5 s is the same speed within 10 %. A chained document's row keeps the first run's seconds, so the probe reads
    against the machine they came from."""
    from fluxgrpo.bench.baseline_probe import probe_config, probe_seconds, run_probe, speed_note
    from fluxgrpo.bench.efficiency import algorithm_config, iteration_seconds
    from fluxgrpo.cli.bench import _render_efficiency

    assert probe_seconds([9.0, 4.0, 5.0, 6.0]) == 5.0 and probe_seconds([3.0]) == 3.0
    path, _, cfg = _earlier(tmp_path)
    guarded = {**SETTINGS, "guard": "shapes:-10%", "keep_best": "shapes"}
    base = base_training_config(
        dataclasses.replace(cfg, iterations=8, base_overrides=guarded),
        Workspace(tmp_path / "f", tmp_path / "h", tmp_path / "i.json", tmp_path / "runs"),
    )
    dance = algorithm_config(base, "dance")
    cut = probe_config(dance)
    assert (cut.max_train_steps, cut.checkpointing_steps, cut.eval_every, cut.guard, cut.keep_best) == (6, 6, 0, "", "")
    assert Path(cut.output_dir) == tmp_path / "runs" / "dance" / "probe" and cut.learning_rate == dance.learning_rate
    assert probe_config(dataclasses.replace(dance, max_train_steps=2, checkpointing_steps=2)).max_train_steps == 2

    trained = []

    def stand_in(probe_cfg):
        trained.append(probe_cfg.output_dir)
        return [{"seconds_rollout": s / 2, "seconds_decode_reward": 0.0, "seconds_update": s / 2} for s in (9, 4, 5, 6)]

    probe = run_probe(dance, 10.0, stand_in, iteration_seconds)
    assert trained == [cut.output_dir]
    assert probe == {
        "iterations": 4,
        "timed_iterations": 3,
        "seconds_per_iteration": 5.0,
        "reused_seconds_per_iteration": 10.0,
        "speed_ratio": 2.0,
    }
    assert "took 10 s there and 5 s here (median of 3 probe iterations): this machine ran them 2.00× as fast" in (
        speed_note(probe)
    )
    assert speed_note({**probe, "reused_seconds_per_iteration": 5.2, "speed_ratio": 1.04}).endswith(
        "the same speed within 10%"
    )
    assert "did not probe" in speed_note(None)

    again = _reusing(cfg, path)
    row = load_baseline(again, "dance").as_row()
    _, reusing_document, _ = _comparison(tmp_path / "again", again, row)
    reusing_document["config"]["baseline_probe"] = probe
    chained = tmp_path / "chained.json"
    chained.write_text(json.dumps(reusing_document))
    third = dataclasses.replace(again, baseline_from=str(chained))
    first_seconds = load_baseline(third, "dance").row["seconds_per_iteration"]
    assert first_seconds == row["seconds_per_iteration"]  # the first run's seconds, which the probe reads against
    _render_efficiency(reusing_document)
    out = " ".join(capsys.readouterr().out.split())
    assert "this machine ran them 2.00× as fast" in out
