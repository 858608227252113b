"""Every check of a training configuration, each problem saying which numbers disagree and how to fix them: the
functions ``TrainConfig.problems`` calls (``validate`` raises them all at once)."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import TYPE_CHECKING

from fluxgrpo.config.choices import (
    AGGREGATIONS,
    DECODE_SAMPLES,
    LR_SCHEDULERS,
    MAX_IMAGE_SIDE,
    MAX_SEED,
    ODE_SOLVERS,
    RATIO_NORMALIZATIONS,
    SAMPLERS,
    SETTING_BOUNDS,
    WANDB_MODES,
    WINDOW_POLICIES,
    flag,
)
from fluxgrpo.config.guard_rules import guard_problems
from fluxgrpo.config.retain_check import retain_problems
from fluxgrpo.data.benchmarks import eval_prompts_problem
from fluxgrpo.errors import UsageError
from fluxgrpo.grpo.objectives.catalogue import (
    CATALOGUE,
    ObjectiveEntry,
    objective_names,
    option_groups,
    option_key_fields,
    settings_not_read,
)
from fluxgrpo.models.known import MODEL_FAMILIES
from fluxgrpo.rewards.base import REWARD_DTYPES
from fluxgrpo.rewards.registry import reward_record
from fluxgrpo.rewards.reward_set import parse_reward_list, reward_spec_problems, run_reward_names
from fluxgrpo.runtime.adapt import ATTENTION_BACKENDS
from fluxgrpo.runtime.device import DEVICE_TYPES

if TYPE_CHECKING:
    from collections.abc import Callable

    from fluxgrpo.config.schema import TrainConfig

# The adapter scale alpha/R past which an update moves the weights by orders of magnitude more than the rate says
# (1e30 passed and every update was skipped as non-finite, #50.5).
MAX_LORA_ALPHA = 4096.0


def config_problems(cfg: TrainConfig) -> list[str]:
    """Every inconsistency, each saying which numbers disagree and how to fix them."""
    out: list[str] = []
    out += _shape_problems(cfg)
    out += _number_problems(cfg)
    if cfg.guidance < 0 or cfg.kl_beta < 0:
        out.append("--guidance and --kl-beta cannot be negative")
    if cfg.weight_decay < 0 or cfg.lr_warmup_steps < 0 or cfg.keep_last < 0:
        out.append("--weight-decay, --lr-warmup-steps and --keep-last cannot be negative")
    if cfg.save_images_every < 0 or cfg.images_per_save < 0:
        out.append("--save-images-every and --images-per-save cannot be negative")
    if not 0 < cfg.ema_decay < 1:
        out.append(f"--ema-decay {cfg.ema_decay} must be in (0, 1)")
    if cfg.lr_scheduler not in LR_SCHEDULERS:
        out.append(f"--lr-scheduler {cfg.lr_scheduler!r}: use one of {', '.join(LR_SCHEDULERS)}")
    if cfg.device != "auto" and cfg.device not in DEVICE_TYPES:
        out.append(f"--device {cfg.device!r}: use auto or one of {', '.join(DEVICE_TYPES)}")
    out.extend(reward_spec_problems(cfg.reward))
    if cfg.advantage_aggregation not in AGGREGATIONS:
        out.append(f"--advantage-aggregation {cfg.advantage_aggregation!r}: use one of {', '.join(AGGREGATIONS)}")
    if cfg.reward_dtype not in REWARD_DTYPES:
        out.append(f"--reward-dtype {cfg.reward_dtype!r}: use one of {', '.join(REWARD_DTYPES)}")
    if cfg.lora_rank < 0:
        out.append(f"--lora-rank {cfg.lora_rank} cannot be negative (0 trains every weight)")
    if cfg.lora_rank > 0:
        if not 0 < cfg.lora_alpha <= MAX_LORA_ALPHA:
            out.append(f"--lora-alpha {cfg.lora_alpha} must be in (0, {MAX_LORA_ALPHA:g}] (Flow-GRPO's FLUX: 128)")
        if not 0 <= cfg.lora_dropout < 1:
            out.append(f"--lora-dropout {cfg.lora_dropout} must be in [0, 1)")
        if not any(part.strip() for part in cfg.lora_targets.split(",")):
            out.append("--lora-targets is empty: name the modules to adapt, e.g. attn.to_q,attn.to_k")
    out += _algorithm_problems(cfg)
    if cfg.attention not in ATTENTION_BACKENDS:
        out.append(f"--attention {cfg.attention!r}: use one of {', '.join(ATTENTION_BACKENDS)}")
    if not 0 <= cfg.seed <= MAX_SEED:
        out.append(f"--seed {cfg.seed} is out of range: use 0 to {MAX_SEED} (numpy's seed range)")
    out += _logging_problems(cfg)
    return out


def _shape_problems(cfg: TrainConfig) -> list[str]:
    """The image size, the counts, the trained timesteps and the batches' division of the trajectories."""
    out: list[str] = []
    for name in ("height", "width"):
        value = getattr(cfg, name)
        if value <= 0 or value % 16:
            out.append(f"--{name} {value} must be a positive multiple of 16 (FLUX packs 2×2 latents of 8× VAE pixels)")
        elif value > MAX_IMAGE_SIDE:
            out.append(f"--{name} {value} is out of range: at most {MAX_IMAGE_SIDE} pixels")
    positive_ints = (
        "dies",
        "sampling_steps",
        "num_generations",
        "train_batch_size",
        "rollout_batch_size",
        "gradient_accumulation_steps",
        "train_micro_batch_size",
        "max_train_steps",
        "checkpointing_steps",
    )
    if cfg.model_family not in MODEL_FAMILIES:
        out.append(f"--model-family {cfg.model_family!r}: use one of {', '.join(MODEL_FAMILIES)}")
    for name in positive_ints:
        if getattr(cfg, name) < 1:
            out.append(f"--{flag(name)} must be at least 1 (got {getattr(cfg, name)})")
    if cfg.num_generations < 2:
        out.append(
            f"--num-generations {cfg.num_generations}: GRPO needs at least 2 trajectories per prompt "
            "to compute a group advantage"
        )
    if cfg.sampling_steps >= 2 and not 0 < cfg.timestep_fraction <= 1:
        out.append(f"--timestep-fraction {cfg.timestep_fraction} must be in (0, 1]")
    elif cfg.sampling_steps >= 1 and cfg.train_timesteps < 1 and 0 <= cfg.sde_window < cfg.sampling_steps:
        # (a window out of range has its own line below)
        steps, other = (
            (f"--sde-window {cfg.sde_window}", "--sde-window")
            if cfg.sde_window
            else (f"(--sampling-steps {cfg.sampling_steps} − 1)", "--sampling-steps")
        )
        out.append(
            f"--timestep-fraction {cfg.timestep_fraction} × {steps} trains no timestep: raise --timestep-fraction "
            f"or {other}"
        )
    per_rank = cfg.trajectories_per_rank
    for name in ("rollout_batch_size", "train_micro_batch_size"):
        size = getattr(cfg, name)
        if size >= 1 and per_rank >= 1 and per_rank % size:
            divisors = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
            out.append(
                f"--{flag(name)} {size} does not divide the {per_rank} trajectories per rank "
                f"(--train-batch-size {cfg.train_batch_size} × --num-generations {cfg.num_generations}); "
                f"use one of {divisors} so every batch has the same shape"
            )
    return out


