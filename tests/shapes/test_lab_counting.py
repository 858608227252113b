"""Counting as filled quadrants: the independence ceiling and the reading of a model's samples, hand-worked."""

from __future__ import annotations

import itertools

import pytest

from fluxgrpo.lab.counting import counting_report, exactly_if_independent, filled_quadrants, independent_ceiling, main
from fluxgrpo.shapes import world
from fluxgrpo.shapes.checker import FoundObject, check

CENTRES = ((16, 16), (48, 16), (16, 48), (48, 48))  # the quadrants' centres at 64², in filled_quadrants' order


def checked(patterns: list[tuple[bool, ...]], caption: str):
    """The checker's results on one render per pattern: red circles at the filled quadrants' centres."""
    results = []
    for filled in patterns:
        objects = [
            world.PlacedObject("circle", "red", x, y, 9.0) for (x, y), f in zip(CENTRES, filled, strict=True) if f
        ]
        results.append(check(world.render(world.Scene(64, objects)), caption))
    return results


def test_independent_quadrants_cap_exactly_three_of_four_at_the_binomials_best():
    assert independent_ceiling(3) == pytest.approx(4 * 0.75**3 * 0.25)  # 0.421875
    assert independent_ceiling(2) == pytest.approx(6 * 0.5**4)  # 0.375
    assert exactly_if_independent([0.5] * 4, 2) == pytest.approx(6 / 16)
    assert exactly_if_independent([0.9] * 4, 3) == pytest.approx(4 * 0.9**3 * 0.1)
    assert exactly_if_independent([1.0, 1.0, 1.0, 0.0], 3) == 1.0
    assert exactly_if_independent([1.0, 1.0, 1.0, 0.0], 4) == 0.0
    for p in (0.5, 0.7, 0.75, 0.8, 0.95):  # equally likely quadrants never beat the ceiling, reached at 3/4
        assert exactly_if_independent([p] * 4, 3) <= independent_ceiling(3) + 1e-12
    assert exactly_if_independent([1.0, 1.0, 0.5, 1.0], 3) == 0.5  # broken symmetry does: one quadrant a coin


def test_an_objects_quadrant_is_where_its_box_centre_lies():
    def at(x0: int, y0: int, x1: int, y1: int) -> FoundObject:
        return FoundObject("circle", "red", 50, (x0, y0, x1, y1))

    assert filled_quadrants([at(2, 2, 20, 20)], 64) == (True, False, False, False)
    assert filled_quadrants([at(40, 2, 60, 20), at(2, 40, 20, 60)], 64) == (False, True, True, False)
    assert filled_quadrants([at(30, 30, 40, 40)], 64) == (False, False, False, True)  # centre (35, 35)
    assert filled_quadrants([], 64) == (False,) * 4


def test_a_model_that_always_leaves_one_quadrant_empty_is_coordinated():
    patterns = [tuple(q != empty for q in range(4)) for empty in range(4)]
    report = counting_report(checked(patterns, "three circles"), 64)
    assert report is not None
    assert report["strict"] == 1.0 and report["exactly_asked_filled"] == 1.0
    assert report["quadrants_filled"] == [0, 0, 0, 4, 0]
    assert report["quadrant_odds"] == [0.75] * 4
    # a constant sum of four equally varying indicators: each pair's correlation is −1/3
    assert report["mean_correlation"] == pytest.approx(-1 / 3, abs=1e-3)
    assert report["if_independent"] == pytest.approx(independent_ceiling(3), abs=1e-4)
    assert report["more_objects_than_filled_quadrants"] == 0.0


def test_a_model_that_flips_a_coin_per_quadrant_is_not():
    patterns = list(itertools.product((False, True), repeat=4))  # every pattern once: odds 1/2, no correlation
    report = counting_report(checked(patterns, "three circles"), 64)
    assert report is not None
    assert report["quadrant_odds"] == [0.5] * 4 and report["mean_correlation"] == pytest.approx(0.0, abs=1e-9)
    assert report["exactly_asked_filled"] == report["if_independent"] == 0.25  # 4 of 16 patterns fill exactly three
    assert report["strict"] == 0.25
    assert counting_report(checked(patterns[-1:], "a red circle"), 64) is None  # no count asked


def test_the_command_refuses_a_caption_without_a_count_before_loading_anything(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["--flux-dir", str(tmp_path / "missing"), "--captions", "a red circle"])
    assert stopped.value.code == 2
    assert "name no count" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--flux-dir", str(tmp_path / "missing"), "--captions", "three dragons"])
    assert "no word 'dragons'" in capsys.readouterr().err
