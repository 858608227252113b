"""Training configuration: one typed dataclass, DanceGRPO's names, validated before any worker starts.

Sources, later wins: the defaults below (the Atlas A3 16-die recipe) → a YAML file (``--config``, a shipped
name such as ``tiny-cpu`` or a path) → command-line flags. A YAML key is the flag without dashes, with
underscores for hyphens (``--num-generations`` ↔ ``num_generations``). A key set to ``null`` (or left empty)
keeps the default. Unknown keys are rejected, and every problem is reported at once.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

from fluxgrpo.errors import UsageError
from fluxgrpo.models.known import MODEL_FAMILIES
from fluxgrpo.paths import (
    DEFAULT_EMBEDDINGS_DIR,
    DEFAULT_FLUX_DIR,
    DEFAULT_HPS_DIR,
    DEFAULT_OUTPUT_DIR,
    EMBEDDINGS_INDEX,
    HPS_DIR_HELP,
)
from fluxgrpo.rewards import reward_names
from fluxgrpo.rewards.base import REWARD_DTYPES
from fluxgrpo.rewards.reward_set import AGGREGATIONS, parse_reward_list, reward_spec_problems
from fluxgrpo.runtime.adapt import ATTENTION_BACKENDS
from fluxgrpo.runtime.device import DEVICE_TYPES

LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")
MAX_SEED = 2**32 - 1  # numpy's seed range; each rank seeds with --seed + rank, reduced modulo 2**32 for numpy
# Flow-GRPO's FLUX LoRA targets: every attention projection of both streams and the double blocks' MLPs (the single
# blocks' attention shares the to_q/to_k/to_v names, so it is adapted too).
LORA_DEFAULT_TARGETS = (
    "attn.to_q,attn.to_k,attn.to_v,attn.to_out.0,attn.add_q_proj,attn.add_k_proj,attn.add_v_proj,attn.to_add_out,"
    "ff.net.0.proj,ff.net.2,ff_context.net.0.proj,ff_context.net.2"
)
WANDB_MODES = ("online", "offline", "disabled")
MAX_IMAGE_SIDE = 8192  # 4× FLUX.1-dev's largest trained side; the activations of a larger one fit no device
# Upper bounds far past any published setting, below the values that make every update non-finite and the run
# "succeed" with the base weights (an η of 1e9, say).
SETTING_BOUNDS = {
    "eta": 10.0,
    "learning_rate": 1.0,
    "weight_decay": 10.0,
    "kl_beta": 1e4,
    "guidance": 100.0,
    "shift": 100.0,
}
# The algorithm options' choices (fluxgrpo/grpo implements each; listed here so validation needs no torch).
SAMPLERS = ("dance", "flow-grpo", "cps")
WINDOW_POLICIES = ("sliding", "random", "random-early")
DECODE_SAMPLES = ("x0", "final")
ODE_SOLVERS = ("euler", "dpm2")
RATIO_NORMALIZATIONS = ("none", "grpo-guard")
OBJECTIVES = ("grpo", "nft", "awm")
NFT_DECAY_TYPES = (0, 1, 2)
AWM_WEIGHTINGS = ("uniform", "t", "t2", "ghuber", "huber")
AWM_TIME_FRACTION = 0.9  # AWM trains at the sampler-grid indices 1 … int(0.9·N)−1


def _opt(default: Any, help: str, **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, **meta})


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
        f"Reward model(s): {', '.join(reward_names())} (brightness, exposure, structure: smoke tests for tiny "
        "models); several as name:weight,... (e.g. hpsv2:1,pickscore:0.5; weights normalised to sum 1).",
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
    objective: str = _opt(
        "grpo",
        "Training objective: grpo (PPO-clip on the SDE's per-step log-probs), nft (DiffusionNFT) or awm "
        "(Advantage-Weighted Matching); nft and awm roll out with the DPM-Solver++(2M) ODE and train on final samples.",
    )
    nft_beta: float = _opt(1.0, "DiffusionNFT's β: the step of its implicit positive/negative policies.")
    nft_decay_type: int = _opt(
        1,
        "DiffusionNFT's old-policy decay: 1 min(0.001·s, 0.5), 2 (0 for 75 steps, then 0.0075/step up to 0.999), 0 none.",
    )
    awm_weighting: str = _opt("ghuber", f"AWM's weighting of the flow-matching error: {', '.join(AWM_WEIGHTINGS)}.")
    awm_ghuber_power: float = _opt(0.25, "AWM's ghuber power p.")
    awm_ema_beta: float = _opt(1.0, "Weight of AWM's pull towards its EMA policy (0: off, no EMA copy).")
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
        "Held-out prompt file, one per line, or a benchmark set fetched with fetch-weights (hpdv2); empty: the 48 "
        "held-out prompts shipped with fluxgrpo.",
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

    # ---------------------------------------------------------------------------------------------------
    @property
    def trajectories_per_rank(self) -> int:
        return self.train_batch_size * self.num_generations

    @property
    def shares_group_noise(self) -> bool:
        """Whether a group's trajectories start from one noise: with the SDE only (an ODE would repeat the image)."""
        return self.init_same_noise and self.objective == "grpo"

    @property
    def trainable_timesteps(self) -> int:
        """The transitions a trajectory may train on: the SDE window, or N−1 (the last one cannot change the
        reward, so it never trains). nft: the N sampler timesteps; awm: the grid indices 1 … int(0.9·N)−1."""
        if self.objective == "nft":
            return self.sampling_steps
        if self.objective == "awm":
            return max(int(self.sampling_steps * AWM_TIME_FRACTION) - 1, 0)
        return self.sde_window or self.sampling_steps - 1

    @property
    def train_timesteps(self) -> int:
        """T_train = int(trainable·fraction): with DanceGRPO's sampler int((N−1)·fraction)."""
        return int(self.trainable_timesteps * self.timestep_fraction)

    @property
    def rollout_model_calls(self) -> int:
        """Transformer forwards per trajectory in a rollout (with dpm2 and a sliding window: at its first position)."""
        if self.ode_solver != "dpm2" or not 0 < self.sde_window < self.sampling_steps:
            return self.sampling_steps
        from fluxgrpo.grpo.schedule import sigma_schedule
        from fluxgrpo.grpo.step_plan import tail_schedule

        sigmas = sigma_schedule(self.sampling_steps, self.shift)
        return self.sde_window + tail_schedule(sigmas, self.sde_window, self.shift, self.ode_compress_ratio).numel() - 1

    def derived(self, world_size: int) -> dict[str, Any]:
        """The numbers a user checks before spending a cluster-day."""
        per_rank = self.trajectories_per_rank
        micro_batches = math.ceil(per_rank / self.train_micro_batch_size)
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
            "train_forward_backward_per_rank": per_rank * self.train_timesteps,
            "total_optimizer_steps": self.max_train_steps * steps,
        }

    def problems(self) -> list[str]:
        """Every inconsistency, each saying which numbers disagree and how to fix them."""
        out: list[str] = []
        for name in ("height", "width"):
            value = getattr(self, name)
            if value <= 0 or value % 16:
                out.append(
                    f"--{name} {value} must be a positive multiple of 16 (FLUX packs 2×2 latents of 8× VAE pixels)"
                )
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
        if self.model_family not in MODEL_FAMILIES:
            out.append(f"--model-family {self.model_family!r}: use one of {', '.join(MODEL_FAMILIES)}")
        for name in positive_ints:
            if getattr(self, name) < 1:
                out.append(f"--{_flag(name)} must be at least 1 (got {getattr(self, name)})")
        if self.num_generations < 2:
            out.append(
                f"--num-generations {self.num_generations}: GRPO needs at least 2 trajectories per prompt "
                "to compute a group advantage"
            )
        if self.sampling_steps >= 2 and not 0 < self.timestep_fraction <= 1:
            out.append(f"--timestep-fraction {self.timestep_fraction} must be in (0, 1]")
        elif self.sampling_steps >= 1 and self.train_timesteps < 1:
            steps = (
                f"--sde-window {self.sde_window}"
                if self.sde_window
                else f"(--sampling-steps {self.sampling_steps} − 1)"
            )
            out.append(f"--timestep-fraction {self.timestep_fraction} × {steps} trains no timestep: raise either")
        per_rank = self.trajectories_per_rank
        for name in ("rollout_batch_size", "train_micro_batch_size"):
            size = getattr(self, name)
            if size >= 1 and per_rank >= 1 and per_rank % size:
                divisors = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
                out.append(
                    f"--{_flag(name)} {size} does not divide the {per_rank} trajectories per rank "
                    f"(--train-batch-size {self.train_batch_size} × --num-generations {self.num_generations}); "
                    f"use one of {divisors} so every batch has the same shape"
                )
        non_finite = [f.name for f in fields(self) if f.type == "float" and not math.isfinite(getattr(self, f.name))]
        for name in non_finite:
            out.append(f"--{_flag(name)} must be a finite number (got {getattr(self, name)})")
        for name in ("eta", "clip_range", "adv_clip_max", "learning_rate", "max_grad_norm"):
            if name not in non_finite and not getattr(self, name) > 0:
                out.append(f"--{_flag(name)} must be positive (got {getattr(self, name)})")
        if "shift" not in non_finite and self.shift <= 0:
            out.append(f"--shift must be positive (got {self.shift})")
        for name, most in SETTING_BOUNDS.items():
            if name not in non_finite and abs(getattr(self, name)) > most:
                out.append(f"--{_flag(name)} {getattr(self, name)} is out of range: at most {most}")
        if self.guidance < 0 or self.kl_beta < 0:
            out.append("--guidance and --kl-beta cannot be negative")
        if self.weight_decay < 0 or self.lr_warmup_steps < 0 or self.keep_last < 0:
            out.append("--weight-decay, --lr-warmup-steps and --keep-last cannot be negative")
        if self.save_images_every < 0 or self.images_per_save < 0:
            out.append("--save-images-every and --images-per-save cannot be negative")
        if not 0 < self.ema_decay < 1:
            out.append(f"--ema-decay {self.ema_decay} must be in (0, 1)")
        if self.lr_scheduler not in LR_SCHEDULERS:
            out.append(f"--lr-scheduler {self.lr_scheduler!r}: use one of {', '.join(LR_SCHEDULERS)}")
        if self.device != "auto" and self.device not in DEVICE_TYPES:
            out.append(f"--device {self.device!r}: use auto or one of {', '.join(DEVICE_TYPES)}")
        out.extend(reward_spec_problems(self.reward))
        if self.advantage_aggregation not in AGGREGATIONS:
            out.append(f"--advantage-aggregation {self.advantage_aggregation!r}: use one of {', '.join(AGGREGATIONS)}")
        if self.reward_dtype not in REWARD_DTYPES:
            out.append(f"--reward-dtype {self.reward_dtype!r}: use one of {', '.join(REWARD_DTYPES)}")
        if self.lora_rank < 0:
            out.append(f"--lora-rank {self.lora_rank} cannot be negative (0 trains every weight)")
        if self.lora_rank > 0:
            if not self.lora_alpha > 0:
                out.append(f"--lora-alpha must be positive (got {self.lora_alpha})")
            if not 0 <= self.lora_dropout < 1:
                out.append(f"--lora-dropout {self.lora_dropout} must be in [0, 1)")
            if not any(part.strip() for part in self.lora_targets.split(",")):
                out.append("--lora-targets is empty: name the modules to adapt, e.g. attn.to_q,attn.to_k")
        out += self._algorithm_problems()
        if self.attention not in ATTENTION_BACKENDS:
            out.append(f"--attention {self.attention!r}: use one of {', '.join(ATTENTION_BACKENDS)}")
        if not 0 <= self.seed <= MAX_SEED:
            out.append(f"--seed {self.seed} is out of range: use 0 to {MAX_SEED} (numpy's seed range)")
        out += self._logging_problems()
        return out

    def _logging_problems(self) -> list[str]:
        """Held-out evaluation, guards and experiment-tracker settings."""
        from fluxgrpo.data.benchmarks import eval_prompts_problem
        from fluxgrpo.training.guards import guard_problems

        out = []
        if self.eval_every < 0:
            out.append(f"--eval-every must be 0 (off) or a number of iterations (got {self.eval_every})")
        for name in ("eval_images_per_prompt", "eval_steps"):
            if getattr(self, name) < 1:
                out.append(f"--{_flag(name)} must be at least 1 (got {getattr(self, name)})")
        if self.eval_prompts and (problem := eval_prompts_problem(self.eval_prompts)):
            out.append(problem)
        out.extend(parse_reward_list(self.eval_rewards, "--eval-rewards", weights=False, empty_ok=True)[1])
        out.extend(guard_problems(self))
        if self.wandb_mode and self.wandb_mode not in WANDB_MODES:
            out.append(f"--wandb-mode {self.wandb_mode!r}: use one of {', '.join(WANDB_MODES)}, or leave it empty")
        return out

    def _objective_problems(self) -> list[str]:
        out = []
        if self.objective not in OBJECTIVES:
            out.append(f"--objective {self.objective!r}: use one of {', '.join(OBJECTIVES)}")
            return out
        if self.objective != "grpo":
            grpo_only = [
                flag
                for flag, used in (
                    ("--sde-window", self.sde_window != 0),
                    ("--ratio-normalization grpo-guard", self.ratio_normalization != "none"),
                    ("--ode-solver dpm2", self.ode_solver != "euler"),
                )
                if used
            ]
            if grpo_only:
                out.append(
                    f"{', '.join(grpo_only)}: only --objective grpo has per-step log-probs; --objective "
                    f"{self.objective} rolls out with the ODE (leave these at their defaults)"
                )
        if not self.nft_beta > 0:
            out.append(f"--nft-beta {self.nft_beta} must be positive")
        if self.nft_decay_type not in NFT_DECAY_TYPES:
            out.append(f"--nft-decay-type {self.nft_decay_type}: use one of {', '.join(map(str, NFT_DECAY_TYPES))}")
        if self.awm_weighting not in AWM_WEIGHTINGS:
            out.append(f"--awm-weighting {self.awm_weighting!r}: use one of {', '.join(AWM_WEIGHTINGS)}")
        if not self.awm_ghuber_power > 0:
            out.append(f"--awm-ghuber-power {self.awm_ghuber_power} must be positive")
        if not self.awm_ema_beta >= 0:
            out.append(f"--awm-ema-beta {self.awm_ema_beta} cannot be negative (0 turns the EMA term off)")
        if self.objective == "awm" and self.sampling_steps >= 1 and self.trainable_timesteps < 1:
            out.append(
                f"--objective awm trains at grid indices 1 … int(0.9·N)−1, none with --sampling-steps "
                f"{self.sampling_steps}: use at least 3"
            )
        return out

    def _algorithm_problems(self) -> list[str]:
        out = self._objective_problems()
        for name, allowed in (
            ("sampler", SAMPLERS),
            ("sde_window_policy", WINDOW_POLICIES),
            ("decode_sample", DECODE_SAMPLES),
            ("ode_solver", ODE_SOLVERS),
            ("ratio_normalization", RATIO_NORMALIZATIONS),
        ):
            if getattr(self, name) not in allowed:
                out.append(f"--{_flag(name)} {getattr(self, name)!r}: use one of {', '.join(allowed)}")
        if not 0 <= self.sde_window <= self.sampling_steps - 1:
            out.append(
                f"--sde-window {self.sde_window} must be between 0 (off) and the {self.sampling_steps - 1} trainable "
                f"steps of --sampling-steps {self.sampling_steps}"
            )
        if self.sde_window_policy == "random-early" and self.sde_window > self.sampling_steps // 2:
            out.append(
                f"--sde-window-policy random-early starts the window in 0…N/2−W: --sde-window {self.sde_window} is "
                f"more than half of --sampling-steps {self.sampling_steps}"
            )
        if self.sde_window_shift_every < 0 or self.sde_window_stride < 0:
            out.append("--sde-window-shift-every and --sde-window-stride cannot be negative")
        if self.ode_solver == "dpm2" and self.sde_window == 0:
            out.append("--ode-solver dpm2 integrates the steps outside an SDE window: set --sde-window too")
        if not 0 < self.ode_compress_ratio <= 1:
            out.append(f"--ode-compress-ratio {self.ode_compress_ratio} must be in (0, 1]")
        if not self.kl_beta >= 0:
            out.append(f"--kl-beta {self.kl_beta} cannot be negative (0 turns the KL off)")
        if self.ratio_normalization == "grpo-guard" and self.sampler == "cps":
            out.append(
                "--ratio-normalization grpo-guard needs a Gaussian log-prob: use --sampler dance or flow-grpo "
                "(cps's log-prob has its constants removed)"
            )
        if self.sampler == "cps" and not self.eta < 1:
            out.append(f"--eta {self.eta} with --sampler cps must be below 1 (the noise is σ'·sin(η·π/2))")
        return out

    def validate(self) -> TrainConfig:
        problems = self.problems()
        if problems:
            raise UsageError("invalid training configuration:\n  - " + "\n  - ".join(problems))
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _flag(name: str) -> str:
    return name.replace("_", "-")