def _number_problems(cfg: TrainConfig) -> list[str]:
    """Every float finite, the positive ones positive, none past its bound (``SETTING_BOUNDS``)."""
    out: list[str] = []
    types = {f.name: f.type for f in fields(cfg)} | {key: found.type for key, found in option_key_fields().items()}
    non_finite = [
        name for name, value in cfg.to_dict().items() if types.get(name) == "float" and not math.isfinite(value)
    ]
    for name in non_finite:
        out.append(f"--{flag(name)} must be a finite number (got {getattr(cfg, name)})")
    for name in ("eta", "clip_range", "adv_clip_max", "learning_rate", "max_grad_norm"):
        if name not in non_finite and not getattr(cfg, name) > 0:
            out.append(f"--{flag(name)} must be positive (got {getattr(cfg, name)})")
    if "shift" not in non_finite and cfg.shift <= 0:
        out.append(f"--shift must be positive (got {cfg.shift})")
    for name, most in SETTING_BOUNDS.items():
        if name not in non_finite and abs(getattr(cfg, name)) > most:
            out.append(f"--{flag(name)} {getattr(cfg, name)} is out of range: at most {most}")
    return out


def _logging_problems(cfg: TrainConfig) -> list[str]:
    """Held-out evaluation, guards and experiment-tracker settings."""

    out = []
    if cfg.eval_every < 0:
        out.append(f"--eval-every must be 0 (off) or a number of iterations (got {cfg.eval_every})")
    for name in ("eval_images_per_prompt", "eval_steps"):
        if getattr(cfg, name) < 1:
            out.append(f"--{flag(name)} must be at least 1 (got {getattr(cfg, name)})")
    if cfg.eval_prompts and (problem := eval_prompts_problem(cfg.eval_prompts)):
        out.append(problem)
    out.extend(parse_reward_list(cfg.eval_rewards, "--eval-rewards", weights=False, empty_ok=True)[1])
    out.extend(_reward_image_size_problems(cfg))
    out.extend(guard_problems(cfg))
    if cfg.wandb_mode and cfg.wandb_mode not in WANDB_MODES:
        out.append(f"--wandb-mode {cfg.wandb_mode!r}: use one of {', '.join(WANDB_MODES)}, or leave it empty")
    return out


