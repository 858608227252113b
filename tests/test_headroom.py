"""Headroom: best-of-k and pass@k, by hand and through ``fluxgrpo score --headroom``; its share in train's line."""

from __future__ import annotations

import itertools
import json
import math

import pytest
from test_score import hand_made_index
from typer.testing import CliRunner

from fluxgrpo.cli.app import app
from fluxgrpo.headroom import best_of_k, best_of_n_mean, headroom, ks_up_to, pass_at_k, share_used
from fluxgrpo.metrics import held_out_trend


def _by_enumeration(scores: list[float], k: int) -> float:
    subsets = list(itertools.combinations(scores, k))
    return sum(max(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_best_of_k_is_the_mean_best_over_every_k_subset(k):
    scores = [0.2, 0.9, 0.4, 0.4]
    assert best_of_k(scores, k) == pytest.approx(_by_enumeration(scores, k))


def test_best_of_k_by_hand():
    # [0, 0, 1]: best of 1 = 1/3; best of 2 = 1 − C(2,2)/C(3,2) = 2/3; best of 3 = 1
    assert [best_of_k([0.0, 1.0, 0.0], k) for k in (1, 2, 3)] == pytest.approx([1 / 3, 2 / 3, 1.0])
    with pytest.raises(ValueError, match="best-of-4"):
        best_of_k([0.0, 1.0, 0.0], 4)


def test_pass_at_k_is_codex_estimator():
    # n = 4, c = 1 passing: pass@1 = 1/4, pass@2 = 1 − C(3,2)/C(4,2) = 1/2, pass@4 = 1
    scores = [1.0, 0.5, 0.75, 0.0]
    assert [pass_at_k(scores, k, 1.0) for k in (1, 2, 4)] == pytest.approx([0.25, 0.5, 1.0])
    assert pass_at_k(scores, 2, 0.7) == pytest.approx(1 - math.comb(2, 2) / math.comb(4, 2))
    assert pass_at_k([float("nan"), 1.0], 1, 1.0) == 0.5  # a NaN never passes


def test_headroom_over_prompts_reads_every_prompt_at_the_smallest_group():
    room = headroom({"a": [0.0, 1.0, 0.0, 0.0], "b": [0.5, 0.5, float("nan")]}, threshold=1.0)
    assert (room.prompts, room.images_per_prompt) == (2, 2)
    assert ks_up_to(2) == [1, 2] and ks_up_to(6) == [1, 2, 4, 6]
    assert room.best_of[1] == pytest.approx((0.25 + 0.5) / 2)
    assert room.best_of[2] == pytest.approx((_by_enumeration([0.0, 1.0, 0.0, 0.0], 2) + 0.5) / 2)
    assert room.pass_at == pytest.approx({1: 0.125, 2: 0.25})
    assert room.ceiling == room.best_of[2] and room.mean == room.best_of[1]


def test_best_of_n_mean_and_the_share_of_headroom():
    assert best_of_n_mean(["a", "a", "b", "b"], [0.0, 1.0, 0.5, 0.25]) == 0.75
    assert best_of_n_mean(["a", "b"], [0.0, 1.0]) is None  # one image per prompt: no headroom to read
    assert share_used(0.5, 0.6, 0.9) == pytest.approx(0.25)
    assert share_used(0.9, 0.95, 0.9) is None


def test_held_out_trend_carries_the_ceiling_and_the_share_used():
    records = [
        {"iteration": 0, "eval_seconds": 1.0, "eval_shapes_mean": 0.5, "eval_shapes_best_of_n": 0.9},
        {"iteration": 8, "eval_seconds": 1.0, "eval_shapes_mean": 0.6},
    ]
    trend = held_out_trend(records)["shapes"]
    assert trend["ceiling"] == 0.9 and trend["headroom_used"] == pytest.approx(0.25)


def test_score_headroom_on_hand_made_images(tmp_path):
    # brightness = level / 255: prompt 0 images 0.2, 0.4, 0.6, 0.8; prompt 1 all 0.6
    index = hand_made_index(tmp_path / "run", ["p0", "p1"], [[51, 102, 153, 204], [153] * 4], [[0, 1, 2, 3]] * 2)
    runner = CliRunner()
    args = ["score", "--index", str(index), "--reward", "brightness", "--device", "cpu", "--headroom"]
    result = runner.invoke(app, [*args, "--json", "--pass-threshold", "0.7"])
    assert result.exit_code == 0, result.output
    room = json.loads(result.stdout)["headroom"]
    expected_best = {k: (_by_enumeration([0.2, 0.4, 0.6, 0.8], k) + 0.6) / 2 for k in (1, 2, 4)}
    assert {int(k): v for k, v in room["best_of"].items()} == pytest.approx(expected_best, abs=1e-6)
    assert {int(k): v for k, v in room["pass_at"].items()} == pytest.approx({1: 0.125, 2: 0.25, 4: 0.5}, abs=1e-6)
    table = runner.invoke(app, args)
    assert table.exit_code == 0 and "best of 4" in table.stdout and "pass@k" not in table.stdout  # no threshold
    refused = runner.invoke(app, ["score", "--index", str(index), "--reward", "brightness", "--pass-threshold", "1"])
    assert refused.exit_code == 2 and "--pass-threshold is read only with --headroom" in refused.output
