"""The training configuration's schema: one typed dataclass, DanceGRPO's names, each field with its default and its
help (the flag's help text); ``checks.py`` holds its checks, ``files.py`` how it is read and saved.

An objective's own settings are no fields here: each objective's settings class (``grpo/objectives/<name>/
settings.py``) holds them, and ``objective_settings`` holds one instance of every registered class. Their config keys
stay flat (``nft_beta``, ``--nft-beta``): ``config_fields`` generates them after ``objective``, ``to_dict`` writes
them there, ``TrainConfig(nft_beta=…)`` and ``dataclasses.replace(cfg, nft_beta=…)`` set them, and ``cfg.nft_beta``
reads one (``settings_of(NftOptions).beta`` is the typed way).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypeVar

from fluxgrpo.config.checks import config_problems
from fluxgrpo.config.choices import LR_SCHEDULERS, WANDB_MODES
from fluxgrpo.errors import UsageError
from fluxgrpo.grpo.objectives.catalogue import (
    CATALOGUE,
    ObjectiveEntry,
    objective_help,
    option_groups,
    option_key_fields,
)
from fluxgrpo.grpo.objectives.flow_matching import FlowMatchingOptions, resolved_draws
from fluxgrpo.grpo.objectives.options import Options, OptionSet
from fluxgrpo.models.known import LORA_DEFAULT_TARGETS, MODEL_FAMILIES
from fluxgrpo.paths import (
    DEFAULT_EMBEDDINGS_DIR,
    DEFAULT_FLUX_DIR,
    DEFAULT_HPS_DIR,
    DEFAULT_OUTPUT_DIR,
    EMBEDDINGS_INDEX,
    HPS_DIR_HELP,
)
from fluxgrpo.rewards import reward_names
from fluxgrpo.runtime.adapt import ATTENTION_BACKENDS
from fluxgrpo.runtime.device import DEVICE_TYPES

SettingsT = TypeVar("SettingsT", bound=Options)


def _opt(default: Any, help: str, **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, **meta})


def default_objective_settings() -> OptionSet:
    """Every registered settings class at its defaults."""
    return OptionSet().merged(option_groups(), {})


@dataclass
class TrainConfig:
    """Every knob of a training run. Defaults reproduce the Atlas A3 16-die DanceGRPO recipe."""

    # --- data and weights -----------------------------------------------------------------------------
    model: str = _opt(DEFAULT_FLUX_DIR, "FLUX diffusers folder (from `fluxgrpo fetch-weights`).")
    model_family: str = _opt(
        "flux-dev",
        f"The model this config is for: {', '.join(MODEL_FAMILIES)} (whatever --model holds). A --dry-run plans "
        "from its known shapes without its weights, and says when --model holds another model.",
    )
    dies: int = _opt(1, "Worker processes on this node, one per accelerator die (--dies overrides a config's).")
    hps_dir: str = _opt(DEFAULT_HPS_DIR, HPS_DIR_HELP)
    data_json_path: str = _opt(
        f"{DEFAULT_EMBEDDINGS_DIR}/{EMBEDDINGS_INDEX}", "Embeddings index written by `fluxgrpo preprocess`."
    )
    output_dir: str = _opt(DEFAULT_OUTPUT_DIR, "Checkpoints, metrics.jsonl, sample images and the resolved config.")
    reward: str = _opt(
        "hpsv2",
        f"Reward model(s): {', '.join(reward_names())} (shapes: the shapes world's rule-based checker, no weights; "
        "brightness, exposure, structure: smoke tests for tiny models); several as name:weight,... (e.g. hpsv2:1,pickscore:0.5; weights normalised to sum 1).",
    )
    reward_dtype: str = _opt("fp32", "Dtype the reward encoders run in: fp32 or bf16 (scores are fp32 either way).")
    # --- rollout --------------------------------------------------------------------------------------
    height: int = _opt(720, "Image height in pixels (multiple of 16).")
    width: int = _opt(720, "Image width in pixels (multiple of 16).")
    sampling_steps: int = _opt(16, "Denoising steps N per trajectory.")
    eta: float = _opt(0.3, "SDE noise level η (the same at every step).")
    shift: float = _opt(3.0, "Time shift s of the σ schedule.")
    guidance: float = _opt(3.5, "FLUX-dev distilled guidance value.")
    num_generations: int = _opt(12, "Trajectories per prompt G (the group size).")
    train_batch_size: int = _opt(1, "Prompts per rank per iteration.")
    init_same_noise: bool = _opt(
        True,
        "Share the initial noise within each group (not across prompts); --objective grpo only: the ODE rollouts of "
        "nft and awm need a noise per image, or a group's images would all be the same.",
    )
    rollout_batch_size: int = _opt(4, "Trajectories per transformer forward during rollout.")
    # --- policy update --------------------------------------------------------------------------------
    timestep_fraction: float = _opt(
        0.6, "Fraction of the N−1 transitions (or of the SDE window) each trajectory trains on."
    )
    clip_range: float = _opt(1e-4, "PPO clip ε on the probability ratio.")
    adv_clip_max: float = _opt(5.0, "Advantages are clipped to ±this.")
    advantage_aggregation: str = _opt(
        "sum-rewards",
        "With several rewards: sum-rewards (group advantage of Σ w·r) or sum-advantages (Σ w·A, each reward "
        "standardised in its group first).",
    )
    learning_rate: float = _opt(1e-5, "AdamW learning rate.")
    weight_decay: float = _opt(1e-4, "AdamW weight decay.")
    max_grad_norm: float = _opt(1.0, "Gradient-norm clip before each optimizer step.")
    gradient_accumulation_steps: int = _opt(4, "Micro-batches per optimizer step.")
    train_micro_batch_size: int = _opt(1, "Trajectories per training forward.")
    lr_scheduler: str = _opt("constant_with_warmup", f"Learning-rate schedule: {', '.join(LR_SCHEDULERS)}.")
    lr_warmup_steps: int = _opt(0, "Warm-up optimizer steps.")
    lora_rank: int = _opt(
        0, "LoRA rank R: train rank-R adapters, base frozen in the compute dtype (0: full fine-tune)."
    )
    lora_alpha: float = _opt(128.0, "LoRA alpha: adapter outputs are scaled by alpha/R (Flow-GRPO's FLUX: R 64, 128).")
    lora_targets: str = _opt(LORA_DEFAULT_TARGETS, "Comma-separated module names that get LoRA adapters.")
    lora_dropout: float = _opt(0.0, "Dropout on the LoRA adapters' input.")
    # --- algorithm options (the peers' methods; the defaults are DanceGRPO's) ---------------------------
    objective: str = _opt("grpo", objective_help())  # config_fields() asks again: one registered since is named
    sampler: str = _opt(
        "dance",
        "SDE of the rollout and its log-prob: dance (η at every step), flow-grpo (Flow-GRPO's σ-dependent noise) "
        "or cps (coefficients-preserving); --eta is the noise level of each.",
    )
    sde_window: int = _opt(
        0, "Only this many consecutive steps are SDE and trained, ODE elsewhere (MixGRPO); 0: every step is SDE."
    )
    sde_window_policy: str = _opt(
        "sliding",
        "Window placement: sliding (from the noisy end, see --sde-window-shift-every), random (anywhere), or "
        "random-early (starts in 0…N/2−W, Flow-GRPO-Fast's range).",
    )
    sde_window_shift_every: int = _opt(0, "Move the sliding window every this many iterations (0: it stays).")
    sde_window_stride: int = _opt(1, "Steps the sliding window moves towards the data each time.")
    sde_window_wrap: bool = _opt(False, "After its last position the sliding window starts over (else it stays).")
    ode_solver: str = _opt(
        "euler", "ODE outside the window: euler, or dpm2 (DPM-Solver++ 2M on fewer steps after the window)."
    )
    ode_compress_ratio: float = _opt(0.4, "With --ode-solver dpm2: the fraction of the steps after the window kept.")
    decode_sample: str = _opt(
        "x0",
        "What the VAE decodes for the reward: x0 (the last model call's x̂0, DanceGRPO's) or final (the rollout's final "
        "latent, with the last SDE step's noise: Flow-GRPO's plain sampler). nft and awm end on σ = 0, where both agree.",
    )
    kl_beta: float = _opt(0.0, "Weight of Flow-GRPO's KL to the frozen base model on the SDE means (0: off).")
    ratio_normalization: str = _opt(
        "none", "PPO ratio: none, or grpo-guard (GRPO-Guard's normalised log-ratio and 1/|dt| step weights)."
    )
    use_ema: bool = _opt(False, "Keep an EMA of the weights (sharded like the model), saved with checkpoints.")
    ema_decay: float = _opt(0.995, "EMA decay per iteration (one EMA update per iteration, as DanceGRPO).")
    # --- loop, checkpoints, logging -------------------------------------------------------------------
    seed: int = _opt(42, "Seed for prompts, noise and timestep draws (per rank: derived from it).")
    max_train_steps: int = _opt(300, "Iterations (rollout + update rounds).")
    checkpointing_steps: int = _opt(40, "Save a checkpoint every this many iterations (and after the last).")
    keep_last: int = _opt(0, "Keep only the newest K checkpoints (0 keeps all).")
    save_images_every: int = _opt(10, "Save a few rollout images every K iterations (0 never).")
    images_per_save: int = _opt(4, "How many images each rank saves when it does.")
    gradient_checkpointing: bool = _opt(True, "Activation checkpointing in every transformer block.")
    retain_rollout_graphs: bool = _opt(
        False,
        "--objective grpo, one optimizer step per rollout: the rollout keeps the trained steps' forward graphs and the "
        "update back-propagates through them instead of recomputing those forwards (LeanGRPO's Retain; same math). "
        "Costs their activations from rollout to update (train --dry-run sizes them). Off by default.",
    )
    cpu_offload: bool = _opt(False, "Offload sharded parameters and optimizer state to host memory (FSDP).")
    attention: str = _opt(
        "sdpa", f"Attention kernel: {' or '.join(ATTENTION_BACKENDS)} (the fused Ascend kernel: bf16 only)."
    )
    compile: bool = _opt(
        False,
        "torch.compile FLUX's repeated blocks (one double and one single block compiled, reused by all) for the "
        "rollout, the update and the evaluation; CPUs and GPUs (refused on Ascend).",
    )
    device: str = _opt("auto", f"auto (first found of {', '.join(DEVICE_TYPES)}), or one of them.")
    tensorboard: bool = _opt(False, "Also log metrics, eval grids and reward histograms to TensorBoard.")
    wandb: bool = _opt(False, "Also log metrics, eval grids and reward histograms to Weights & Biases.")
    wandb_project: str = _opt("fluxgrpo", "Weights & Biases project.")
    wandb_name: str = _opt("", "Weights & Biases run name (empty: wandb picks one).")
    wandb_mode: str = _opt("", f"Weights & Biases mode: {', '.join(WANDB_MODES)} (empty: wandb's default).")
    # --- held-out evaluation --------------------------------------------------------------------------
    eval_every: int = _opt(
        0, "Evaluate on held-out prompts at iteration 0, every K iterations and after the last (0: off)."
    )
    eval_prompts: str = _opt(
        "",
        "Held-out prompt file, one per line, a benchmark set fetched with fetch-weights (hpdv2), shapes-heldout "
        "(the shapes world's held-out captions, shipped), or training (the run's own training captions, on fresh "
        "seeds: the overfit check); empty: the 48 held-out prompts shipped with fluxgrpo.",
    )
    eval_images_per_prompt: int = _opt(1, "Images per held-out prompt (image j of prompt i always has the same seed).")
    eval_steps: int = _opt(28, "Denoising steps of the deterministic (ODE) evaluation sampler, as `fluxgrpo sample`.")
    eval_rewards: str = _opt("", "More rewards to score evaluations with, comma-separated (beside --reward).")
    guard: str = _opt(
        "",
        "Rules checked at each evaluation, NAME:-X%|+X%|min=V|max=V comma-separated (NAME: an evaluated reward, diversity, "
        "velocity_norm_ratio, group_spread; X% relative to the run's first value), e.g. clipscore:-3%,diversity:-15%.",
    )
    guard_action: str = _opt("warn", "When a --guard rule fires: warn (log, go on) or stop (checkpoint, exit 3).")
    keep_best: str = _opt(
        "", "Keep the best evaluation passing every guard by this metric (e.g. hpsv2) as <output-dir>/best/."
    )
    # The objectives' own settings (not a flag: their flat keys are, ``config_fields``).
    objective_settings: OptionSet = field(default_factory=default_objective_settings)

    # ---------------------------------------------------------------------------------------------------
    @property
    def trajectories_per_rank(self) -> int:
        return self.train_batch_size * self.num_generations

    @property
    def shares_group_noise(self) -> bool:
        """Whether a group's trajectories start from one noise: with the SDE only (an ODE would repeat the image)."""
        return self.init_same_noise and self._objective_entry().keeps_trajectory

    @property
    def trainable_timesteps(self) -> int:
        """The transitions a trajectory may train on (the objective's catalogue entry): grpo the SDE window, or N−1
        (the last one cannot change the reward, so it never trains); nft the N sampler timesteps; awm the grid
        indices lo … int(0.9·N)−1; vgrpo the N sampler timesteps; neighbor the N−1 transitions."""
        return self._objective_entry().trainable_timesteps(self)

    def settings_of(self, cls: type[SettingsT]) -> SettingsT:
        """The values of an objective's settings class (``grpo/objectives/<name>/settings.py``)."""
        return self.objective_settings.of(cls)

    if not TYPE_CHECKING:  # untyped reads of the flat keys, for scripts and older callers: cfg.nft_beta

        def __getattr__(self, name: str) -> Any:
            found = option_key_fields().get(name) if not name.startswith("__") else None
            if found is None or "objective_settings" not in self.__dict__:
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
            return getattr(self.objective_settings.of(found.owner), found.name)

    def _objective_entry(self) -> ObjectiveEntry:
        """The catalogue entry of ``--objective`` (an unknown name is reported by ``problems``; until then, the
        sizes are grpo's)."""
        return CATALOGUE.get(self.objective) or CATALOGUE["grpo"]

    @property
    def train_timesteps(self) -> int:
        """T_train = int(trainable·fraction): with DanceGRPO's sampler int((N−1)·fraction); nft/awm: --fm-timesteps
        when set; vgrpo: its N_MC pairs (the catalogue entry says)."""
        entry = self._objective_entry()
        if entry.train_timesteps is not None:
            return entry.train_timesteps(self)
        return int(self.trainable_timesteps * self.timestep_fraction)

    @property
    def flow_matching_draws(self) -> tuple[str, str]:
        """(sharing, timestep rule) of nft/awm/vgrpo's (t, ε) draws, ``auto`` resolved to the authors' rules."""
        return resolved_draws(self.settings_of(FlowMatchingOptions), self._objective_entry().draws)

    @property
    def trained_samples_per_rank(self) -> int:
        """What the update trains on per rank: every trajectory, or Neighbor GRPO's B anchors per group."""
        trained = self._objective_entry().trained_samples
        return self.trajectories_per_rank if trained is None else trained(self)

    @property
    def rollout_model_calls(self) -> int:
        """Transformer forwards per trajectory in a rollout (with dpm2 and a sliding window: at its first position)."""
        if self.ode_solver != "dpm2" or not 0 < self.sde_window < self.sampling_steps:
            return self.sampling_steps
        from fluxgrpo.grpo.schedule import sigma_schedule, tail_schedule

        sigmas = sigma_schedule(self.sampling_steps, self.shift)
        return self.sde_window + tail_schedule(sigmas, self.sde_window, self.shift, self.ode_compress_ratio).numel() - 1

    def derived(self, world_size: int) -> dict[str, Any]:
        """The numbers a user checks before spending a cluster-day."""
        per_rank = self.trajectories_per_rank
        trained = self.trained_samples_per_rank
        micro_batches = math.ceil(trained / self.train_micro_batch_size)
        steps = math.ceil(micro_batches / self.gradient_accumulation_steps)
        return {
            "world_size": world_size,
            "prompts_per_iteration": world_size * self.train_batch_size,
            "images_per_iteration": world_size * per_rank,
            "trajectories_per_rank": per_rank,
            "train_timesteps_per_trajectory": self.train_timesteps,
            "micro_batches_per_iteration": micro_batches,
            "optimizer_steps_per_iteration": steps,
            # When GA does not divide the micro-batches the last step takes the leftover ones (never dropped); its
            # gradient keeps the 1/(GA·T_train) scale, so it is proportionally smaller.
            "micro_batches_in_last_optimizer_step": micro_batches - (steps - 1) * self.gradient_accumulation_steps,
            "trajectories_per_optimizer_step": world_size
            * self.train_micro_batch_size
            * self.gradient_accumulation_steps,
            "rollout_forwards_per_rank": per_rank * self.rollout_model_calls,
            "train_forward_backward_per_rank": trained * self.train_timesteps,
            "total_optimizer_steps": self.max_train_steps * steps,
        }

    def problems(self) -> list[str]:
        """Every inconsistency, each saying which numbers disagree and how to fix them (``checks.py``)."""
        return config_problems(self)

    def validate(self) -> TrainConfig:
        problems = self.problems()
        if problems:
            raise UsageError("invalid training configuration:\n  - " + "\n  - ".join(problems))
        return self

    def to_dict(self) -> dict[str, Any]:
        """Config key → value, the objectives' settings flat after ``objective`` (loadable with --config)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name == "objective_settings":
                continue
            out[f.name] = getattr(self, f.name)
            if f.name == "objective":
                out.update(self.objective_settings.flat())
        return out


_dataclass_init = TrainConfig.__init__


@functools.wraps(_dataclass_init)
def _init_with_flat_settings(self: TrainConfig, objective_settings: OptionSet | None = None, **values: Any) -> None:
    """The dataclass's ``__init__``, with the objectives' flat keys (``nft_beta=…``) set on ``objective_settings``."""
    keys = option_key_fields()
    flat = {key: values.pop(key) for key in list(values) if key in keys}
    settings = (objective_settings or OptionSet()).merged(option_groups(), flat)
    _dataclass_init(self, objective_settings=settings, **values)


TrainConfig.__init__ = _init_with_flat_settings  # type: ignore[method-assign, assignment]


def config_fields() -> list[dataclasses.Field]:
    """Every config key as a field (name, type, default, help): ``TrainConfig``'s, with the registered objectives'
    settings generated after ``objective`` (the flags, the YAML keys), and ``objective``'s help naming every
    objective registered by now."""
    out = []
    for f in fields(TrainConfig):
        if f.name == "objective_settings":
            continue
        if f.name != "objective":
            out.append(f)
        else:
            out.append(_as_field(f.name, str(f.type), f.default, objective_help()))
            out += [_as_field(key, found.type, found.default, found.help) for key, found in option_key_fields().items()]
    return out


def _as_field(name: str, kind: str, default: Any, help: str) -> dataclasses.Field:
    made: dataclasses.Field = field(default=default, metadata={"help": help})
    made.name, made.type = name, kind
    return made
