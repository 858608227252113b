"""The lab's cheap gate before a long build: a candidate world model and its plasticity, in miniature."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import numpy as np
import pytest

from fluxgrpo.lab.candidate import candidate
from fluxgrpo.lab.plan import PLANS
from fluxgrpo.lab.plasticity import PlasticitySettings, fine_tuning_lr, plasticity
from fluxgrpo.shapes.shipped import shipped_weights_dir
from fluxgrpo.shapes.sizes import FLUX_SUBDIR

SHIPPED_FLUX = shipped_weights_dir() / FLUX_SUBDIR
needs_shipped = pytest.mark.skipif(not SHIPPED_FLUX.is_dir(), reason="the shapes weights are not in this checkout")


@needs_shipped
def test_plasticity_judges_fresh_seeds_at_each_step_and_restores_nothing_it_did_not_load():
    settings = PlasticitySettings(pool=4, steps=2, lr=1e-3, batch=2, at=(1,), judge=2)
    report = plasticity(SHIPPED_FLUX, ["three circles", "a red square"], settings)
    assert [entry["step"] for entry in report["history"]] == [0, 1, 2]
    for entry in report["history"]:
        assert set(entry["per_caption"]) == {"three circles", "a red square"}
        assert all(0.0 <= rate <= 1.0 for rate in entry["per_caption"].values())
        assert set(entry["counting"]) == {"three circles"}  # how it fills the quadrants: counting captions only
        assert entry["counting"]["three circles"]["images"] == 2
    assert set(report["best_of_pool"]) == {"three circles", "a red square"}
    assert report["settings"]["judge"] == 2


@needs_shipped
def test_transfer_judges_other_captions_with_the_checker_mean():
    settings = PlasticitySettings(pool=4, steps=1, lr=1e-3, batch=2, at=(), judge=2)
    judged = ["a red circle", "two blue squares", "three triangles"]
    report = plasticity(SHIPPED_FLUX, ["three circles"], settings, judged)
    assert report["judged"] == "3 other captions"
    learnt = report["best_of_pool"]["three circles"] > 0
    assert [entry["step"] for entry in report["history"]] == ([0, 1] if learnt else [0])
    for entry in report["history"]:
        assert set(entry["per_caption"]) == set(judged)  # the fine-tuned caption is not judged
        assert 0.0 <= entry["strict"] <= entry["mean"] <= 1.0  # every claim holding counts 1 in the mean too


@needs_shipped
@pytest.mark.parametrize("guidance", [3.5, 1.75])
def test_the_pool_keeps_the_evaluation_samplers_images_with_their_noise_and_latents(guidance):
    import torch
    from diffusers import FluxPipeline

    from fluxgrpo.lab.measure import sample_with
    from fluxgrpo.lab.plasticity import POOL_SEED, best_of_n
    from fluxgrpo.sampling.generate import initial_latents
    from fluxgrpo.sampling.request import image_seed
    from fluxgrpo.shapes.checker import check

    pipe = FluxPipeline.from_pretrained(SHIPPED_FLUX, dtype=torch.float32, trust_remote_code=False)
    pipe.set_progress_bar_config(disable=True)
    captions = ["a red circle", "three circles"]
    kept = best_of_n(pipe, captions, pool=6, steps=4, guidance=guidance)
    groups = sample_with(pipe, captions, 6, 4, guidance, seed=POOL_SEED)  # the evaluation sampler at that guidance
    for i, (caption, group) in enumerate(zip(captions, groups, strict=True)):
        passing = [j for j, image in enumerate(group) if check(image, caption).strict]
        assert len(kept[caption]) == len(passing)
        for sample, j in zip(kept[caption], passing, strict=True):
            assert np.array_equal(sample.image, group[j])  # the same pixels the evaluation's sampler draws
            assert torch.equal(sample.noise, initial_latents([image_seed(POOL_SEED, i, j)], 64, 64)[0])
            assert sample.latent.shape == sample.noise.shape


@needs_shipped
def test_the_judge_samples_at_the_settings_guidance():
    import torch
    from diffusers import FluxPipeline

    from fluxgrpo.lab.measure import sample_with
    from fluxgrpo.lab.plasticity import JUDGE_SEED, judge_captions
    from fluxgrpo.shapes.checker import check

    pipe = FluxPipeline.from_pretrained(SHIPPED_FLUX, dtype=torch.float32, trust_remote_code=False)
    pipe.set_progress_bar_config(disable=True)
    captions = ["a red circle", "two blue squares"]
    for guidance in (3.5, 1.0):
        judging = judge_captions(pipe, captions, 3, 4, JUDGE_SEED, guidance=guidance)
        groups = sample_with(pipe, captions, 3, 4, guidance, seed=JUDGE_SEED)
        expected = {c: float(np.mean([check(im, c).score for im in g])) for c, g in zip(captions, groups, strict=True)}
        assert judging.mean == expected
    # the guidance reaches the sampler: guidance 1 (the conditional velocity alone) draws other images than 3.5
    images = [sample_with(pipe, captions[:1], 1, 4, g, seed=JUDGE_SEED)[0][0] for g in (3.5, 1.0)]
    assert not np.array_equal(*images)


def _fine_tuned_on_blue_circles(runs: list[PlasticitySettings]) -> tuple[dict, list[dict]]:
    """The shipped transformer's weights, and its weights after fine-tuning on the best of 4 `a blue circle` samples
    under each of ``runs``, every run from the shipped weights."""
    import copy

    import torch
    from diffusers import FluxPipeline

    from fluxgrpo.lab.plasticity import best_of_n, finetune_on

    pipe = FluxPipeline.from_pretrained(SHIPPED_FLUX, dtype=torch.float32, trust_remote_code=False)
    pipe.set_progress_bar_config(disable=True)
    kept = best_of_n(pipe, ["a blue circle"], pool=4, steps=4)
    assert kept["a blue circle"], "the base draws a blue circle in most seeds"
    base = copy.deepcopy(pipe.transformer.state_dict())
    trained = []
    for settings in runs:
        pipe.transformer.load_state_dict(base)
        torch.manual_seed(0)
        finetune_on(pipe, kept, settings)
        trained.append(copy.deepcopy(pipe.transformer.state_dict()))
    return base, trained


@needs_shipped
def test_coupled_fine_tuning_trains_on_the_samplers_own_noise():
    import torch

    runs = [PlasticitySettings(pool=4, steps=2, lr=1e-3, batch=2, at=(), judge=1, coupled=c) for c in (False, True)]
    base, (fresh, coupled) = _fine_tuned_on_blue_circles(runs)
    trained = {False: fresh, True: coupled}
    changed = [name for name in base if not torch.equal(base[name], trained[True][name])]
    assert changed, "coupled fine-tuning moved no weight"
    # the same rows and σ draws either way: only the noise (its own vs fresh) and the latent (the sampler's vs the
    # VAE's encoding of the image) differ, and the weights with them
    assert any(not torch.equal(trained[False][name], trained[True][name]) for name in changed)


@needs_shipped
@pytest.mark.parametrize(("size", "distill_steps", "plan"), [(64, 2, "shipped"), (128, 0, "quadrant")])
def test_a_candidate_is_a_flux_folder_the_plasticity_test_reads(tmp_path, size, distill_steps, plan):
    shortened = replace(PLANS[plan], image_size=size, transformer_steps=2, images=8, threads=1,
                        distill_steps=distill_steps, text_steps=min(PLANS[plan].text_steps, 2))  # fmt: skip
    record = candidate(tmp_path, shortened)
    assert record["plan"] == asdict(shortened)
    assert json.loads((tmp_path / "candidate.json").read_text()) == record
    assert (tmp_path / FLUX_SUBDIR / "model_index.json").is_file()
    settings = PlasticitySettings(pool=2, steps=1, batch=2, at=(), judge=1, size=size)
    report = plasticity(tmp_path / FLUX_SUBDIR, ["three circles"], settings)
    # a two-step candidate draws nothing correct: with nothing to fine-tune on, only the base is judged
    learnt = report["best_of_pool"]["three circles"] > 0
    assert [entry["step"] for entry in report["history"]] == ([0, 1] if learnt else [0])


def test_the_cosine_schedule_is_the_builders_and_constant_keeps_the_rate():
    constant = PlasticitySettings(lr=1e-3, steps=1000)
    assert [fine_tuning_lr(constant, step) for step in (1, 500, 1000)] == [1e-3, 1e-3, 1e-3]
    cosine = replace(constant, schedule="cosine")
    # 50 warm-up steps (5 % of 1,000): step 1 at 1/50 of the rate, step 50 at the full rate
    assert fine_tuning_lr(cosine, 1) == pytest.approx(1e-3 / 50)
    assert fine_tuning_lr(cosine, 50) == pytest.approx(1e-3)
    assert fine_tuning_lr(cosine, 51) == pytest.approx(1e-3)  # the cosine's start
    # halfway through the cosine (step 51 + 475): 0.5 · (1 + cos(π/2)) · 0.9 + 0.1 = 0.55 of the rate
    assert fine_tuning_lr(cosine, 526) == pytest.approx(0.55e-3)
    # the last step: 0.5 · (1 + cos(π · 949/950)) · 0.9 + 0.1, a tenth of the rate and a hair
    assert fine_tuning_lr(cosine, 1000) == pytest.approx(1e-4, abs=1e-8)


@needs_shipped
def test_the_fine_tuning_seed_changes_its_draws_and_nothing_else():
    import torch

    runs = [PlasticitySettings(pool=4, steps=2, lr=1e-3, batch=2, at=(), judge=1, seed=s) for s in (0, 0, 1)]
    base, trained = _fine_tuned_on_blue_circles(runs)
    assert all(torch.equal(trained[0][name], trained[1][name]) for name in base)  # a seed repeats itself
    assert any(not torch.equal(trained[0][name], trained[2][name]) for name in base)
