"""The shapes world's pretrained weights: the world's tokenizers, the seeded builder (shortened), what ships in the
package, and ``fetch-weights --source shapes`` writing it in the real layout through the product's loaders."""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fluxgrpo.cli.app import app
from fluxgrpo.errors import UsageError
from fluxgrpo.lab import build, build_hps
from fluxgrpo.lab.plan import agreement_captions
from fluxgrpo.shapes import world
from fluxgrpo.shapes.shipped import shipped_weights_dir, write_shapes_weights
from fluxgrpo.shapes.tokenizers import WORLD_TEXT_LENGTH, build_world_clip_tokenizer, build_world_t5_tokenizer
from fluxgrpo.weights.layout import CLIP_MANIFEST, HPS_MANIFEST, check_flux_dir, check_hps_dir
from fluxgrpo.weights.manifest import MANIFEST_NAME, Manifest, read_manifest, sha256_file, write_manifest

runner = CliRunner()


def test_world_tokenizers_know_every_world_word_whole():
    clip, t5 = build_world_clip_tokenizer(), build_world_t5_tokenizer()
    for word in world.VOCABULARY:
        assert clip.tokenize(word) == [f"{word}</w>"]
        assert t5.tokenize(word) == [f"▁{word}"]
    longest = max((c.text() for c in world.all_captions()), key=lambda t: len(t5(t).input_ids))
    assert len(t5(longest).input_ids) <= WORLD_TEXT_LENGTH  # no caption of the world is cut
    assert clip.tokenize("xyz") == ["x", "y", "z</w>"]  # any other text is still spelled


def test_hard_negative_changes_one_claim_and_stays_seen():
    rng = random.Random(0)
    for text in world.split().train[:60]:
        negative = build_hps.hard_negative(text, rng)
        if negative is None:
            continue
        assert negative != text and world.combination_kind(negative) == "seen"
        original, changed = world.parse_caption(text), world.parse_caption(negative)
        assert original.family == changed.family


def test_a_broad_hps_learns_from_half_the_other_captions_and_is_measured_on_the_rest():
    train = list(world.split().train)
    assert build_hps.hps_caption_list(build.QUICK_PLAN) == train
    broad = build_hps.hps_caption_list(replace(build.QUICK_PLAN, hps_captions="broad"))
    measured = agreement_captions()
    assert broad[: len(train)] == train and len(set(broad)) == len(broad)
    assert not set(measured) & set(broad)  # agreement is read on captions neither HPS learnt from
    assert set(world.prompt_set("shapes-heldout")) <= set(measured)
    assert len(broad) + len(measured) == len(world.all_captions())  # every caption on one side
    assert abs((len(broad) - len(train)) - (len(measured) - 30)) <= 1  # the other captions halved
    assert any(world.combination_kind(text) == "novel" for text in broad)  # pairings the policy never draws
    assert agreement_captions() == measured  # seeded: the same split every time


def test_the_decoders_loss_weighs_an_object_and_its_one_pixel_rim():
    import numpy as np

    image = np.full((1, 5, 5, 3), world.BACKGROUND, dtype=np.uint8)
    image[0, 1, 1] = world.COLOURS["green"]  # one object pixel near the corner
    image[0, 4, 4] = [235, 235, 235]  # off-white: background (an anti-aliasing tint under the threshold)
    weights = build.object_weights(image, 8.0)[0, 0]
    expected = torch.ones(5, 5)
    expected[0:3, 0:3] = 9.0  # the pixel and its 8 neighbours
    assert weights.shape == (5, 5) and torch.equal(weights, expected)


@pytest.fixture(scope="module")
def quick_build(tmp_path_factory):
    out = tmp_path_factory.mktemp("shapes-build")
    info = build.build(out, build.QUICK_PLAN)
    return out, info


def test_shortened_build_writes_every_part_and_its_record(quick_build):
    out, info = quick_build
    assert (out / build.FLUX_SUBDIR / "model_index.json").is_file()
    assert json.loads((out / build.BUILD_INFO).read_text()) == info
    vae_config = json.loads((out / build.FLUX_SUBDIR / "vae" / "config.json").read_text())
    # the latent normalisation is measured on the dataset's latents, as FLUX's was
    assert vae_config["shift_factor"] == info["vae"]["shift_factor"]
    assert vae_config["scaling_factor"] == info["vae"]["scaling_factor"] > 0
    assert set(info["seconds"]) == {"render", "vae", "transformer", "distillation", "hps", "total"}


