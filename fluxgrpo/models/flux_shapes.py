"""FLUX's parameter shapes from its config.json alone, without diffusers: what ``train``'s memory estimate reads off
the model before any worker starts.

Building ``FluxTransformer2DModel`` and ``AutoencoderKL`` on the meta device gives the same numbers, but importing
diffusers to do it costs the launching command 10-15 s on a loaded 2-core host (diffusers imports every model family
it ships, peft, transformers and scipy with them), ahead of, and in addition to, the workers' own import. The
architectures below are diffusers' (``transformer_flux.py``, ``autoencoder_kl.py``); a config with a key they do not
model gets None, and the caller builds the model on the meta device instead. The tests compare both ways on every
known model.
"""

from __future__ import annotations

from typing import Any

Shapes = dict[str, tuple[int, ...]]

# FluxTransformer2DModel's arguments (diffusers 0.35 - 0.42); a config with any other key is not modelled here.
TRANSFORMER_KEYS = frozenset(
    {
        "patch_size",
        "in_channels",
        "out_channels",
        "num_layers",
        "num_single_layers",
        "attention_head_dim",
        "num_attention_heads",
        "joint_attention_dim",
        "pooled_projection_dim",
        "guidance_embeds",
        "axes_dims_rope",
    }
)
TIMESTEP_CHANNELS = 256  # the sinusoidal timestep (and guidance) projection's width
MLP_RATIO = 4  # FeedForward's and the single block's MLP width, in multiples of the model width

# AutoencoderKL's arguments that change its parameters, and the ones that do not (scaling, sizes, dtype hints).
VAE_KEYS = frozenset(
    {
        "in_channels",
        "out_channels",
        "down_block_types",
        "up_block_types",
        "block_out_channels",
        "layers_per_block",
        "latent_channels",
        "norm_num_groups",
        "use_quant_conv",
        "use_post_quant_conv",
        "mid_block_add_attention",
        "act_fn",
        "sample_size",
        "scaling_factor",
        "shift_factor",
        "latents_mean",
        "latents_std",
        "force_upcast",
    }
)


def _modelled(config: dict[str, Any], keys: frozenset[str]) -> bool:
    """Every key is one the architecture below models (diffusers' own ``_class_name``, ``_diffusers_version``,
    ``_name_or_path`` … say nothing about shapes)."""
    return all(key in keys or key.startswith("_") for key in config)


def _linear(shapes: Shapes, linears: dict[str, tuple[int, int]], name: str, d_in: int, d_out: int) -> None:
    linears[name] = (d_in, d_out)
    shapes[f"{name}.weight"] = (d_out, d_in)
    shapes[f"{name}.bias"] = (d_out,)


def transformer_layout(config: dict[str, Any]) -> tuple[Shapes, dict[str, tuple[int, int]]] | None:
    """(parameter name → shape, in ``named_parameters`` order; Linear module name → (in, out) features, in
    ``named_modules`` order) of ``FluxTransformer2DModel.from_config(config)``; None for a config it does not model."""
    if not _modelled(config, TRANSFORMER_KEYS):
        return None
    get = config.get
    heads, head_dim = int(get("num_attention_heads", 24)), int(get("attention_head_dim", 128))
    dim = heads * head_dim
    in_channels = int(get("in_channels", 64))
    out_channels = int(get("out_channels") or in_channels)
    patch = int(get("patch_size", 1))
    shapes: Shapes = {}
    linears: dict[str, tuple[int, int]] = {}
    embedders = ["timestep_embedder", *(["guidance_embedder"] if get("guidance_embeds", False) else [])]
    for embedder in embedders:
        _linear(shapes, linears, f"time_text_embed.{embedder}.linear_1", TIMESTEP_CHANNELS, dim)
        _linear(shapes, linears, f"time_text_embed.{embedder}.linear_2", dim, dim)
    _linear(shapes, linears, "time_text_embed.text_embedder.linear_1", int(get("pooled_projection_dim", 768)), dim)
    _linear(shapes, linears, "time_text_embed.text_embedder.linear_2", dim, dim)
    _linear(shapes, linears, "context_embedder", int(get("joint_attention_dim", 4096)), dim)
    _linear(shapes, linears, "x_embedder", in_channels, dim)
    mlp = dim * MLP_RATIO
    for i in range(int(get("num_layers", 19))):
        block = f"transformer_blocks.{i}"
        _linear(shapes, linears, f"{block}.norm1.linear", dim, 6 * dim)
        _linear(shapes, linears, f"{block}.norm1_context.linear", dim, 6 * dim)
        _attention(shapes, linears, f"{block}.attn", dim, head_dim, joint=True)
        for ff in ("ff", "ff_context"):
            _linear(shapes, linears, f"{block}.{ff}.net.0.proj", dim, mlp)
            _linear(shapes, linears, f"{block}.{ff}.net.2", mlp, dim)
    for i in range(int(get("num_single_layers", 38))):
        block = f"single_transformer_blocks.{i}"
        _linear(shapes, linears, f"{block}.norm.linear", dim, 3 * dim)
        _linear(shapes, linears, f"{block}.proj_mlp", dim, mlp)
        _linear(shapes, linears, f"{block}.proj_out", dim + mlp, dim)
        _attention(shapes, linears, f"{block}.attn", dim, head_dim, joint=False)
    _linear(shapes, linears, "norm_out.linear", dim, 2 * dim)
    _linear(shapes, linears, "proj_out", dim, patch * patch * out_channels)
    return shapes, linears


