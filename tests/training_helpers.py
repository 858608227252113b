"""The small tiny-cpu training config and the in-test launch that the training tests share."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from fluxgrpo.config import TrainConfig, build_config
from fluxgrpo.grpo.types import Conditioning, Rollout, UpdateStats
from fluxgrpo.runtime.launch import LaunchSpec
from fluxgrpo.training.launch_plan import launch_training, plan_training

# The conditioning shapes of the one-block tiny transformers the rollout/update tests build.
TEXT_TOKENS, TEXT_DIM, POOLED_DIM = 8, 32, 32
# The shipped tiny-cpu settings (brightness reward, lr 3e-3, clip 1e-2) long enough for the toy reward to rise.
TOY_REWARD_RUN = {
    "max_train_steps": 16,
    "checkpointing_steps": 16,
    "num_generations": 8,
    "rollout_batch_size": 8,
    "train_micro_batch_size": 4,
    "sampling_steps": 8,
}


def make_batch(num_trajectories: int, seed: int = 0) -> tuple[Conditioning, torch.Tensor]:
    """Random conditioning rows and initial noise [B, 16, 64] (a 32² image's packed latents), seeded."""
    generator = torch.Generator().manual_seed(seed)
    cond = Conditioning(
        prompt_embeds=torch.randn(num_trajectories, TEXT_TOKENS, TEXT_DIM, generator=generator),
        pooled=torch.randn(num_trajectories, POOLED_DIM, generator=generator),
        text_ids=torch.zeros(TEXT_TOKENS, 3),
    )
    return cond, torch.randn(num_trajectories, 16, 64, generator=generator)


def tiny_config(tiny_weights, tiny_embeddings, output_dir: Path, **overrides: Any) -> TrainConfig:
    """tiny-cpu shrunk to 4 iterations of 6 steps, G 4, checkpoints every 2, no evaluation, on the fixtures' weights
    and prompts."""
    values = {
        "model": str(tiny_weights.flux_dir),
        "hps_dir": str(tiny_weights.hps_dir),
        "data_json_path": str(tiny_embeddings.index_path),
        "output_dir": str(output_dir),
        "max_train_steps": 4,
        "checkpointing_steps": 2,
        "save_images_every": 0,
        "num_generations": 4,
        "rollout_batch_size": 4,
        "train_micro_batch_size": 2,
        "sampling_steps": 6,
        "eval_every": 0,  # the shipped config evaluates (the quickstart shows its grid); a test asks for it
        **overrides,
    }
    return build_config("tiny-cpu", values)


def tiny_train_argv(tiny_weights, tiny_embeddings, *extra: str) -> list[str]:
    """`fluxgrpo train` arguments for tiny-cpu on the fixtures' weights and prompts, followed by ``extra``."""
    return [
        "train",
        "--config",
        "tiny-cpu",
        "--model",
        str(tiny_weights.flux_dir),
        "--hps-dir",
        str(tiny_weights.hps_dir),
        "--data-json-path",
        str(tiny_embeddings.index_path),
        "--eval-every",  # the shipped config evaluates; a test asks for it (a later --eval-every wins)
        "0",
        *extra,
    ]


def run(cfg: TrainConfig, dies: int = 1, resume: str | None = None) -> list[dict[str, Any]]:
    """Pre-flight and launch as `fluxgrpo train` does, quietly; rank 0's metrics records."""
    return launch_training(plan_training(cfg, LaunchSpec(nproc_per_node=dies), resume), log=lambda _: None)


def sde_rollout(
    transformer: torch.nn.Module,
    cond: Conditioning,
    noise: torch.Tensor,
    sigmas: torch.Tensor,
    *,
    eta: float,
    generator: torch.Generator,
    sampler: str = "dance",
    **settings: Any,
) -> Rollout:
    """The trainer's SDE rollout (``sample_trajectories``) with ``sampler`` at noise level ``eta``; ``settings``:
    guidance, rollout_batch_size, compute_dtype, keep_means (``RolloutSettings``), img_ids, device_type, plan."""
    from fluxgrpo.grpo.rollout import RolloutSettings, sample_trajectories
    from fluxgrpo.grpo.samplers import make_sampler

    sigma_max = float(sigmas[1]) if sigmas.shape[0] > 2 else 0.0
    keys = ("guidance", "rollout_batch_size", "compute_dtype", "keep_means")
    rollout_settings = RolloutSettings(
        make_sampler(sampler, eta, sigma_max), **{key: settings.pop(key) for key in keys if key in settings}
    )
    return sample_trajectories(transformer, cond, noise, sigmas, rollout_settings, generator=generator, **settings)


def grpo_update(
    transformer: torch.nn.Module,
    rollout: Rollout,
    cond: Conditioning,
    advantages: torch.Tensor,
    optimizer: Any,
    lr_scheduler: Any,
    *,
    num_train_timesteps: int,
    clip_range: float,
    micro_batch_size: int,
    grad_accum_steps: int,
    max_grad_norm: float,
    kl_beta: float = 0.0,
    ratio_normalization: str = "none",
    compute_dtype: torch.dtype | None = None,
    **driver: Any,
) -> UpdateStats:
    """One ``--objective grpo`` update through the update driver (``run_update``); ``driver``: device_type,
    generator_cpu, reference."""
    from fluxgrpo.grpo.objectives.grpo.loss import GrpoObjective, GrpoSettings
    from fluxgrpo.grpo.update import UpdatePlumbing, run_update

    objective = GrpoObjective(GrpoSettings(num_train_timesteps, clip_range, kl_beta, ratio_normalization))
    plumbing = UpdatePlumbing(micro_batch_size, grad_accum_steps, max_grad_norm, compute_dtype)
    trainee = SimpleNamespace(
        transformer=transformer, optimizer=optimizer, lr_scheduler=lr_scheduler, reference=driver.pop("reference", None)
    )
    return run_update(trainee, objective, rollout, cond, advantages, plumbing, **driver)
