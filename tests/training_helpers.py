"""The small tiny-cpu training config and the in-test launch that the training tests share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fluxgrpo.config import TrainConfig, build_config
from fluxgrpo.runtime.launch import LaunchSpec
from fluxgrpo.train_launch import launch_training, plan_training


def tiny_config(tiny_weights, tiny_embeddings, output_dir: Path, **overrides: Any) -> TrainConfig:
    """tiny-cpu shrunk to 4 iterations of 6 steps, G 4, checkpoints every 2, on the fixtures' weights and prompts."""
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
        **overrides,
    }
    return build_config("tiny-cpu", values)


def run(cfg: TrainConfig, dies: int = 1, resume: str | None = None) -> list[dict[str, Any]]:
    """Pre-flight and launch as `fluxgrpo train` does, quietly; rank 0's metrics records."""
    return launch_training(plan_training(cfg, LaunchSpec(nproc_per_node=dies), resume), log=lambda _: None)
