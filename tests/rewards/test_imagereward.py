"""ImageReward: our transformers-BLIP forward against a plain re-derivation of the authors' model from their checkpoint
keys, the authors' preprocessing from PIL and the same on tensors, tokenisation, normalisation, loading, safety.

Uses the tiny ImageReward that ``fetch-weights --source tiny`` writes into ``<hps_dir>/imagereward``: random weights
saved under the authors' ``ImageReward.pt`` keys, with a real-shaped ``med_config.json``.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.weights.layout import imagereward_dir

PROMPTS = ["a red fox in the snow", "a castle on a hill", "a cat with a dog"]
PIXEL_LEVELS = 1.5
# The authors' score normalisation (ImageReward.py: self.mean / self.std), written out here.
AUTHORS_MEAN, AUTHORS_STD = 0.16717362830052426, 1.0333394966054072


@pytest.fixture(scope="module")
def reward(tiny_weights):
    from fluxgrpo.rewards.imagereward import ImageRewardReward

    torch.set_num_threads(1)
    return ImageRewardReward(imagereward_dir(tiny_weights.hps_dir))


@pytest.fixture(scope="module")
def checkpoint(tiny_weights):
    folder = imagereward_dir(tiny_weights.hps_dir) / "model"
    state = torch.load(folder / "ImageReward.pt", weights_only=True)
    return (
        state,
        json.loads((folder / "med_config.json").read_text()),
        json.loads((folder / "vision_config.json").read_text()),
    )


def authors_transform():
    from torchvision.transforms import CenterCrop, Compose, InterpolationMode, Normalize, Resize, ToTensor

    return Compose(
        [
            Resize(224, interpolation=InterpolationMode.BICUBIC),
            CenterCrop(224),
            lambda image: image.convert("RGB"),
            ToTensor(),
            Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
        ]
    )


def _attention(q, k, v, heads, mask=None):
    b, n, d = q.shape
    split = lambda t: t.reshape(t.shape[0], t.shape[1], heads, d // heads).transpose(1, 2)  # noqa: E731
    scores = split(q) @ split(k).transpose(-2, -1) / (d // heads) ** 0.5
    if mask is not None:
        scores = scores + (1.0 - mask[:, None, None, :].float()) * -10000.0  # BLIP's extended attention mask
    return (scores.softmax(-1) @ split(v)).transpose(1, 2).reshape(b, n, d)


def authors_score(checkpoint, pixels, input_ids, attention_mask):
    """ImageReward.score re-derived from BLIP's vit.py / med.py and the authors' MLP, on the checkpoint's own keys."""
    state, med, vision = checkpoint
    s = lambda prefix: {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}  # noqa: E731
    vit, bert, mlp = s("blip.visual_encoder."), s("blip.text_encoder."), s("mlp.layers.")
    width, heads = vision["hidden_size"], vision["num_attention_heads"]
    ln = lambda x, p, eps: F.layer_norm(x, (x.shape[-1],), p["weight"], p["bias"], eps)  # noqa: E731
    sub = lambda d, prefix: {k[len(prefix) :]: v for k, v in d.items() if k.startswith(prefix)}  # noqa: E731
    lin = lambda x, d, prefix: F.linear(x, d[prefix + ".weight"], d[prefix + ".bias"])  # noqa: E731

    x = F.conv2d(pixels, vit["patch_embed.proj.weight"], vit["patch_embed.proj.bias"], stride=vision["patch_size"])
    x = x.flatten(2).transpose(1, 2)
    x = torch.cat([vit["cls_token"].expand(x.shape[0], -1, -1), x], dim=1)
    x = x + vit["pos_embed"][:, : x.shape[1]]
    for i in range(vision["num_hidden_layers"]):
        h = ln(x, sub(vit, f"blocks.{i}.norm1."), 1e-6)
        q, k, v = lin(h, vit, f"blocks.{i}.attn.qkv").reshape(*h.shape[:2], 3, width).unbind(2)
        x = x + lin(_attention(q, k, v, heads), vit, f"blocks.{i}.attn.proj")
        h = ln(x, sub(vit, f"blocks.{i}.norm2."), 1e-6)
        x = x + lin(F.gelu(lin(h, vit, f"blocks.{i}.mlp.fc1")), vit, f"blocks.{i}.mlp.fc2")
    image_embeds = ln(x, sub(vit, "norm."), 1e-6)

    eps, text_heads = med["layer_norm_eps"], med["num_attention_heads"]
    positions = torch.arange(input_ids.shape[1])
    h = bert["embeddings.word_embeddings.weight"][input_ids] + bert["embeddings.position_embeddings.weight"][positions]
    h = ln(h, sub(bert, "embeddings.LayerNorm."), eps)
    for i in range(med["num_hidden_layers"]):
        layer = sub(bert, f"encoder.layer.{i}.")
        a = _attention(
            *(lin(h, layer, f"attention.self.{n}") for n in ("query", "key", "value")), text_heads, attention_mask
        )
        h = ln(lin(a, layer, "attention.output.dense") + h, sub(layer, "attention.output.LayerNorm."), eps)
        q = lin(h, layer, "crossattention.self.query")
        k, v = (lin(image_embeds, layer, f"crossattention.self.{n}") for n in ("key", "value"))
        c = _attention(q, k, v, text_heads)  # every image token is attended (image_atts are all ones)
        h = ln(lin(c, layer, "crossattention.output.dense") + h, sub(layer, "crossattention.output.LayerNorm."), eps)
        ff = lin(F.gelu(lin(h, layer, "intermediate.dense")), layer, "output.dense")
        h = ln(ff + h, sub(layer, "output.LayerNorm."), eps)
    r = h[:, 0, :].float()
    for index in (0, 2, 4, 6, 7):  # the authors' nn.Sequential: linear layers at these positions, no activations
        r = lin(r, mlp, str(index))
    return ((r - AUTHORS_MEAN) / AUTHORS_STD).squeeze(-1)