def test_the_same_seed_rebuilds_the_same_files(quick_build, tmp_path):
    out, _ = quick_build
    build.build(tmp_path, build.QUICK_PLAN)
    for name in ("transformer/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors"):
        assert sha256_file(tmp_path / build.FLUX_SUBDIR / name) == sha256_file(out / build.FLUX_SUBDIR / name)
    hps_a = torch.load(out / build.HPS_SUBDIR / "HPS_v2.1_compressed.pt", weights_only=True)["state_dict"]
    hps_b = torch.load(tmp_path / build.HPS_SUBDIR / "HPS_v2.1_compressed.pt", weights_only=True)["state_dict"]
    assert all(torch.equal(hps_a[k], hps_b[k]) for k in hps_a)


def test_the_hps_stage_alone_rebuilds_the_same_hps_on_a_finished_build(quick_build, tmp_path, capsys):
    out, info = quick_build
    copy = tmp_path / "build"
    shutil.copytree(out, copy)
    (copy / build.HPS_SUBDIR / "HPS_v2.1_compressed.pt").unlink()
    rebuilt = build.rebuild_hps(copy, build.QUICK_PLAN)
    alone = torch.load(copy / build.HPS_SUBDIR / "HPS_v2.1_compressed.pt", weights_only=True)["state_dict"]
    whole = torch.load(out / build.HPS_SUBDIR / "HPS_v2.1_compressed.pt", weights_only=True)["state_dict"]
    assert alone.keys() == whole.keys() and all(torch.equal(alone[k], whole[k]) for k in whole)
    assert rebuilt["hps"] == {**info["hps"], "rebuilt_alone": True}
    assert json.loads((copy / build.BUILD_INFO).read_text()) == rebuilt
    assert rebuilt["seconds"]["vae"] == info["seconds"]["vae"]  # the other stages' record is kept
    # a build made with another plan for the base model is refused: the HPS would be judged on the wrong model
    with pytest.raises(UsageError, match="transformer_steps differ"):
        build.rebuild_hps(copy, replace(build.QUICK_PLAN, transformer_steps=3))
    with pytest.raises(UsageError, match="needs a finished build"):
        build.rebuild_hps(tmp_path / "empty", build.QUICK_PLAN)
    # an HPS taught on broader captions is a stage-5 setting: rebuilt alone on the same base model, and new
    broad = build.rebuild_hps(copy, replace(build.QUICK_PLAN, hps_captions="broad"))
    assert broad["plan"]["hps_captions"] == "broad"
    assert broad["hps"]["judged_samples"] == info["hps"]["judged_samples"]
    other = torch.load(copy / build.HPS_SUBDIR / "HPS_v2.1_compressed.pt", weights_only=True)["state_dict"]
    assert any(not torch.equal(other[k], whole[k]) for k in whole)
    capsys.readouterr()  # the stage's own progress above
    assert build.main(["--out", str(tmp_path / "empty"), "--only", "hps", "--quick"]) == 2  # one line, no traceback
    assert capsys.readouterr().err.startswith("error: --only hps needs a finished build")


def test_fetched_build_loads_through_the_products_own_loaders(quick_build, tmp_path):
    from fluxgrpo.models.flux import encode_prompts, load_text_encoders, load_transformer
    from fluxgrpo.rewards.hpsv2 import HpsV2Reward

    out, _ = quick_build
    written = write_shapes_weights(tmp_path / "flux", tmp_path / "hps", source=out)
    assert set(written) == {"flux", "hps", "clip"}
    assert check_flux_dir(tmp_path / "flux").complete
    assert all(part.complete and part.source == "shapes" for part in check_hps_dir(tmp_path / "hps"))
    assert read_manifest(tmp_path / "flux").source == "shapes"

    encoders = load_text_encoders(tmp_path / "flux")
    encoded = encode_prompts(encoders, ["two blue triangles"], WORLD_TEXT_LENGTH)
    assert tuple(encoded.prompt_embeds.shape) == (1, WORLD_TEXT_LENGTH, 32)
    assert load_transformer(tmp_path / "flux").config.joint_attention_dim == 32
    reward = HpsV2Reward(tmp_path / "hps")
    scores = reward(torch.rand(2, 3, 64, 64), ["a red circle", "a red circle"])
    assert scores.shape == (2,) and torch.isfinite(scores).all()


