"""From the run's config to the settings records of ``grpo/`` (which imports nothing above it): the update's, the
step plan's, the rollout's, and the objective (``--objective``) with the parts it needs."""

from __future__ import annotations

from typing import Any

import torch

from fluxgrpo.config import TrainConfig
from fluxgrpo.grpo.objectives.awm import AwmObjective, AwmSettings
from fluxgrpo.grpo.objectives.base import Objective
from fluxgrpo.grpo.objectives.grpo import GrpoObjective, UpdateSettings
from fluxgrpo.grpo.objectives.nft import NftObjective, NftSettings
from fluxgrpo.grpo.rollout import RolloutSettings
from fluxgrpo.grpo.samplers import make_sampler
from fluxgrpo.grpo.step_plan import PlanSettings
from fluxgrpo.lora import LoraSpec, parse_targets

OLD_POLICY, EMA_POLICY = "old_policy", "ema_policy"  # the names policy copies are saved under


def update_settings(cfg: TrainConfig) -> UpdateSettings:
    return UpdateSettings(
        num_train_timesteps=cfg.train_timesteps,
        clip_range=cfg.clip_range,
        micro_batch_size=cfg.train_micro_batch_size,
        grad_accum_steps=cfg.gradient_accumulation_steps,
        max_grad_norm=cfg.max_grad_norm,
        kl_beta=cfg.kl_beta,
        ratio_normalization=cfg.ratio_normalization,
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


def rollout_settings(cfg: TrainConfig, sigmas: torch.Tensor) -> RolloutSettings:
    """The SDE rollout's settings; ``sigmas`` [N+1] is the σ table (flow-grpo's σ₁ comes from it)."""
    sigma_max = float(sigmas[1]) if sigmas.shape[0] > 2 else 0.0
    return RolloutSettings(
        sampler=make_sampler(cfg.sampler, cfg.eta, sigma_max),
        guidance=cfg.guidance,
        rollout_batch_size=cfg.rollout_batch_size,
        keep_means=cfg.ratio_normalization == "grpo-guard",
    )


def policy_copy_names(cfg: TrainConfig) -> tuple[str, ...]:
    """The extra copies of the trainable weights the objective keeps (saved with checkpoints, counted by memory)."""
    if cfg.objective == "nft":
        return (OLD_POLICY,)
    if cfg.objective == "awm" and cfg.awm_ema_beta > 0:
        return (EMA_POLICY,)
    return ()


def build_objective(cfg: TrainConfig, policy_copies: dict[str, Any], reference: Any) -> Objective:
    """The objective of ``cfg.objective`` over the run's policy copies and KL reference."""
    if cfg.objective == "nft":
        nft = NftSettings(
            num_train_timesteps=cfg.train_timesteps,
            micro_batch_size=cfg.train_micro_batch_size,
            grad_accum_steps=cfg.gradient_accumulation_steps,
            beta=cfg.nft_beta,
            kl_beta=cfg.kl_beta,
            adv_clip_max=cfg.adv_clip_max,
            decay_type=cfg.nft_decay_type,
        )
        return NftObjective(nft, policy_copies[OLD_POLICY], reference)
    if cfg.objective == "awm":
        awm = AwmSettings(
            num_train_timesteps=cfg.train_timesteps,
            micro_batch_size=cfg.train_micro_batch_size,
            grad_accum_steps=cfg.gradient_accumulation_steps,
            weighting=cfg.awm_weighting,
            ghuber_power=cfg.awm_ghuber_power,
            clip_range=cfg.clip_range,
            kl_beta=cfg.kl_beta,
            ema_beta=cfg.awm_ema_beta,
            adv_clip_max=cfg.adv_clip_max,
        )
        return AwmObjective(awm, policy_copies.get(EMA_POLICY), reference)
    return GrpoObjective(update_settings(cfg), reference)


def lora_spec(cfg: TrainConfig) -> LoraSpec | None:
    """The LoRA of a run, or None for full fine-tuning (``--lora-rank 0``)."""
    if cfg.lora_rank == 0:
        return None
    return LoraSpec(cfg.lora_rank, cfg.lora_alpha, parse_targets(cfg.lora_targets), cfg.lora_dropout)