def _reward_image_size_problems(cfg: TrainConfig) -> list[str]:
    """A reward that reads only some image sizes (shapes: 64² or 128²) against --height/--width."""

    try:
        names = run_reward_names(cfg.reward, cfg.eval_rewards, cfg.eval_every)
    except UsageError:
        return []  # the reward lists' own problems are reported above
    out = []
    for name in names:
        check = reward_record(name).image_size_problems
        if check is not None:
            out.extend(check(cfg.height, cfg.width))
    return out


def _objective_problems(cfg: TrainConfig) -> list[str]:
    """The objective's catalogue entry checks the run; every registered settings class checks its own flags."""
    if cfg.objective not in CATALOGUE:
        return [f"--objective {cfg.objective!r}: use one of {', '.join(objective_names())}"]
    out = []
    entry = CATALOGUE[cfg.objective]
    if not entry.keeps_trajectory:
        trajectory_only = [
            flag
            for flag, used in (
                ("--sde-window", cfg.sde_window != 0),
                ("--ratio-normalization grpo-guard", cfg.ratio_normalization != "none"),
                ("--ode-solver dpm2", cfg.ode_solver != "euler"),
            )
            if used
        ]
        if trajectory_only:
            keeping = ", ".join(name for name, other in CATALOGUE.items() if other.keeps_trajectory)
            out.append(
                f"{', '.join(trajectory_only)}: only --objective {keeping} has per-step log-probs; --objective "
                f"{cfg.objective} rolls out with the ODE (leave these at their defaults)"
            )
    for group in option_groups():
        out.extend(cfg.settings_of(group).problems())
    out.extend(entry.run_problems(cfg))
    out.extend(_ignored_option_problems(cfg, entry))
    return out


def unread_flag_problems(cfg: TrainConfig, given: list[str]) -> list[str]:
    """Settings given as flags (``given``: their field names) that ``--objective`` does not read: the SDE rollout's
    (``--eta``, ``--sampler``, …) for an objective that rolls out with the ODE, an entry's ``ignores`` (``--clip-range``
    for nft, ``--timestep-fraction`` for vgrpo) and the other objectives' own flags. A config file's value for them
    stays allowed: ``--config shapes-cpu --objective vgrpo`` keeps the file's dance settings unread, but a flag the
    user typed for the run must do something."""

    # Judged on the whole config (a file's --fm-timesteps leaves a typed --timestep-fraction unread), reported for
    # the typed flags only.
    by_objective = [name for name in settings_not_read(cfg.objective, cfg.to_dict()) if name in given]
    out = [
        f"--{flag(name)} {getattr(cfg, name)}: --objective {cfg.objective} does not read it; leave it out (`fluxgrpo "
        "train --help` says what each flag applies to)"
        for name in by_objective
    ]
    for names, switched_on, switch in _READ_ONLY_WITH:  # and the settings another one turns on (#50.6)
        if switched_on(cfg):
            continue
        out.extend(
            f"--{flag(name)} {getattr(cfg, name)}: the run does not read it without {switch}; add that, or leave "
            f"--{flag(name)} out"
            for name in names
            if name in given and name not in by_objective
        )
    return out