def _attention(
    shapes: Shapes, linears: dict[str, tuple[int, int]], name: str, dim: int, head_dim: int, *, joint: bool
) -> None:
    """FluxAttention: q/k/v (and, in a double block, the text stream's own projections and output)."""
    shapes[f"{name}.norm_q.weight"] = (head_dim,)
    shapes[f"{name}.norm_k.weight"] = (head_dim,)
    for projection in ("to_q", "to_k", "to_v"):
        _linear(shapes, linears, f"{name}.{projection}", dim, dim)
    if not joint:  # a single block's attention is pre-only: its output goes through the block's proj_out
        return
    _linear(shapes, linears, f"{name}.to_out.0", dim, dim)
    shapes[f"{name}.norm_added_q.weight"] = (head_dim,)
    shapes[f"{name}.norm_added_k.weight"] = (head_dim,)
    for projection in ("add_q_proj", "add_k_proj", "add_v_proj"):
        _linear(shapes, linears, f"{name}.{projection}", dim, dim)
    _linear(shapes, linears, f"{name}.to_add_out", dim, dim)


def _conv(c_in: int, c_out: int, kernel: int) -> int:
    return c_in * c_out * kernel * kernel + c_out


def _resnet(c_in: int, c_out: int) -> int:
    """ResnetBlock2D without a time embedding: two GroupNorms, two 3×3 convs, a 1×1 shortcut when widths differ."""
    shortcut = _conv(c_in, c_out, 1) if c_in != c_out else 0
    return 2 * c_in + _conv(c_in, c_out, 3) + 2 * c_out + _conv(c_out, c_out, 3) + shortcut


def _mid_block(channels: int, attention: bool) -> int:
    """UNetMidBlock2D: two resnets and, between them, one single-head attention with its GroupNorm."""
    attention_parameters = 2 * channels + 4 * (channels * channels + channels) if attention else 0
    return 2 * _resnet(channels, channels) + attention_parameters


def vae_parameter_count(config: dict[str, Any]) -> int | None:
    """The parameters of ``AutoencoderKL.from_config(config)``; None for a config it does not model."""
    get = config.get
    down_types = tuple(get("down_block_types", ("DownEncoderBlock2D",)))
    up_types = tuple(get("up_block_types", ("UpDecoderBlock2D",)))
    if (
        not _modelled(config, VAE_KEYS)
        or {*down_types} != {"DownEncoderBlock2D"}
        or {*up_types} != {"UpDecoderBlock2D"}
    ):
        return None
    channels = [int(c) for c in get("block_out_channels", (64,))]
    if len(channels) != len(down_types) or len(channels) != len(up_types):
        return None
    layers = int(get("layers_per_block", 1))
    latent = int(get("latent_channels", 4))
    attention = bool(get("mid_block_add_attention", True))
    total = 0
    # encoder: conv_in, down blocks (each but the last halves the size with a 3×3 conv), mid block, norm, conv_out
    total += _conv(int(get("in_channels", 3)), channels[0], 3)
    previous = channels[0]
    for i, width in enumerate(channels):
        total += sum(_resnet(previous if j == 0 else width, width) for j in range(layers))
        total += _conv(width, width, 3) if i < len(channels) - 1 else 0
        previous = width
    total += _mid_block(channels[-1], attention) + 2 * channels[-1] + _conv(channels[-1], 2 * latent, 3)
    # decoder: conv_in, mid block, up blocks (one resnet more each; all but the last double the size), norm, conv_out
    total += _conv(latent, channels[-1], 3) + _mid_block(channels[-1], attention)
    previous = channels[-1]
    for i, width in enumerate(reversed(channels)):
        total += sum(_resnet(previous if j == 0 else width, width) for j in range(layers + 1))
        total += _conv(width, width, 3) if i < len(channels) - 1 else 0
        previous = width
    total += 2 * channels[0] + _conv(channels[0], int(get("out_channels", 3)), 3)
    total += _conv(2 * latent, 2 * latent, 1) if get("use_quant_conv", True) else 0
    total += _conv(latent, latent, 1) if get("use_post_quant_conv", True) else 0
    return total
