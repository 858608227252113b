"""The collapse / reward-hacking warning (``fluxgrpo.training.collapse``): thresholds on hand-worked records, the
image spread on hand-made images, and `score --compare` saying when the compared images lost their diversity."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from PIL import Image
from typer.testing import CliRunner

from fluxgrpo.cli.app import app
from fluxgrpo.training.collapse import (
    VELOCITY_NORM_ALARM,
    image_spread,
    record_signs,
    spread_sign,
    warning_line,
)

runner = CliRunner()


def iterations(ratios=None, spreads=None):
    count = len(ratios or spreads)
    return [
        {
            "iteration": k + 1,
            "reward_mean": 0.5,
            **({"velocity_norm_ratio": ratios[k]} if ratios else {}),
            **({"group_std_mean": spreads[k]} if spreads else {}),
        }
        for k in range(count)
    ]


def test_velocity_norm_ratio_warns_on_the_mean_of_the_last_five_iterations_above_1_05():
    # the last five average 1.04 (no sign); one more at 1.15 moves the window's mean to 1.066
    calm = iterations(ratios=[1.0, 3.0, 1.00, 1.02, 1.04, 1.06, 1.08])
    assert record_signs(calm) == []
    drifting = iterations(ratios=[1.0, 3.0, 1.00, 1.02, 1.04, 1.06, 1.08, 1.15])
    (sign,) = record_signs(drifting)
    assert (
        sign.signal == "velocity_norm_ratio" and "v-ratio 1.07" in sign.text and str(VELOCITY_NORM_ALARM) in sign.text
    )
    assert record_signs(iterations(ratios=[1.0, math.nan, 1.0])) == []  # a NaN probe is no evidence either way


def test_group_spread_warns_when_it_fell_three_times_or_more():
    # first five mean 0.09, last five mean 0.01: a 9× fall
    fallen = iterations(spreads=[0.09] * 5 + [0.05] * 3 + [0.01] * 5)
    (sign,) = record_signs(fallen)
    assert sign.signal == "group_spread" and "fell 9.0×" in sign.text and "0.09 → 0.01" in sign.text
    assert record_signs(iterations(spreads=[0.09] * 5 + [0.031] * 5)) == []  # 2.9×: not yet


def test_diversity_warns_below_half_of_the_iteration_0_evaluation():
    records = [{"iteration": 0, "eval_diversity": 0.2}, {"iteration": 10, "eval_diversity": 0.11}]
    assert record_signs(records) == []
    records.append({"iteration": 20, "eval_diversity": 0.08})
    (sign,) = record_signs(records)
    assert sign.signal == "diversity" and "0.2 → 0.08 (-60 %" in sign.text


def test_a_held_out_fall_beyond_the_noise_of_its_evaluations_warns_with_the_training_rise_beside_it():
    def evaluation(iteration, mean):  # 100 images of spread 0.3 at each end: 2·√(2·0.09/100) = 0.0849 of noise
        return {"iteration": iteration, "eval_seconds": 1.0, "eval_images": 100, "eval_shapes_mean": mean,
                "eval_shapes_std": 0.3}  # fmt: skip

    trained = [{"iteration": k, "reward_mean": 0.4 + 0.02 * k} for k in range(1, 11)]
    assert record_signs([evaluation(0, 0.6), *trained, evaluation(10, 0.52)]) == []  # −0.08: within the noise
    (sign,) = record_signs([evaluation(0, 0.6), *trained, evaluation(10, 0.50)])
    assert sign.signal == "held_out"
    assert sign.text == (
        "held-out shapes 0.6 → 0.5 (-0.1, beyond the ±0.085 a redraw of the images could give) while the training "
        "reward rose +0.1"  # the means of the first and last 5 iterations: 0.46 → 0.56
    )
    assert record_signs([evaluation(0, 0.6), *trained, evaluation(10, 0.70)]) == []  # a rise is no sign

    # the paired noise of barely-moved weights is tiny: a fall beyond it but under 5 % of the start is drift, not a
    # collapse (0.6 → 0.571 is −4.8 %); 0.6 → 0.569 (−5.2 %) is both
    def paired(iteration, mean):
        return {**evaluation(iteration, mean), "eval_shapes_change_noise": 0.004, "eval_change_from": 0}

    assert record_signs([evaluation(0, 0.6), *trained, paired(10, 0.571)]) == []
    (sign,) = record_signs([evaluation(0, 0.6), *trained, paired(10, 0.569)])
    assert "(-0.031, beyond the ±0.004 a redraw of the images could give)" in sign.text


def save(path: Path, colour) -> Path:
    Image.new("RGB", (16, 16), colour).save(path)
    return path


def test_image_spread_is_the_rms_distance_from_the_mean_image(tmp_path):
    black, white = save(tmp_path / "b.png", (0, 0, 0)), save(tmp_path / "w.png", (255, 255, 255))
    assert image_spread([black, white]) == pytest.approx(127.5)  # each is 127.5 from the mean grey
    assert image_spread([black, black, black]) == 0.0
    assert math.isnan(image_spread([black]))
    grey = save(tmp_path / "g.png", (60, 60, 60))
    # mean 20; distances 20, 20, 40 → rms sqrt((400 + 400 + 1600) / 3)
    assert image_spread([black, black, grey]) == pytest.approx(math.sqrt(800))
    assert spread_sign(20.0, 10.1, "base", "trained") is None
    sign = spread_sign(21.1, 5.4, "base", "trained")
    assert sign is not None and "21.1 (base) → 5.4 (trained) of 255, -74 %" in sign.text
    line = warning_line([sign])
    assert line is not None and line.startswith("warning: this run looks collapsed") and "\n" not in line
    assert "--learning-rate" in line and "--guard" in line  # says what to do


def sample_index(folder: Path, colours: list[tuple[int, int, int]]) -> Path:
    """A sample index of one prompt with an image per colour (seeds 0, 1, …)."""
    folder.mkdir(parents=True)
    images = []
    for j, colour in enumerate(colours):
        save(folder / f"0000_{j:02d}.png", colour)
        images.append({"file": f"0000_{j:02d}.png", "prompt": "a cat", "prompt_index": 0, "image_index": j, "seed": j})
    document = {
        "format": "fluxgrpo-sample-index",
        "format_version": 1,
        "fluxgrpo_version": "test",
        "model": "m",
        "checkpoint": None,
        "ema": False,
        "settings": {},
        "prompts": ["a cat"],
        "grid": "grid.png",
        "images": images,
    }
    (folder / "index.json").write_text(json.dumps(document))
    return folder / "index.json"


def test_score_compare_says_when_the_better_scored_images_all_look_alike(tmp_path):
    base = sample_index(tmp_path / "base", [(0, 0, 0), (200, 200, 200), (40, 90, 160), (250, 30, 30)])
    collapsed = sample_index(tmp_path / "trained", [(210, 210, 210)] * 4)  # brighter, and all the same
    argv = ["score", "--index", str(collapsed), "--compare", str(base), "--reward", "brightness", "--device", "cpu"]
    table = runner.invoke(app, argv)
    assert table.exit_code == 0, table.output
    assert "improved prompts: 1 of 1 (100%)" in table.stdout
    warning = [line for line in table.stdout.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "looks collapsed" in warning[0] and "→ 0.0 (this run) of 255" in warning[0]
    document = json.loads(runner.invoke(app, [*argv, "--json"]).stdout)
    collapse = document["compare"]["collapse"]
    assert collapse["image_spread"] == 0.0 and collapse["other_image_spread"] > 50
    assert collapse["warning"] == warning[0]
    # two runs as varied as each other: no warning
    varied = sample_index(tmp_path / "varied", [(10, 10, 10), (190, 190, 190), (60, 80, 170), (240, 40, 40)])
    calm = runner.invoke(app, ["score", "--index", str(varied), "--compare", str(base), "--reward", "brightness"])
    assert calm.exit_code == 0 and "warning:" not in calm.stdout
