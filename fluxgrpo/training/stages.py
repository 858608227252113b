"""The loop's stages: the prompts a rank draws, the initial noise, the rollout, decoding and scoring, the update,
the sample images it saves. Shared with the evaluation, the bench and the deep check, which call these and no
copies of them."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from PIL import Image

import fluxgrpo.paths
from fluxgrpo.config import TrainConfig
from fluxgrpo.grpo.latents import latent_shape, pack_latents, unpack_latents
from fluxgrpo.grpo.rollout import sample_final_latents, sample_trajectories
from fluxgrpo.grpo.schedule import StepPlan
from fluxgrpo.grpo.types import Conditioning
from fluxgrpo.grpo.update import Trainee, run_update, skipped_update, update_metrics
from fluxgrpo.models.flux import decode_latents
from fluxgrpo.run_folder import IMAGES_DIR, check_regular_or_absent
from fluxgrpo.runtime import device as rt_device
from fluxgrpo.training.parts import TrainingParts
from fluxgrpo.training.settings import objective_initial_noise

if TYPE_CHECKING:
    from fluxgrpo.grpo.objectives.base import Objective
    from fluxgrpo.grpo.rollout import RolloutSettings
    from fluxgrpo.grpo.types import FinalSamples, Rollout, UpdateStats
    from fluxgrpo.grpo.update import UpdatePlumbing
    from fluxgrpo.grpo.weight_copies import ShardedEMA
    from fluxgrpo.rewards.base import RewardFn


def draw_prompts(parts: TrainingParts, cfg: TrainConfig):
    """Conditioning for this rank's prompts, each row repeated G times (groups contiguous)."""

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
    """[B, L, C] packed Gaussian noise, shared by the G members of a group when ``shares_group_noise``; or the
    noise the objective draws itself (its catalogue entry's ``initial_noise``: Neighbor GRPO's neighbourhoods)."""

    shape = latent_shape(cfg.height, cfg.width)
    own = objective_initial_noise(cfg)
    if own is not None:
        size = (shape.channels, shape.latent_height, shape.latent_width)
        return own(num_prompts, cfg.num_generations, size, generator, device)
    draws = num_prompts if cfg.shares_group_noise else num_prompts * cfg.num_generations
    noise = torch.randn(
        (draws, shape.channels, shape.latent_height, shape.latent_width),
        generator=generator,
        device=device,
        dtype=torch.float32,
    )
    packed = pack_latents(noise)
    return packed.repeat_interleave(cfg.num_generations, dim=0) if cfg.shares_group_noise else packed


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

    images = []
    with torch.no_grad():
        for start in range(0, final_x0.shape[0], chunk):
            latents = unpack_latents(final_x0[start : start + chunk], height, width)
            with rt_device.autocast(device_type, compute_dtype):
                batch = decode_latents(vae, latents.to(next(vae.parameters()).dtype))
            images.append(batch.float())
    return torch.cat(images)


def score_images(reward_fn: RewardFn, images: torch.Tensor, captions, chunk: int) -> torch.Tensor:
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


