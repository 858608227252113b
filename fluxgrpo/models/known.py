"""The models a training config can name (its ``model_family``), with the shapes that size a run, known without
their weights: so ``train --dry-run`` on a laptop plans a FLUX.1-dev cluster run from FLUX.1-dev's shapes, whatever
``--model`` holds there, and says when the weights on disk are another model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fluxgrpo.models.tiny import TINY_TRANSFORMER_CONFIG, TINY_VAE_CONFIG
from fluxgrpo.shapes.sizes import WORLD_TEXT_LENGTH, WORLD_TRANSFORMER_CONFIG, WORLD_VAE_CONFIG

# The modules LoRA adapts by default (--lora-targets; fluxgrpo/lora.py adds the adapters), by FLUX's module names:
# Flow-GRPO's FLUX targets, every attention projection of both streams and the double blocks' MLPs (the single
# blocks' attention shares the to_q/to_k/to_v names, so it is adapted too).
LORA_DEFAULT_TARGETS = (
    "attn.to_q,attn.to_k,attn.to_v,attn.to_out.0,attn.add_q_proj,attn.add_k_proj,attn.add_v_proj,attn.to_add_out,"
    "ff.net.0.proj,ff.net.2,ff_context.net.0.proj,ff_context.net.2"
)
# FLUX.1-dev's transformer/config.json and vae/config.json (11.9 B and 83.8 M parameters).
FLUX_DEV_TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}
FLUX_DEV_VAE_CONFIG: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "block_out_channels": (128, 256, 512, 512),
    "layers_per_block": 2,
    "act_fn": "silu",
    "latent_channels": 16,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    "force_upcast": True,
    "mid_block_add_attention": True,
}
# The transformer config keys that decide its size: two folders agreeing on these hold the same model's shapes.
SIZING_KEYS = (
    "in_channels",
    "num_layers",
    "num_single_layers",
    "attention_head_dim",
    "num_attention_heads",
    "joint_attention_dim",
    "pooled_projection_dim",
)
WEIGHTS = "weights"  # the model_family that means "whatever --model holds": sized from its config.json


@dataclass(frozen=True)
class KnownModel:
    name: str  # the model_family value
    title: str  # for messages
    transformer: dict[str, Any]
    vae: dict[str, Any]
    text_tokens: int  # the T5 sequence length its embeddings have
    # What `fluxgrpo sample` defaults to when --model holds it: (image side in pixels, T5 tokens). FLUX.1-dev's
    # training recipe's 720 and 512 unless the model was trained at its own (the shapes world: 64 and 12).
    sample_defaults: tuple[int, int] = (720, 512)
    # `fluxgrpo sample --steps`'s default: FLUX.1-dev's 28, or the steps its own evaluation samples with (the shapes
    # configs' eval_steps 12), so a sample looks like the run's held-out grids.
    sample_steps: int = 28
    # `fluxgrpo sample --guidance`'s default: FLUX.1-dev's 3.5, or the distilled guidance the model's own configs
    # roll out and evaluate at (the shapes world: 1.75, where its best-of-32 headroom passes 0.9).
    sample_guidance: float = 3.5

    def matches(self, transformer_config: dict[str, Any]) -> bool:
        return all(transformer_config.get(key) == self.transformer.get(key) for key in SIZING_KEYS)


KNOWN_MODELS: dict[str, KnownModel] = {
    "flux-dev": KnownModel("flux-dev", "FLUX.1-dev", FLUX_DEV_TRANSFORMER_CONFIG, FLUX_DEV_VAE_CONFIG, 512),
    "tiny": KnownModel(
        "tiny", "the tiny random FLUX (fetch-weights --source tiny)", TINY_TRANSFORMER_CONFIG, TINY_VAE_CONFIG, 32
    ),
    "shapes": KnownModel(
        "shapes",
        "the shapes world's pretrained FLUX (fetch-weights --source shapes)",
        WORLD_TRANSFORMER_CONFIG,
        WORLD_VAE_CONFIG,
        WORLD_TEXT_LENGTH,
        sample_defaults=(WORLD_VAE_CONFIG["sample_size"], WORLD_TEXT_LENGTH),
        sample_steps=12,
        sample_guidance=1.75,
    ),
}
MODEL_FAMILIES = (*KNOWN_MODELS, WEIGHTS)


def known_model(transformer_config: dict[str, Any]) -> KnownModel | None:
    """The known model a transformer config is, or None."""
    return next((model for model in KNOWN_MODELS.values() if model.matches(transformer_config)), None)


def identify(transformer_config: dict[str, Any]) -> str:
    """What a transformer config is, in words: a known model's title, or its size."""
    known = known_model(transformer_config)
    if known is not None:
        return known.title
    blocks = f"{transformer_config.get('num_layers')} + {transformer_config.get('num_single_layers')} blocks"
    heads, dim = transformer_config.get("num_attention_heads"), transformer_config.get("attention_head_dim")
    width = heads * dim if isinstance(heads, int) and isinstance(dim, int) else "?"
    return f"a FLUX-architecture model of {blocks}, width {width}"
