"""The GRPO training loop that runs on every rank (DanceGRPO's FLUX recipe, without its bugs).

Each iteration, on each rank:

1. draw ``train_batch_size`` prompts (a seeded distributed sampler whose epoch advances) and repeat each G times;
2. rollout: SDE sampling with per-step log-probs (every step, or a window with ODE elsewhere: ``schedule.py``),
   in chunks of ``rollout_batch_size`` (``rollout.py``, the steps in ``samplers.py``); or, for the objectives
   that train on final samples (``--objective nft/awm/vgrpo/neighbor``: every objective whose catalogue entry keeps
   no trajectory), the ODE keeping the final latents (and the path, where the objective asks) (``rollout_stage``);
3. decode the final x̂0 with the VAE and score the images with the reward model, batched, on the device;
4. group advantages (unbiased std + 1e-8, clipped), rewards gathered across ranks for logging;
5. policy update (``update_stage``): the update driver (``update.py``: micro-batches, forwards, gradient
   accumulation) on the objective's loss (``grpo/objectives``: PPO-clip on a random subset of timesteps per
   trajectory, DiffusionNFT, AWM, V-GRPO or Neighbor GRPO);
6. metrics (rank 0) with the drift signals (``drift.py``); every ``eval_every`` iterations the held-out evaluation
   and its guards (``guards.py``: warn, or stop the run), and, every ``checkpointing_steps`` iterations, after the
   last, at a new best evaluation (``--keep-best``) and at a guard's stop, a checkpoint.

Deviations from DanceGRPO, each deliberate: initial noise is shared within a group only (not across the
prompts on a rank); rollout and update are batched; rewards are computed from tensors in float32 (no PNG
round trip, no fp16 autocast); leftover gradients at the end of an iteration are stepped, not dropped; the
sampler's epoch advances; a checkpoint holds the state *after* its iteration and everything needed for an
exact resume. All randomness in an iteration comes from generators seeded by (seed, rank, iteration), so a
resumed run draws exactly what an uninterrupted one would have.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fluxgrpo.checkpoint.layout import latest_checkpoint, resolve_resume
from fluxgrpo.checkpoint.state import TrainingState, load_checkpoint, save_checkpoint
from fluxgrpo.config import TrainConfig
from fluxgrpo.grpo.advantages import aggregate_rewards
from fluxgrpo.grpo.latents import image_ids
from fluxgrpo.grpo.schedule import plan_for_iteration, sigma_schedule
from fluxgrpo.metrics import MetricsLogger, WandbRun, run_info
from fluxgrpo.runtime import device as rt_device
from fluxgrpo.runtime import dist as rt_dist
from fluxgrpo.runtime.dist import DistContext
from fluxgrpo.runtime.nodes import check_shared_folder, restarted
from fluxgrpo.runtime.worker import worker_session
from fluxgrpo.training.eval import Evaluator
from fluxgrpo.training.guards import RunMonitor
from fluxgrpo.training.parts import TrainingParts, build_parts
from fluxgrpo.training.resume_state import read_training_state
from fluxgrpo.training.settings import build_objective, plan_settings, rollout_settings, update_plumbing
from fluxgrpo.training.stages import (
    RolloutDraws,
    decode_and_score,
    draw_prompts,
    initial_noise,
    rollout_stage,
    save_sample_images,
    update_stage,
)
from fluxgrpo.training.stats import PhaseClock, SkippedUpdateWatch, any_finite_reward, iteration_record, progress_line


def derive_seed(seed: int, rank: int, iteration: int, stream: int) -> int:
    """A distinct 63-bit seed per (run seed, rank, iteration, random stream)."""
    mixed = (seed * 1_000_003 + rank) * 1_000_033 + iteration
    return (mixed * 31 + stream) % (2**63 - 1)


NOISE_STREAM, TIMESTEP_STREAM, WINDOW_STREAM = 1, 2, 3


@dataclass(frozen=True)
class IterationRandomness:
    """The iteration's three random streams, seeded by (seed, rank, iteration): a resumed run draws what an
    uninterrupted one would have."""

    noise: torch.Generator  # on the device: initial noise and the SDE steps' noise
    timestep: torch.Generator  # on the CPU: which timesteps are trained, drift probes
    window: torch.Generator  # on the CPU, rank 0's seed: which steps are SDE, the same on every rank


def iteration_randomness(cfg: TrainConfig, ctx: DistContext, iteration: int) -> IterationRandomness:
    return IterationRandomness(
        noise=torch.Generator(device=ctx.device).manual_seed(derive_seed(cfg.seed, ctx.rank, iteration, NOISE_STREAM)),
        timestep=torch.Generator().manual_seed(derive_seed(cfg.seed, ctx.rank, iteration, TIMESTEP_STREAM)),
        window=torch.Generator().manual_seed(derive_seed(cfg.seed, 0, iteration, WINDOW_STREAM)),
    )


def open_metrics(cfg: TrainConfig, ctx: DistContext, resume_after: int) -> MetricsLogger:
    """metrics.jsonl (rank 0) cut back to the resumed iteration, with TensorBoard / wandb when asked."""
    return MetricsLogger(
        Path(cfg.output_dir),
        enabled=ctx.is_main,
        tensorboard=cfg.tensorboard,
        wandb=WandbRun(cfg.wandb_project, cfg.wandb_name, cfg.wandb_mode) if cfg.wandb else None,
        config=cfg.to_dict(),
        resume_after=resume_after,
        ctx=ctx,
        run_info=run_info(ctx) if ctx.is_main else None,
    )


def save_training_checkpoint(
    ctx: DistContext, cfg: TrainConfig, parts: TrainingParts, iteration: int, guards: dict[str, Any]
) -> Path:
    """The state after ``iteration``: weights, optimizer, scheduler, EMA, RNGs, every rank's sampler position and
    the guards' state (baselines, best: ``training/guards.py``)."""
    samplers = rt_dist.all_gather_object(ctx, parts.sampler.state_dict())
    trainer_state = {
        "iteration": iteration,
        "sampler": {str(rank): state for rank, state in enumerate(samplers)},
        "config": cfg.to_dict(),
        "guards": guards,
    }
    return save_checkpoint(
        Path(cfg.output_dir),
        iteration,
        ctx,
        training_state(parts),
        trainer_state=trainer_state,
        keep_last=cfg.keep_last or None,
    )