def config_fields() -> list[dataclasses.Field]:
    return list(fields(TrainConfig))


# --- shipped configs and YAML -------------------------------------------------------------------------


def shipped_configs() -> dict[str, Path]:
    """Config name → file for the YAML files inside the package (``fluxgrpo/configs``)."""
    folder = resources.files("fluxgrpo") / "configs"
    return {Path(p.name).stem: Path(str(p)) for p in folder.iterdir() if p.name.endswith(".yaml")}


def config_summary(path: Path) -> str:
    """The first comment lines of a shipped config: what it is and the command that launches it."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# ").rstrip())
    return "\n".join(lines)


def resolve_config_path(name_or_path: str) -> Path:
    shipped = shipped_configs()
    if name_or_path in shipped:
        return shipped[name_or_path]
    path = Path(name_or_path)
    if path.is_file():
        return path
    raise UsageError(
        f"--config {name_or_path!r} is neither a shipped config ({', '.join(sorted(shipped))}) nor a file; "
        "see `fluxgrpo train --list-configs`"
    )


def read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UsageError(
            f"{path} is not a text file (not UTF-8), so not a YAML config: pass one with --config"
        ) from None
    except OSError as exc:
        raise UsageError(
            f"cannot read {path} ({exc.strerror or exc}): pass a readable YAML file with --config"
        ) from None
    try:
        # An alias repeats a node without copying text: nested ones expand a few hundred bytes into gigabytes.
        # A config has no use for them, and the event stream finds one without expanding anything.
        if any(isinstance(event, yaml.AliasEvent) for event in yaml.parse(text, Loader=yaml.SafeLoader)):
            raise UsageError(f"{path} uses YAML aliases (*name): write each value out; pass another file with --config")
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        reason = " ".join(str(exc).split())  # PyYAML's message spans lines, with a caret drawing
        raise UsageError(f"{path} is not valid YAML ({reason}): fix it, or pass another file with --config") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path} must hold a mapping of option names to values")
    return data


def build_config(config: str | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Defaults → YAML file → flag overrides (None values mean "not given"), validated.

    Raises:
        UsageError: unknown keys, wrong types, or inconsistent values (all listed together).
    """
    values: dict[str, Any] = {}
    problems: list[str] = []
    known = {f.name: f for f in config_fields()}
    if config:
        path = resolve_config_path(config)
        for key, value in read_yaml(path).items():
            key = str(key).replace("-", "_")
            if key not in known:
                problems.append(f"{path}: unknown key {key!r}")
                continue
            if value is None:  # `output_dir:` or `output_dir: null` means "the default", not the string "None"
                continue
            values[key] = value
    for key, value in (overrides or {}).items():
        if value is not None:
            values[key] = value
    for key, value in list(values.items()):
        try:
            values[key] = _coerce(known[key], value)
        except (TypeError, ValueError):
            problems.append(f"{key}: {value!r} is not a valid {known[key].type}")
    if problems:
        raise UsageError("invalid training configuration:\n  - " + "\n  - ".join(problems))
    return TrainConfig(**values).validate()


def _coerce(f: dataclasses.Field, value: Any) -> Any:
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    if kind == "bool":
        if isinstance(value, bool):
            return value
        raise ValueError(value)
    if kind == "int":
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(value)
        return int(value)
    if kind == "float":
        if isinstance(value, bool):
            raise ValueError(value)
        return float(value)
    return str(value)


def save_resolved(cfg: TrainConfig, path: Path, derived: dict[str, Any], extra: dict[str, Any] | None = None) -> None:
    """Write the resolved config (loadable with --config) with the derived numbers as a comment block."""
    import yaml

    header = ["# Resolved fluxgrpo training config (load it again with --config <this file>).", "# Derived:"]
    header += [f"#   {k}: {v}" for k, v in derived.items()]
    for k, v in (extra or {}).items():
        header.append(f"#   {k}: {v}")
    from fluxgrpo.run_folder import write_run_file

    path.parent.mkdir(parents=True, exist_ok=True)
    write_run_file(path, "\n".join(header) + "\n" + yaml.safe_dump(cfg.to_dict(), sort_keys=False))
