"""The parts one rank measures.

Models. ``tiny`` is the seeded tiny FLUX of ``fetch-weights --source tiny`` (2 + 2 blocks, width 32), built in
memory. ``flux-dev-shaped`` is FLUX.1-dev's transformer architecture with random weights, built on the device without
any download: width 3072 (24 heads × 128), joint_attention_dim 4096, pooled 768, in_channels 64, guidance embedding,
RoPE axes (16, 56, 56), and ``--blocks D,S`` double/single blocks (19, 38 is the real model), with a random VAE of
FLUX.1-dev's configuration. A PATH is a diffusers FLUX folder (real or tiny weights); ``--blocks`` keeps its first D
and S blocks. Text encoders are never loaded: the conditioning is random with the right shape (``--text-tokens``
T5 tokens, 512 as FLUX.1-dev's pipeline pads to; the model's joint_attention_dim; a pooled vector).

The reward phase of the shaped model. HPSv2 is open_clip's ViT-H-14 (986 M parameters), so on an accelerator the
default (``--reward auto``) scores with a randomly initialised ViT-H-14 through the same scoring code: its cost is
the real reward's cost (a forward of the 224² image tower per image; text features are cached per prompt, as in
training, where each prompt is scored G times). On cpu, where one ViT-H-14 image takes seconds, ``auto`` uses the
tiny HPS-shaped CLIP instead, which measures the preprocessing and data movement, not HPS's compute.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import open_clip
import torch
from diffusers import AutoencoderKL, FluxTransformer2DModel

import fluxgrpo.rewards
from fluxgrpo.bench.config import SHAPED_MODEL, TINY_MODEL, BenchConfig
from fluxgrpo.bench.flops import FluxShape
from fluxgrpo.errors import UsageError
from fluxgrpo.models.flux import load_transformer, load_vae, read_transformer_config
from fluxgrpo.models.known import FLUX_DEV_TRANSFORMER_CONFIG as KNOWN_FLUX_DEV_TRANSFORMER
from fluxgrpo.models.known import FLUX_DEV_VAE_CONFIG as KNOWN_FLUX_DEV_VAE
from fluxgrpo.models.tiny import build_tiny_flux_pipeline
from fluxgrpo.rewards.hpsv2 import write_tiny_reward
from fluxgrpo.rewards.open_clip_model import REAL_REWARD_ARCH
from fluxgrpo.runtime import device as rt_device
from fluxgrpo.runtime.adapt import adapt_transformer
from fluxgrpo.weights.layout import HPS_CHECKPOINT, OPEN_CLIP_WEIGHTS

if TYPE_CHECKING:
    from torch import nn

    from fluxgrpo.rewards.base import RewardFn
    from fluxgrpo.runtime.dist import DistContext

# fp32 weights, gradients and AdamW's two moments: what one trained parameter costs before any activation.
TRAINING_BYTES_PER_PARAMETER = 16

# FLUX.1-dev's transformer/config.json, less the block counts (a flag), and its vae/config.json (83.8 M parameters).
FLUX_DEV_TRANSFORMER_CONFIG: dict[str, Any] = {
    k: v for k, v in KNOWN_FLUX_DEV_TRANSFORMER.items() if k not in ("num_layers", "num_single_layers")
}
FLUX_DEV_BLOCKS = (KNOWN_FLUX_DEV_TRANSFORMER["num_layers"], KNOWN_FLUX_DEV_TRANSFORMER["num_single_layers"])
FLUX_DEV_VAE_CONFIG = KNOWN_FLUX_DEV_VAE


# --------------------------------------------------------------------------------------------- models


def random_hps_reward(architecture: str, device: torch.device | str, seed: int) -> RewardFn:
    """HPSv2's reward (``rewards.load_reward("hpsv2", ...)``, the trainer's own code) with random weights.

    ``architecture`` is "tiny-clip" (the tiny HPS-shaped CLIP of ``fetch-weights --source tiny``) or "vit-h-14"
    (HPSv2's open_clip ViT-H-14, 986 M parameters). The weights are written to a temporary folder in the HPS layout
    and loaded the way training loads them: same preprocessing, towers, text-feature cache and cosine score, so
    the reward phase costs what the real reward costs. For ViT-H-14 that is a 4 GB file written and read once.
    """

    with tempfile.TemporaryDirectory(prefix="fluxgrpo-bench-reward-") as folder:
        if architecture == "tiny-clip":
            write_tiny_reward(Path(folder), seed)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = open_clip.create_model(REAL_REWARD_ARCH, pretrained=None, precision="fp32", device="cpu")
            # The initial open_clip weights hold every key; an HPS checkpoint with one key then overrides just it.
            torch.save(model.state_dict(), Path(folder, OPEN_CLIP_WEIGHTS))
            torch.save({"state_dict": {"logit_scale": model.logit_scale.detach()}}, Path(folder, HPS_CHECKPOINT))
            del model
        return fluxgrpo.rewards.load_reward("hpsv2", folder, device)


@dataclass
class BenchModel:
    """The parts one rank measures."""

    name: str
    transformer: nn.Module
    vae: nn.Module
    reward: RewardFn
    reward_name: str
    reward_parameters: int | None
    shape: FluxShape


def resolve_reward(cfg: BenchConfig, device_type: str, shape: FluxShape) -> str:
    """``auto``: HPSv2's ViT-H-14 (random weights) beside a FLUX.1-dev-width transformer on an accelerator, the
    tiny HPS-shaped CLIP otherwise (on cpu one ViT-H-14 image takes seconds)."""
    if cfg.reward != "auto":
        return cfg.reward
    full_width = (
        shape.hidden
        >= FLUX_DEV_TRANSFORMER_CONFIG["num_attention_heads"] * FLUX_DEV_TRANSFORMER_CONFIG["attention_head_dim"]
    )
    return "vit-h-14" if full_width and device_type != "cpu" else "tiny-clip"


def device_memory_bytes(ctx: DistContext) -> int | None:
    devices = rt_device.describe_devices(ctx.device_type)
    index = ctx.local_rank if ctx.device_type != "cpu" else 0
    total = devices[index].total_bytes if index < len(devices) else 0
    return total or None


def check_training_memory(shape: FluxShape, ctx: DistContext, model: str) -> None:
    """Refuse a model whose fp32 weights, gradients and AdamW state alone exceed the devices' memory."""
    total = device_memory_bytes(ctx)
    if total is None:
        return
    needed = shape.parameter_count() * TRAINING_BYTES_PER_PARAMETER / ctx.world_size
    if needed > total:
        raise UsageError(
            f"{model} with {shape.double_blocks} double + {shape.single_blocks} single blocks has "
            f"{shape.parameter_count() / 1e9:.2f} B parameters: fp32 weights, gradients and AdamW state need "
            f"{needed / 2**30:.0f} GiB per device before any activation, more than the {total / 2**30:.0f} GiB "
            "there: pass fewer --blocks D,S (e.g. 8,16 on a 141 GB device) or shard over more --dies"
        )


def _trim_blocks(transformer: nn.Module, blocks: tuple[int, int] | None, model: str) -> None:
    if blocks is None:
        return
    double, single = blocks
    have = (len(transformer.transformer_blocks), len(transformer.single_transformer_blocks))  # type: ignore[arg-type]  # FLUX/diffusers attribute reached through nn.Module.__getattr__
    if double > have[0] or single > have[1]:
        raise UsageError(f"--blocks {double},{single}: {model} has only {have[0]} double and {have[1]} single blocks")
    del transformer.transformer_blocks[double:]  # type: ignore[union-attr, operator]  # FLUX/diffusers attribute reached through nn.Module.__getattr__
    del transformer.single_transformer_blocks[single:]  # type: ignore[union-attr, operator]  # FLUX/diffusers attribute reached through nn.Module.__getattr__


def build_bench_model(cfg: BenchConfig, ctx: DistContext, compute_dtype: torch.dtype) -> BenchModel:
    """Transformer (fp32 master weights, adapted to the device), VAE (compute dtype) and reward on ``ctx.device``."""

    device = ctx.device
    if cfg.model == TINY_MODEL:
        pipeline = build_tiny_flux_pipeline(cfg.seed)
        transformer, vae = pipeline.transformer, pipeline.vae
        _trim_blocks(transformer, cfg.blocks, cfg.model)
    elif cfg.model == SHAPED_MODEL:
        double, single = cfg.blocks or FLUX_DEV_BLOCKS
        config = {**FLUX_DEV_TRANSFORMER_CONFIG, "num_layers": double, "num_single_layers": single}
        check_training_memory(FluxShape.from_config(config), ctx, cfg.model)
        torch.manual_seed(cfg.seed)
        with device:  # random init on the device itself: 12 B parameters would take minutes on the host
            transformer = FluxTransformer2DModel(**config)
            vae = AutoencoderKL(**FLUX_DEV_VAE_CONFIG)
    else:
        check_training_memory(FluxShape.from_config(read_transformer_config(cfg.model), cfg.blocks), ctx, cfg.model)
        transformer = load_transformer(cfg.model, dtype=torch.float32, device="cpu")
        _trim_blocks(transformer, cfg.blocks, cfg.model)
        vae = load_vae(cfg.model, dtype=torch.float32, device="cpu")
    # Every builder and loader above yields fp32 weights (the trainer's masters); only the VAE changes dtype.
    transformer = transformer.to(device).requires_grad_(True)
    adapt_transformer(transformer, ctx.device_type, attention=cfg.attention, compute_dtype=compute_dtype)
    vae = vae.to(device) if vae.dtype == compute_dtype else vae.to(device=device, dtype=compute_dtype)
    vae.eval().requires_grad_(False)
    shape = FluxShape.from_transformer(transformer)

    reward_name = resolve_reward(cfg, ctx.device_type, shape)
    if reward_name in ("tiny-clip", "vit-h-14"):
        reward = random_hps_reward(reward_name, device, cfg.seed)
    else:
        reward = fluxgrpo.rewards.load_reward(reward_name, cfg.hps_dir, device)
    reward_model = getattr(reward, "model", None)
    reward_parameters = sum(p.numel() for p in reward_model.parameters()) if reward_model is not None else None
    return BenchModel(cfg.model, transformer, vae, reward, reward_name, reward_parameters, shape)