def training_state(parts: TrainingParts) -> TrainingState:
    """What a checkpoint saves and a resume restores in place of the run's parts."""
    return TrainingState(
        parts.transformer, parts.optimizer, parts.lr_scheduler, ema=parts.ema, extra_states=parts.policy_copies
    )


def restore(ctx: DistContext, parts: TrainingParts, checkpoint: Path | None) -> int:
    """Load a checkpoint into ``parts``; returns the iterations it had completed (0 without one)."""
    if checkpoint is None:
        return 0
    read_training_state(checkpoint)  # its shape, before anything loads (an elastic restart skips the launch's check)
    loaded = load_checkpoint(checkpoint, ctx, training_state(parts))
    parts.sampler.load_state_dict(loaded.trainer_state["sampler"][str(ctx.rank)])
    rt_dist.rank0_print(ctx, f"resumed from {checkpoint} after iteration {loaded.iteration}")
    return loaded.iteration


def checkpoint_to_resume(
    ctx: DistContext, output_dir: Path, resume: str | None, launch_token: str | None = None
) -> Path | None:
    """The checkpoint this start of the workers continues from: ``--resume``'s, or after an elastic restart
    (``--max-restarts``) the newest complete one, with no flag (rank 0 looks, every rank loads the same)."""

    marker = None if launch_token is None else output_dir / "logs" / f".started-{launch_token}"
    if restarted(ctx, marker):
        newest = latest_checkpoint(output_dir) if ctx.is_main else None
        found = rt_dist.broadcast_object(ctx, None if newest is None else str(newest))
        rt_dist.rank0_print(ctx, f"the workers started again (--max-restarts): continuing from {found or 'the start'}")
        return None if found is None else Path(found)
    return resolve_resume(output_dir, resume) if resume is not None else None


