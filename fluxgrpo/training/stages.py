"""The loop's stages that are not algorithm: the prompts a rank draws, the initial noise, decoding and scoring,
the sample images it saves. Shared with the evaluation and the bench."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fluxgrpo.config import TrainConfig
from fluxgrpo.runtime import device as rt_device
from fluxgrpo.training.parts import TrainingParts


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
    """[B, L, C] packed Gaussian noise; shared by the G members of a group when ``shares_group_noise``."""
    from fluxgrpo.grpo.latents import latent_shape, pack_latents

    shape = latent_shape(cfg.height, cfg.width)
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


def save_sample_images(images: torch.Tensor, output_dir: Path, iteration: int, rank: int, count: int) -> None:
    """``images/flux_{iteration}_{rank}_{idx}.png`` for the first ``count`` trajectories: one set per save, kept."""
    from PIL import Image

    from fluxgrpo.paths import write_atomic
    from fluxgrpo.run_folder import IMAGES_DIR, check_regular_or_absent

    folder = output_dir / IMAGES_DIR
    folder.mkdir(parents=True, exist_ok=True)
    pixels = (images[:count].clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    for idx, array in enumerate(pixels):
        path = folder / f"flux_{iteration}_{rank}_{idx}.png"
        check_regular_or_absent(path)
        write_atomic(path, lambda f, array=array: Image.fromarray(array).save(f, format="PNG"))


def rollout_stage(
    parts: TrainingParts,
    cfg: TrainConfig,
    objective: Any,
    cond: Any,
    noise: torch.Tensor,
    sigmas: torch.Tensor,
    img_ids: torch.Tensor,
    plan: Any,
    generator: torch.Generator,
) -> Any:
    """What the objective trains on: the SDE trajectory with its log-probs (``Rollout``), or the ODE's final
    latents (``FinalSamples``) sampled with the objective's rollout policy (NFT: θ_old) swapped in."""
    import contextlib

    from fluxgrpo.grpo.rollout import sample_final_latents, sample_trajectories
    from fluxgrpo.training.settings import rollout_settings

    device_type = parts.ctx.device_type
    if objective.keeps_trajectory:
        return sample_trajectories(
            parts.transformer, cond, noise, sigmas, rollout_settings(cfg, sigmas), img_ids=img_ids,
            device_type=device_type, generator=generator, plan=plan,
        )  # fmt: skip
    policy = objective.rollout_policy()
    swapped = policy.swapped_in(parts.transformer) if policy is not None else contextlib.nullcontext()
    with swapped:
        return sample_final_latents(
            parts.transformer, cond, noise, sigmas, guidance=cfg.guidance, rollout_batch_size=cfg.rollout_batch_size,
            img_ids=img_ids, device_type=device_type,
        )  # fmt: skip
