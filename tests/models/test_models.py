"""Loading FLUX parts and the rewards from the standard layout (tiny weights), and the HPSv2 scoring math."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from fluxgrpo.errors import FluxgrpoError, UsageError
from fluxgrpo.weights.layout import HPS_CHECKPOINT, HPS_MANIFEST, OPEN_CLIP_WEIGHTS, REWARD_ARCH_FILE
from fluxgrpo.weights.manifest import Manifest, describe_files, write_manifest

PROMPTS = ["a red fox curled up in the snow", "an old lighthouse in a storm", "a bowl of ramen"]


@pytest.fixture(scope="module")
def hps(tiny_weights):
    from fluxgrpo.rewards.hpsv2 import HpsV2Reward

    return HpsV2Reward(tiny_weights.hps_dir, device="cpu")


@pytest.fixture(scope="module")
def pipeline(tiny_weights):
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(tiny_weights.flux_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _uint8_images(count: int, height: int, width: int, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)) for _ in range(count)]


def _as_tensor(images: list[Image.Image]) -> torch.Tensor:
    # the exact values ToTensor produces: uint8 / 255
    return torch.stack([torch.from_numpy(np.array(im)).permute(2, 0, 1).float() / 255 for im in images])


# --- FLUX loaders -----------------------------------------------------------------------------------------------


def test_loaders_honour_dtype_and_config(tiny_weights):
    from fluxgrpo.models.flux import load_scheduler_config, load_text_encoders, load_transformer, load_vae

    transformer = load_transformer(tiny_weights.flux_dir, dtype=torch.bfloat16)
    assert next(transformer.parameters()).dtype == torch.bfloat16
    assert len(transformer.transformer_blocks) == 2 and len(transformer.single_transformer_blocks) == 2
    vae = load_vae(tiny_weights.flux_dir)
    assert next(vae.parameters()).dtype == torch.float32 and not vae.training
    encoders = load_text_encoders(tiny_weights.flux_dir)
    assert (encoders.embed_dim, encoders.pooled_dim) == (32, 32)
    assert not any(p.requires_grad for p in encoders.t5.parameters())
    config = load_scheduler_config(tiny_weights.flux_dir)
    assert (config["shift"], config["use_dynamic_shifting"]) == (3.0, True)


def test_encode_prompts_matches_flux_pipeline(tiny_weights, pipeline):
    from fluxgrpo.models.flux import encode_prompts, load_text_encoders

    encoders = load_text_encoders(tiny_weights.flux_dir)
    ours = encode_prompts(encoders, PROMPTS, max_sequence_length=32)
    embeds, pooled, _ = pipeline.encode_prompt(PROMPTS, prompt_2=None, max_sequence_length=32)
    assert ours.prompt_embeds.shape == (3, 32, 32) and ours.pooled.shape == (3, 32)
    torch.testing.assert_close(ours.prompt_embeds, embeds, rtol=0, atol=1e-5)
    torch.testing.assert_close(ours.pooled, pooled, rtol=0, atol=1e-5)
    assert ours.truncated == [False, False, False]


def test_encode_prompts_flags_prompts_longer_than_the_sequence(tiny_weights):
    from fluxgrpo.models.flux import encode_prompts, load_text_encoders, t5_token_counts

    encoders = load_text_encoders(tiny_weights.flux_dir)
    # "a cat" is ▁a ▁cat </s> = 3 tokens; 7 known words + </s> = 8 tokens: fits 8 exactly; 8 words + </s> = 9 does not
    prompts = ["a cat", "a red cat on a big chair", "a red cat on a big old chair"]
    assert t5_token_counts(encoders, prompts) == [3, 8, 9]
    assert encode_prompts(encoders, prompts, max_sequence_length=8).truncated == [False, False, True]


def test_decode_latents_matches_the_pipeline_post_processing(tiny_weights):
    from diffusers.image_processor import VaeImageProcessor

    from fluxgrpo.models.flux import decode_latents, load_vae

    vae = load_vae(tiny_weights.flux_dir)
    latents = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        images = decode_latents(vae, latents)
        # FluxPipeline: latents / scaling_factor + shift_factor → decode → postprocess to [0, 1]
        reference = VaeImageProcessor().postprocess(
            vae.decode(latents / 0.3611 + 0.1159, return_dict=False)[0], output_type="pt"
        )
    assert images.shape == (2, 3, 64, 64) and images.dtype == torch.float32
    torch.testing.assert_close(images, reference, rtol=0, atol=1e-6)


# --- HPSv2 preprocessing math -----------------------------------------------------------------------------------


def test_resize_longest_and_pad_centres_the_image():
    from fluxgrpo.rewards.hpsv2 import resize_longest_and_pad

    # 112 x 61 ones → scale 224/112 = 2 → 224 x round(122) = 122 → pad 102 columns: 51 left, 51 right
    out = resize_longest_and_pad(torch.ones(1, 3, 112, 61), 224)
    assert out.shape == (1, 3, 224, 224)
    assert out[..., :51].abs().max() == 0 and out[..., 173:].abs().max() == 0
    torch.testing.assert_close(out[..., 51:173], torch.ones(1, 3, 224, 122), rtol=0, atol=1e-5)
    # 100 x 61 → scale 2.24 → 224 x round(136.64) = 137 → pad 87: 43 left, 44 right
    out = resize_longest_and_pad(torch.ones(1, 3, 100, 61), 224)
    assert out[..., :43].abs().max() == 0 and out[..., 43 + 137 :].abs().max() == 0
    assert out[..., 43].min() > 0.99 and out[..., 43 + 136].min() > 0.99
    # a square at the target size is untouched
    square = torch.rand(2, 3, 224, 224)
    assert torch.equal(resize_longest_and_pad(square, 224), square)


def test_normalize_clip_uses_the_openai_statistics():
    from fluxgrpo.rewards.base import CLIP_MEAN, CLIP_STD, normalize_clip

    mean = torch.tensor(CLIP_MEAN).view(1, 3, 1, 1).expand(1, 3, 2, 2)
    std = torch.tensor(CLIP_STD).view(1, 3, 1, 1).expand(1, 3, 2, 2)
    torch.testing.assert_close(normalize_clip(mean), torch.zeros(1, 3, 2, 2))  # (mean - mean) / std = 0
    torch.testing.assert_close(normalize_clip(mean + std), torch.ones(1, 3, 2, 2))  # std / std = 1
    assert CLIP_MEAN[0] == 0.48145466 and CLIP_STD[2] == 0.27577711


# --- HPSv2 scores -------------------------------------------------------------------------------------------------


def test_tensor_path_equals_pil_path(hps):
    images = _uint8_images(3, 96, 72)
    from_tensor = hps(_as_tensor(images), PROMPTS)
    from_pil = hps.score_pil(images, PROMPTS)
    assert from_tensor.shape == (3,) and from_tensor.dtype == torch.float32
    torch.testing.assert_close(from_tensor, from_pil, rtol=0, atol=1e-5)


def test_scores_equal_a_direct_open_clip_computation(tiny_weights, hps):
    import open_clip
    import torchvision.transforms.functional as TF

    from fluxgrpo.rewards.open_clip_model import reward_model_name

    arch = reward_model_name(tiny_weights.hps_dir)
    model = open_clip.create_model(arch, pretrained=str(tiny_weights.hps_dir / HPS_CHECKPOINT)).eval()
    tokenizer = open_clip.get_tokenizer(arch)
    images = _uint8_images(2, 64, 40, seed=1)
    expected = []
    for image, prompt in zip(images, PROMPTS[:2], strict=True):
        # hpsv2's validation transform with torchvision: ToTensor, longest side to 224, centred pad, normalise
        x = TF.to_tensor(image)
        new_h, new_w = 224, round(40 * 224 / 64)  # 224 x 140
        x = TF.resize(x, [new_h, new_w], interpolation=TF.InterpolationMode.BICUBIC, antialias=True)
        pad_w = 224 - new_w
        x = TF.pad(x, [pad_w // 2, 0, pad_w - pad_w // 2, 0], fill=0)
        x = TF.normalize(x, mean=[0.48145466, 0.4578275, 0.40821073], std=[0.26862954, 0.26130258, 0.27577711])
        with torch.no_grad():
            image_features = model.encode_image(x.unsqueeze(0), normalize=True)
            text_features = model.encode_text(tokenizer([prompt]), normalize=True)
        expected.append((image_features @ text_features.T).item())
    torch.testing.assert_close(hps.score_pil(images, PROMPTS[:2]), torch.tensor(expected), rtol=0, atol=1e-5)


def test_batched_equals_one_at_a_time_and_text_cache_is_used(tiny_weights):
    from fluxgrpo.rewards.hpsv2 import HpsV2Reward

    reward = HpsV2Reward(tiny_weights.hps_dir, batch_size=2)
    images = torch.rand(5, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    prompts = [PROMPTS[i % 3] for i in range(5)]
    batched = reward(images, prompts)
    assert len(reward._text_features) == 3  # five images, three distinct prompts
    singles = torch.cat([reward(images[i : i + 1], [prompts[i]]) for i in range(5)])
    torch.testing.assert_close(batched, singles, rtol=0, atol=1e-5)
    assert batched.abs().max() <= 1  # cosine similarities


def test_reward_checks_its_inputs(hps):
    with pytest.raises(ValueError, match="one prompt per image"):
        hps(torch.rand(2, 3, 64, 64), ["only one"])
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        hps(torch.rand(3, 64, 64), ["a"])


def _copy_hps(tmp_path, tiny_weights):
    hps_dir = tmp_path / "hps"
    shutil.copytree(tiny_weights.hps_dir, hps_dir)
    return hps_dir


def _rewrite_hps_checkpoint(hps_dir, state_dict):
    torch.save({"state_dict": state_dict}, hps_dir / HPS_CHECKPOINT)
    files = describe_files(hps_dir, [HPS_CHECKPOINT, REWARD_ARCH_FILE])
    write_manifest(hps_dir, Manifest(part="hps", source="tiny", files=files), HPS_MANIFEST)


def test_keys_missing_from_the_hps_checkpoint_come_from_the_open_clip_weights(tmp_path, tiny_weights):
    from fluxgrpo.rewards.hpsv2 import load_hps_model

    hps_dir = _copy_hps(tmp_path, tiny_weights)
    full = torch.load(hps_dir / HPS_CHECKPOINT, weights_only=True)["state_dict"]
    initial = torch.load(hps_dir / OPEN_CLIP_WEIGHTS, weights_only=True)
    dropped = {"logit_scale", "visual.conv1.weight"}
    _rewrite_hps_checkpoint(hps_dir, {k: v for k, v in full.items() if k not in dropped})
    model, _ = load_hps_model(hps_dir)
    state = model.state_dict()
    for key in dropped:
        assert torch.equal(state[key], initial[key]), key
    assert torch.equal(state["token_embedding.weight"], full["token_embedding.weight"])
    assert not torch.equal(full["token_embedding.weight"], initial["token_embedding.weight"])


def test_a_checkpoint_for_another_architecture_is_a_clear_error(tmp_path, tiny_weights):
    from fluxgrpo.rewards.hpsv2 import load_hps_model

    hps_dir = _copy_hps(tmp_path, tiny_weights)
    full = torch.load(hps_dir / HPS_CHECKPOINT, weights_only=True)["state_dict"]
    _rewrite_hps_checkpoint(hps_dir, {**full, "visual.extra.weight": torch.zeros(1)})
    with pytest.raises(FluxgrpoError, match=r"unexpected keys.*fetch-weights"):
        load_hps_model(hps_dir)
    _rewrite_hps_checkpoint(hps_dir, {**full, "logit_scale": torch.zeros(3)})
    with pytest.raises(FluxgrpoError, match=r"do not fit.*fetch-weights"):
        load_hps_model(hps_dir)


def test_missing_reward_weights_name_fetch_weights(tmp_path, tiny_weights):
    from fluxgrpo.rewards.hpsv2 import HpsV2Reward

    hps_dir = _copy_hps(tmp_path, tiny_weights)
    (hps_dir / OPEN_CLIP_WEIGHTS).unlink()
    with pytest.raises(FluxgrpoError, match=f"{OPEN_CLIP_WEIGHTS}.*fetch-weights"):
        HpsV2Reward(hps_dir)


def test_architecture_defaults_to_vit_h_14_and_accepts_open_clips_wrapper(tmp_path, tiny_weights):
    from fluxgrpo.rewards.open_clip_model import register_open_clip_config, reward_model_name
    from fluxgrpo.rewards.tiny import TINY_REWARD_CONFIG

    assert reward_model_name(tmp_path) == "ViT-H-14"  # no architecture file: the real weights
    name = register_open_clip_config(TINY_REWARD_CONFIG)
    assert register_open_clip_config({"model_cfg": TINY_REWARD_CONFIG}) == name
    assert reward_model_name(tiny_weights.hps_dir) == name
    with pytest.raises(FluxgrpoError, match="embed_dim"):
        register_open_clip_config({"vision_cfg": {}})


# --- other rewards and the registry -----------------------------------------------------------------------------


def test_brightness_is_the_mean_pixel_value():
    from fluxgrpo.rewards.brightness import BrightnessReward

    images = torch.zeros(2, 3, 4, 4)
    images[0] = 0.25  # every pixel 0.25 → 0.25
    images[1, :, :, 2:] = 1.0  # half the columns 1, half 0 → 0.5
    scores = BrightnessReward()(images.to(torch.bfloat16), ["a", "b"])
    assert scores.dtype == torch.float32
    assert scores.tolist() == [0.25, 0.5]


def test_load_reward_registry(tiny_weights):
    from fluxgrpo.rewards import load_reward, reward_names
    from fluxgrpo.rewards.brightness import BrightnessReward
    from fluxgrpo.rewards.hpsv2 import HpsV2Reward

    assert reward_names()[0] == "hpsv2" and {"pickscore", "clipscore", "brightness"} <= set(reward_names())
    assert isinstance(load_reward("brightness", tiny_weights.hps_dir), BrightnessReward)
    assert isinstance(load_reward("hpsv2", tiny_weights.hps_dir, "cpu"), HpsV2Reward)
    with pytest.raises(UsageError, match="hpsv2, pickscore, "):
        load_reward("no-such-reward", tiny_weights.hps_dir)


def test_hps_runs_in_fp32_by_default_even_where_the_runtime_computes_in_bf16(tiny_weights, hps, monkeypatch):
    # Issue #11.6: accelerators compute FLUX in bf16, but the reward encoders stay fp32 unless --reward-dtype bf16.
    from fluxgrpo.rewards import load_reward
    from fluxgrpo.runtime import device as rt_device

    images = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    full_precision = hps(images, PROMPTS[:2])
    monkeypatch.setattr(rt_device, "compute_dtype", lambda device_type: torch.bfloat16)
    assert torch.equal(load_reward("hpsv2", tiny_weights.hps_dir)(images, PROMPTS[:2]), full_precision)
    mixed = load_reward("hpsv2", tiny_weights.hps_dir, reward_dtype="bf16")(images, PROMPTS[:2])
    assert mixed.dtype == torch.float32
    assert not torch.equal(mixed, full_precision)  # the bf16 branch really ran (cpu autocast: the same branch)
    torch.testing.assert_close(mixed, full_precision, rtol=0, atol=2e-2)