def blocky_image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    blocks = rng.random((height // 8 + 1, width // 8 + 1, 3))
    return Image.fromarray((np.kron(blocks, np.ones((8, 8, 1)))[:height, :width] * 255).astype(np.uint8))


def as_tensor(image: Image.Image) -> torch.Tensor:
    from torchvision.transforms.functional import to_tensor

    return to_tensor(image).unsqueeze(0)


@pytest.mark.parametrize("size", [(300, 410), (720, 720), (64, 64), (257, 199), (227, 300)])
def test_tensor_preprocessing_matches_the_authors_transform(reward, size):
    from fluxgrpo.rewards.base import CLIP_STD

    image = blocky_image(*size, seed=size[0])
    expected = authors_transform()(image).unsqueeze(0)
    ours = reward.preprocess(as_tensor(image))
    assert ours.shape == expected.shape == (1, 3, 224, 224)
    levels = ((ours - expected) * torch.tensor(CLIP_STD).view(1, 3, 1, 1)).abs() * 255
    assert levels.max() <= PIXEL_LEVELS, levels.max()


def test_tokens_are_bert_uncased_with_blips_two_tokens_padded_to_35(reward, checkpoint):
    tokens = reward._tokenize(["A Red FOX", " ".join(["castle"] * 60)])
    assert tokens.shape == (2, 2, 35)
    cls_id = reward.tokenizer.convert_tokens_to_ids("[CLS]")
    assert (tokens[:, 0, 0] == cls_id).all()  # ImageReward keeps [CLS] first (no [ENC] swap)
    assert tokens[0, 0].tolist() == reward.tokenizer("a red fox", padding="max_length", max_length=35)["input_ids"]
    assert tokens[0, 1].sum() == 5 and tokens[1, 1].sum() == 35  # [CLS] a red fox [SEP]; the long one truncated
    assert len(reward.tokenizer) == checkpoint[1]["vocab_size"]
    assert reward.tokenizer.convert_tokens_to_ids(["[DEC]", "[ENC]"]) == [
        len(reward.tokenizer) - 2,
        len(reward.tokenizer) - 1,
    ]


def test_scores_equal_the_authors_forward_from_the_checkpoint_keys(reward, checkpoint):
    images = [blocky_image(300, 410, seed=1), blocky_image(512, 512, seed=2), blocky_image(200, 260, seed=3)]
    pixels = torch.stack([authors_transform()(image) for image in images])
    tokens = reward._tokenize(PROMPTS)
    with torch.no_grad():
        expected = authors_score(checkpoint, pixels, tokens[:, 0], tokens[:, 1])
    assert expected.std() > 1e-3  # the tiny model really tells the images apart
    torch.testing.assert_close(reward.score_pil(images, PROMPTS), expected, rtol=0, atol=1e-4)
    # From tensors: the preprocessing differs by 8-bit rounding only.
    ours = torch.cat([reward(as_tensor(image), [prompt]) for image, prompt in zip(images, PROMPTS, strict=True)])
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, expected, rtol=0, atol=0.05 * expected.abs().max().item())


def test_batched_scores_equal_one_at_a_time(tiny_weights):
    from fluxgrpo.rewards.imagereward import ImageRewardReward

    reward = ImageRewardReward(imagereward_dir(tiny_weights.hps_dir), batch_size=2)
    images = torch.rand(5, 3, 80, 48, generator=torch.Generator().manual_seed(5))
    prompts = [PROMPTS[i % 3] for i in range(5)]
    batched = reward(images, prompts)
    single = torch.cat([reward(images[i : i + 1], [prompts[i]]) for i in range(5)])
    torch.testing.assert_close(batched, single, rtol=0, atol=1e-4)


def test_vision_key_renames_round_trip(checkpoint):
    from fluxgrpo.rewards.imagereward import authors_vision_key, vision_key

    keys = [k[len("blip.visual_encoder.") :] for k in checkpoint[0] if k.startswith("blip.visual_encoder.")]
    assert all(authors_vision_key(vision_key(k)) == k for k in keys)
    assert vision_key("blocks.3.attn.proj.weight") == "encoder.layers.3.self_attn.projection.weight"


def test_registry_layout_and_missing_weights(tiny_weights, tmp_path):
    from fluxgrpo.rewards import load_reward, reward_names, reward_weights_status
    from fluxgrpo.rewards.imagereward import ImageRewardReward

    assert "imagereward" in reward_names()
    assert isinstance(load_reward("imagereward", tiny_weights.hps_dir), ImageRewardReward)
    assert [s.complete for s in reward_weights_status("imagereward", tiny_weights.hps_dir)] == [True]
    with pytest.raises(FluxgrpoError, match=r"fetch-weights --only imagereward --hps-dir"):
        load_reward("imagereward", tmp_path / "nothing")


def test_a_code_running_imagereward_checkpoint_is_refused(tiny_weights, tmp_path):
    from fluxgrpo.rewards import load_reward

    folder = tmp_path / "hps_ckpt"
    shutil.copytree(imagereward_dir(tiny_weights.hps_dir), imagereward_dir(folder))
    model_dir = imagereward_dir(folder) / "model"
    (model_dir / "manifest.json").unlink()
    marker = tmp_path / "PWNED"

    class RunsCode:
        def __reduce__(self):
            import os

            return (os.system, (f"touch {marker}",))

    torch.save({"mlp.layers.0.weight": RunsCode()}, model_dir / "ImageReward.pt")
    with pytest.raises(FluxgrpoError) as exc:
        load_reward("imagereward", folder)
    assert str(model_dir / "ImageReward.pt") in str(exc.value) and "\n" not in str(exc.value)
    assert not marker.exists()


# -- fetch-weights --only imagereward ---------------------------------------------------------------------------------


def test_imagereward_from_hugging_face_loads_as_served_and_modelscope_says_it_has_none(
    tiny_weights, tmp_path, monkeypatch
):
    from fakehub import FakeHub, FakeRepo, isolate_hub_environment
    from typer.testing import CliRunner

    from fluxgrpo.cli.app import app
    from fluxgrpo.rewards import load_reward
    from fluxgrpo.weights.layout import check_imagereward_dir
    from fluxgrpo.weights.manifest import read_manifest

    isolate_hub_environment(tmp_path, monkeypatch)
    served = imagereward_dir(tiny_weights.hps_dir)
    model_repo, bert_repo = tmp_path / "served" / "imagereward", tmp_path / "served" / "bert"
    shutil.copytree(served / "model", model_repo, ignore=shutil.ignore_patterns("manifest.json", "vision_config.json"))
    (model_repo / "README.md").write_text("ImageReward\n")  # the real repo's neighbours are never fetched
    shutil.copytree(served / "tokenizer", bert_repo, ignore=shutil.ignore_patterns("manifest.json"))
    (bert_repo / "model.safetensors").write_bytes(b"0" * 64)  # BERT's own weights: not needed, not fetched
    hps_dir = tmp_path / "hps_ckpt"
    # The tiny vision shape is not on the hub (the real model is ViT-L); give the fetched folder the tiny one so it
    # can be built here, as the tiny HPS architecture file is for the HPS fetch tests.
    (imagereward_dir(hps_dir) / "model").mkdir(parents=True)
    shutil.copy(served / "model" / "vision_config.json", imagereward_dir(hps_dir) / "model")
    repos = [FakeRepo("THUDM/ImageReward", model_repo), FakeRepo("google-bert/bert-base-uncased", bert_repo)]
    runner = CliRunner()
    common = ["--flux-dir", str(tmp_path / "flux"), "--hps-dir", str(hps_dir), "--only", "imagereward", "--json"]
    with FakeHub("hf", repos) as hub:
        result = runner.invoke(app, ["fetch-weights", "--source", "hf", "--endpoint", hub.url, *common])
        assert result.exit_code == 0, result.output
        fetched = sorted((repo, path) for repo, path, _ in hub.content_requests())
    assert fetched == [
        ("THUDM/ImageReward", "ImageReward.pt"),
        ("THUDM/ImageReward", "med_config.json"),
        ("google-bert/bert-base-uncased", "tokenizer_config.json"),
        ("google-bert/bert-base-uncased", "vocab.txt"),
    ]
    # The fetch removed the tiny vision shape (it would misbuild the real ViT-L); put it back to build the tiny one.
    assert not (imagereward_dir(hps_dir) / "model" / "vision_config.json").exists()
    shutil.copy(served / "model" / "vision_config.json", imagereward_dir(hps_dir) / "model")
    status = check_imagereward_dir(imagereward_dir(hps_dir))
    assert status.complete and status.source == "hf", status.problems
    assert read_manifest(imagereward_dir(hps_dir) / "model").repo == "THUDM/ImageReward"
    images = torch.rand(2, 3, 48, 64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(
        load_reward("imagereward", hps_dir)(images, PROMPTS[:2]),
        load_reward("imagereward", tiny_weights.hps_dir)(images, PROMPTS[:2]),
        rtol=0,
        atol=0,
    )

    with FakeHub("modelscope", []) as hub:
        result = runner.invoke(app, ["fetch-weights", "--source", "modelscope", "--endpoint", hub.url, *common])
    assert result.exit_code == 2
    assert "no known repository on modelscope" in result.stderr and "--source hf" in result.stderr
