"""The lab's HPS agreement: Spearman's ρ of the tiny HPS against the checker, pooled and within each prompt, the
seen and novel combinations apart (hand-worked ranks)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import ClassVar

import numpy as np
import pytest
import torch

from fluxgrpo.lab.measure import hps_agreement
from fluxgrpo.rewards import hpsv2
from fluxgrpo.shapes import world


class _ScoresByPrompt:
    """Stands in for HpsV2Reward: the scores listed for each prompt, in image order."""

    scores: ClassVar[dict[str, list[float]]] = {}

    def __init__(self, hps_dir):
        self.hps_dir = hps_dir

    def __call__(self, pixels, prompts):
        assert pixels.shape[1:] == (3, 64, 64) and len(set(prompts)) == 1
        return torch.tensor(self.scores[prompts[0]])


def test_within_prompt_rho_is_reported_for_seen_and_novel_captions_apart(monkeypatch):
    heldout = [world.parse_caption(text) for text in world.prompt_set("shapes-heldout")]
    seen = next(c.text() for c in heldout if not world.is_novel(c))
    novel = next(c.text() for c in heldout if world.is_novel(c))
    flat = "a red square"  # every image the same checker score: no within-prompt ρ, still pooled
    _ScoresByPrompt.scores = {seen: [1.0, 2.0, 3.0], novel: [3.0, 2.0, 1.0], flat: [5.0, 5.0, 5.0]}
    monkeypatch.setattr(hpsv2, "HpsV2Reward", _ScoresByPrompt)
    rule = {seen: [0.0, 0.5, 1.0], novel: [0.0, 0.5, 1.0], flat: [1.0, 1.0, 1.0]}
    prompts = [seen, novel, flat]
    groups = [[np.zeros((64, 64, 3), np.uint8)] * 3 for _ in prompts]
    results = [[SimpleNamespace(score=s) for s in rule[p]] for p in prompts]
    report = hps_agreement("unused", prompts, groups, results)
    # seen: the HPS orders the three as the checker (ρ 1); novel: the reverse (ρ −1)
    assert report["spearman_within_prompt_seen_mean"] == 1.0
    assert report["spearman_within_prompt_novel_mean"] == -1.0
    assert report["spearman_within_prompt_mean"] == 0.0
    assert report["prompts_with_spread"] == 2
    # pooled over 9 images: HPS 1 2 3 3 2 1 5 5 5 against the checker 0 .5 1 0 .5 1 1 1 1, by hand from the ranks
    hps_ranks = np.array([1.5, 3.5, 5.5, 5.5, 3.5, 1.5, 8, 8, 8])
    rule_ranks = np.array([1.5, 3.5, 7, 1.5, 3.5, 7, 7, 7, 7])
    expected = np.corrcoef(hps_ranks, rule_ranks)[0, 1]
    assert report["spearman_pooled"] == pytest.approx(expected, abs=1e-4)


def test_every_image_measure_draws_is_drawn_at_its_guidance(monkeypatch, tmp_path):
    from fluxgrpo.lab import measure as lab_measure

    drawn: list[tuple[int, float]] = []

    def fake_sample(flux_dir, prompts, per_prompt, steps, guidance=3.5, seed=0):
        drawn.append((len(prompts), guidance))
        return [[np.zeros((64, 64, 3), np.uint8)] * per_prompt for _ in prompts]

    monkeypatch.setattr(lab_measure, "sample_images", fake_sample)
    monkeypatch.setattr(lab_measure, "vae_reconstruction_strict", lambda flux_dir, layout: 1.0)
    monkeypatch.setattr(lab_measure, "agreement_captions", lambda: ["a red square", "a blue circle"])
    monkeypatch.setattr(lab_measure, "hps_agreement", lambda hps_dir, captions, groups, results: {})
    report = lab_measure.measure(tmp_path, tmp_path, per_prompt=1, steps=2, agreement="wide", guidance=1.75)
    assert report["settings"]["guidance"] == 1.75
    # the held-out captions, the training captions' sample and the agreement captions, each at the asked guidance
    assert [g for _, g in drawn] == [1.75, 1.75, 1.75] and drawn[-1][0] == 2
    drawn.clear()
    assert lab_measure.measure(tmp_path, None, per_prompt=1, steps=2)["settings"]["guidance"] == 3.5
    assert [g for _, g in drawn] == [3.5, 3.5]
