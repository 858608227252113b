"""From the run's config to the settings records of ``grpo/`` (which imports nothing above it): the update's
plumbing, the step plan's, the rollout's, and the objective (``--objective``, found in the objectives' catalogue)
with the policy copies it needs."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from fluxgrpo.config import TrainConfig
from fluxgrpo.grpo.objectives.base import Objective
from fluxgrpo.grpo.objectives.catalogue import objective_entry
from fluxgrpo.grpo.rollout import RolloutSettings
from fluxgrpo.grpo.samplers import make_sampler
from fluxgrpo.grpo.step_plan import PlanSettings
from fluxgrpo.grpo.update import UpdatePlumbing
from fluxgrpo.lora import LoraSpec, parse_targets


def update_plumbing(cfg: TrainConfig) -> UpdatePlumbing:
    return UpdatePlumbing(
        micro_batch_size=cfg.train_micro_batch_size,
        grad_accum_steps=cfg.gradient_accumulation_steps,
        max_grad_norm=cfg.max_grad_norm,
    )


def plan_settings(cfg: TrainConfig) -> PlanSettings:
    return PlanSettings(
        sde_window=cfg.sde_window,
        sde_window_policy=cfg.sde_window_policy,
        sde_window_shift_every=cfg.sde_window_shift_every,
        sde_window_stride=cfg.sde_window_stride,
        sde_window_wrap=cfg.sde_window_wrap,
        ode_solver=cfg.ode_solver,
        ode_compress_ratio=cfg.ode_compress_ratio,
        shift=cfg.shift,
    )


def rollout_settings(cfg: TrainConfig, sigmas: torch.Tensor, objective: Objective) -> RolloutSettings:
    """The rollout's settings; ``sigmas`` [N+1] is the σ table (flow-grpo's σ₁ comes from it); ``objective`` says
    what the rollout keeps."""
    sigma_max = float(sigmas[1]) if sigmas.shape[0] > 2 else 0.0
    return RolloutSettings(
        sampler=make_sampler(cfg.sampler, cfg.eta, sigma_max),
        guidance=cfg.guidance,
        rollout_batch_size=cfg.rollout_batch_size,
        keep_means=objective.keeps_step_means,
        retain_graphs=cfg.retain_rollout_graphs,
    )


def policy_copy_names(cfg: TrainConfig) -> tuple[str, ...]:
    """The extra copies of the trainable weights the objective keeps (saved with checkpoints, counted by memory)."""
    return objective_entry(cfg.objective).policy_copies(cfg)


def build_objective(cfg: TrainConfig, policy_copies: dict[str, Any]) -> Objective:
    """The objective of ``cfg.objective`` (its catalogue entry's class) over the run's policy copies."""
    builder: Any = objective_entry(cfg.objective).builder
    if isinstance(builder, str):
        module, _, name = builder.partition(":")
        builder = getattr(importlib.import_module(module), name)
    objective: Objective = builder.from_config(cfg, policy_copies)
    return objective


def lora_spec(cfg: TrainConfig) -> LoraSpec | None:
    """The LoRA of a run, or None for full fine-tuning (``--lora-rank 0``)."""
    if cfg.lora_rank == 0:
        return None
    return LoraSpec(cfg.lora_rank, cfg.lora_alpha, parse_targets(cfg.lora_targets), cfg.lora_dropout)
