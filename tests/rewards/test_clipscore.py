"""CLIPScore: open_clip's own preprocessing from PIL, the same on tensors, max(100·cos, 0), batching, loading.

Uses the tiny LAION-layout CLIP (``open_clip_pytorch_model.bin`` + the tiny architecture file) that
``fetch-weights --source tiny`` writes into the HPS folder.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.weights.layout import CLIP_MANIFEST, OPEN_CLIP_WEIGHTS, REWARD_ARCH_FILE

PROMPTS = ["a red fox in the snow", "a castle on a hill at night", "two cats on a sofa"]
PIXEL_LEVELS = 1.5  # 8-bit rounding of PIL's resize (twice) against our float path, in levels of 255


@pytest.fixture(scope="module")
def reward(tiny_weights):
    from fluxgrpo.rewards.clipscore import ClipScoreReward

    torch.set_num_threads(1)
    return ClipScoreReward(tiny_weights.hps_dir)


@pytest.fixture(scope="module")
def authors_model(tiny_weights):
    """open_clip's model built and loaded the plain way (create_model + the .bin), independent of fluxgrpo."""
    import json

    import open_clip

    cfg = json.loads((tiny_weights.hps_dir / REWARD_ARCH_FILE).read_text())
    model = open_clip.model.CLIP(**cfg)
    model.load_state_dict(torch.load(tiny_weights.hps_dir / OPEN_CLIP_WEIGHTS, weights_only=True))
    return model.eval()


def blocky_image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    blocks = rng.random((height // 8 + 1, width // 8 + 1, 3))
    pixels = np.kron(blocks, np.ones((8, 8, 1)))[:height, :width]
    return Image.fromarray((pixels * 255).astype(np.uint8))


def as_tensor(image: Image.Image) -> torch.Tensor:
    from torchvision.transforms.functional import to_tensor

    return to_tensor(image).unsqueeze(0)


@pytest.mark.parametrize("size", [(300, 410), (720, 720), (64, 64), (257, 199), (227, 300)])
def test_tensor_preprocessing_matches_open_clips_transform(reward, size):
    import open_clip

    from fluxgrpo.rewards.base import CLIP_STD

    image = blocky_image(*size, seed=size[1])
    expected = open_clip.image_transform(224, is_train=False)(image).unsqueeze(0)
    ours = reward.preprocess(as_tensor(image))
    assert ours.shape == expected.shape == (1, 3, 224, 224)
    levels = ((ours - expected) * torch.tensor(CLIP_STD).view(1, 3, 1, 1)).abs() * 255
    assert levels.max() <= PIXEL_LEVELS, levels.max()


def test_crop_offsets_round_like_torchvision():
    from fluxgrpo.rewards.clipscore import center_crop_rounded

    # 5 rows → 2: (5 − 2) / 2 = 1.5 rounds (half to even) to 2; 8 columns: 3.0 → 3.
    grid = torch.arange(40.0).view(1, 1, 5, 8)
    assert center_crop_rounded(grid, 2).flatten().tolist() == [19.0, 20.0, 27.0, 28.0]


def test_pil_scores_are_the_authors_recipe(reward, authors_model):
    import open_clip

    images = [blocky_image(300, 410, seed=1), blocky_image(512, 512, seed=2)]
    prompts = PROMPTS[:2]
    with torch.no_grad():
        pixels = torch.stack([open_clip.image_transform(224, is_train=False)(im) for im in images])
        image_features = authors_model.encode_image(pixels)
        text_features = authors_model.encode_text(open_clip.get_tokenizer("ViT-H-14")(prompts))
    image_features = image_features / image_features.norm(dim=-1, keepdim=True)
    text_features = text_features / text_features.norm(dim=-1, keepdim=True)
    expected = (100 * (image_features * text_features).sum(dim=-1)).clamp(min=0)
    torch.testing.assert_close(reward.score_pil(images, prompts), expected, rtol=0, atol=1e-4)
    # From tensors: 8-bit rounding apart, on a score of magnitude ~100 · cos.
    ours = torch.cat([reward(as_tensor(image), [prompt]) for image, prompt in zip(images, prompts, strict=True)])
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, expected, rtol=0, atol=0.5)


def test_negative_agreement_scores_zero(reward, monkeypatch):
    monkeypatch.setattr(reward, "cosine", lambda pixels, prompts: torch.tensor([-0.25, 0.0, 0.31]))
    assert reward.score_pixels(torch.zeros(3, 3, 224, 224), PROMPTS).tolist() == pytest.approx([0.0, 0.0, 31.0])


def test_batched_scores_equal_one_at_a_time_and_text_is_cached(tiny_weights):
    from fluxgrpo.rewards.clipscore import ClipScoreReward

    reward = ClipScoreReward(tiny_weights.hps_dir, batch_size=2)
    images = torch.rand(5, 3, 80, 48, generator=torch.Generator().manual_seed(5))
    prompts = [PROMPTS[i % 3] for i in range(5)]
    batched = reward(images, prompts)
    assert len(reward._text_features) == 3
    single = torch.cat([reward(images[i : i + 1], [prompts[i]]) for i in range(5)])
    torch.testing.assert_close(batched, single, rtol=0, atol=1e-4)


def test_registry_loads_clipscore_and_a_missing_clip_names_the_fetch_command(tiny_weights, tmp_path):
    from fluxgrpo.rewards import load_reward, reward_names
    from fluxgrpo.rewards.clipscore import ClipScoreReward

    assert "clipscore" in reward_names()
    assert isinstance(load_reward("clipscore", tiny_weights.hps_dir), ClipScoreReward)
    with pytest.raises(FluxgrpoError, match=r"fetch-weights --only clip --hps-dir"):
        load_reward("clipscore", tmp_path / "nothing")


def test_a_code_running_clip_bin_is_refused_under_clipscore(tiny_weights, tmp_path):
    from fluxgrpo.rewards import load_reward

    folder = tmp_path / "hps_ckpt"
    shutil.copytree(tiny_weights.hps_dir, folder)
    (folder / CLIP_MANIFEST).unlink()
    marker = tmp_path / "PWNED"

    class RunsCode:
        def __reduce__(self):
            import os

            return (os.system, (f"touch {marker}",))

    torch.save({"weight": RunsCode()}, folder / OPEN_CLIP_WEIGHTS)
    with pytest.raises(FluxgrpoError) as exc:
        load_reward("clipscore", folder)
    assert str(folder / OPEN_CLIP_WEIGHTS) in str(exc.value) and "\n" not in str(exc.value)
    assert not marker.exists()
