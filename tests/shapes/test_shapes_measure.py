"""``python -m fluxgrpo.shapes.measure``'s accuracy summary, on the renderer's own images and on wrong ones."""

from __future__ import annotations

import numpy as np

from fluxgrpo.shapes import world
from fluxgrpo.shapes.checker import check
from fluxgrpo.shapes.measure import accuracy


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
