"""PickScore: the tensor path against the CLIP processor + CLIPModel path, per-prompt scoring, logit_scale, batching.

Uses the tiny PickScore that ``fetch-weights --source tiny`` writes into ``<hps_dir>/pickscore`` (the session's
``tiny_weights`` fixture): a random transformers CLIPModel, the tiny CLIP tokenizer and the real processor settings.
"""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.weights.layout import check_pickscore_dir, pickscore_dir

PROMPTS = ["a red fox in the snow", "a castle on a hill at night", "two cats on a sofa", "a bowl of apples"]
# The processor moves pixels by at most 8-bit rounding (half a level, after the resize and once more inside it)
# from our float path: allow 1.5 levels of 255, measured in the normalised units the model sees.
PIXEL_LEVELS = 1.5


@pytest.fixture(scope="module")
def reward(tiny_weights):
    from fluxgrpo.rewards.pickscore import PickScoreReward

    torch.set_num_threads(1)
    return PickScoreReward(pickscore_dir(tiny_weights.hps_dir))


@pytest.fixture(scope="module")
def processor_parts(tiny_weights):
    from transformers import CLIPImageProcessor, CLIPModel, CLIPTokenizer

    folder = pickscore_dir(tiny_weights.hps_dir)
    processor = folder / "processor"
    return (
        CLIPImageProcessor.from_pretrained(processor),
        CLIPTokenizer.from_pretrained(processor),
        CLIPModel.from_pretrained(folder / "model").eval(),
    )


