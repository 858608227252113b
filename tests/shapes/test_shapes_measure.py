"""``python -m fluxgrpo.lab.measure``'s accuracy summary, on the renderer's own images and on wrong ones."""

from __future__ import annotations

import numpy as np

from fluxgrpo.lab.measure import accuracy
from fluxgrpo.shapes import world
from fluxgrpo.shapes.checker import check


def test_accuracy_reports_strict_rates_overall_by_combination_kind_and_by_family():
    seen = next(p for p in world.prompt_set("shapes-heldout") if world.combination_kind(p) == "seen")
    novel = next(p for p in world.prompt_set("shapes-heldout") if world.combination_kind(p) == "novel")
    blank = np.full((64, 64, 3), world.BACKGROUND, dtype=np.uint8)  # no object: every claim fails
    groups = [
        [world.render_caption(seen, 0), world.render_caption(seen, 1)],  # both true
        [world.render_caption(novel, 0), blank],  # one true, one empty
    ]
    results = [[check(image, prompt) for image in group] for prompt, group in zip([seen, novel], groups, strict=True)]
    summary = accuracy([seen, novel], results)
    assert summary["all"]["strict"] == 0.75 and summary["all"]["prompts"] == 2
    assert summary["seen"]["strict"] == 1.0 and summary["novel"]["strict"] == 0.5
    assert summary["groups_with_spread"] == 0.5  # the novel prompt's pair differs, the seen one's does not
    families = {world.parse_caption(seen).family: [1.0, 1.0], world.parse_caption(novel).family: []}
    families[world.parse_caption(novel).family] += [1.0, 0.0]
    assert summary["strict_by_family"] == {f: float(np.mean(v)) for f, v in sorted(families.items())}


def test_claim_breakdown_counts_each_kind_of_claim_and_the_extra_objects():
    from fluxgrpo.lab.measure import claim_breakdown

    prompt = "a red circle left of a blue square"

    def scene(*objects: tuple[str, str, float, float]) -> np.ndarray:
        return world.render(world.Scene(64, [world.PlacedObject(s, c, x, y, 11.0) for s, c, x, y in objects]))

    true = scene(("circle", "red", 16, 40), ("square", "blue", 48, 40))
    swapped = scene(("circle", "red", 48, 40), ("square", "blue", 16, 40))
    extra = scene(("circle", "red", 16, 40), ("square", "blue", 48, 40), ("triangle", "yellow", 32, 12))
    results = [[check(image, prompt) for image in (true, swapped, extra)]]
    breakdown = claim_breakdown([prompt], results)
    # the present and colour claims hold in all three images, the relation in the first and the third
    assert breakdown["claims_held"] == {"colour": 1.0, "present": 1.0, "relation": round(2 / 3, 4)}
    assert breakdown["objects_found_minus_asked"] == round(1 / 3, 4)  # 0, 0 and 1 extra
    # the relation among the images where both objects are drawn; one without the square does not count
    assert (
        breakdown["relation_when_both_drawn"] == round(2 / 3, 4) and breakdown["relation_images_with_both_drawn"] == 3
    )
    lone = scene(("circle", "red", 16, 40))
    alone = claim_breakdown([prompt], [[check(lone, prompt), check(swapped, prompt)]])
    assert alone["relation_when_both_drawn"] == 0.0 and alone["relation_images_with_both_drawn"] == 1
    assert claim_breakdown(["two red circles"], [[check(true, "two red circles")]])["relation_when_both_drawn"] is None


def test_slot_probe_reads_a_linearly_coded_label_and_not_a_random_one():
    from fluxgrpo.lab.capacity import caption_slots, slot_probe

    assert caption_slots("three blue squares") == ("blue", "square", "-", "-", "-", "3")
    assert caption_slots("a circle left of a red square") == ("-", "circle", "red", "square", "left of", "-")
    rng = np.random.default_rng(0)
    labels = [str(i % 3) for i in range(90)]
    coded = np.eye(3)[[int(label) for label in labels]] * 3 + rng.normal(size=(90, 3)) * 0.1
    features = np.hstack([coded, rng.normal(size=(90, 20))])
    assert slot_probe(features[:60], labels[:60], features[60:], labels[60:]) == 1.0
    noise = rng.normal(size=(90, 23))
    assert slot_probe(noise[:60], labels[:60], noise[60:], labels[60:]) < 0.7  # chance is 1/3
