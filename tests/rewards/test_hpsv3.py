"""HPSv3: our scores against the authors' forward re-derived on transformers' own Qwen2-VL classes and processor, the
authors' preprocessing from PIL and the same on tensors, the chat template, loading, both checkpoint namings, fetch.

Uses the tiny HPSv3 that ``fetch-weights --source tiny`` writes into ``<hps_dir>/hpsv3``: random weights saved under
the authors' ``HPSv3.safetensors`` keys (transformers 4.45 names, bfloat16), a real-format Qwen2-VL config.json and a
Qwen2 tokenizer with Qwen2-VL's special tokens.
"""

from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.weights.layout import hpsv3_dir

PROMPTS = ["a red fox in the snow", "a castle on a hill at dawn, oil painting", "a cat"]
PIXEL_LEVELS = 1.5
# Qwen2-VL-Instruct's chat template (chat_template.json of Qwen/Qwen2-VL-7B-Instruct), as published.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)
# Qwen/Qwen2-VL-7B-Instruct's preprocessor_config.json pixel bounds (the processor's own resize is a no-op after the
# authors' fetch_image resize to 256·28² pixels).
PROCESSOR_MIN_PIXELS, PROCESSOR_MAX_PIXELS = 3136, 12845056


@pytest.fixture(scope="module")
def reward(tiny_weights):
    from fluxgrpo.rewards.hpsv3 import HpsV3Reward

    torch.set_num_threads(1)
    return HpsV3Reward(hpsv3_dir(tiny_weights.hps_dir))


def blocky_image(height: int, width: int, seed: int) -> Image.Image:
    """An image with sharp edges and flat areas (what resizing treats most differently), as the other reward tests."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, size=(max(2, height // 16), max(2, width // 16), 3), dtype=np.uint8)
    return Image.fromarray(small).resize((width, height), Image.Resampling.NEAREST)


def authors_fetch_image(image: Image.Image) -> Image.Image:
    """qwen-vl-utils' fetch_image with min_pixels = max_pixels = 256·28²: PIL bicubic to smart_resize's size."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    height, width = smart_resize(image.height, image.width, 28, 256 * 28 * 28, 256 * 28 * 28)
    return image.convert("RGB").resize((width, height), Image.Resampling.BICUBIC)


def authors_processor(reward):
    """Qwen2-VL's processor as the authors build it: the base tokenizer with <|Reward|> added, right padding."""
    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    image_processor = Qwen2VLImageProcessorPil(min_pixels=PROCESSOR_MIN_PIXELS, max_pixels=PROCESSOR_MAX_PIXELS)
    reward.tokenizer.padding_side = "right"
    return Qwen2VLProcessor(
        image_processor=image_processor,
        tokenizer=reward.tokenizer,
        video_processor=Qwen2VLVideoProcessor(),  # unused, but the processor insists on one
        chat_template=QWEN2_VL_CHAT_TEMPLATE,
    )


def authors_messages(prompt: str, image: Image.Image) -> list[dict]:
    from fluxgrpo.rewards.hpsv3 import INSTRUCTION, RATING_REQUEST

    text = INSTRUCTION.format(text_prompt=prompt) + RATING_REQUEST
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}]


def authors_batch(reward, images, prompts):
    processor = authors_processor(reward)
    texts = [
        processor.apply_chat_template(authors_messages(p, i), tokenize=False, add_generation_prompt=True)
        for p, i in zip(prompts, images, strict=True)
    ]
    resized = [authors_fetch_image(image) for image in images]
    return processor(text=texts, images=resized, padding=True, return_tensors="pt")


