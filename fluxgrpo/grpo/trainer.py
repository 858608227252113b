"""The GRPO training loop that runs on every rank (DanceGRPO's FLUX recipe, without its bugs).

Each iteration, on each rank:

1. draw ``train_batch_size`` prompts (a seeded distributed sampler whose epoch advances) and repeat each G times;
2. rollout: SDE sampling with per-step log-probs (every step, or a window with ODE elsewhere: ``step_plan.py``),
   in chunks of ``rollout_batch_size`` (``rollout.py``);
3. decode the final x̂0 with the VAE and score the images with the reward model, batched, on the device;
4. group advantages (unbiased std + 1e-8, clipped), rewards gathered across ranks for logging;
5. policy update on a random subset of timesteps per trajectory, PPO-clip, gradient accumulation (``update.py``);
6. metrics (rank 0) and, every ``checkpointing_steps`` iterations and after the last, a checkpoint.

Deviations from DanceGRPO, each deliberate: initial noise is shared within a group only (not across the
prompts on a rank); rollout and update are batched; rewards are computed from tensors in float32 (no PNG
round trip, no fp16 autocast); leftover gradients at the end of an iteration are stepped, not dropped; the
sampler's epoch advances; a checkpoint holds the state *after* its iteration and everything needed for an
exact resume. All randomness in an iteration comes from generators seeded by (seed, rank, iteration), so a
resumed run draws exactly what an uninterrupted one would have.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fluxgrpo.config import TrainConfig
from fluxgrpo.runtime import device as rt_device
from fluxgrpo.runtime import dist as rt_dist
from fluxgrpo.runtime.dist import DistContext, shard_transformer


def derive_seed(seed: int, rank: int, iteration: int, stream: int) -> int:
    """A distinct 63-bit seed per (run seed, rank, iteration, random stream)."""
    mixed = (seed * 1_000_003 + rank) * 1_000_033 + iteration
    return (mixed * 31 + stream) % (2**63 - 1)


NOISE_STREAM, TIMESTEP_STREAM, WINDOW_STREAM = 1, 2, 3


@dataclass
class TrainingParts:
    """Everything a rank holds for training."""

    ctx: DistContext
    transformer: torch.nn.Module
    vae: torch.nn.Module
    reward_fn: Any  # a RewardSet: images, prompts → scores [B, K], one column per --reward entry
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    ema: Any
    dataset: Any
    sampler: Any
    reference: Any = None  # the KL's reference model (``--kl-beta`` > 0)


# --------------------------------------------------------------------------------------------- set-up


def build_parts(cfg: TrainConfig, ctx: DistContext) -> TrainingParts:
    from diffusers.optimization import get_scheduler

    from fluxgrpo.data.embeddings import EmbeddingDataset
    from fluxgrpo.data.sampler import PromptSampler
    from fluxgrpo.grpo.ema import ShardedEMA
    from fluxgrpo.models.flux import load_vae
    from fluxgrpo.rewards.reward_set import load_reward_set

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
    return TrainingParts(ctx, transformer, vae, reward_fn, optimizer, lr_scheduler, ema, dataset, sampler, reference)


def build_reference(cfg: TrainConfig, ctx: DistContext, transformer: torch.nn.Module):
    """The KL's reference, the base model: for a LoRA run the policy with its adapters disabled; for full
    fine-tuning the base weights again, frozen, in the compute dtype (a forward is all it does), built and sharded
    like the policy (meta device, each rank reading its own shards). Built from ``cfg.model``, so a resumed run gets
    the same reference."""
    from fluxgrpo.grpo.reference import AdapterDisabledReference, FrozenReference
    from fluxgrpo.lora import is_lora_model
    from fluxgrpo.models.shard_loading import empty_transformer, fill_transformer

    if is_lora_model(transformer):
        return AdapterDisabledReference(transformer)
    compute_dtype = rt_device.compute_dtype(ctx.device_type)
    base = empty_transformer(cfg.model).to(compute_dtype)
    adapt_for_device(base, cfg, ctx)
    if ctx.distributed:
        shard_transformer(base, cfg.cpu_offload, compute_dtype)
    fill_transformer(base, cfg.model, "cpu" if cfg.cpu_offload else ctx.device)
    return FrozenReference(base)


def build_transformer(cfg: TrainConfig, ctx: DistContext) -> torch.nn.Module:
    """The transformer to train, sharded, with its weights (and LoRA adapters, with --lora-rank) in place.

    Built on the meta device and sharded before any weight exists; each rank then reads only its own shards from
    the safetensors, so the job holds one copy of the weights in host memory, not one per rank.
    """
    from fluxgrpo.lora import LoraSpec, add_lora, base_weight_name, init_adapters
    from fluxgrpo.models.shard_loading import empty_transformer, fill_transformer

    compute_dtype = rt_device.compute_dtype(ctx.device_type)
    lora = LoraSpec.from_config(cfg)
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
    return transformer


def adapt_for_device(transformer: torch.nn.Module, cfg: TrainConfig, ctx: DistContext) -> None:
    """Accelerator-specific kernels (fused RMSNorm, float32 RoPE, fused attention), decided by the runtime."""
    from fluxgrpo.runtime.adapt import adapt_transformer

    adapt_transformer(
        transformer, ctx.device_type, attention=cfg.attention, compute_dtype=rt_device.compute_dtype(ctx.device_type)
    )


# --------------------------------------------------------------------------------------------- stages


def draw_prompts(parts: TrainingParts, cfg: TrainConfig):
    """Conditioning for this rank's prompts, each row repeated G times (groups contiguous)."""
    from fluxgrpo.grpo.types import Conditioning

    indices = parts.sampler.next_batch()
    items = [parts.dataset[i] for i in indices]
    device = parts.ctx.device
    cond = Conditioning(
        prompt_embeds=torch.stack([it.prompt_embeds for it in items]).to(device, torch.float32),
        pooled=torch.stack([it.pooled for it in items]).to(device, torch.float32),
        text_ids=items[0].text_ids.to(device, torch.float32),
        captions=tuple(it.caption for it in items),
    )
    return cond.repeat_interleave(cfg.num_generations)