def test_shapes_never_overwrites_hub_weights(quick_build, tmp_path):
    out, _ = quick_build
    flux_dir = tmp_path / "flux"
    flux_dir.mkdir()
    write_manifest(flux_dir, Manifest(part="flux", source="hf", files=[]), MANIFEST_NAME)
    with pytest.raises(Exception, match="refusing to overwrite them with shapes ones"):
        write_shapes_weights(flux_dir, tmp_path / "hps", parts=["flux"], source=out)


SHIPPED = shipped_weights_dir()
needs_shipped = pytest.mark.skipif(
    not (SHIPPED / build.FLUX_SUBDIR).is_dir(), reason="the shapes weights are not built into this checkout"
)


@needs_shipped
def test_shipped_files_fit_the_budget():
    total = sum(p.stat().st_size for p in SHIPPED.rglob("*") if p.is_file())
    assert total <= 30 * 2**20


@needs_shipped
def test_fetch_weights_source_shapes_writes_the_real_layout_offline():
    result = runner.invoke(app, ["fetch-weights", "--source", "shapes", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["source"] == "shapes"
    assert {row["part"]: row["complete"] for row in report["parts"]} == {"flux": True, "hps": True, "clip": True}
    assert read_manifest(Path("data/flux")).source == "shapes"
    assert read_manifest(Path("hps_ckpt"), HPS_MANIFEST).source == "shapes"
    assert read_manifest(Path("hps_ckpt"), CLIP_MANIFEST).source == "shapes"
    shipped = SHIPPED / build.FLUX_SUBDIR / "transformer" / "diffusion_pytorch_model.safetensors"
    fetched = Path("data/flux/transformer/diffusion_pytorch_model.safetensors")
    assert sha256_file(fetched) == sha256_file(shipped)
    # tiny replaces an earlier shapes folder (both are written offline), and shapes replaces tiny
    assert runner.invoke(app, ["fetch-weights", "--source", "tiny", "--only", "flux"]).exit_code == 0
    assert read_manifest(Path("data/flux")).source == "tiny"


def test_fetch_weights_source_shapes_refuses_hub_flags_and_seed():
    for extra in (["--seed", "1"], ["--revision", "main"]):
        result = runner.invoke(app, ["fetch-weights", "--source", "shapes", *extra])
        assert result.exit_code == 2
        assert extra[0] in result.output
    result = runner.invoke(app, ["fetch-weights", "--source", "shapes", "--only", "pickscore"])
    assert result.exit_code == 2 and "for --source shapes" in result.output


def test_guidance_distillation_learns_the_teachers_classifier_free_guided_velocity():
    """At guidance 1 the target v_u + 1·(v_c − v_u) is the teacher's conditional velocity, so a student that starts
    as the teacher has nothing to learn (its first loss is 0: the conditional rows are paired with their own
    captions); at guidance 3 the target leaves v_c by 2·(v_c − v_u), which the first loss measures."""

    from diffusers import FluxTransformer2DModel

    from fluxgrpo.shapes.sizes import WORLD_TRANSFORMER_CONFIG

    clip, clip_tokenizer, t5, t5_tokenizer = build.build_text_encoders(3)
    captions = ["a red circle", "two blue triangles", "a square left of a circle"]
    token_ids = build.tokenize_captions(clip_tokenizer, t5_tokenizer, [*captions, ""])
    torch.manual_seed(0)
    teacher = FluxTransformer2DModel(**WORLD_TRANSFORMER_CONFIG)
    latents = torch.randn(6, 16, 8, 8)
    index = [0, 1, 2, 0, 1, 2]
    plan = replace(build.QUICK_PLAN, distill_steps=1, transformer_batch=4)

    def first_loss(guidance: float) -> float:
        fixed = replace(plan, distill_guidance_low=guidance, distill_guidance_high=guidance)
        _, losses = build.distill_guidance(teacher, clip, t5, latents, index, token_ids, fixed)
        return losses[0]

    assert first_loss(1.0) < 1e-10
    assert first_loss(3.0) > 1e-6


def test_sample_defaults_to_the_world_models_own_size_and_text_length(tmp_path):
    from PIL import Image

    from fluxgrpo.sample import model_sample_defaults

    write_shapes_weights(tmp_path / "flux", tmp_path / "hps", parts=["flux"])
    assert model_sample_defaults(tmp_path / "flux") == (64, WORLD_TEXT_LENGTH)
    assert model_sample_defaults(tmp_path / "nothing") == (720, 512)  # FLUX.1-dev's; the request then names the fix
    out = tmp_path / "samples"
    args = ["sample", "--model", str(tmp_path / "flux"), "--prompt", "two red squares", "--steps", "2", "--json"]
    result = runner.invoke(app, [*args, "--out", str(out), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert (
        "trained at 64x64 pixels and 12 T5 tokens and evaluated with 12 steps at guidance 1.75: its own are the "
        "defaults" in result.stderr
    )
    index = json.loads((out / "index.json").read_text())
    with Image.open(out / index["images"][0]["file"]) as image:
        assert image.size == (64, 64)


def test_shipped_text_encoders_carry_every_part_of_the_heldout_captions():
    """The T5 the shipped transformer reads codes each part of a held-out caption (novel combinations too) linearly,
    each colour or shape word knows where a relation puts its object, and the transformer reads the relation words
    (docs/results/shapes-world.md, "Relations")."""
    from fluxgrpo.lab.capacity import CAPTION_SLOTS, capacity

    report = capacity(shipped_weights_dir() / build.FLUX_SUBDIR, images=16)
    assert set(report["t5_slot_probe_heldout"]) == set(CAPTION_SLOTS)
    # 0.92 at the least on the quadrant build (a novel caption's second shape), 0.95 on the first world's
    assert all(v >= 0.9 for probe in report["t5_slot_probe_heldout"].values() for v in probe.values())
    losses = report["flow_loss"]
    assert all(0 < v < 1 for v in losses.values())
    # FLUX's transformer reads the text tokens without their order, so each word must carry where its object goes
    # (0.94 shipped; 0.47 before the text stage) and the transformer must read the relation words (told backwards,
    # the flow loss rises by 0.15 shipped; by nothing before): results/shapes-world.md, "Relations"
    assert report["t5_word_knows_its_object_leads_heldout"] >= 0.85
    relation = report["relation_renders_flow_loss"]
    assert relation["direction_swapped"] > relation["true_caption"] + 0.05
    assert relation["axis_swapped"] > relation["true_caption"] + 0.02


def test_a_build_stopped_after_a_stage_resumes_to_the_same_files(quick_build, tmp_path):
    from fluxgrpo.lab import stages

    out, info = quick_build
    partial = build.build(tmp_path, build.QUICK_PLAN, stop_after="transformer")
    assert set(partial["seconds"]) == {"render", "vae", "transformer"} and not (tmp_path / build.BUILD_INFO).exists()
    assert stages.finished(tmp_path, "vae", build.QUICK_PLAN) is not None
    assert stages.finished(tmp_path, "vae", replace(build.QUICK_PLAN, vae_steps=3)) is None  # another plan: rebuilt
    resumed = build.build(tmp_path, build.QUICK_PLAN, resume=True)
    assert resumed["vae"] == info["vae"] and resumed["transformer"] == info["transformer"]
    for name in ("transformer/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors"):
        assert sha256_file(tmp_path / build.FLUX_SUBDIR / name) == sha256_file(out / build.FLUX_SUBDIR / name)


@pytest.mark.parametrize("record", ["not json", "{}", '{"plan": {}}'])
def test_the_hps_stage_alone_refuses_a_damaged_record_in_one_line(quick_build, tmp_path, capsys, record):
    out, _ = quick_build
    copy = tmp_path / "build"
    shutil.copytree(out, copy)
    (copy / build.BUILD_INFO).write_text(record)
    assert build.main(["--out", str(copy), "--only", "hps", "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --only hps: ") and "rebuild every stage" in err and len(err.splitlines()) == 1