@pytest.fixture(scope="module")
def authors_model(tiny_weights):
    """The authors' Qwen2VLRewardModelBT re-derived: transformers' Qwen2VLForConditionalGeneration with their rm_head,
    loaded from the checkpoint with the 4.45 → current key renames (``visual.`` → ``model.visual.``, ``model.`` →
    ``model.language_model.``)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    folder = hpsv3_dir(tiny_weights.hps_dir)
    state = load_file(folder / "model" / "HPSv3.safetensors")
    values = json.loads((folder / "base" / "config.json").read_text())
    values["vocab_size"] = state["model.embed_tokens.weight"].shape[0]
    config = Qwen2VLConfig(**values)
    config._attn_implementation = "sdpa"
    model = Qwen2VLForConditionalGeneration(config)
    renamed = {}
    for key, value in state.items():
        if key.startswith("visual."):
            renamed["model." + key] = value
        elif key.startswith("model."):
            renamed["model.language_model." + key[len("model.") :]] = value
        elif key.startswith("lm_head."):
            renamed[key] = value
    model.load_state_dict(renamed, strict=True)
    hidden = config.text_config.hidden_size
    rm_head = torch.nn.Sequential(
        torch.nn.Linear(hidden, 1024),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.05),
        torch.nn.Linear(1024, 16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 2),
    )
    rm_head.load_state_dict({k[len("rm_head.") :]: v for k, v in state.items() if k.startswith("rm_head.")})
    # The authors' create_model_and_processor: model.to(torch.bfloat16), which rounds the rotary tables (buffers)
    # too; computed in float32 here, as our default scores.
    return model.to(torch.bfloat16).float().eval(), rm_head.float().eval()


def authors_mu(authors_model, reward, batch, multimodal_positions: bool = False, head: bool = True) -> torch.Tensor:
    """Qwen2VLRewardModelBT.forward: embed, splice the image features in, the decoder with position_ids=None (plain
    positions), rm_head in float32 at <|Reward|>, column 0. ``multimodal_positions`` runs Qwen2-VL's own forward
    instead (M-RoPE image positions), which the authors' override bypasses. ``head=False``: the decoder's output
    at <|Reward|> instead."""
    model, rm_head = authors_model
    with torch.no_grad():
        if multimodal_positions:
            hidden = model.model(**batch).last_hidden_state
        else:
            input_ids = batch["input_ids"]
            embeds = model.model.language_model.embed_tokens(input_ids)
            image_embeds = model.model.visual(batch["pixel_values"], grid_thw=batch["image_grid_thw"]).pooler_output
            mask = (input_ids == model.config.image_token_id).unsqueeze(-1).expand_as(embeds)
            embeds = embeds.masked_scatter(mask, image_embeds)
            hidden = model.model.language_model(
                inputs_embeds=embeds, attention_mask=batch["attention_mask"], position_ids=None
            ).last_hidden_state
        reward_id = reward.tokenizer.convert_tokens_to_ids("<|Reward|>")
        if not head:
            return hidden[batch["input_ids"] == reward_id]
        logits = rm_head(hidden.float())[batch["input_ids"] == reward_id]
    return logits.view(batch["input_ids"].shape[0], -1)[:, 0]


# -- preprocessing -----------------------------------------------------------------------------------------------------


def test_smart_resize_is_qwen_vl_utils_rule_at_the_authors_pixel_count():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as transformers_smart_resize

    from fluxgrpo.rewards.hpsv3 import smart_resize

    # Hand-worked: a square image is 448² = 256·28²; 512×1024 → β = √(512·1024/200704) → (308, 616).
    assert smart_resize(720, 720) == (448, 448)
    assert smart_resize(64, 64) == (448, 448)
    assert smart_resize(512, 1024) == (308, 616)
    for height, width in [(300, 410), (257, 199), (1024, 576), (720, 1280), (96, 2000)]:
        expected = transformers_smart_resize(height, width, 28, 256 * 28 * 28, 256 * 28 * 28)
        assert smart_resize(height, width) == expected, (height, width)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2100)


def test_conversation_is_what_qwen2_vl_chat_template_renders(reward):
    from fluxgrpo.rewards.hpsv3 import conversation_text

    image = blocky_image(64, 64, seed=0)
    for prompt in [*PROMPTS, "braces {like} this"]:
        rendered = reward.tokenizer.apply_chat_template(
            authors_messages(prompt, image),
            chat_template=QWEN2_VL_CHAT_TEMPLATE,
            tokenize=False,
            add_generation_prompt=True,
        )
        assert conversation_text(prompt) == rendered


@pytest.mark.parametrize("size", [(720, 720), (64, 64), (300, 410), (257, 199), (512, 1024)])
def test_pil_pixel_rows_equal_qwen2_vl_image_processor(reward, size):
    image = blocky_image(*size, seed=size[0])
    rows, grids = reward.preprocess_pil([image])
    processor = authors_processor(reward).image_processor
    expected = processor(images=[authors_fetch_image(image)], return_tensors="pt")
    assert grids.tolist() == expected["image_grid_thw"].tolist()
    torch.testing.assert_close(rows, expected["pixel_values"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("size", [(720, 720), (64, 64), (300, 410), (257, 199), (512, 1024)])
def test_tensor_pixel_rows_match_the_pil_path(reward, size):
    from torchvision.transforms.functional import to_tensor

    from fluxgrpo.rewards.base import CLIP_STD

    image = blocky_image(*size, seed=size[1])
    expected, expected_grids = reward.preprocess_pil([image])
    rows, grids = reward.preprocess(to_tensor(image).unsqueeze(0))
    assert grids.tolist() == expected_grids.tolist() and rows.shape == expected.shape
    # Rows are (channel, frame, y, x) patches: undo the normalisation per channel to compare in 8-bit levels.
    std = torch.tensor(CLIP_STD).repeat_interleave(2 * 14 * 14)
    levels = ((rows - expected) * std).abs() * 255
    assert levels.max() <= PIXEL_LEVELS, levels.max()


# -- scores ------------------------------------------------------------------------------------------------------------


def test_scores_equal_the_authors_forward(reward, authors_model):
    images = [blocky_image(300, 410, seed=1), blocky_image(512, 512, seed=2), blocky_image(200, 260, seed=3)]
    batch = authors_batch(reward, images, PROMPTS)
    expected = authors_mu(authors_model, reward, batch)
    assert expected.std() > 1e-3  # the tiny model really tells the images apart
    ours = reward.score_pil(images, PROMPTS)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)
    # The authors' plain positions matter: Qwen2-VL's own multimodal positions give other scores.
    multimodal = authors_mu(authors_model, reward, batch, multimodal_positions=True)
    assert (multimodal - expected).abs().max() > 1e-4
    # So do their bfloat16-rounded rotary tables: exact float32 ones give other scores too.
    exact_tables = copy.deepcopy(authors_model)
    fresh = {
        name: b for name, b in type(authors_model[0])(authors_model[0].config).named_buffers() if "inv_freq" in name
    }
    for name, table in fresh.items():
        owner = exact_tables[0].get_submodule(name.rsplit(".", 1)[0])
        owner.register_buffer(name.rsplit(".", 1)[1], table, persistent=False)
    at_reward = authors_mu(authors_model, reward, batch, head=False)
    changed = (authors_mu(exact_tables, reward, batch, head=False) - at_reward).abs().max() / at_reward.abs().max()
    assert changed > 1e-2  # the decoder's output at <|Reward|> moves by about 4 % on the tiny model
    # From tensors: the preprocessing differs by 8-bit rounding only.
    from torchvision.transforms.functional import to_tensor

    from_tensors = torch.cat([reward(to_tensor(i).unsqueeze(0), [p]) for i, p in zip(images, PROMPTS, strict=True)])
    torch.testing.assert_close(from_tensors, expected, rtol=0, atol=0.1 * expected.std().item())


def test_tokens_are_the_processors_with_one_reward_token(reward):
    images = [blocky_image(64, 64, seed=4), blocky_image(300, 410, seed=5)]
    batch = authors_batch(reward, images, PROMPTS[:2])
    _rows, grids = reward.preprocess_pil(images)
    pads = [int(g.prod()) // 4 for g in grids]
    input_ids, attention_mask = reward._batch_tokens(PROMPTS[:2], pads)
    assert input_ids.tolist() == batch["input_ids"].tolist()
    assert attention_mask.tolist() == batch["attention_mask"].tolist()
    reward_id = reward.tokenizer.convert_tokens_to_ids("<|Reward|>")
    assert reward_id == len(reward.tokenizer) - 1 == reward.modules["language_model"].embed_tokens.num_embeddings - 1
    assert ((input_ids == reward_id).sum(dim=1) == 1).all()


def test_batched_scores_equal_one_at_a_time(tiny_weights):
    from fluxgrpo.rewards.hpsv3 import HpsV3Reward

    reward = HpsV3Reward(hpsv3_dir(tiny_weights.hps_dir), batch_size=2)
    images = torch.rand(5, 3, 80, 48, generator=torch.Generator().manual_seed(5))
    prompts = [PROMPTS[i % 3] for i in range(5)]  # different lengths: right padding inside each batch
    batched = reward(images, prompts)
    single = torch.cat([reward(images[i : i + 1], [prompts[i]]) for i in range(5)])
    torch.testing.assert_close(batched, single, rtol=0, atol=1e-5)


def test_bf16_is_the_authors_dtype_with_a_float32_head(tiny_weights, reward):
    from fluxgrpo.rewards.hpsv3 import HpsV3Reward

    bf16 = HpsV3Reward(hpsv3_dir(tiny_weights.hps_dir), compute_dtype=torch.bfloat16)
    dtypes = {name: p.dtype for name, p in bf16.modules.named_parameters()}
    assert {d for n, d in dtypes.items() if not n.startswith("rm_head.")} == {torch.bfloat16}
    assert {d for n, d in dtypes.items() if n.startswith("rm_head.")} == {torch.float32}
    images = torch.rand(3, 3, 64, 64, generator=torch.Generator().manual_seed(6))
    scores = bf16(images, PROMPTS)
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores, reward(images, PROMPTS), rtol=0, atol=0.05)


def test_prompt_with_qwen_special_tokens_is_refused(reward):
    with pytest.raises(ValueError, match="special tokens"):
        reward(torch.rand(1, 3, 64, 64), ["a cat <|Reward|>"])


# -- loading -----------------------------------------------------------------------------------------------------------


def test_registry_layout_and_missing_weights(tiny_weights, tmp_path):
    from fluxgrpo.rewards import load_reward, reward_names, reward_weights_status
    from fluxgrpo.rewards.hpsv3 import HpsV3Reward

    assert "hpsv3" in reward_names()
    assert isinstance(load_reward("hpsv3", tiny_weights.hps_dir), HpsV3Reward)
    assert [s.complete for s in reward_weights_status("hpsv3", tiny_weights.hps_dir)] == [True]
    with pytest.raises(FluxgrpoError, match=r"fetch-weights --only hpsv3 --hps-dir"):
        load_reward("hpsv3", tmp_path / "nothing")


def _copy_without_manifests(tiny_weights, tmp_path):
    folder = hpsv3_dir(tmp_path / "hps")
    shutil.copytree(hpsv3_dir(tiny_weights.hps_dir), folder, ignore=shutil.ignore_patterns("manifest.json"))
    return folder


def test_checkpoint_in_current_transformers_names_scores_the_same(tiny_weights, reward, tmp_path):
    from fluxgrpo.rewards.hpsv3 import HpsV3Reward

    folder = _copy_without_manifests(tiny_weights, tmp_path)
    checkpoint = folder / "model" / "HPSv3.safetensors"
    state = load_file(checkpoint)
    renamed = {
        (
            "model." + k
            if k.startswith("visual.")
            else "model.language_model." + k[6:]
            if k.startswith("model.")
            else k
        ): v
        for k, v in state.items()
    }
    save_file(renamed, checkpoint)
    images = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(HpsV3Reward(folder)(images, PROMPTS[:2]), reward(images, PROMPTS[:2]), rtol=0, atol=0)


def test_a_checkpoint_that_does_not_fit_is_refused_in_one_line(tiny_weights, tmp_path):
    from fluxgrpo.rewards import load_reward

    folder = _copy_without_manifests(tiny_weights, tmp_path)
    checkpoint = folder / "model" / "HPSv3.safetensors"
    state = load_file(checkpoint)
    del state["rm_head.5.weight"]
    save_file(state, checkpoint)
    with pytest.raises(FluxgrpoError, match=r"missing rm_head\.5\.weight.*fetch-weights --only hpsv3") as exc:
        load_reward("hpsv3", folder.parent)
    assert "\n" not in str(exc.value)


def test_a_truncated_checkpoint_placed_by_hand_is_reported(tiny_weights, tmp_path):
    from fluxgrpo.weights.layout import check_hpsv3_dir

    folder = _copy_without_manifests(tiny_weights, tmp_path)
    assert check_hpsv3_dir(folder).complete
    checkpoint = folder / "model" / "HPSv3.safetensors"
    checkpoint.write_bytes(checkpoint.read_bytes()[:-100])
    status = check_hpsv3_dir(folder)
    assert not status.complete and "truncated" in status.problems[0]
    assert "fetch-weights --only hpsv3" in status.fix


def test_a_tokenizer_that_is_not_the_checkpoints_is_refused(tiny_weights, tmp_path):
    from fluxgrpo.rewards import load_reward

    folder = _copy_without_manifests(tiny_weights, tmp_path)
    checkpoint = folder / "model" / "HPSv3.safetensors"
    state = load_file(checkpoint)
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        state[key] = torch.cat([state[key], state[key][:1]])  # one row more than the tokenizer has
    save_file(state, checkpoint)
    with pytest.raises(FluxgrpoError, match="not the one HPSv3 was trained with"):
        load_reward("hpsv3", folder.parent)


# -- fetch-weights --only hpsv3 ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["hf", "modelscope"])
def test_hpsv3_from_either_hub_fetches_only_what_it_needs_and_loads_as_served(
    tiny_weights, tmp_path, monkeypatch, source
):
    from fakehub import FakeHub, FakeRepo, isolate_hub_environment
    from typer.testing import CliRunner

    from fluxgrpo.cli.app import app
    from fluxgrpo.rewards import load_reward
    from fluxgrpo.weights.layout import check_hpsv3_dir
    from fluxgrpo.weights.manifest import read_manifest

    isolate_hub_environment(tmp_path, monkeypatch)
    served = hpsv3_dir(tiny_weights.hps_dir)
    model_repo, base_repo = tmp_path / "served" / "hpsv3", tmp_path / "served" / "qwen2-vl"
    shutil.copytree(served / "model", model_repo, ignore=shutil.ignore_patterns("manifest.json"))
    (model_repo / "README.md").write_text("HPSv3\n")
    shutil.copytree(served / "base", base_repo, ignore=shutil.ignore_patterns("manifest.json"))
    # The base model's own weights and neighbours are never fetched: HPSv3.safetensors holds every weight.
    (base_repo / "model-00001-of-00005.safetensors").write_bytes(b"0" * 64)
    (base_repo / "chat_template.json").write_text(json.dumps({"chat_template": QWEN2_VL_CHAT_TEMPLATE}))
    repos = [FakeRepo("MizzenAI/HPSv3", model_repo), FakeRepo("Qwen/Qwen2-VL-7B-Instruct", base_repo)]
    hps_dir = tmp_path / "hps_ckpt"
    common = ["--flux-dir", str(tmp_path / "flux"), "--hps-dir", str(hps_dir), "--only", "hpsv3", "--json"]
    with FakeHub(source, repos) as hub:
        result = CliRunner().invoke(app, ["fetch-weights", "--source", source, "--endpoint", hub.url, *common])
        assert result.exit_code == 0, result.output
        fetched = sorted((repo, path) for repo, path, _ in hub.content_requests())
    assert fetched == [
        ("MizzenAI/HPSv3", "HPSv3.safetensors"),
        ("Qwen/Qwen2-VL-7B-Instruct", "config.json"),
        ("Qwen/Qwen2-VL-7B-Instruct", "tokenizer.json"),
        ("Qwen/Qwen2-VL-7B-Instruct", "tokenizer_config.json"),
    ]
    status = check_hpsv3_dir(hpsv3_dir(hps_dir))
    assert status.complete and status.source == source, status.problems
    assert read_manifest(hpsv3_dir(hps_dir) / "model").repo == "MizzenAI/HPSv3"
    images = torch.rand(2, 3, 48, 64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(
        load_reward("hpsv3", hps_dir)(images, PROMPTS[:2]),
        load_reward("hpsv3", tiny_weights.hps_dir)(images, PROMPTS[:2]),
        rtol=0,
        atol=0,
    )


# Qwen/Qwen2-VL-7B-Instruct's config.json (the values that shape the model).
QWEN2_VL_7B_CONFIG = {
    "model_type": "qwen2_vl",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "vision_config": {
        "depth": 32,
        "embed_dim": 1280,
        "mlp_ratio": 4,
        "num_heads": 16,
        "in_chans": 3,
        "hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vocab_size": 152064,
}
# MizzenAI/HPSv3's HPSv3.safetensors: 16,584,387,300 bytes holding 736 tensors.
PUBLISHED_CHECKPOINT_BYTES, PUBLISHED_TENSORS = 16_584_387_300, 736


def test_parameter_count_is_the_published_checkpoints_and_the_memory_models():
    from fluxgrpo.rewards.hpsv3 import build_hpsv3_modules, read_base_config_values
    from fluxgrpo.rewards.registry import reward_record

    rows = 151_657 + 1  # Qwen2-VL's tokenizer with <|Reward|>
    modules = build_hpsv3_modules(read_base_config_values(dict(QWEN2_VL_7B_CONFIG), rows), empty=True)
    parameters = sum(p.numel() for p in modules.parameters())
    assert parameters == reward_record("hpsv3").parameters
    # Every tensor of the published file in bfloat16, lm_head included, leaves a JSON header of 64–160 bytes per tensor
    # (name, dtype, shape, offsets): our build is its architecture (152,064 rows or a float32 head would not fit).
    tensors = len(modules.state_dict()) + 1  # + lm_head.weight
    assert tensors == PUBLISHED_TENSORS
    header = PUBLISHED_CHECKPOINT_BYTES - 2 * (parameters + rows * QWEN2_VL_7B_CONFIG["hidden_size"])
    assert 64 * tensors < header < 160 * tensors, header


# -- training, evaluation and `fluxgrpo score` -------------------------------------------------------------------------


def test_trains_on_hpsv3_and_evaluates_with_it_as_score_does(tiny_weights, tiny_embeddings, tmp_path, monkeypatch):
    """One iteration with HPSv3 as the training reward and, beside it, as an eval reward; the eval's logged score is
    what `fluxgrpo score` (the PIL path) gives the saved images, computed by the training model itself (fp32: the
    same model `score` loads), not by a second copy on rank 0."""
    import math

    from training_helpers import run, tiny_config

    from fluxgrpo.metrics import read_metrics
    from fluxgrpo.rewards import scoring
    from fluxgrpo.score import ScoreRequest, score

    loaded: list[str] = []
    real_load_scorer = scoring.load_scorer

    def load_scorer(name, hps_dir, device):
        loaded.append(name)
        return real_load_scorer(name, hps_dir, device)

    monkeypatch.setattr(scoring, "load_scorer", load_scorer)  # the evaluation looks it up there

    prompts = tmp_path / "eval_prompts.txt"
    prompts.write_text("a lighthouse in a storm, oil painting\na cat on a windowsill, photo\n")
    cfg = tiny_config(
        tiny_weights,
        tiny_embeddings,
        tmp_path / "out",
        reward="hpsv3",
        max_train_steps=1,
        checkpointing_steps=1,
        eval_every=1,
        eval_prompts=str(prompts),
        eval_images_per_prompt=1,
        eval_steps=2,
        eval_rewards="brightness",
    )
    records = run(cfg)
    assert loaded == ["brightness"]  # the eval-only reward; HPSv3 is the training model
    trained = next(r for r in records if "reward_mean" in r)
    assert math.isfinite(trained["reward_mean"]) and trained["reward_std"] > 0
    assert trained["first_abs_log_ratio"] < 1e-4  # the ratio is 1 before the first update
    evals = {r["iteration"]: r for r in read_metrics(tmp_path / "out") if "eval_hpsv3_mean" in r}
    assert sorted(evals) == [0, 1]
    report = score(
        ScoreRequest(index=str(tmp_path / "out" / "eval" / "iteration-1"), reward="hpsv3", hps_dir=cfg.hps_dir)
    )
    assert evals[1]["eval_hpsv3_mean"] == report.overall.mean
