"""The small tiny-cpu training config and the in-test launch that the training tests share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fluxgrpo.config import TrainConfig, build_config
from fluxgrpo.grpo import Conditioning
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