def save_sample_images(images: torch.Tensor, output_dir: Path, iteration: int, rank: int, count: int) -> None:
    """``images/flux_{iteration}_{rank}_{idx}.png`` for the first ``count`` trajectories: one set per save, kept."""

    folder = output_dir / IMAGES_DIR
    folder.mkdir(parents=True, exist_ok=True)
    pixels = (images[:count].clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    for idx, array in enumerate(pixels):
        path = folder / f"flux_{iteration}_{rank}_{idx}.png"
        check_regular_or_absent(path)
        fluxgrpo.paths.write_atomic(path, lambda f, array=array: Image.fromarray(array).save(f, format="PNG"))


@dataclass(frozen=True)
class RolloutDraws:
    """The generators a rollout reads: ``noise`` for its SDE steps (None for the ODE's), ``timestep`` the update's
    timestep draw, read ahead from a copy with ``--retain-rollout-graphs`` (the generator does not move)."""

    noise: torch.Generator | None
    timestep: torch.Generator | None = None


def rollout_stage(
    transformer: torch.nn.Module,
    objective: Objective,
    settings: RolloutSettings,
    cond: Conditioning,
    noise: torch.Tensor,
    sigmas: torch.Tensor,
    img_ids: torch.Tensor,
    *,
    device_type: str,
    draws: RolloutDraws,
    plan: StepPlan | None = None,
) -> Rollout | FinalSamples:
    """What the objective trains on: the SDE trajectory with its log-probs (``Rollout``; ``plan`` its SDE window,
    ``draws.noise`` its step noise; with ``settings.retain_graphs`` the forwards of the steps the update will draw from
    ``draws.timestep``, kept), or the ODE's final latents (``FinalSamples``) sampled with the objective's rollout
    policy (NFT: θ_old) swapped in."""

    if objective.keeps_trajectory:
        assert draws.noise is not None  # the SDE draws its step noise
        train_indices = None
        if settings.retain_graphs:  # config-checked: grpo, on-policy
            assert draws.timestep is not None  # the update's timestep draw, read ahead
            trainable = (plan or StepPlan.every_step(sigmas.shape[0] - 1)).trainable
            train_indices = objective.planned_train_indices(noise.shape[0], trainable, draws.timestep)  # type: ignore[attr-defined]
        return sample_trajectories(
            transformer, cond, noise, sigmas, settings, img_ids=img_ids, device_type=device_type,
            generator=draws.noise, plan=plan, train_indices=train_indices,
        )  # fmt: skip
    policy = objective.rollout_policy()
    swapped = policy.swapped_in(transformer) if policy is not None else contextlib.nullcontext()
    with swapped:
        return sample_final_latents(
            transformer, cond, noise, sigmas, guidance=settings.guidance, rollout_batch_size=settings.rollout_batch_size,
            img_ids=img_ids, device_type=device_type, compute_dtype=settings.compute_dtype,
            keep_path=objective.keeps_ode_path,
        )  # fmt: skip


class TrainedModel(Trainee, Protocol):
    """What an update trains and steps, and its EMA (``TrainingParts`` is one; the bench and the deep check build
    their own)."""

    @property
    def ema(self) -> ShardedEMA | None: ...  # updated once per update that stepped


def update_stage(
    model: TrainedModel,
    objective: Objective,
    rollout: Rollout | FinalSamples,
    cond: Conditioning,
    advantages: torch.Tensor,
    plumbing: UpdatePlumbing,
    *,
    device_type: str,
    generator_cpu: torch.Generator,
    learnable: bool = True,
) -> UpdateStats:
    """Train on the rollout (``grpo.update.run_update``), then the objective's after-update step (its policy copies)
    and the EMA; with ``learnable`` False (no finite reward on any rank) nothing runs and nothing moves, not even
    weight decay or Adam's step count, and the statistics say the update was skipped."""

    if not learnable:
        retained = getattr(rollout, "retained", None)
        if retained is not None:  # the kept rollout graphs are not used: free their activations now
            retained.release()
        return skipped_update(
            update_metrics(objective), num_trajectories=rollout.num_trajectories, num_steps=rollout.num_steps,
            micro_batch_size=plumbing.micro_batch_size, grad_accum_steps=plumbing.grad_accum_steps,
            device=cond.prompt_embeds.device,
        )  # fmt: skip
    update = run_update(
        model, objective, rollout, cond, advantages, plumbing, device_type=device_type, generator_cpu=generator_cpu
    )
    # the optimizer steps taken so far in the run (the scheduler steps with each one and is saved with checkpoints):
    # the step count DiffusionNFT's and AWM's decay schedules read
    objective.finish(model.transformer, int(model.lr_scheduler.last_epoch))
    if model.ema is not None and update.optimizer_steps:
        model.ema.update(model.transformer)  # once per iteration, as DanceGRPO
    return update
