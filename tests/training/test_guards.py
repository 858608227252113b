"""Guards on the held-out evaluation, the best checkpoint, diversity and the velocity-norm drift signal.

The hackable toy: tiny-cpu trains brightness (the training reward rises) while the evaluation also scores
``exposure``, which falls whenever pixels above mid-grey brighten; a guard on it stops the run at the first
evaluation that falls beyond its limit, and ``best/`` keeps the evaluation before.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from training_helpers import run, tiny_config, tiny_train_argv
from typer.testing import CliRunner

from fluxgrpo.checkpoint.best import read_best
from fluxgrpo.checkpoint.layout import BEST_DIR, is_best_checkpoint, latest_checkpoint, list_checkpoints
from fluxgrpo.cli.app import app
from fluxgrpo.config import TrainConfig, build_config
from fluxgrpo.config.guard_rules import GuardRule, parse_guard_spec
from fluxgrpo.errors import UsageError
from fluxgrpo.metrics import read_metrics, reward_trend
from fluxgrpo.training.eval import diversity
from fluxgrpo.training.guards import GUARD_RECORD, GUARD_STOP_EXIT_CODE

runner = CliRunner()
NOT_TRAINING = ("seconds_", "images_per_second", "peak_memory", "guards_fired")  # timings and the guards' state
FALL_PERCENT = 0.5  # exposure's fall that stops the toy run (its evaluations fall by 0.3 % to 0.8 %)
EVAL_PROMPTS = ["a red apple on a table", "a blue car in the rain"]


def toy_settings(prompts: Path, **overrides) -> dict:
    return {
        "max_train_steps": 8,
        "checkpointing_steps": 100,
        "eval_every": 2,
        "eval_prompts": str(prompts),
        "eval_images_per_prompt": 2,
        "eval_steps": 2,
        "eval_rewards": "exposure,hpsv2",
        "guard": f"exposure:-{FALL_PERCENT}%",
        "keep_best": "brightness",
        **overrides,
    }


def toy_argv(tiny_weights, tiny_embeddings, out: Path, prompts: Path, **overrides) -> list[str]:
    flags = []
    for key, value in toy_settings(prompts, **overrides).items():
        flags += [f"--{key.replace('_', '-')}", str(value)]
    return [
        *tiny_train_argv(tiny_weights, tiny_embeddings),
        "--output-dir", str(out), "--save-images-every", "0", "--num-generations", "4", "--rollout-batch-size", "4",
        "--train-micro-batch-size", "2", "--sampling-steps", "6", *flags,
    ]  # fmt: skip


def training_numbers(records):
    return [{k: v for k, v in r.items() if not k.startswith(NOT_TRAINING)} for r in records if "reward_mean" in r]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("guard-prompts") / "eval.txt"
    path.write_text("\n".join(EVAL_PROMPTS) + "\n")
    return path


@pytest.fixture(scope="module")
def stopped_run(tiny_weights, tiny_embeddings, prompts_file, tmp_path_factory):
    """The toy through the CLI with --guard-action stop and --keep-last 1: (result, output folder)."""
    out = tmp_path_factory.mktemp("guard-stop") / "out"
    argv = toy_argv(tiny_weights, tiny_embeddings, out, prompts_file, guard_action="stop", keep_last=1)
    result = runner.invoke(app, [*argv, "--json"])
    return result, out


# --------------------------------------------------------------------------------------------- the rules


def test_guard_spec_parses_every_form_and_names_every_bad_entry():
    rules = parse_guard_spec(
        "clipscore:-3%, diversity:+10%,velocity_norm_ratio:max=1.05,group_spread:min=0.01", ["clipscore"]
    )
    assert [(r.name, r.kind, r.bound, r.key) for r in rules] == [
        ("clipscore", "fall", 3.0, "eval_clipscore_mean"),
        ("diversity", "rise", 10.0, "eval_diversity"),
        ("velocity_norm_ratio", "above", 1.05, "velocity_norm_ratio"),
        ("group_spread", "below", 0.01, "group_std_mean"),
    ]
    assert parse_guard_spec("", ["hpsv2"]) == []
    with pytest.raises(UsageError) as bad:
        parse_guard_spec("pickscore:-3%,hpsv2:3%,hpsv2:-3,hpsv2:max=x,hpsv2:-0%,velocity_norm_ratio:>1", ["hpsv2"])
    message = str(bad.value)
    for fragment in ("'pickscore' is not a metric", "'hpsv2:3%'", "a fall or rise is a percentage", "'x' is not",
                     "must be a positive", "velocity_norm_ratio:>1"):  # fmt: skip
        assert fragment in message
    with pytest.raises(UsageError, match="two rules"):
        parse_guard_spec("hpsv2:-3%,hpsv2:min=0.2", ["hpsv2"])


def test_relative_limits_scale_with_the_baseline_magnitude_and_nan_fires():
    fall = GuardRule("imagereward", "fall", 5.0, "imagereward:-5%")
    assert fall.limit(2.0) == pytest.approx(1.9) and fall.limit(-2.0) == pytest.approx(-2.1)  # |baseline|
    assert fall.fires(-2.11, -2.0) and not fall.fires(-2.09, -2.0)
    assert not fall.fires(0.0, None)  # no baseline yet: a relative rule cannot fire
    assert fall.fires(math.nan, 2.0)
    above = GuardRule("velocity_norm_ratio", "above", 1.05, "velocity_norm_ratio:max=1.05")
    assert above.limit(None) == 1.05 and above.fires(1.0501, None) and not above.fires(1.05, None)


def test_guard_settings_are_validated_with_the_evaluation():
    settings = {"guard": "diversity:-15%", "guard_action": "halt", "keep_best": "pickscore", "eval_every": 0}
    problems = "\n".join(TrainConfig(**{**build_config("tiny-cpu", {}).to_dict(), **settings}).problems())
    assert "--guard-action 'halt'" in problems and "set --eval-every K" in problems
    assert "--keep-best 'pickscore'" in problems
    assert "--eval-images-per-prompt 2 or more" in problems and "add clipscore or hpsv2 to --eval-rewards" in problems
    final_samples = {"guard": "velocity_norm_ratio:max=1.05", "eval_every": 4, "objective": "nft"}
    problems = "\n".join(TrainConfig(**{**build_config("tiny-cpu", {}).to_dict(), **final_samples}).problems())
    assert "--objective nft does not keep" in problems
    grpo = {**final_samples, "objective": "grpo"}
    assert "velocity_norm_ratio" not in "\n".join(
        TrainConfig(**{**build_config("tiny-cpu", {}).to_dict(), **grpo}).problems()
    )


# --------------------------------------------------------------------------------------------- diversity


def test_diversity_is_zero_for_identical_images_rises_with_spread_and_ignores_seed_order():
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(3, 16, generator=generator)  # three prompts
    noise = torch.randn(3, 4, 16, generator=generator)  # four seeds each
    prompts = [p for p in range(3) for _ in range(4)]

    def features(spread: float) -> torch.Tensor:
        return (base[:, None, :] + spread * noise).reshape(12, 16)

    assert diversity(features(0.0), prompts) == pytest.approx(0.0, abs=1e-12)
    values = [diversity(features(spread), prompts) for spread in (0.05, 0.2, 0.5, 2.0)]
    assert all(a < b for a, b in itertools.pairwise(values))
    order = torch.randperm(12, generator=generator)
    assert diversity(features(0.5)[order], [prompts[i] for i in order]) == pytest.approx(values[2], abs=1e-12)
    # by hand: two orthogonal images of one prompt are 1 apart; a prompt with one image is left out
    assert diversity(torch.tensor([[1.0, 0.0], [0.0, 3.0], [5.0, 5.0]]), [0, 0, 1]) == pytest.approx(1.0)
    assert math.isnan(diversity(torch.eye(2), [0, 1]))


def test_clip_reward_embeddings_give_zero_diversity_for_copies_of_one_image(tiny_weights):
    from PIL import Image

    from fluxgrpo.rewards.hpsv2 import HpsV2Reward

    reward = HpsV2Reward(tiny_weights.hps_dir)
    grey = Image.new("RGB", (32, 32), (128, 128, 128))
    stripes = Image.new("RGB", (32, 32), (250, 10, 10))
    features = reward.embed_pil([grey, grey.copy(), grey, stripes])
    assert features.shape[0] == 4 and torch.allclose(features.norm(dim=1), torch.ones(4))
    assert diversity(features[:2], [0, 0]) == pytest.approx(0.0, abs=1e-6)
    assert diversity(features[2:], [0, 0]) > 1e-4


# --------------------------------------------------------------------------------------------- the toy run


def test_stop_guard_fires_at_the_first_fall_exits_3_and_keeps_the_checkpoint_before(stopped_run):
    result, out = stopped_run
    assert result.exit_code == GUARD_STOP_EXIT_CODE, result.output
    records = read_metrics(out)
    evals = [r for r in records if "eval_exposure_mean" in r]
    base = evals[0]["eval_exposure_mean"]
    limit = base - abs(base) * FALL_PERCENT / 100
    expected = next(r["iteration"] for r in evals if r["eval_exposure_mean"] < limit)  # the first fall past it
    assert 0 < expected < 8
    train = [r for r in records if "reward_mean" in r]
    assert train[-1]["iteration"] == expected  # stopped there: no iteration after it
    assert evals[-1]["eval_brightness_mean"] > evals[0]["eval_brightness_mean"]  # while the trained reward rose
    stop = records[-1]
    assert stop["record"] == GUARD_RECORD and stop["guard_stop"] == 1 and stop["iteration"] == expected
    assert stop["guard_exposure_limit"] == pytest.approx(limit) and stop["guard_exposure_fired"] == 1
    summary = json.loads(result.stdout)
    assert summary["guard_stop"].startswith(f"stopped by guard exposure:-{FALL_PERCENT}% at iteration {expected}")
    assert summary["guard_stop"] in result.output  # the one line on stderr too
    assert result.stderr.count("from its baseline") == 1  # said once (it was three times: issue #31.7)
    # the last checkpoint is the stop's; best/ is the best evaluation before the fall (brightness only rises here)
    assert latest_checkpoint(out).name == f"checkpoint-{expected}"
    passing = [r for r in evals if 0 < r["iteration"] < expected]
    best = max(passing, key=lambda r: r["eval_brightness_mean"])
    facts = read_best(out)
    assert facts["iteration"] == best["iteration"] and facts["value"] == best["eval_brightness_mean"]
    assert is_best_checkpoint(out / BEST_DIR)
    # --keep-last 1 pruned every other checkpoint-<k>, but never best/
    assert [p.name for p in list_checkpoints(out)] == [f"checkpoint-{expected}"]
    state = json.loads((out / BEST_DIR / "state" / "trainer_state.json").read_text())
    assert state["iteration"] == best["iteration"]


def test_the_drifting_toy_says_so_in_trains_summary_and_its_report(
    tiny_weights, tiny_embeddings, prompts_file, tmp_path
):
    """Issue #31.1: over 8 iterations the toy's training reward rises while its velocity norm drifts past 1.05
    (tiny-cpu's learning rate is there to move fast); `train`'s summary and the report's say so, with the number."""
    pytest.importorskip("matplotlib")
    from fluxgrpo.report import build_report
    from fluxgrpo.training.collapse import VELOCITY_NORM_ALARM

    out = tmp_path / "warned"
    result = runner.invoke(app, toy_argv(tiny_weights, tiny_embeddings, out, prompts_file, guard=""))
    assert result.exit_code == 0, result.output
    records = [r for r in read_metrics(out) if "reward_mean" in r]
    recent = [r["velocity_norm_ratio"] for r in records[-5:]]
    assert sum(recent) / len(recent) > VELOCITY_NORM_ALARM
    assert reward_trend(records)["change"] > 0  # what the reward alone would call a success
    lines = result.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("reward "))
    trend, warning = lines[at], lines[at + 1]  # the held-out changes follow them
    assert trend.startswith("reward ") and "↑" in trend  # the warning sits right under the trend it qualifies
    assert warning.startswith("warning: this run looks collapsed or reward-hacked: v-ratio ")
    assert f"v-ratio {sum(recent) / len(recent):.3g} " in warning and "--learning-rate" in warning
    assert "looks collapsed or reward-hacked: v-ratio" in build_report([out]).summary
    # two iterations have not drifted yet: no warning
    short = runner.invoke(
        app, [*toy_argv(tiny_weights, tiny_embeddings, tmp_path / "short", prompts_file, guard="", max_train_steps=2),
              "--json"],
    )  # fmt: skip
    assert short.exit_code == 0, short.output
    assert json.loads(short.stdout)["collapse_warning"] is None


