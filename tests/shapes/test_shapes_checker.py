"""The shapes checker: near-perfect on the renderer's own images, and each kind of wrong image fails the right claim."""

from __future__ import annotations

import random

import numpy as np
import pytest

from fluxgrpo.shapes import checker, world
from fluxgrpo.shapes.checker import FoundObject, check, relative_position
from fluxgrpo.shapes.world import Caption, ObjectSpec, PlacedObject, Scene, parse_caption, render, sample_scene

IMAGES_PER_FAMILY = 400


def _strict_rate(family: str, size: int, n: int, blur: float = 0.0, layout: str = "free") -> float:
    from scipy import ndimage

    captions = [c for c in world.all_captions() if c.family == family]
    rng = random.Random(family)
    passed = 0
    for seed in range(n):
        caption = captions[rng.randrange(len(captions))]
        image = render(sample_scene(caption, random.Random(seed), size, layout))
        if blur:
            noise = np.random.default_rng(seed).normal(0.0, 4.0, image.shape)
            blurred = ndimage.gaussian_filter(image.astype(np.float64), (blur, blur, 0)) + noise
            image = np.clip(np.rint(blurred), 0, 255).astype(np.uint8)
        passed += check(image, caption).strict
    return passed / n


@pytest.mark.parametrize("family", world.FAMILIES)
def test_strict_on_the_renderers_own_images_for_every_family(family):
    assert _strict_rate(family, 64, IMAGES_PER_FAMILY) >= 0.99


@pytest.mark.parametrize("family", world.FAMILIES)
def test_strict_survives_a_blur_and_noise_like_a_vae_reconstruction(family):
    assert _strict_rate(family, 64, 150, blur=1.2) >= 0.99


@pytest.mark.parametrize("family", world.FAMILIES)
def test_the_quadrant_layouts_renders_pass_too_sharp_and_blurred(family):
    assert _strict_rate(family, 64, 200, layout="quadrants") >= 0.99
    assert _strict_rate(family, 64, 100, blur=1.2, layout="quadrants") >= 0.99
    assert _strict_rate(family, 128, 50, layout="quadrants") >= 0.99


