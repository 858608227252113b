"""Tiny random reward models, built offline and seeded, with the real architecture classes of each reward.

They live beside the rewards (not in ``models/tiny.py``, which is FLUX's) because each copies its reward's
architecture and preprocessing settings; each reward's tiny writer (its record's ``write_tiny``) saves them in exactly
the real files' layout, so tests and the CPU quickstart load them through the same code as the real weights. The
tiny ImageReward and HPSv3 are built in their own modules, which own the architecture code they need.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from open_clip.model import CLIP
from transformers import CLIPConfig, CLIPModel

from fluxgrpo.rewards.base import CLIP_MEAN, CLIP_STD
from fluxgrpo.tiny_tokenizers import CLIP_MAX_LENGTH, build_tiny_clip_tokenizer

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

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CLIP(**copy.deepcopy(TINY_REWARD_CONFIG))
    return model.eval()


def build_tiny_pickscore_model(seed: int = 0) -> CLIPModel:
    """A random transformers CLIPModel shaped like PickScore's (a CLIP with projections), shrunk; seeded.

    The vision tower takes 224 x 224 inputs, what the processor config produces (49 patches of 32); the text tower
    uses the tiny CLIP tokenizer's 514 ids with CLIP's 77 positions. The global RNG is left untouched.
    """

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