def test_the_report_shows_the_guard_firing_and_why_best_is_not_the_best_evaluation(stopped_run):
    """Issue #31.3: the guard panel reads the guard records (written after the evaluation that fired), and the
    summary says why best/ is not the iteration where the evaluated reward peaked."""
    pytest.importorskip("matplotlib")
    from fluxgrpo.report import build_report
    from fluxgrpo.report.figures import panels_for
    from fluxgrpo.report.run import read_run

    _, out = stopped_run
    records = [r for r in read_metrics(out) if "reward_mean" in r]
    report = build_report([out])
    stop = records[-1]["iteration"]
    run = read_run(out)
    (panel,) = [p for p in panels_for([run]) if p.title.startswith("Guard rules fired")]
    assert panel.title in report.panels
    (line,) = panel.lines
    xs, ys = run.series(line.key, run.guard_records)
    assert xs[-1] == stop and ys[-1] == 1 and ys[0] == 0  # the firing at the stop shows
    assert "Guards fired" not in report.panels  # the iteration records' count, taken before that evaluation
    best = read_best(out)["iteration"]
    assert f"best/ is iteration {best}" in report.summary
    evals = [r for r in read_metrics(out) if "eval_brightness_mean" in r]
    top = max(evals, key=lambda r: r["eval_brightness_mean"])["iteration"]
    assert top == stop != best  # brightness is best where the guard fired, so best/ is the one before
    assert f"at iteration {stop} (not best/: guard exposure fired there)" in report.summary
    page = Path(report.html).read_text()
    assert f"<th class=best>iteration {best}" in page and f"<th class=fired>iteration {stop}" in page