def test_the_quadrant_layout_puts_one_object_to_a_quadrant_and_relations_in_a_row_or_column():
    for seed, caption in enumerate(world.all_captions()):
        scene = sample_scene(caption, random.Random(seed), 64, "quadrants")
        cells = [(int(o.x // 32), int(o.y // 32)) for o in scene.objects]
        assert len(set(cells)) == len(cells)
        for o, (column, row) in zip(scene.objects, cells, strict=True):
            assert abs(o.x - (column + 0.5) * 32) <= 2 and abs(o.y - (row + 0.5) * 32) <= 2
        if caption.relation:
            assert cells[0][0] == cells[1][0] or cells[0][1] == cells[1][1]


def test_an_unknown_layout_is_refused_by_name():
    with pytest.raises(ValueError, match="quadrants"):
        sample_scene(parse_caption("a circle"), random.Random(0), 64, "grid")


def test_shape_features_match_their_closed_forms_on_large_ideal_shapes():
    side = 400
    ys, xs = (np.indices((side, side)) + 0.5) / side - 0.5
    square = np.ones((side, side))
    disc = (xs**2 + ys**2 <= 0.25).astype(np.float64)
    # equilateral, apex up (the renderer's): side 0.8, height 0.8·√3/2, apex at y = −0.35
    height = 0.8 * np.sqrt(3) / 2
    triangle = ((ys >= -0.35) & (ys <= -0.35 + height) & (np.abs(xs) <= (ys + 0.35) / height * 0.4)).astype(np.float64)
    skew, ratio = checker.shape_features(square)
    assert abs(skew) < 1e-6 and ratio == pytest.approx(2.0, abs=0.01)  # κ4 −s⁴/120 on an axis, −s⁴/240 diagonally
    skew, ratio = checker.shape_features(disc)
    assert abs(skew) < 1e-6 and ratio == pytest.approx(1.0, abs=0.01)  # the same in every direction
    skew, _ = checker.shape_features(triangle)
    assert skew == pytest.approx(-2 * np.sqrt(2) / 5, abs=0.01)  # a triangular distribution with its mode at the end
    # A Gaussian blur adds to the variance only: the square's κ4 ratio survives it.
    from scipy import ndimage

    padded = np.pad(np.ones((40, 40)), 20)
    assert checker.shape_features(ndimage.gaussian_filter(padded, 3.0))[1] == pytest.approx(2.0, abs=0.05)
    assert [checker.classify_shape(m) for m in (square, disc, triangle)] == ["square", "circle", "triangle"]


def test_strict_at_128_pixels():
    assert min(_strict_rate(family, 128, 40) for family in world.FAMILIES) >= 0.97


def _scene(*objects: tuple[str, str, float, float]) -> Scene:
    return Scene(64, [PlacedObject(shape, colour, x, y, 8.0) for shape, colour, x, y in objects])


def _claims(scene: Scene, caption: str) -> dict[str, bool]:
    return {claim.text: claim.holds for claim in check(render(scene), caption).claims}


def test_each_found_object_has_its_shape_colour_and_box():
    found = checker.find_objects(render(_scene(("triangle", "blue", 16, 16), ("circle", "yellow", 46, 44))))
    assert sorted((o.shape, o.colour) for o in found) == [("circle", "yellow"), ("triangle", "blue")]
    for obj in found:
        x, y = obj.centre
        assert (abs(x - 16) < 2 and abs(y - 17) < 3) or (abs(x - 46) < 2 and abs(y - 44) < 2)


def test_a_true_scene_satisfies_every_claim_and_scores_one():
    result = check(
        render(_scene(("circle", "red", 14, 32), ("square", "yellow", 48, 30))), "a red circle left of a yellow square"
    )
    assert [c.kind for c in result.claims] == ["present", "colour", "present", "colour", "relation"]
    assert result.strict and result.score == 1.0


def test_wrong_colour_fails_the_colour_claim_only():
    claims = _claims(
        _scene(("circle", "green", 14, 32), ("square", "yellow", 48, 30)), "a red circle left of a yellow square"
    )
    assert claims == {
        "a circle": True,
        "the circle is red": False,
        "a square": True,
        "the square is yellow": True,
        "the circle is left of the square": True,
    }
    result = check(
        render(_scene(("circle", "green", 14, 32), ("square", "yellow", 48, 30))),
        "a red circle left of a yellow square",
    )
    assert result.score == pytest.approx(4 / 5) and not result.strict
    assert [c.label() for c in result.claims if not c.holds] == ["✗ the circle is red (green circle)"]


def test_a_moved_object_fails_the_relation_claim_only():
    claims = _claims(
        _scene(("circle", "red", 48, 32), ("square", "yellow", 14, 30)), "a red circle left of a yellow square"
    )
    assert [text for text, holds in claims.items() if not holds] == ["the circle is left of the square"]
    label = next(
        c
        for c in check(
            render(_scene(("circle", "red", 48, 32), ("square", "yellow", 14, 30))), "a circle left of a square"
        ).claims
        if c.kind == "relation"
    ).label()
    assert label == "✗ the circle is left of the square (right of instead)"


def test_a_missing_object_fails_its_presence_and_what_depends_on_it():
    claims = _claims(_scene(("circle", "red", 14, 32)), "a red circle left of a yellow square")
    assert claims == {
        "a circle": True,
        "the circle is red": True,
        "a square": False,
        "the square is yellow": False,
        "the circle is left of the square": False,
    }
    assert _claims(_scene(("circle", "red", 14, 32)), "a circle and a triangle") == {
        "a circle": True,
        "a triangle": False,
    }


def test_an_extra_object_fails_the_count():
    two = (("triangle", "blue", 14, 14), ("triangle", "blue", 48, 14))
    assert _claims(_scene(*two), "two blue triangles") == {"two triangles": True, "the triangles are blue": True}
    extra = _scene(*two, ("triangle", "blue", 30, 48))
    assert _claims(extra, "two blue triangles") == {"two triangles": False, "the triangles are blue": True}
    assert check(render(extra), "two blue triangles").claims[0].found == "3 found"
    # Another shape is no extra triangle (GenEval's exclude counts the class asked for only).
    assert _claims(_scene(*two, ("circle", "red", 30, 48)), "two triangles") == {"two triangles": True}


def test_the_scene_claim_counts_every_object_found_against_the_objects_asked():
    two = (("triangle", "blue", 14, 14), ("triangle", "blue", 48, 14))
    with_circle = render(_scene(*two, ("circle", "red", 30, 48)))
    # GenEval's claims all hold with an object of another shape beside them; the scene claim does not.
    assert check(with_circle, "two triangles").strict
    result = check(with_circle, "two triangles", scene=True)
    assert [(c.kind, c.holds) for c in result.claims] == [("count", True), ("scene", False)]
    assert result.claims[-1].label() == "✗ nothing else (2 objects) (3 found)"
    assert result.score == pytest.approx(1 / 2)
    exact = check(render(_scene(*two)), "two blue triangles", scene=True)
    assert exact.strict and exact.claims[-1].label() == "✓ nothing else (2 objects)"
    # One object per object named, for the families without a count; a position caption names two.
    scene = _scene(("circle", "red", 14, 32), ("square", "yellow", 48, 30))
    assert check(render(scene), "a red circle left of a yellow square", scene=True).strict
    assert [c.holds for c in check(render(scene), "a red circle", scene=True).claims] == [True, True, False]
    assert checker.objects_asked(parse_caption("three green squares")) == 3
    assert checker.objects_asked(parse_caption("a circle and a triangle")) == 2
    assert checker.objects_asked(parse_caption("a yellow triangle")) == 1


def test_colour_is_checked_on_the_largest_objects_of_the_shape():
    # GenEval checks the colour of its most confident detections; area stands in for confidence here.
    big_blue = Scene(64, [PlacedObject("circle", "blue", 16, 32, 10.0), PlacedObject("circle", "red", 48, 32, 7.0)])
    assert _claims(big_blue, "a red circle") == {"a circle": True, "the circle is red": False}
    assert _claims(big_blue, "a blue circle") == {"a circle": True, "the circle is blue": True}


def test_relative_position_matches_geneval_by_hand():
    # Boxes 10 px wide; centres 20 px apart horizontally, 4 px vertically. Revised offset: dx = 20 - 0.1·20 = 18,
    # dy = max(4 - 0.1·20, 0) = 2; divided by |offset| = √416 ≈ 20.4: dx ≈ 0.88 > 0.5, dy ≈ 0.10.
    a = FoundObject("circle", "red", 80, (0, 0, 10, 10))
    b = FoundObject("square", "red", 100, (20, 4, 30, 14))
    assert relative_position(a, b) == {"left of"}
    assert relative_position(b, a) == {"right of"}
    # A diagonal offset holds both relations, as in GenEval: (20, 20) → revised (18, 18)/28.3 = 0.64 each.
    c = FoundObject("circle", "red", 80, (20, 20, 30, 30))
    assert relative_position(a, c) == {"left of", "above"}
    # Boxes whose centres are closer than a tenth of their sizes hold no relation.
    d = FoundObject("circle", "red", 80, (1, 1, 11, 11))
    assert relative_position(a, d) == set()


def test_a_blended_rim_joins_its_object_instead_of_counting_as_another():
    # a red circle whose outer ring is orange (a generated object's shading): one object, red, its colour claim judged
    # on every pixel: a thin ring keeps it red, a thick one does not
    image = render(_scene(("circle", "red", 32, 32))).astype(np.float64)
    rows, cols = np.indices(image.shape[:2])
    radius = np.hypot(rows - 31.5, cols - 31.5)
    for ring, true in ((1.0, True), (4.0, False)):
        painted = image.copy()
        painted[(radius > 8.0 - ring) & (radius <= 8.0)] = checker.BLEND_COLOURS["orange"]
        found = checker.find_objects(painted.astype(np.uint8))
        assert [(o.shape, o.colour, o.true_colour) for o in found] == [("circle", "red", true)], ring
        assert check(painted.astype(np.uint8), "one circle").strict  # counted once


def test_segmentation_keeps_anti_aliased_edges_with_their_object_and_ignores_specks():
    image = render(_scene(("square", "green", 32, 32)))
    labels = checker.segment(image)
    assert set(np.unique(labels)) == {-1, list(world.COLOURS).index("green")}
    speck = image.copy()
    speck[2:4, 2:4] = world.COLOURS["red"]
    assert [(o.shape, o.colour) for o in checker.find_objects(speck)] == [("square", "green")]


def test_float_images_in_zero_one_read_as_their_bytes():
    image = render(_scene(("circle", "red", 14, 32), ("square", "yellow", 48, 30)))
    assert check(image / 255.0, "a circle left of a square") == check(image, "a circle left of a square")


def test_wrong_sizes_and_unknown_words_are_one_clear_line():
    with pytest.raises(checker.ImageSizeError, match=r"a 32x32 image: the shapes world renders at 64x64 or 128x128"):
        check(np.zeros((32, 32, 3), np.uint8), "a circle")
    with pytest.raises(checker.ImageSizeError, match=r"\[H, W, 3\]"):
        check(np.zeros((64, 64), np.uint8), "a circle")
    with pytest.raises(world.CaptionError, match=r"no word 'dog', 'purple'"):
        check(np.zeros((64, 64, 3), np.uint8), "a purple dog")


def test_every_caption_of_the_grammar_has_claims_and_round_trips():
    for caption in world.all_captions():
        assert parse_caption(caption.text()) == caption
        result = check(render(sample_scene(caption, random.Random(0))), caption)
        assert result.claims and result.caption == caption.text()


def test_claim_counts_follow_the_family():
    empty: list[FoundObject] = []
    cases = {
        Caption("single_object", (ObjectSpec("circle"),)): ["present"],
        Caption("two_object", (ObjectSpec("circle"), ObjectSpec("square"))): ["present", "present"],
        Caption("counting", (ObjectSpec("square", "blue"),), count=3): ["count", "colour"],
        Caption("colors", (ObjectSpec("square", "blue"),)): ["present", "colour"],
        Caption("position", (ObjectSpec("circle"), ObjectSpec("square")), relation="above"): [
            "present",
            "present",
            "relation",
        ],
    }
    for caption, kinds in cases.items():
        claims = checker.claims_of(caption, empty)
        assert [c.kind for c in claims] == kinds and not any(c.holds for c in claims)


def _painted(shape: str, rgb: tuple[int, int, int] | np.ndarray, x: float = 32, y: float = 32) -> np.ndarray:
    """The renderer's image of one shape, its red pixels repainted in ``rgb`` with the anti-aliased edge kept: each
    pixel's share of red against the background carried over to the new colour."""
    image = render(Scene(64, [PlacedObject(shape, "red", x, y, 11.0)])).astype(np.float64)
    background = np.array(world.BACKGROUND, dtype=np.float64)
    direction = np.array(world.COLOURS["red"], dtype=np.float64) - background
    alpha = np.clip(((image - background) @ direction) / (direction @ direction), 0, 1)[..., None]
    colour = np.broadcast_to(np.asarray(rgb, dtype=np.float64), image.shape)
    return np.clip(np.rint(background + alpha * (colour - background)), 0, 255).astype(np.uint8)


@pytest.mark.parametrize(
    ("blend", "near"),
    [("orange", ("red", "yellow")), ("purple", ("red", "blue")), ("teal", ("green", "blue")),
     ("olive", ("green", "yellow")), ("brown", ("red", "green")), ("grey", ("blue", "yellow"))],
)  # fmt: skip
def test_a_blended_colour_fails_every_colour_claim_but_is_still_an_object(blend, near):
    image = _painted("circle", checker.BLEND_COLOURS[blend])
    found = checker.find_objects(image)
    assert [(o.shape, o.colour) for o in found] == [("circle", blend)]
    assert check(image, "a circle").strict  # present: a shape was drawn
    for colour in world.COLOURS:
        result = check(image, f"a {colour} circle")
        assert [c.holds for c in result.claims] == [True, False], (blend, colour)
    assert all(f"({blend} circle)" in check(image, f"a {c} circle").claims[1].label() for c in near)


def test_a_shade_or_a_gradient_across_one_shape_is_not_its_nearest_colour():
    red, yellow = (np.array(world.COLOURS[c], dtype=np.float64) for c in ("red", "yellow"))
    # a third of the way from red to yellow: nearer the orange blend's line than red's, so an orange square
    third = _painted("square", red + (yellow - red) / 3)
    assert checker.find_objects(third)[0].colour == "orange"
    assert check(third, "a red square").claims[1].label() == "✗ the square is red (orange square)"
    # a tenth of the way stays red (within the documented tolerance), and so does the renderer's exact red
    assert check(_painted("square", red + 0.1 * (yellow - red)), "a red square").strict
    assert check(_painted("square", red), "a red square").strict
    # red at 70 % brightness: its inside on no anchor's line (OTHER_COLOUR), its anti-aliased rim on red's: one
    # object, red by its rim, whose solid pixels are off the red line: present, not red
    shade = _painted("circle", 0.7 * red)
    largest = checker.find_objects(shade)[0]
    assert (largest.shape, largest.colour, largest.true_colour) == ("circle", "red", False)
    assert [c.label() for c in check(shade, "a red circle").claims] == [
        "✓ a circle",
        "✗ the circle is red (off-red circle)",
    ]
    # alone (no rim to join), a shade is an object of another colour
    labels = checker.segment(shade)
    assert (labels == len(checker.ANCHORS)).sum() > 0.5 * (labels >= 0).sum()
    # red a little darker (85 %): 34 off the red line, within the tolerance
    assert check(_painted("circle", 0.85 * red), "a red circle").strict
    # a gradient from red at the left edge to yellow at the right, across one circle: never "a red circle"
    ramp = np.linspace(0.0, 1.0, 64)[None, :, None]
    gradient = _painted("circle", red + ramp * (yellow - red))
    for colour in ("red", "yellow"):
        assert not check(gradient, f"a {colour} circle").strict