def train(cfg: TrainConfig, resume: str | None = None, launch_token: str | None = None) -> list[dict[str, Any]]:
    """Run the GRPO loop on this rank; returns rank 0's metrics records (empty on other ranks).

    ``fluxgrpo train`` reads them back from metrics.jsonl (``worker_entry`` returns nothing through the launcher);
    the records are returned for in-process callers: `bench --algorithms` (``bench/efficiency.py``) and tests.
    """

    with worker_session(cfg.device) as ctx:
        rt_device.seed_everything(cfg.seed + ctx.rank)
        output_dir = Path(cfg.output_dir)
        check_shared_folder(ctx, output_dir)  # several nodes: one folder that all of them see, or no resume
        parts = build_parts(cfg, ctx)
        checkpoint = checkpoint_to_resume(ctx, output_dir, resume, launch_token)
        start = restore(ctx, parts, checkpoint)
        metrics = open_metrics(cfg, ctx, start)
        evaluator = Evaluator(cfg, ctx, metrics)
        monitor = RunMonitor(cfg, parts, metrics, checkpoint)  # guards, best checkpoint, drift signals
        sigmas = sigma_schedule(cfg.sampling_steps, cfg.shift).to(ctx.device)  # [N+1]
        img_ids = image_ids(cfg.height, cfg.width).to(ctx.device)  # [L, 3]
        objective = build_objective(cfg, parts.policy_copies)
        step_plan_settings, plumbing = plan_settings(cfg), update_plumbing(cfg)
        rollout_setup = rollout_settings(cfg, sigmas, objective)
        records: list[dict[str, Any]] = []
        skipped_updates = SkippedUpdateWatch(last_iteration=cfg.max_train_steps)
        # the base model at iteration 0: every eval curve and every guard baseline starts there
        first = monitor.check(start, evaluator.before_training(start, parts), records)
        last = start if first.stop else cfg.max_train_steps  # a guard the starting weights fail: nothing to train
        for iteration in range(start + 1, last + 1):
            rt_dist.mark(f"iteration {iteration}")  # named if this rank stops or falls behind the others
            rt_device.reset_peak_memory(ctx.device)
            clock = PhaseClock(ctx.device)
            rng = iteration_randomness(cfg, ctx, iteration)
            # Which steps are SDE (and trained): all (DanceGRPO) or a window; the same on every rank.
            plan = plan_for_iteration(step_plan_settings, sigmas, iteration, rng.window)

            cond = draw_prompts(parts, cfg)  # [B = prompts × G] rows, groups contiguous
            noise = initial_noise(cfg, cfg.train_batch_size, rng.noise, ctx.device)  # [B, L, C]
            rollout = rollout_stage(
                parts.transformer, objective, rollout_setup, cond, noise, sigmas, img_ids,
                device_type=ctx.device_type, draws=RolloutDraws(rng.noise, rng.timestep), plan=plan,
            )  # fmt: skip
            drift = monitor.measure_drift(iteration, rollout, cond, rng.timestep)  # no RNG drawn, no weight moved
            clock.lap("rollout")

            decoded = rollout.final_x0 if cfg.decode_sample == "x0" else rollout.final_latent
            assert decoded is not None  # every rollout keeps its last latent
            images, scores = decode_and_score(parts, cfg, decoded, cond.captions)  # [B,3,H,W], [B, K]
            clock.lap("decode_reward")

            rewards, adv = aggregate_rewards(  # [B] Σ w·r, [B] advantages
                scores, parts.reward_fn.weights, cfg.advantage_aggregation, cfg.num_generations, cfg.adv_clip_max
            ).as_tuple()
            update = update_stage(
                parts, objective, rollout, cond, adv.advantages, plumbing, device_type=ctx.device_type,
                generator_cpu=rng.timestep, learnable=any_finite_reward(ctx, rewards),
            )  # fmt: skip
            clock.lap("update")

            record = iteration_record(ctx, cfg, parts, iteration, scores, rewards, adv.advantages, update, clock)
            record.update(drift)
            if cfg.sde_window:
                record["sde_window_start"] = plan.sde_start
            metrics.log(record, histograms={"reward": rewards})
            records.append(record)
            rt_dist.rank0_print(ctx, progress_line(record, cfg.max_train_steps, objective.progress))
            skipped_updates.observe(record)  # K iterations in a row without a step: a run that cannot learn stops
            if cfg.save_images_every and iteration % cfg.save_images_every == 0:
                save_sample_images(images, output_dir, iteration, ctx.rank, cfg.images_per_save)
            # before the checkpoint: a saved iteration has its evaluation and guard check
            verdict = monitor.check(iteration, evaluator.maybe_run(iteration, parts), records)
            due = iteration % cfg.checkpointing_steps == 0 or iteration == cfg.max_train_steps
            if due or verdict.save_checkpoint:  # a new best/, or a guard's stop, keeps this iteration
                path = save_training_checkpoint(ctx, cfg, parts, iteration, monitor.state_dict())
                rt_dist.rank0_print(ctx, f"saved {path}")
                monitor.checkpoint_saved(iteration, path)
            if iteration == start + 1:  # loading, compiling and the first rollout are behind: the short timeout
                rt_dist.steady_state(ctx)
            if verdict.stop:
                break
        metrics.close()
    return records if ctx.is_main else []


def worker_entry(payload: dict[str, Any]) -> None:
    """Every rank's part of ``fluxgrpo train`` (``runtime.launch.run_workers``): ``{"config", "resume",
    "launch_token"}`` (the token names this node's launcher in a restartable run: ``checkpoint_to_resume``)."""
    train(TrainConfig(**payload["config"]).validate(), payload.get("resume"), payload.get("launch_token"))