def test_warn_changes_no_training_number(stopped_run, tiny_weights, tiny_embeddings, prompts_file, tmp_path):
    _, stopped = stopped_run
    plain = tiny_config(
        tiny_weights, tiny_embeddings, tmp_path / "plain", **toy_settings(prompts_file, guard="", keep_best="")
    )
    warned = tiny_config(
        tiny_weights, tiny_embeddings, tmp_path / "warn", **toy_settings(prompts_file, guard_action="warn")
    )
    plain_records, warned_records = run(plain), run(warned)
    assert training_numbers(plain_records) == training_numbers(warned_records)
    assert [r["iteration"] for r in training_numbers(warned_records)] == list(range(1, 9))  # no stop with warn
    fired = [
        r for r in read_metrics(tmp_path / "warn") if r.get("record") == GUARD_RECORD and r["guard_exposure_fired"]
    ]
    assert fired and all(r["guard_stop"] == 0 for r in fired)
    # and a stopped run is the same run up to its stop
    stopped_numbers = training_numbers(read_metrics(stopped))
    assert stopped_numbers == training_numbers(warned_records)[: len(stopped_numbers)]


def test_velocity_norm_ratio_is_exactly_one_before_the_first_update(
    stopped_run, tiny_weights, tiny_embeddings, tmp_path
):
    _, out = stopped_run
    first = [r for r in read_metrics(out) if "reward_mean" in r]
    assert first[0]["velocity_norm_ratio"] == 1.0  # full fine-tuning: the iteration-1 reference
    assert all(math.isfinite(r["velocity_norm_ratio"]) for r in first)
    assert any(r["velocity_norm_ratio"] != 1.0 for r in first[1:])  # and it moves once the weights do
    for name, overrides in (("lora", {"lora_rank": 4, "lora_alpha": 8.0}), ("kl", {"kl_beta": 0.01})):
        cfg = tiny_config(tiny_weights, tiny_embeddings, tmp_path / name, max_train_steps=2, **overrides)
        records = run(cfg)
        assert records[0]["velocity_norm_ratio"] == 1.0, name  # paired with the reference's forward
        assert records[1]["velocity_norm_ratio"] != 1.0, name


