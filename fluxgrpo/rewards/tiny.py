"""Tiny random reward models, built offline and seeded, with the real architecture classes of each reward.

They live beside the rewards (not in ``models/tiny.py``, which is FLUX's) because each copies its reward's
architecture and preprocessing settings; ``models/tiny_weights.py`` saves them in exactly the real files' layout, so
tests and the CPU quickstart load them through the same code as the real weights.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from fluxgrpo.models.tiny import CLIP_MAX_LENGTH, build_tiny_clip_tokenizer
from fluxgrpo.rewards.base import CLIP_MEAN, CLIP_STD

if TYPE_CHECKING:
    from open_clip.model import CLIP
    from transformers import CLIPModel

# open_clip model config (the format of open_clip's model_configs/*.json). The tokenizer is open_clip's real one
# (49408 tokens, context 77), so the text tower's vocabulary matches ViT-H-14's.
TINY_REWARD_CONFIG: dict[str, Any] = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 224, "layers": 1, "width": 32, "head_width": 16, "patch_size": 32},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}

# The CLIP image processor settings PickScore is used with (laion/CLIP-ViT-H-14-laion2B-s32B-b79K, OpenAI CLIP's
# preprocessing): shortest side to 224 bicubic, centre crop 224, OpenAI CLIP mean and std. Written in the legacy
# feature-extractor form many CLIP repos still ship; CLIPImageProcessor reads both forms.
PICKSCORE_PROCESSOR_CONFIG: dict[str, Any] = {
    "crop_size": 224,
    "do_center_crop": True,
    "do_normalize": True,
    "do_resize": True,
    "feature_extractor_type": "CLIPFeatureExtractor",
    "image_mean": list(CLIP_MEAN),
    "image_std": list(CLIP_STD),
    "resample": 3,  # PIL bicubic
    "size": 224,
}


def build_tiny_reward_model(seed: int = 0) -> CLIP:
    """A random open_clip CLIP with the TINY_REWARD_CONFIG architecture, seeded; the global RNG is untouched."""
    import torch
    from open_clip.model import CLIP

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CLIP(**copy.deepcopy(TINY_REWARD_CONFIG))
    return model.eval()


def build_tiny_pickscore_model(seed: int = 0) -> CLIPModel:
    """A random transformers CLIPModel shaped like PickScore's (a CLIP with projections), shrunk; seeded.

    The vision tower takes 224 x 224 inputs, what the processor config produces (49 patches of 32); the text tower
    uses the tiny CLIP tokenizer's 514 ids with CLIP's 77 positions. The global RNG is left untouched.
    """
    import torch
    from transformers import CLIPConfig, CLIPModel

    tokenizer = build_tiny_clip_tokenizer()
    config = CLIPConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 32,
            "intermediate_size": 37,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "max_position_embeddings": CLIP_MAX_LENGTH,
            "hidden_act": "gelu",
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "image_size": PICKSCORE_PROCESSOR_CONFIG["crop_size"],
            "patch_size": 32,
            "hidden_size": 32,
            "intermediate_size": 37,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "hidden_act": "gelu",
        },
        projection_dim=16,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CLIPModel(config)
    return model.eval()


# ImageReward: a BLIP-shaped ViT (one block, patch 32 at 224) and a one-layer BERT with cross-attention, in the shape
# of the real med_config.json; the vocabulary is bert-base-uncased's special tokens plus lower-case characters and a
# few words (WordPiece spells the rest), and BLIP adds [DEC] and [ENC] on load.
TINY_IMAGEREWARD_VISION: dict[str, Any] = {
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "patch_size": 32,
    "mlp_ratio": 2,
}
_BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_TINY_BERT_WORDS = ["a", "the", "of", "in", "on", "and", "with", "cat", "dog", "red", "fox", "snow", "castle", "hill"]


def tiny_bert_vocab() -> list[str]:
    """WordPiece vocabulary: specials (bert's ids 0..4 order differs; only names matter), characters, a few words."""
    characters = list("abcdefghijklmnopqrstuvwxyz0123456789.,;:!?'\"-()&/")
    words = [w for w in _TINY_BERT_WORDS if w not in characters]
    return [*_BERT_SPECIALS, *characters, *(f"##{c}" for c in characters), *words]


def tiny_imagereward_med_config() -> dict[str, Any]:
    """med_config.json of the tiny ImageReward (the real one's keys; vocab = tiny vocabulary + [DEC] + [ENC])."""
    return {
        "architectures": ["BertModel"],
        "attention_probs_dropout_prob": 0.1,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "hidden_size": 32,
        "initializer_range": 0.02,
        "intermediate_size": 37,
        "layer_norm_eps": 1e-12,
        "max_position_embeddings": 64,
        "model_type": "bert",
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "pad_token_id": 0,
        "type_vocab_size": 2,
        "vocab_size": len(tiny_bert_vocab()) + 2,
        "encoder_width": TINY_IMAGEREWARD_VISION["hidden_size"],
        "add_cross_attention": True,
    }


def build_tiny_imagereward_state(seed: int = 0) -> dict[str, Any]:
    """A random tiny ImageReward's weights under the authors' checkpoint keys; seeded, global RNG untouched.

    The head gets weights of std 1.5/√fan_in so scores vary visibly with the image (the real head's init, std
    1/769, would make every tiny score the same to many digits).
    """
    import torch

    from fluxgrpo.rewards.imagereward import authors_state_dict, build_imagereward_modules

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vision, text, head = build_imagereward_modules(tiny_imagereward_med_config(), TINY_IMAGEREWARD_VISION)
        for layer in head:
            if isinstance(layer, torch.nn.Linear):
                torch.nn.init.normal_(layer.weight, std=1.5 / layer.in_features**0.5)
                torch.nn.init.normal_(layer.bias, std=0.1)
    return authors_state_dict(vision, text, head)


# HPSv3: a Qwen2-VL with two decoder layers of width 32 and two vision blocks (the real patch, merge and temporal sizes,
# so images go through exactly the real preprocessing), and the real rm_head shape. The tokenizer is byte-level BPE
# with Qwen2's special tokens after the 256 byte symbols and merges that spell each word of the authors' instruction
# (so a conversation is ~700 tokens, not ~2900 bytes).
QWEN2_VL_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
TINY_HPSV3_VISION: dict[str, Any] = {
    "depth": 2,
    "embed_dim": 32,
    "hidden_size": 32,
    "mlp_ratio": 2,
    "num_heads": 2,
    "in_chans": 3,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}


def build_tiny_qwen2_tokenizer() -> Any:
    """A Qwen2 tokenizer: the 256 byte symbols, merges spelling the instruction's words, then Qwen2-VL's specials."""
    from transformers import Qwen2Tokenizer

    from fluxgrpo.models.tiny import byte_level_symbols
    from fluxgrpo.rewards.hpsv3 import INSTRUCTION, RATING_REQUEST

    symbols = byte_level_symbols()
    bytes_only = Qwen2Tokenizer(vocab={s: i for i, s in enumerate(symbols)}, merges=[])
    pieces = bytes_only.backend_tokenizer.pre_tokenizer.pre_tokenize_str(INSTRUCTION + RATING_REQUEST)
    vocab = {s: i for i, s in enumerate(symbols)}
    merges: list[tuple[str, str]] = []
    for piece, _ in pieces:
        for end in range(2, len(piece) + 1):  # "Ġwor" + "d" → "Ġword", one merge per prefix
            left, right = piece[: end - 1], piece[end - 1]
            if piece[:end] not in vocab:
                vocab[piece[:end]] = len(vocab)
                merges.append((left, right))
    tokenizer = Qwen2Tokenizer(
        vocab=vocab, merges=merges, unk_token=None, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN2_VL_SPECIAL_TOKENS[1:])})
    return tokenizer


