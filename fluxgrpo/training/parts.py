"""Building what a rank holds for training: the sharded policy (and LoRA adapters), the KL reference, the VAE,
the rewards, the optimizer and scheduler, EMA, the prompt data and its distributed sampler."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from diffusers.optimization import get_scheduler

from fluxgrpo.config import TrainConfig
from fluxgrpo.data.embeddings import EmbeddingDataset
from fluxgrpo.data.sampler import PromptSampler
from fluxgrpo.grpo.weight_copies import AdapterDisabledReference, FrozenReference, PolicyCopy, ShardedEMA
from fluxgrpo.lora import add_lora, base_weight_name, init_adapters, is_lora_model
from fluxgrpo.models.compile import CompileMeter, compile_repeated_blocks
from fluxgrpo.models.flux import load_vae
from fluxgrpo.models.shard_loading import empty_transformer, fill_transformer
from fluxgrpo.rewards.reward_set import load_reward_set
from fluxgrpo.runtime import device as rt_device
from fluxgrpo.runtime.adapt import adapt_transformer, compile_backend
from fluxgrpo.runtime.dist import DistContext, shard_transformer
from fluxgrpo.training.settings import lora_spec, policy_copy_names

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler

    from fluxgrpo.grpo.weight_copies import ReferenceModel
    from fluxgrpo.rewards.reward_set import RewardSet


@dataclass
class TrainingParts:
    """Everything a rank holds for training."""

    ctx: DistContext
    transformer: torch.nn.Module
    vae: torch.nn.Module
    reward_fn: RewardSet  # images, prompts → scores [B, K], one column per --reward entry
    optimizer: torch.optim.Optimizer
    lr_scheduler: LRScheduler
    ema: Any  # a grpo.weight_copies.ShardedEMA with --use-ema, else None
    dataset: EmbeddingDataset
    sampler: PromptSampler
    reference: ReferenceModel | None = None  # the KL's reference model (``--kl-beta`` > 0)
    policy_copies: dict[str, PolicyCopy] = field(default_factory=dict)  # name → NFT's old, AWM's EMA policy
    compile_meter: CompileMeter | None = None  # with --compile: compilations per metrics record


def build_parts(cfg: TrainConfig, ctx: DistContext) -> TrainingParts:
    dataset = EmbeddingDataset(cfg.data_json_path)
    transformer = build_transformer(cfg, ctx)
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=cfg.learning_rate, betas=(0.9, 0.999), eps=1e-8, weight_decay=cfg.weight_decay
    )
    total_steps = cfg.derived(ctx.world_size)["total_optimizer_steps"]
    lr_scheduler = get_scheduler(
        cfg.lr_scheduler, optimizer, num_warmup_steps=cfg.lr_warmup_steps, num_training_steps=max(total_steps, 1)
    )
    ema = ShardedEMA(transformer, cfg.ema_decay) if cfg.use_ema else None
    vae = load_vae(cfg.model, dtype=rt_device.compute_dtype(ctx.device_type), device=ctx.device)
    vae.requires_grad_(False).eval()
    reward_fn = load_reward_set(cfg.reward, cfg.hps_dir, ctx.device, cfg.reward_dtype)
    sampler = PromptSampler(
        len(dataset), rank=ctx.rank, world_size=ctx.world_size, batch_size=cfg.train_batch_size, seed=cfg.seed
    )
    reference = build_reference(cfg, ctx, transformer) if cfg.kl_beta > 0 else None
    compile_meter = None
    if cfg.compile:
        compile_meter = CompileMeter()

    copies = {name: PolicyCopy(transformer) for name in policy_copy_names(cfg)}  # θ at the start, as the authors'
    return TrainingParts(
        ctx,
        transformer,
        vae,
        reward_fn,
        optimizer,
        lr_scheduler,
        ema,
        dataset,
        sampler,
        reference,
        policy_copies=copies,
        compile_meter=compile_meter,
    )


def build_reference(cfg: TrainConfig, ctx: DistContext, transformer: torch.nn.Module) -> ReferenceModel:
    """The KL's reference, the base model: for a LoRA run the policy with its adapters disabled; for full
    fine-tuning the base weights again, frozen, in the compute dtype (a forward is all it does), built and sharded
    like the policy (meta device, each rank reading its own shards). Built from ``cfg.model``, so a resumed run gets
    the same reference."""

    if is_lora_model(transformer):
        return AdapterDisabledReference(transformer)
    compute_dtype = rt_device.compute_dtype(ctx.device_type)
    base = empty_transformer(cfg.model).to(compute_dtype)
    adapt_for_device(base, cfg, ctx)
    if ctx.distributed:
        shard_transformer(base, cfg.cpu_offload, compute_dtype)
    fill_transformer(base, cfg.model, "cpu" if cfg.cpu_offload else ctx.device)
    compile_if_asked(base, cfg, ctx)
    return FrozenReference(base)


def build_transformer(cfg: TrainConfig, ctx: DistContext) -> torch.nn.Module:
    """The transformer to train, sharded, with its weights (and LoRA adapters, with --lora-rank) in place.

    Built on the meta device and sharded before any weight exists; each rank then reads only its own shards from
    the safetensors, so the job holds one copy of the weights in host memory, not one per rank.
    """

    compute_dtype = rt_device.compute_dtype(ctx.device_type)
    lora = lora_spec(cfg)
    transformer = empty_transformer(cfg.model)
    if lora is not None:
        add_lora(transformer, lora, compute_dtype)
    adapt_for_device(transformer, cfg, ctx)
    if cfg.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    if ctx.distributed:
        shard_transformer(transformer, cfg.cpu_offload, compute_dtype)
    device = "cpu" if cfg.cpu_offload else ctx.device
    fill_transformer(transformer, cfg.model, device, stored_name=base_weight_name)
    if lora is not None:
        init_adapters(transformer, cfg.seed)
    compile_if_asked(transformer, cfg, ctx)
    return transformer


def compile_if_asked(transformer: torch.nn.Module, cfg: TrainConfig, ctx: DistContext) -> None:
    """With --compile, FLUX's repeated blocks compiled regionally (``models.compile``), once, here where the model
    is built: the rollout, the update (with or without activation checkpointing) and the evaluation then all run
    the compiled blocks, and no call site knows."""
    if not cfg.compile:
        return

    compile_repeated_blocks(transformer, compile_backend(ctx.device_type))


def adapt_for_device(transformer: torch.nn.Module, cfg: TrainConfig, ctx: DistContext) -> None:
    """Accelerator-specific kernels (fused RMSNorm, float32 RoPE, fused attention), decided by the runtime."""

    adapt_transformer(
        transformer, ctx.device_type, attention=cfg.attention, compute_dtype=rt_device.compute_dtype(ctx.device_type)
    )
