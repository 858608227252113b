"""``fetch-weights --source tiny``: the real layout, loadable by diffusers and open_clip themselves, complete."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from fluxgrpo.cli.app import app
from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.weights.layout import (
    CLIP_MANIFEST,
    HPS_CHECKPOINT,
    HPS_MANIFEST,
    OPEN_CLIP_WEIGHTS,
    REWARD_ARCH_FILE,
    check_flux_dir,
    check_hps_dir,
)
from fluxgrpo.weights.manifest import Manifest, read_manifest, sha256_file, write_manifest

runner = CliRunner()


def test_layout_checks_report_complete(tiny_weights):
    flux = check_flux_dir(tiny_weights.flux_dir)
    assert flux.complete, flux.problems
    assert flux.source == "tiny"
    hps, clip = check_hps_dir(tiny_weights.hps_dir)
    assert (hps.name, hps.complete, hps.source) == ("hps", True, "tiny")
    assert (clip.name, clip.complete, clip.source) == ("clip", True, "tiny")


def test_manifests_list_every_file_with_its_hash(tiny_weights):
    manifest = read_manifest(tiny_weights.flux_dir)
    on_disk = {
        p.relative_to(tiny_weights.flux_dir).as_posix()
        for p in tiny_weights.flux_dir.rglob("*")
        if p.is_file() and p.name != "manifest.json"
    }
    assert {f.path for f in manifest.files} == on_disk
    assert "transformer/config.json" in on_disk and "tokenizer_2/tokenizer.json" in on_disk
    for entry in manifest.files:
        assert entry.sha256 == sha256_file(tiny_weights.flux_dir / entry.path)
    hps = read_manifest(tiny_weights.hps_dir, HPS_MANIFEST)
    clip = read_manifest(tiny_weights.hps_dir, CLIP_MANIFEST)
    assert sorted(f.path for f in hps.files) == sorted([HPS_CHECKPOINT, REWARD_ARCH_FILE])
    assert [f.path for f in clip.files] == [OPEN_CLIP_WEIGHTS]


def test_flux_pipeline_loads_through_diffusers_and_makes_an_image(tiny_weights):
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(tiny_weights.flux_dir)
    pipe.set_progress_bar_config(disable=True)
    image = pipe(
        "a red fox in the snow",
        height=64,
        width=64,
        num_inference_steps=2,
        max_sequence_length=32,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    ).images
    assert image.shape == (1, 3, 64, 64)
    assert torch.isfinite(image).all() and image.min() >= 0 and image.max() <= 1


def test_tiny_flux_has_the_shapes_the_rest_of_the_code_relies_on(tiny_weights):
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel

    transformer = FluxTransformer2DModel.from_pretrained(tiny_weights.flux_dir, subfolder="transformer")
    vae = AutoencoderKL.from_pretrained(tiny_weights.flux_dir, subfolder="vae")
    clip = CLIPTextModel.from_pretrained(tiny_weights.flux_dir / "text_encoder")
    t5 = T5EncoderModel.from_pretrained(tiny_weights.flux_dir / "text_encoder_2")
    # 2 double blocks x 4 q/k norms (image q, k + text q, k) + 2 single blocks x 2 = 12
    assert sum(isinstance(m, torch.nn.RMSNorm) for m in transformer.modules()) == 12
    assert transformer.config.joint_attention_dim == t5.config.d_model
    assert transformer.config.pooled_projection_dim == clip.config.hidden_size
    assert transformer.config.in_channels == 4 * vae.config.latent_channels == 64
    assert transformer.config.guidance_embeds is True
    assert 2 ** (len(vae.config.block_out_channels) - 1) == 8
    assert (vae.config.scaling_factor, vae.config.shift_factor) == (0.3611, 0.1159)


def test_open_clip_loads_the_tiny_hps_checkpoint_itself(tiny_weights):
    import open_clip

    from fluxgrpo.rewards.open_clip_model import reward_model_name

    arch = reward_model_name(tiny_weights.hps_dir)
    assert arch != "ViT-H-14"
    hps_file = tiny_weights.hps_dir / HPS_CHECKPOINT
    model = open_clip.create_model(arch, pretrained=str(hps_file))
    saved = torch.load(hps_file, weights_only=True)
    assert set(saved) == {"state_dict"}
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved["state_dict"][key]), key


def test_open_clip_weights_file_is_a_plain_state_dict_of_other_values(tiny_weights):
    initial = torch.load(tiny_weights.hps_dir / OPEN_CLIP_WEIGHTS, weights_only=True)
    hps = torch.load(tiny_weights.hps_dir / HPS_CHECKPOINT, weights_only=True)["state_dict"]
    assert "state_dict" not in initial
    assert set(initial) == set(hps)
    assert not torch.equal(initial["visual.conv1.weight"], hps["visual.conv1.weight"])


def test_same_seed_writes_identical_weights_and_another_seed_does_not(tmp_path, tiny_weights):
    from fluxgrpo.rewards.tiny_weights import write_tiny_weights

    write_tiny_weights(tmp_path / "same" / "flux", tmp_path / "same" / "hps", seed=0)
    write_tiny_weights(tmp_path / "other" / "flux", tmp_path / "other" / "hps", seed=1)
    rel = "transformer/diffusion_pytorch_model.safetensors"
    assert sha256_file(tmp_path / "same" / "flux" / rel) == sha256_file(tiny_weights.flux_dir / rel)
    assert sha256_file(tmp_path / "other" / "flux" / rel) != sha256_file(tiny_weights.flux_dir / rel)
    same = torch.load(tmp_path / "same" / "hps" / HPS_CHECKPOINT, weights_only=True)["state_dict"]
    base = torch.load(tiny_weights.hps_dir / HPS_CHECKPOINT, weights_only=True)["state_dict"]
    assert all(torch.equal(same[k], base[k]) for k in base)


def test_missing_component_is_reported_and_loading_names_fetch_weights(tmp_path, tiny_weights):
    from fluxgrpo.models.flux import load_transformer, load_vae

    flux = tmp_path / "flux"
    shutil.copytree(tiny_weights.flux_dir, flux)
    shutil.rmtree(flux / "vae")
    status = check_flux_dir(flux)
    assert not status.complete
    assert any("vae/" in problem for problem in status.problems)
    with pytest.raises(FluxgrpoError, match=r"vae/.*fluxgrpo fetch-weights"):
        load_vae(flux)
    with pytest.raises(FluxgrpoError, match="fluxgrpo fetch-weights"):
        load_transformer(tmp_path / "nowhere")


def test_missing_reward_file_is_reported(tmp_path, tiny_weights):
    hps = tmp_path / "hps"
    shutil.copytree(tiny_weights.hps_dir, hps)
    (hps / OPEN_CLIP_WEIGHTS).unlink()
    hps_status, clip_status = check_hps_dir(hps)
    assert hps_status.complete and not clip_status.complete
    assert "fetch-weights" in clip_status.fix


def test_rewriting_a_tiny_folder_is_allowed(tmp_path, tiny_weights):
    from fluxgrpo.rewards.tiny_weights import write_tiny_weights

    flux, hps = tmp_path / "flux", tmp_path / "hps"
    shutil.copytree(tiny_weights.flux_dir, flux)
    shutil.copytree(tiny_weights.hps_dir, hps)
    (flux / "stale.txt").write_text("left over")
    write_tiny_weights(flux, hps, seed=3)
    assert not (flux / "stale.txt").exists()
    assert check_flux_dir(flux).complete and all(s.complete for s in check_hps_dir(hps))


def test_real_weights_are_never_overwritten(tmp_path, tiny_weights):
    from fluxgrpo.rewards.tiny_weights import write_tiny_weights

    placed_by_hand = tmp_path / "by-hand"
    (placed_by_hand / "transformer").mkdir(parents=True)
    with pytest.raises(FluxgrpoError, match="--flux-dir"):
        write_tiny_weights(placed_by_hand, tmp_path / "hps")
    assert (placed_by_hand / "transformer").is_dir()

    fetched = tmp_path / "fetched-hps"
    fetched.mkdir()
    (fetched / HPS_CHECKPOINT).write_bytes(b"pretend real")
    write_manifest(fetched, Manifest(part="hps", source="hf", files=[]), HPS_MANIFEST)
    with pytest.raises(FluxgrpoError, match=r"hf weights.*--hps-dir"):
        write_tiny_weights(tmp_path / "flux", fetched)
    assert (fetched / HPS_CHECKPOINT).read_bytes() == b"pretend real"


def test_tiny_tokenizers_cover_english_without_unknown_tokens():
    import open_clip

    from fluxgrpo.models.tiny import build_tiny_clip_tokenizer, build_tiny_t5_tokenizer

    t5 = build_tiny_t5_tokenizer()
    pieces = t5.convert_ids_to_tokens(t5("a cat on Zxq.").input_ids)
    # known words are one piece each; the unknown word is spelled; "</s>" closes the sequence
    assert pieces == ["▁a", "▁cat", "▁on", "▁Z", "x", "q", ".", "</s>"]
    clip = build_tiny_clip_tokenizer()
    assert len(clip) == 514
    # Ids below 512 are the full CLIP vocabulary's: single-letter words are single tokens in both.
    ours = clip("a b z").input_ids[1:-1]
    full = open_clip.get_tokenizer("ViT-H-14")(["a b z"])[0][1:4].tolist()
    assert ours == full


def test_cli_fetch_weights_tiny_writes_complete_parts(tmp_path):
    result = runner.invoke(
        app,
        [
            "fetch-weights",
            "--source",
            "tiny",
            "--flux-dir",
            str(tmp_path / "f"),
            "--hps-dir",
            str(tmp_path / "h"),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert [p["part"] for p in document["parts"]] == ["flux", "hps", "clip", "pickscore", "imagereward", "hpsv3"]
    assert all(p["complete"] and p["source"] == "tiny" and p["bytes"] > 0 for p in document["parts"])


def test_cli_fetch_weights_table_and_usage_errors(tmp_path):
    result = runner.invoke(
        app, ["fetch-weights", "--source", "tiny", "--flux-dir", str(tmp_path / "f"), "--hps-dir", str(tmp_path / "h")]
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.count("complete") == 6  # flux, hps, clip, pickscore, imagereward, hpsv3
    hub = runner.invoke(app, ["fetch-weights", "--source", "hf", "--seed", "1", "--flux-dir", str(tmp_path / "x")])
    assert hub.exit_code == 2
    assert "--seed applies to --source tiny only" in hub.stderr
    assert not (tmp_path / "x").exists()
    bogus = runner.invoke(app, ["fetch-weights", "--source", "nowhere"])
    assert bogus.exit_code == 2 and "--source" in bogus.stderr
