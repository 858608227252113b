"""From the run's config to the settings records of ``grpo/`` (which imports nothing above it): the update's
plumbing, the step plan's, the rollout's, and the objective (``--objective``, found in the objectives' catalogue)
with the policy copies it needs."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch

from fluxgrpo.config import TrainConfig
from fluxgrpo.grpo.objectives.base import Objective
from fluxgrpo.grpo.objectives.catalogue import objective_entry
from fluxgrpo.grpo.objectives.entry import ObjectiveRun
from fluxgrpo.grpo.rollout import RolloutSettings
from fluxgrpo.grpo.samplers import make_sampler
from fluxgrpo.grpo.schedule import PlanSettings
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


def objective_run(cfg: TrainConfig) -> ObjectiveRun:
    """What ``cfg.objective``'s loss reads of the run: its settings and the general values (the loss never sees the
    config)."""
    entry = objective_entry(cfg.objective)
    return ObjectiveRun(
        settings=None if entry.settings is None else cfg.settings_of(entry.settings),
        shared=cfg.objective_settings,
        train_timesteps=cfg.train_timesteps,
        group_size=cfg.num_generations,
        clip_range=cfg.clip_range,
        kl_beta=cfg.kl_beta,
        adv_clip_max=cfg.adv_clip_max,
        ratio_normalization=cfg.ratio_normalization,
        draws=cfg.flow_matching_draws,
    )


def _resolved(hook: str | Callable[..., Any]) -> Callable[..., Any]:
    """A catalogue hook: the function itself, or "module:name" imported now."""
    if isinstance(hook, str):
        module, _, name = hook.partition(":")
        return getattr(importlib.import_module(module), name)
    return hook


def build_objective(cfg: TrainConfig, policy_copies: dict[str, Any]) -> Objective:
    """The objective of ``cfg.objective`` (its catalogue entry's class) over the run's policy copies."""
    builder = _resolved(objective_entry(cfg.objective).builder)
    objective: Objective = builder.from_config(objective_run(cfg), policy_copies)  # type: ignore[attr-defined]
    return objective


def objective_initial_noise(cfg: TrainConfig) -> Callable[..., torch.Tensor] | None:
    """``(num_prompts, group_size, latent_size, generator, device) → [P·G, L, C]`` when ``cfg.objective`` draws its
    rollout's initial noises itself (its catalogue entry's ``initial_noise``, over its settings), else None."""
    entry = objective_entry(cfg.objective)
    if entry.initial_noise is None:
        return None
    settings = None if entry.settings is None else cfg.settings_of(entry.settings)
    return functools.partial(_resolved(entry.initial_noise), settings)


def lora_spec(cfg: TrainConfig) -> LoraSpec | None:
    """The LoRA of a run, or None for full fine-tuning (``--lora-rank 0``)."""
    if cfg.lora_rank == 0:
        return None
    return LoraSpec(cfg.lora_rank, cfg.lora_alpha, parse_targets(cfg.lora_targets), cfg.lora_dropout)