def tiny_hpsv3_base_config(tokenizer: Any) -> dict[str, Any]:
    """config.json of the tiny Qwen2-VL, in the real Qwen2-VL-7B-Instruct file's (flat, transformers 4.4x) format."""
    ids = dict(
        zip(QWEN2_VL_SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(list(QWEN2_VL_SPECIAL_TOKENS)), strict=True)
    )
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "attention_dropout": 0.0,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "hidden_act": "silu",
        "hidden_size": 32,
        "initializer_range": 0.02,
        "intermediate_size": 64,
        "max_position_embeddings": 4096,
        "max_window_layers": 2,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 4096,  # unused: use_sliding_window is false, as in the real config
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vision_config": dict(TINY_HPSV3_VISION),
        # head_dim 8: four rotary frequencies, split over (time, height, width) as the real [16, 24, 24] splits 64
        "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
        "vocab_size": len(tokenizer) + 2,  # the config's row count is padded past the tokenizer's, as the real one is
    }


# The decoder's query and key weights: random weights of the usual 0.02 make attention nearly uniform, so the tiny
# model would not tell rotary positions apart (what the plain-positions and rounded-tables tests check); much larger
# ones make it chaotic, so that the 8-bit rounding of the PIL path moves its scores more than their spread.
TINY_HPSV3_ATTENTION_STD = 0.35


def build_tiny_hpsv3_state(tokenizer: Any, seed: int = 0) -> dict[str, Any]:
    """A random tiny HPSv3's weights under the authors' checkpoint keys (transformers 4.45 names, ``lm_head`` kept),
    all bfloat16 as in the real file; seeded, global RNG untouched.

    The embeddings have one row per token with ``<|Reward|>`` added; the head gets weights of std 1.5/√fan_in so
    scores vary visibly with the image, the decoder's query and key projections ``TINY_HPSV3_ATTENTION_STD``.
    """
    import torch

    from fluxgrpo.rewards.hpsv3 import authors_key, build_hpsv3_modules, read_base_config_values

    rows = len(tokenizer) + 1  # <|Reward|>
    config = read_base_config_values(tiny_hpsv3_base_config(tokenizer), rows)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        modules = build_hpsv3_modules(config)
        for layer in modules["rm_head"]:
            if isinstance(layer, torch.nn.Linear):
                torch.nn.init.normal_(layer.weight, std=1.5 / layer.in_features**0.5)
                torch.nn.init.normal_(layer.bias, std=0.1)
        for layer in modules["language_model"].layers:  # attention sharp enough that positions matter
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                torch.nn.init.normal_(projection.weight, std=TINY_HPSV3_ATTENTION_STD)
        lm_head = torch.randn(rows, config.text_config.hidden_size) * 0.02
    state = {authors_key(key): value for key, value in modules.state_dict().items()}
    state["lm_head.weight"] = lm_head
    return {key: value.to(torch.bfloat16).contiguous() for key, value in state.items()}