# Settings read only when another one turns them on: (the settings, whether the config turns them on, the switch).
_READ_ONLY_WITH: tuple[tuple[tuple[str, ...], Callable[[TrainConfig], bool], str], ...] = (
    (
        ("lora_alpha", "lora_dropout", "lora_targets"),
        lambda c: c.lora_rank > 0,
        "--lora-rank R (0 trains every weight)",
    ),
    (("ema_decay",), lambda c: c.use_ema, "--use-ema"),
    (
        ("sde_window_policy", "sde_window_shift_every", "sde_window_stride", "sde_window_wrap"),
        lambda c: c.sde_window > 0,
        "--sde-window W (0: every step is SDE)",
    ),
    (("ode_compress_ratio",), lambda c: c.ode_solver == "dpm2", "--ode-solver dpm2"),
    (
        ("eval_prompts", "eval_images_per_prompt", "eval_steps", "eval_rewards"),
        lambda c: c.eval_every > 0,
        "--eval-every K (0: no evaluation)",
    ),
    (("guard_action",), lambda c: bool(c.guard), "--guard RULES"),
    (("images_per_save",), lambda c: c.save_images_every > 0, "--save-images-every K"),
    (("wandb_project", "wandb_name", "wandb_mode"), lambda c: c.wandb, "--wandb"),
    (("lr_warmup_steps",), lambda c: c.lr_scheduler != "constant", "a --lr-scheduler other than constant"),
)


def _ignored_option_problems(cfg: TrainConfig, entry: ObjectiveEntry) -> list[str]:
    """An objective's own flag (``ObjectiveEntry.options``) set off its default for an objective that ignores it."""
    known = option_key_fields()
    out = []
    for name in dict.fromkeys(option for other in CATALOGUE.values() for option in other.options):
        if name in entry.options or getattr(cfg, name) == known[name].default:
            continue
        users = [other.name for other in CATALOGUE.values() if name in other.options]
        out.append(
            f"--{flag(name)} {getattr(cfg, name)}: --objective {cfg.objective} ignores it (it applies to "
            f"--objective {' or '.join(users)}); leave it at its default"
        )
    return out


def _algorithm_problems(cfg: TrainConfig) -> list[str]:
    out = _objective_problems(cfg)
    out += retain_problems(cfg)
    for name, allowed in (
        ("sampler", SAMPLERS),
        ("sde_window_policy", WINDOW_POLICIES),
        ("decode_sample", DECODE_SAMPLES),
        ("ode_solver", ODE_SOLVERS),
        ("ratio_normalization", RATIO_NORMALIZATIONS),
    ):
        if getattr(cfg, name) not in allowed:
            out.append(f"--{flag(name)} {getattr(cfg, name)!r}: use one of {', '.join(allowed)}")
    if not 0 <= cfg.sde_window <= cfg.sampling_steps - 1:
        out.append(
            f"--sde-window {cfg.sde_window} must be between 0 (off) and the {cfg.sampling_steps - 1} trainable "
            f"steps of --sampling-steps {cfg.sampling_steps}"
        )
    if cfg.sde_window_policy == "random-early" and cfg.sde_window > cfg.sampling_steps // 2:
        out.append(
            f"--sde-window-policy random-early starts the window in 0…N/2−W: --sde-window {cfg.sde_window} is "
            f"more than half of --sampling-steps {cfg.sampling_steps}"
        )
    if cfg.sde_window_shift_every < 0 or cfg.sde_window_stride < 0:
        out.append("--sde-window-shift-every and --sde-window-stride cannot be negative")
    if cfg.ode_solver == "dpm2" and cfg.sde_window == 0:
        out.append("--ode-solver dpm2 integrates the steps outside an SDE window: set --sde-window too")
    if not 0 < cfg.ode_compress_ratio <= 1:
        out.append(f"--ode-compress-ratio {cfg.ode_compress_ratio} must be in (0, 1]")
    if not cfg.kl_beta >= 0:
        out.append(f"--kl-beta {cfg.kl_beta} cannot be negative (0 turns the KL off)")
    if cfg.ratio_normalization == "grpo-guard" and cfg.sampler == "cps":
        out.append(
            "--ratio-normalization grpo-guard needs a Gaussian log-prob: use --sampler dance or flow-grpo "
            "(cps's log-prob has its constants removed)"
        )
    if cfg.sampler == "cps" and not cfg.eta < 1:
        out.append(f"--eta {cfg.eta} with --sampler cps must be below 1 (the noise is σ'·sin(η·π/2))")
    return out