def initial_noise(cfg: TrainConfig, num_prompts: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """[B, L, C] packed Gaussian noise; shared by the G members of a group when ``init_same_noise``."""
    from fluxgrpo.grpo.latents import latent_shape, pack_latents

    shape = latent_shape(cfg.height, cfg.width)
    draws = num_prompts if cfg.init_same_noise else num_prompts * cfg.num_generations
    noise = torch.randn(
        (draws, shape.channels, shape.latent_height, shape.latent_width),
        generator=generator,
        device=device,
        dtype=torch.float32,
    )
    packed = pack_latents(noise)
    return packed.repeat_interleave(cfg.num_generations, dim=0) if cfg.init_same_noise else packed


def decode_images(
    vae: torch.nn.Module,
    final_x0: torch.Tensor,
    height: int,
    width: int,
    chunk: int,
    device_type: str,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Images [B,3,H,W] in [0,1], fp32: the final x̂0 [B,L,C] decoded by the VAE, ``chunk`` at a time, under the
    device's autocast (``compute_dtype``: the runtime's choice when None)."""
    from fluxgrpo.grpo.latents import unpack_latents
    from fluxgrpo.models.flux import decode_latents

    images = []
    with torch.no_grad():
        for start in range(0, final_x0.shape[0], chunk):
            latents = unpack_latents(final_x0[start : start + chunk], height, width)
            with rt_device.autocast(device_type, compute_dtype):
                batch = decode_latents(vae, latents.to(next(vae.parameters()).dtype))
            images.append(batch.float())
    return torch.cat(images)


def score_images(reward_fn: Any, images: torch.Tensor, captions, chunk: int) -> torch.Tensor:
    """Rewards [B] (one reward) or [B, K] (a RewardSet) fp32 of images [B,3,H,W] and their captions, ``chunk`` at a
    time."""
    with torch.no_grad():
        return torch.cat(
            [
                reward_fn(images[start : start + chunk], list(captions[start : start + chunk])).float()
                for start in range(0, images.shape[0], chunk)
            ]
        )


def decode_and_score(
    parts: TrainingParts, cfg: TrainConfig, final_x0: torch.Tensor, captions
) -> tuple[torch.Tensor, torch.Tensor]:
    """Images [B,3,H,W] in [0,1] and scores [B, K] fp32 (one column per reward), in chunks of rollout_batch_size."""
    chunk = cfg.rollout_batch_size
    images = decode_images(parts.vae, final_x0, cfg.height, cfg.width, chunk, parts.ctx.device_type)
    return images, score_images(parts.reward_fn, images, captions, chunk)


def save_sample_images(images: torch.Tensor, output_dir: Path, rank: int, count: int) -> None:
    """``images/flux_{rank}_{idx}.png`` for the first ``count`` trajectories (overwritten each time)."""
    from PIL import Image

    folder = output_dir / "images"
    folder.mkdir(parents=True, exist_ok=True)
    pixels = (images[:count].clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    for idx, array in enumerate(pixels):
        Image.fromarray(array).save(folder / f"flux_{rank}_{idx}.png")


# --------------------------------------------------------------------------------------------- metrics


def reward_statistics(ctx: DistContext, rewards: torch.Tensor, group_size: int) -> dict[str, float]:
    """Global reward statistics over every rank's trajectories: one gather, one host sync.

    Non-finite rewards are left out (and counted); a group's spread is the unbiased std of its finite rewards,
    0 when fewer than two are finite. ``zero_std_group_fraction`` counts the groups whose advantages are all 0
    because their rewards are equal (``flat_groups``, the same rule ``group_advantages`` applies).
    """
    from fluxgrpo.grpo.advantages import flat_groups

    gathered = rt_dist.all_gather_tensor(ctx, rewards.detach().float())
    finite = torch.isfinite(gathered)
    values = torch.where(finite, gathered, torch.zeros_like(gathered))
    count = finite.sum().float()
    mean = values.sum() / count.clamp(min=1)
    spread = torch.where(finite, gathered - mean, torch.zeros_like(gathered))
    std = (spread.pow(2).sum() / (count - 1).clamp(min=1)).sqrt()
    low = torch.where(finite, gathered, torch.full_like(gathered, float("inf"))).min()
    high = torch.where(finite, gathered, torch.full_like(gathered, float("-inf"))).max()

    grouped, group_finite = values.reshape(-1, group_size), finite.reshape(-1, group_size)
    group_count = group_finite.sum(dim=1).float()
    group_mean = grouped.sum(dim=1) / group_count.clamp(min=1)
    group_spread = torch.where(group_finite, grouped - group_mean[:, None], torch.zeros_like(grouped))
    group_std = (group_spread.pow(2).sum(dim=1) / (group_count - 1).clamp(min=1)).sqrt()
    group_std = torch.where(group_count > 1, group_std, torch.zeros_like(group_std))

    stats = torch.stack(
        [
            mean,
            std,
            low,
            high,
            group_std.mean(),
            flat_groups(gathered.reshape(-1, group_size), group_finite).float().mean(),
            (~finite).sum().float(),
            count,
        ]
    ).tolist()
    names = (
        "reward_mean",
        "reward_std",
        "reward_min",
        "reward_max",
        "group_std_mean",
        "zero_std_group_fraction",
        "nonfinite_rewards",
    )
    out = dict(zip(names, stats[:-1], strict=True))
    if stats[-1] == 0:
        out.update(reward_mean=math.nan, reward_std=math.nan, reward_min=math.nan, reward_max=math.nan)
    return out


def any_finite_reward(ctx: DistContext, rewards: torch.Tensor) -> bool:
    """Whether any rank has a finite reward this iteration (one all-reduce; every rank gets the same answer)."""
    count = torch.isfinite(rewards).sum().to(torch.float32).reshape(1)
    rt_dist.all_reduce_sum(ctx, count)
    return bool(count.item() > 0)


def per_reward_statistics(ctx: DistContext, scores: torch.Tensor, names: list[str]) -> dict[str, float]:
    """reward_<name>_mean / _std over every rank's finite scores of each reward; nothing for a single reward
    (its statistics are reward_mean / reward_std)."""
    if len(names) < 2:
        return {}
    gathered = rt_dist.all_gather_tensor(ctx, scores.detach().float())  # [B·world, K]
    finite = torch.isfinite(gathered)
    values = torch.where(finite, gathered, torch.zeros_like(gathered))
    count = finite.sum(dim=0).float()
    mean = values.sum(dim=0) / count.clamp(min=1)
    spread = torch.where(finite, gathered - mean, torch.zeros_like(gathered))
    std = (spread.pow(2).sum(dim=0) / (count - 1).clamp(min=1)).sqrt()
    out = {}
    for name, m, s, n in zip(names, mean.tolist(), std.tolist(), count.tolist(), strict=True):
        out[f"reward_{name}_mean"], out[f"reward_{name}_std"] = (m, s) if n else (math.nan, math.nan)
    return out


def reduce_update_stats(ctx: DistContext, stats: dict[str, float]) -> dict[str, float]:
    """Mean over ranks of the averages, min of mins, max of maxes (device tensors: collectives need them)."""
    mean_keys = ("loss", "ratio_mean", "clip_fraction", "grad_norm_mean", "kl")
    means = torch.tensor([stats[k] for k in mean_keys], dtype=torch.float32, device=ctx.device)
    rt_dist.all_reduce_sum(ctx, means)
    # min(x) = −max(−x), so one MAX reduction covers both ends
    extremes = torch.tensor(
        [-stats["ratio_min"], stats["ratio_max"], stats["first_abs_log_ratio"], stats["grad_norm_max"]],
        dtype=torch.float32,
        device=ctx.device,
    )
    rt_dist.all_reduce_max(ctx, extremes)
    out = dict(zip(mean_keys, (means / ctx.world_size).tolist(), strict=True))
    low, out["ratio_max"], out["first_abs_log_ratio"], out["grad_norm_max"] = extremes.tolist()
    out["ratio_min"] = -low
    out["optimizer_steps"] = stats["optimizer_steps"]
    out["skipped_steps"] = stats["skipped_steps"]
    out["update_skipped"] = stats["update_skipped"]  # the same on every rank (decided from a global count)
    return out


def ratio_means_per_step(ctx: DistContext, update: Any) -> list[float | None]:
    """Mean ρ of each σ-table step over every rank's trained samples (None: not trained this iteration): the
    drift of the ratio across steps that GRPO-Guard corrects."""
    packed = torch.stack([update.ratio_sum_per_step, update.count_per_step])
    rt_dist.all_reduce_sum(ctx, packed)
    sums, counts = packed.tolist()
    means = [total / count if count else None for total, count in zip(sums, counts, strict=True)]
    return [mean if mean is not None and math.isfinite(mean) else None for mean in means]


def advantage_statistics(ctx: DistContext, advantages: torch.Tensor) -> dict[str, float]:
    gathered = rt_dist.all_gather_tensor(ctx, advantages.detach().float())
    abs_mean, low, high = torch.stack([gathered.abs().mean(), gathered.min(), gathered.max()]).tolist()
    return {"advantage_abs_mean": abs_mean, "advantage_min": low, "advantage_max": high}


def progress_line(record: dict[str, Any], total: int) -> str:
    """One console line per iteration on rank 0 (the full record is in metrics.jsonl)."""
    seconds = record["seconds_rollout"] + record["seconds_decode_reward"] + record["seconds_update"]
    skipped = f" · skipped steps {record['skipped_steps']:.0f}" if record["skipped_steps"] else ""
    if record["update_skipped"]:
        skipped = " · update skipped: no finite reward"
    bad = f" · non-finite rewards {record['nonfinite_rewards']:.0f}" if record["nonfinite_rewards"] else ""
    return (
        f"iteration {record['iteration']}/{total} · reward {record['reward_mean']:.4f} ± {record['reward_std']:.4f} "
        f"· ratio {record['ratio_mean']:.4f} [{record['ratio_min']:.4f}, {record['ratio_max']:.4f}] "
        f"· clip {record['clip_fraction']:.2f} · loss {record['loss']:.3g} · grad {record['grad_norm_mean']:.3g} "
        f"· lr {record['lr']:.2g} · {seconds:.1f} s ({record['images_per_second']:.2f} img/s){skipped}{bad}"
    )


# --------------------------------------------------------------------------------------------- the loop


class PhaseClock:
    """Wall time of each phase of an iteration, measured between device synchronisations."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}
        rt_device.synchronize(device)
        self._last = self._start = time.perf_counter()

    def lap(self, phase: str) -> None:
        rt_device.synchronize(self.device)
        now = time.perf_counter()
        self.seconds[f"seconds_{phase}"] = now - self._last
        self._last = now

    @property
    def total(self) -> float:
        return self._last - self._start


def iteration_record(
    ctx: DistContext,
    cfg: TrainConfig,
    parts: TrainingParts,
    iteration: int,
    scores: torch.Tensor,
    rewards: torch.Tensor,
    advantages: torch.Tensor,
    update: Any,
    clock: PhaseClock,
) -> dict[str, Any]:
    """Everything metrics.jsonl holds for one iteration, reduced over ranks."""
    peak = rt_device.peak_memory_bytes(ctx.device)
    return {
        "iteration": iteration,
        **reward_statistics(ctx, rewards, cfg.num_generations),
        **per_reward_statistics(ctx, scores, parts.reward_fn.names),
        **advantage_statistics(ctx, advantages),
        **reduce_update_stats(ctx, update.as_floats()),
        "ratio_mean_per_step": ratio_means_per_step(ctx, update),
        "lr": parts.lr_scheduler.get_last_lr()[0],
        **clock.seconds,
        "images_per_second": ctx.world_size * cfg.trajectories_per_rank / clock.total,
        "peak_memory_gib": None if peak is None else peak / 2**30,
    }


def save_training_checkpoint(ctx: DistContext, cfg: TrainConfig, parts: TrainingParts, iteration: int) -> Path:
    """The state after ``iteration``: weights, optimizer, scheduler, EMA, RNGs and every rank's sampler position."""
    from fluxgrpo.checkpoint import save_checkpoint

    samplers = rt_dist.all_gather_object(ctx, parts.sampler.state_dict())
    trainer_state = {
        "iteration": iteration,
        "sampler": {str(rank): state for rank, state in enumerate(samplers)},
        "config": cfg.to_dict(),
    }
    return save_checkpoint(
        Path(cfg.output_dir),
        iteration,
        ctx,
        parts.transformer,
        parts.optimizer,
        parts.lr_scheduler,
        ema=parts.ema,
        trainer_state=trainer_state,
        keep_last=cfg.keep_last or None,
    )


def restore(ctx: DistContext, parts: TrainingParts, checkpoint: Path | None) -> int:
    """Load a checkpoint into ``parts``; returns the iterations it had completed (0 without one)."""
    from fluxgrpo.checkpoint import load_checkpoint

    if checkpoint is None:
        return 0
    loaded = load_checkpoint(checkpoint, ctx, parts.transformer, parts.optimizer, parts.lr_scheduler, ema=parts.ema)
    parts.sampler.load_state_dict(loaded.trainer_state["sampler"][str(ctx.rank)])
    rt_dist.rank0_print(ctx, f"resumed from {checkpoint} after iteration {loaded.iteration}")
    return loaded.iteration


def train(cfg: TrainConfig, resume: str | None = None) -> list[dict[str, Any]]:
    """Run the GRPO loop on this rank; returns rank 0's metrics records (empty on other ranks)."""
    from fluxgrpo.checkpoint import resolve_resume
    from fluxgrpo.eval import Evaluator
    from fluxgrpo.grpo.latents import image_ids
    from fluxgrpo.grpo.reward_aggregation import aggregate_rewards
    from fluxgrpo.grpo.rollout import generate_rollout
    from fluxgrpo.grpo.schedule import sigma_schedule
    from fluxgrpo.grpo.step_plan import PlanSettings, plan_for_iteration
    from fluxgrpo.grpo.update import UpdateSettings, policy_update, skipped_update
    from fluxgrpo.metrics import MetricsLogger, run_info
    from fluxgrpo.runtime.worker import worker_session

    with worker_session(cfg.device) as ctx:
        rt_device.seed_everything(cfg.seed + ctx.rank)
        output_dir = Path(cfg.output_dir)
        parts = build_parts(cfg, ctx)
        start = restore(ctx, parts, resolve_resume(output_dir, resume) if resume is not None else None)
        metrics = MetricsLogger(
            output_dir,
            enabled=ctx.is_main,
            tensorboard=cfg.tensorboard,
            wandb=cfg.wandb,
            config=cfg.to_dict(),
            resume_after=start,
            ctx=ctx,
            wandb_project=cfg.wandb_project,
            wandb_name=cfg.wandb_name,
            wandb_mode=cfg.wandb_mode,
            run_info=run_info(ctx) if ctx.is_main else None,
        )
        evaluator = Evaluator(cfg, ctx, metrics)
        sigmas = sigma_schedule(cfg.sampling_steps, cfg.shift).to(ctx.device)  # [N+1]
        img_ids = image_ids(cfg.height, cfg.width).to(ctx.device)  # [L, 3]
        update_settings = UpdateSettings.from_config(cfg)
        plan_settings = PlanSettings.from_config(cfg)
        records = []
        evaluator.before_training(start, parts)  # the base model at iteration 0: every eval curve starts there
        for iteration in range(start + 1, cfg.max_train_steps + 1):
            rt_device.reset_peak_memory(ctx.device)
            clock = PhaseClock(ctx.device)
            noise_gen = torch.Generator(device=ctx.device).manual_seed(
                derive_seed(cfg.seed, ctx.rank, iteration, NOISE_STREAM)
            )
            timestep_gen = torch.Generator().manual_seed(derive_seed(cfg.seed, ctx.rank, iteration, TIMESTEP_STREAM))

            # Which steps are SDE (and trained): all (DanceGRPO) or a window; the same on every rank.
            window_gen = torch.Generator().manual_seed(derive_seed(cfg.seed, 0, iteration, WINDOW_STREAM))
            plan = plan_for_iteration(plan_settings, sigmas, iteration, window_gen)

            cond = draw_prompts(parts, cfg)  # [B = prompts × G] rows, groups contiguous
            noise = initial_noise(cfg, cfg.train_batch_size, noise_gen, ctx.device)  # [B, L, C]
            rollout = generate_rollout(
                parts.transformer,
                cond,
                noise,
                sigmas,
                eta=cfg.eta,
                guidance=cfg.guidance,
                img_ids=img_ids,
                rollout_batch_size=cfg.rollout_batch_size,
                device_type=ctx.device_type,
                generator=noise_gen,
                sampler=cfg.sampler,
                plan=plan,
                keep_means=cfg.ratio_normalization == "grpo-guard",
            )
            clock.lap("rollout")

            images, scores = decode_and_score(parts, cfg, rollout.final_x0, cond.captions)  # [B,3,H,W], [B, K]
            clock.lap("decode_reward")

            rewards, adv = aggregate_rewards(  # [B] Σ w·r, [B] advantages
                scores, parts.reward_fn.weights, cfg.advantage_aggregation, cfg.num_generations, cfg.adv_clip_max
            ).as_tuple()
            if any_finite_reward(ctx, rewards):
                update = policy_update(
                    parts.transformer,
                    rollout,
                    cond,
                    adv.advantages,
                    update_settings,
                    parts.optimizer,
                    parts.lr_scheduler,
                    device_type=ctx.device_type,
                    generator_cpu=timestep_gen,
                    reference=parts.reference,
                )
                if parts.ema is not None and update.optimizer_steps:
                    parts.ema.update(parts.transformer)  # once per iteration, as DanceGRPO
            else:  # nothing to learn from: not even weight decay or Adam's step count may move
                update = skipped_update(rollout, update_settings)
            clock.lap("update")

            record = iteration_record(ctx, cfg, parts, iteration, scores, rewards, adv.advantages, update, clock)
            if cfg.sde_window:
                record["sde_window_start"] = plan.sde_start
            metrics.log(record, histograms={"reward": rewards})
            records.append(record)
            rt_dist.rank0_print(ctx, progress_line(record, cfg.max_train_steps))
            if cfg.save_images_every and iteration % cfg.save_images_every == 0:
                save_sample_images(images, output_dir, ctx.rank, cfg.images_per_save)
            evaluator.maybe_run(iteration, parts)  # before the checkpoint: a saved iteration has its evaluation
            if iteration % cfg.checkpointing_steps == 0 or iteration == cfg.max_train_steps:
                path = save_training_checkpoint(ctx, cfg, parts, iteration)
                rt_dist.rank0_print(ctx, f"saved {path}")
        metrics.close()
    return records if ctx.is_main else []


def worker_entry(payload: dict[str, Any]) -> None:
    """Every rank's part of ``fluxgrpo train`` (``runtime.launch.run_workers``): ``{"config", "resume"}``."""
    train(TrainConfig(**payload["config"]).validate(), payload.get("resume"))