def test_best_checkpoint_loads_in_sample_and_export(stopped_run, tiny_weights, tmp_path):
    from diffusers import FluxTransformer2DModel

    _, out = stopped_run
    sampled = runner.invoke(
        app,
        ["sample", "--model", str(tiny_weights.flux_dir), "--checkpoint", str(out / BEST_DIR), "--prompt", "a red apple", "--steps", "2",
         "--height", "64", "--width", "64", "--out", str(tmp_path / "samples")],
    )  # fmt: skip
    assert sampled.exit_code == 0, sampled.output
    assert list((tmp_path / "samples").glob("*.png"))
    exported = runner.invoke(app, ["export", "--checkpoint", str(out / BEST_DIR), "--out", str(tmp_path / "export")])
    assert exported.exit_code == 0, exported.output
    model = FluxTransformer2DModel.from_pretrained(tmp_path / "export")
    best_weights = FluxTransformer2DModel.from_pretrained(out / BEST_DIR / "transformer").state_dict()
    assert all(torch.equal(value, best_weights[key]) for key, value in model.state_dict().items())


def test_guard_baseline_survives_kill_9_and_resume(tiny_weights, tiny_embeddings, prompts_file, tmp_path):
    out = tmp_path / "out"
    argv = toy_argv(
        tiny_weights, tiny_embeddings, out, prompts_file, max_train_steps=400, checkpointing_steps=2, eval_every=2
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    process = subprocess.Popen([sys.executable, "-m", "fluxgrpo", *argv], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 240
    try:
        while not (out / "checkpoint-2" / "COMPLETE").is_file():
            assert process.poll() is None and time.monotonic() < deadline, "the run ended before its first checkpoint"
            time.sleep(0.05)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    killed_at = json.loads((latest_checkpoint(out) / "state" / "trainer_state.json").read_text())
    done = killed_at["iteration"]
    base = killed_at["guards"]["baselines"]["eval_exposure_mean"]
    assert (
        base
        == next(r for r in read_metrics(out) if r["iteration"] == 0 and "eval_exposure_mean" in r)["eval_exposure_mean"]
    )
    # a rule added on resume takes its baseline from the iteration-0 evaluation too
    added = f"exposure:-{FALL_PERCENT}%,hpsv2:-90%"
    resumed = runner.invoke(app, [*argv, "--resume", "--max-train-steps", str(done + 2), "--guard", added])
    assert resumed.exit_code == 0, resumed.output
    records = read_metrics(out)
    assert len([r for r in records if r["iteration"] == 0 and "eval_exposure_mean" in r]) == 1  # not re-run
    last = [r for r in records if r.get("record") == GUARD_RECORD][-1]
    assert last["iteration"] == done + 2
    assert last["guard_exposure_limit"] == pytest.approx(base - abs(base) * FALL_PERCENT / 100)
    hps_base = next(r for r in records if r["iteration"] == 0 and "eval_hpsv2_mean" in r)["eval_hpsv2_mean"]
    assert last["guard_hpsv2_limit"] == pytest.approx(hps_base - abs(hps_base) * 0.9)


def test_the_drift_probe_changes_no_training_number(tiny_weights, tiny_embeddings, tmp_path, monkeypatch):
    from fluxgrpo.training.drift import DriftProbe

    probed = run(tiny_config(tiny_weights, tiny_embeddings, tmp_path / "probed", max_train_steps=3))
    monkeypatch.setattr(DriftProbe, "measure", lambda self, *args, **kwargs: {})
    unprobed = run(tiny_config(tiny_weights, tiny_embeddings, tmp_path / "unprobed", max_train_steps=3))
    without_ratio = [{k: v for k, v in r.items() if k != "velocity_norm_ratio"} for r in training_numbers(probed)]
    assert without_ratio == training_numbers(unprobed)
    assert all(math.isfinite(r["velocity_norm_ratio"]) for r in probed)