def blocky_image(height: int, width: int, seed: int) -> Image.Image:
    """Random 8x8-pixel blocks: sharp edges, where resampling kernels and clamping differ most."""
    rng = np.random.default_rng(seed)
    blocks = rng.random((height // 8 + 1, width // 8 + 1, 3))
    pixels = np.kron(blocks, np.ones((8, 8, 1)))[:height, :width]
    return Image.fromarray((pixels * 255).astype(np.uint8))


def as_tensor(image: Image.Image) -> torch.Tensor:
    from torchvision.transforms.functional import to_tensor

    return to_tensor(image).unsqueeze(0)


def official_scores(processor_parts, images: list[Image.Image], prompts: list[str]) -> torch.Tensor:
    """PickScore's own recipe (processor → get_*_features → normalise → logit_scale.exp() * dot), per own prompt."""
    image_processor, tokenizer, model = processor_parts
    with torch.no_grad():
        pixel_values = image_processor(images=images, return_tensors="pt")["pixel_values"]
        image_embeds = model.get_image_features(pixel_values=pixel_values)
        tokens = tokenizer(prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
        text_embeds = model.get_text_features(**tokens)
        image_embeds, text_embeds = (getattr(e, "pooler_output", e) for e in (image_embeds, text_embeds))
        image_embeds = image_embeds / image_embeds.norm(dim=-1, keepdim=True)
        text_embeds = text_embeds / text_embeds.norm(dim=-1, keepdim=True)
        return model.logit_scale.exp() * (image_embeds * text_embeds).sum(dim=-1)


# -- preprocessing -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [(300, 410), (720, 720), (64, 64), (257, 199)])
def test_tensor_preprocessing_matches_the_clip_image_processor(reward, processor_parts, size):
    import transformers

    from fluxgrpo.rewards.pickscore import clip_preprocess

    image = blocky_image(*size, seed=size[0])
    ours = clip_preprocess(as_tensor(image), reward.image_spec)
    backends = [processor_parts[0]]
    if hasattr(transformers, "CLIPImageProcessorPil"):  # transformers 5: the PIL backend beside the torchvision one
        backends.append(transformers.CLIPImageProcessorPil(**processor_parts[0].to_dict()))
    std = torch.tensor(reward.image_spec.std).view(1, 3, 1, 1)
    for backend in backends:
        expected = backend(images=image, return_tensors="pt")["pixel_values"]
        assert ours.shape == expected.shape == (1, 3, 224, 224)
        levels = ((ours - expected) * std).abs() * 255  # back to 8-bit levels of the [0, 1] image
        assert levels.max() <= PIXEL_LEVELS, (type(backend).__name__, levels.max())


def test_resize_and_crop_geometry_by_hand():
    from fluxgrpo.rewards.pickscore import center_crop, resize_shortest_edge

    # 300 x 410 → shorter side 224, longer int(224 * 410 / 300) = int(306.13) = 306.
    assert resize_shortest_edge(torch.rand(1, 3, 300, 410), 224).shape[-2:] == (224, 306)
    # 257 x 199 (portrait) → int(224 * 257 / 199) = int(289.29) = 289 x 224.
    assert resize_shortest_edge(torch.rand(1, 3, 257, 199), 224).shape[-2:] == (289, 224)
    # Crop 2 x 3 from 5 x 8: top (5 - 2) // 2 = 1, left (8 - 3) // 2 = 2.
    grid = torch.arange(40.0).view(1, 1, 5, 8)
    assert center_crop(grid, 2, 3).flatten().tolist() == [10.0, 11.0, 12.0, 18.0, 19.0, 20.0]
    same = torch.rand(1, 3, 224, 224)
    assert torch.equal(resize_shortest_edge(same, 224), same)


def test_the_spec_is_read_from_the_processor_config(reward):
    spec = reward.image_spec
    assert (spec.shortest_edge, spec.crop, spec.mode) == (224, (224, 224), "bicubic")
    assert spec.mean == pytest.approx((0.48145466, 0.4578275, 0.40821073))
    assert spec.std == pytest.approx((0.26862954, 0.26130258, 0.27577711))


# -- scores --------------------------------------------------------------------------------------------------------


def test_scores_match_the_processor_and_clip_model_path(reward, processor_parts):
    images = [blocky_image(300, 410, seed=1), blocky_image(512, 512, seed=2)]
    prompts = PROMPTS[:2]
    expected = official_scores(processor_parts, images, prompts)
    # Same pixel_values in: only the model side differs (max_length padding, autocast, the cache), so ~exact.
    pixel_values = processor_parts[0](images=images, return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(reward.score_pixels(pixel_values, prompts), expected, rtol=0, atol=1e-5)
    # From tensors: the preprocessing differs by 8-bit rounding, a few thousandths of a score of magnitude ~1.
    ours = torch.cat([reward(as_tensor(image), [prompt]) for image, prompt in zip(images, prompts, strict=True)])
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, expected, rtol=0, atol=2e-2)


def test_each_image_is_scored_against_its_own_prompt(reward):
    images = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    ab = reward(images, [PROMPTS[0], PROMPTS[1]])
    ba = reward(images, [PROMPTS[1], PROMPTS[0]])
    alone = {(i, p): reward(images[i : i + 1], [PROMPTS[p]])[0] for i in (0, 1) for p in (0, 1)}
    # Batched matmuls round differently from single ones: equal up to float32 noise.
    torch.testing.assert_close(ab, torch.stack([alone[0, 0], alone[1, 1]]), rtol=0, atol=1e-5)
    torch.testing.assert_close(ba, torch.stack([alone[0, 1], alone[1, 0]]), rtol=0, atol=1e-5)
    assert (ab - ba).abs().min() > 1e-3  # swapping the prompts changes both scores
    # DanceGRPO scored every image against the first caption; image 1 against prompt 0 is a different number.
    assert (alone[1, 1] - alone[1, 0]).abs() > 1e-3


def test_logit_scale_multiplies_the_cosine(tiny_weights, tmp_path):
    from fluxgrpo.rewards.pickscore import PickScoreReward, clip_preprocess

    folder = tmp_path / "pickscore"
    shutil.copytree(pickscore_dir(tiny_weights.hps_dir), folder)
    reward = PickScoreReward(folder)
    images = torch.rand(3, 3, 64, 64, generator=torch.Generator().manual_seed(4))
    prompts = PROMPTS[:3]

    reward.model.logit_scale.data.fill_(0.0)  # exp(0) = 1: the score is the bare cosine
    cosine = reward(images, prompts)
    assert cosine.abs().max() <= 1.0
    # The cosine by hand from the model's own projections.
    with torch.no_grad():
        pixel_values = clip_preprocess(images, reward.image_spec)
        image_embeds = reward.model.get_image_features(pixel_values=pixel_values)
        tokens = reward.tokenizer(prompts, padding="max_length", max_length=77, truncation=True, return_tensors="pt")
        text_embeds = reward.model.get_text_features(**tokens)
    image_embeds, text_embeds = (getattr(e, "pooler_output", e) for e in (image_embeds, text_embeds))
    by_hand = torch.nn.functional.cosine_similarity(image_embeds, text_embeds, dim=-1)
    torch.testing.assert_close(cosine, by_hand, rtol=0, atol=1e-6)

    reward.model.logit_scale.data.fill_(math.log(100.0))  # exp(ln 100) = 100, the real PickScore's scale
    torch.testing.assert_close(reward(images, prompts), 100.0 * by_hand, rtol=1e-5, atol=1e-5)


def test_batched_scores_equal_one_image_at_a_time(tiny_weights):
    from fluxgrpo.rewards.pickscore import PickScoreReward

    reward = PickScoreReward(pickscore_dir(tiny_weights.hps_dir), batch_size=2)  # 5 images: chunks of 2, 2, 1
    images = torch.rand(5, 3, 80, 48, generator=torch.Generator().manual_seed(5))
    prompts = [PROMPTS[i % 4] for i in range(5)]
    batched = reward(images, prompts)
    single = torch.cat([reward(images[i : i + 1], [prompts[i]]) for i in range(5)])
    assert batched.shape == (5,)
    torch.testing.assert_close(batched, single, rtol=0, atol=1e-5)


def test_a_prompt_longer_than_77_tokens_is_truncated_not_an_error(reward):
    long_prompt = " ".join(["a very detailed painting of a fox"] * 40)
    score = reward(torch.rand(1, 3, 32, 32), [long_prompt])
    assert score.shape == (1,) and torch.isfinite(score).all()


def test_pickscore_runs_in_fp32_by_default_and_in_bf16_on_request(tiny_weights, reward, monkeypatch):
    from fluxgrpo.rewards import load_reward
    from fluxgrpo.runtime import device as rt_device

    images = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(6))
    full_precision = reward(images, PROMPTS[:2])
    monkeypatch.setattr(rt_device, "compute_dtype", lambda device_type: torch.bfloat16)
    assert torch.equal(load_reward("pickscore", tiny_weights.hps_dir)(images, PROMPTS[:2]), full_precision)
    mixed = load_reward("pickscore", tiny_weights.hps_dir, reward_dtype="bf16")(images, PROMPTS[:2])
    assert mixed.dtype == torch.float32
    assert not torch.equal(mixed, full_precision)  # the bf16 branch really ran
    torch.testing.assert_close(mixed, full_precision, rtol=0, atol=5e-2)


# -- registry and layout -------------------------------------------------------------------------------------------


def test_load_reward_finds_pickscore_inside_the_hps_dir(tiny_weights):
    from fluxgrpo.rewards import load_reward, reward_names
    from fluxgrpo.rewards.pickscore import PickScoreReward

    assert "pickscore" in reward_names()
    reward = load_reward("pickscore", tiny_weights.hps_dir, "cpu")
    assert isinstance(reward, PickScoreReward)
    scores = reward(torch.rand(2, 3, 64, 64), PROMPTS[:2])
    assert scores.shape == (2,) and scores.dtype == torch.float32 and torch.isfinite(scores).all()


def test_a_missing_pickscore_names_the_fetch_command(tmp_path, tiny_weights):
    from fluxgrpo.rewards import load_reward

    with pytest.raises(FluxgrpoError, match=r"fetch-weights --only pickscore --hps-dir"):
        load_reward("pickscore", tmp_path / "hps_ckpt")
    folder = tmp_path / "hps_ckpt" / "pickscore"
    shutil.copytree(pickscore_dir(tiny_weights.hps_dir), folder)
    (folder / "processor" / "preprocessor_config.json").unlink()
    status = check_pickscore_dir(folder)
    assert not status.complete
    assert any("preprocessor_config.json" in problem for problem in status.problems)
    with pytest.raises(FluxgrpoError, match="preprocessor_config.json"):
        load_reward("pickscore", tmp_path / "hps_ckpt")


def test_the_tiny_pickscore_is_complete_and_in_the_real_layout(tiny_weights):
    from fluxgrpo.weights.manifest import read_manifest

    folder = pickscore_dir(tiny_weights.hps_dir)
    status = check_pickscore_dir(folder)
    assert (status.complete, status.source) == (True, "tiny")
    model_files = {f.path for f in read_manifest(folder / "model").files}
    processor_files = {f.path for f in read_manifest(folder / "processor").files}
    assert model_files == {"config.json", "model.safetensors"}
    assert processor_files == {
        "preprocessor_config.json",
        "tokenizer_config.json",
        "tokenizer.json",
        "vocab.json",
        "merges.txt",
    }


def test_pil_path_is_the_official_processor_path(reward, processor_parts):
    images = [blocky_image(300, 410, seed=7), blocky_image(257, 199, seed=8)]
    expected = official_scores(processor_parts, images, PROMPTS[:2])
    torch.testing.assert_close(reward.score_pil(images, PROMPTS[:2]), expected, rtol=0, atol=1e-5)
