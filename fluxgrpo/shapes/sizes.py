"""The shapes world model's sizes, without the world: what ``models/known.py`` (imported with every config, so on
``--help``'s path) names the ``shapes`` model family by, and what the builder builds (``lab/plan.py``)."""

from __future__ import annotations

from typing import Any

# The shipped build's layout (``fluxgrpo/shapes/weights``), read by ``fetch-weights --source shapes`` and written by
# the builder: a diffusers FLUX folder, the tiny HPS, and the build's record.
BUILD_INFO = "build.json"
FLUX_SUBDIR = "flux"
HPS_SUBDIR = "hps"

# The world's captions are at most 8 words ("a red circle left of a yellow square"), 9 T5 tokens with the end token:
# the world's configs pad T5 to this length instead of FLUX's 512.
WORLD_TEXT_LENGTH = 12

# FLUX's parts at laptop size. The transformer sees 16 image tokens (a 64² image) and 12 text tokens.
WORLD_TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 64,  # 16 latent channels x 2x2 packing
    "num_layers": 2,
    "num_single_layers": 2,
    "attention_head_dim": 32,
    "num_attention_heads": 4,
    "joint_attention_dim": 32,  # = the T5's d_model
    "pooled_projection_dim": 32,  # = the CLIP's hidden size
    "guidance_embeds": True,
    "axes_dims_rope": (8, 12, 12),  # each even, summing to attention_head_dim
}
WORLD_VAE_CONFIG: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "block_out_channels": (8, 16, 32, 32),
    "layers_per_block": 1,
    "latent_channels": 16,
    "norm_num_groups": 4,
    "sample_size": 64,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}
