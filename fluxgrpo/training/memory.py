"""A per-die memory model of a training run, so a config that cannot fit is refused before a cluster starts.

Peak bytes on one die = what lives all run long + the largest of the three phases + a fixed runtime reserve:

    persistent  weights      4·S          fp32 master shards (S = this die's share of the transformer, FSDP2's
                                          dim-0 chunks: Σ ceil(rows / dies)·row, exactly what FSDP2 allocates)
                             (LoRA: 2·S_base + 4·S_adapters: base frozen in bf16, adapters fp32)
                optimizer    8·S_train    AdamW exp_avg + exp_avg_sq of the trainable shards
                ema          4·S_train    with --use-ema
                kl reference 2·S          with --kl-beta > 0 and full fine-tuning (LoRA disables its adapters)
                policy copies 4·S_train·k k = 1 for --objective nft (old policy), awm with --awm-ema-beta > 0 (EMA)
                reward       4·R          every reward model's weights (2·R with --reward-dtype bf16)
                vae          2·V          the VAE in the compute dtype
                rollout      B·(N+1)·L·64·4 + images  the trajectory latents and decoded images of one iteration
    rollout     gathered     2·(2·block + root)  FSDP2 all-gathers a block in bf16 and prefetches the next
                forward      rb·T·D·2·12  one block's no-grad temporaries for rollout_batch_size trajectories
    decode      vae          rb·3·C·H·W·2    the VAE decoder's full-resolution maps (C = 256 for FLUX's VAE)
    update      gradients    4·S_train    fp32 gradient shards (freed after each optimizer step)
                gathered     2·(2·block + root) + 4·block  bf16 parameters and one block's unsharded fp32 grads
                activations  mb·T·D·(n_double·a_d + n_single·a_s)·c       without --gradient-checkpointing
                             mb·T·D·((n_double + n_single)·2 + a_d)·c      with it (block inputs + one recompute)
                objective    B·T_train·(1+k)·L·64·4  nft/awm/vgrpo: the noise and each copy's velocity per trained slot
                             (vgrpo: its N_MC pairs are one forward, so mb above is micro-batch × N_MC; neighbor: 0,
                             its candidates' paths are the rollout term's trajectory latents)
    retained    (rollout, decode and update, with --retain-rollout-graphs) B·T_train·T·D·(what one row's training
                forward saves: the activations above at mb = 1, without the recompute term): the kept forwards live
                from the rollout's trained steps to the update's backward

T = (H/16)·(W/16) + S image and text tokens, D the transformer width, c = compute-dtype bytes / 2. The activation
coefficients a_d, a_s (bytes a double / single block saves for backward, per token per unit of width, in bf16)
are measured: tests/training/test_memory.py re-measures them with autograd's saved-tensor hooks on a FLUX block and fails
if they drift. With --cpu-offload the weights, gradients, optimizer state and EMA live in host memory instead.
With one die (no FSDP) the fp32 weights are not gathered but autocast keeps a bf16 copy of them per forward.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fluxgrpo.errors import FluxgrpoError, UsageError
from fluxgrpo.grpo.objectives.catalogue import objective_entry
from fluxgrpo.models.flux_shapes import transformer_layout, vae_parameter_count
from fluxgrpo.models.known import KNOWN_MODELS, identify
from fluxgrpo.rewards.registry import reward_record
from fluxgrpo.rewards.reward_set import eval_reward_names, reward_spec_names
from fluxgrpo.runtime import device as rt_device

if TYPE_CHECKING:
    from fluxgrpo.config import TrainConfig

GiB = 2**30
# Bytes a FLUX block saves for backward per token per unit of width, in bf16 (fused/flash attention):
# measured on double and single blocks of widths 512-1024 (tests/training/test_memory.py keeps them honest).
DOUBLE_BLOCK_ACTIVATION_BYTES = 57
SINGLE_BLOCK_ACTIVATION_BYTES = 51
# One block's no-grad temporaries per token per unit of width in the rollout (q, k, v, attention out, 4× MLP).
ROLLOUT_FORWARD_BYTES = 12 * 2
# Live feature maps at once at the VAE decoder's full-resolution stage (its input, a norm, a conv output).
VAE_LIVE_MAPS = 3
# Device context, kernels' workspace and allocator fragmentation: kept free on every die.
RUNTIME_RESERVE_BYTES = 2 * GiB
DEFAULT_TEXT_TOKENS = 512  # FLUX.1-dev's T5 sequence length, DanceGRPO's preprocessing
LATENT_CHANNELS = 64  # packed 2×2×16


@dataclass(frozen=True)
class TransformerShape:
    """What the memory model needs to know about the FLUX transformer, read off a meta-device build."""

    parameter_shapes: dict[str, tuple[int, ...]]
    block_parameters: int  # the largest block's parameters
    root_parameters: int  # parameters outside the blocks (embedders, norm_out, proj_out)
    width: int  # D = heads × head dim
    double_blocks: int
    single_blocks: int

    @property
    def parameters(self) -> int:
        return sum(math.prod(shape) for shape in self.parameter_shapes.values())


def shard_elements(shapes: dict[str, tuple[int, ...]] | list[tuple[int, ...]], dies: int) -> int:
    """Elements FLUX's parameters take on one die under FSDP2: each tensor split along dim 0 into ``dies`` chunks
    of ceil(rows / dies) rows (padded, so every die allocates the largest chunk)."""
    total = 0
    for shape in shapes.values() if isinstance(shapes, dict) else shapes:
        if not shape:
            total += 1
            continue
        total += math.ceil(shape[0] / dies) * math.prod(shape[1:])
    return total


def transformer_shape(config: dict[str, Any]) -> TransformerShape:
    """FluxTransformer2DModel's sizes for ``config``: from its architecture written out (``models/flux_shapes.py``,
    no diffusers import in the launching command), else from a build on the meta device (no memory)."""

    layout = transformer_layout(config)
    if layout is None:
        return _built_transformer_shape(config)
    shapes = layout[0]
    double = _block_count(shapes, "transformer_blocks.")
    single = _block_count(shapes, "single_transformer_blocks.")
    blocks = [f"transformer_blocks.{i}." for i in range(double)] + [
        f"single_transformer_blocks.{i}." for i in range(single)
    ]
    block_sizes = [sum(math.prod(s) for name, s in shapes.items() if name.startswith(block)) for block in blocks]
    in_blocks = sum(block_sizes)
    return TransformerShape(
        parameter_shapes=dict(shapes),
        block_parameters=max(block_sizes),
        root_parameters=sum(math.prod(s) for s in shapes.values()) - in_blocks,
        width=int(config.get("num_attention_heads", 24)) * int(config.get("attention_head_dim", 128)),
        double_blocks=double,
        single_blocks=single,
    )


def _block_count(shapes: dict[str, tuple[int, ...]], prefix: str) -> int:
    return len({name[len(prefix) :].split(".")[0] for name in shapes if name.startswith(prefix)})


def _built_transformer_shape(config: dict[str, Any]) -> TransformerShape:
    """Build FluxTransformer2DModel from its config on the meta device (no memory) and read its sizes."""
    return shape_of(_meta_transformer(config))


def _meta_transformer(config: dict[str, Any]) -> Any:
    """FluxTransformer2DModel from ``config`` on the meta device: its shapes, no storage (imports diffusers)."""
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        return FluxTransformer2DModel.from_config(config)


def shape_of(model: Any) -> TransformerShape:
    """The sizes of a built FluxTransformer2DModel."""
    blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    return TransformerShape(
        parameter_shapes={name: tuple(p.shape) for name, p in model.named_parameters()},
        block_parameters=max(sum(p.numel() for p in block.parameters()) for block in blocks),
        root_parameters=sum(p.numel() for p in model.parameters() if id(p) not in in_blocks),
        width=int(model.config.num_attention_heads * model.config.attention_head_dim),
        double_blocks=len(model.transformer_blocks),
        single_blocks=len(model.single_transformer_blocks),
    )


def lora_adapter_shapes(config: dict[str, Any], targets: tuple[str, ...], rank: int) -> tuple[tuple[int, ...], ...]:
    """The A (rank × in) and B (out × rank) matrices LoRA adds to every Linear that ``targets`` name."""

    layout = transformer_layout(config)
    if layout is not None:
        linears = layout[1]
    else:  # a config the written-out architecture does not model: build it on the meta device
        linears = {
            name: (module.in_features, module.out_features)
            for name, module in _meta_transformer(config).named_modules()
            if isinstance(module, torch.nn.Linear)
        }
    shapes: list[tuple[int, ...]] = []
    for name, (d_in, d_out) in linears.items():
        if any(name == t or name.endswith("." + t) for t in targets):
            shapes += [(rank, d_in), (d_out, rank)]
    return tuple(shapes)


@dataclass(frozen=True)
class VaeShape:
    parameters: int
    decode_channels: int  # channels of the decoder's full-resolution maps (the upsampler feeding the last block)


def vae_shape(config: dict[str, Any]) -> VaeShape:
    parameters = vae_parameter_count(config)
    if parameters is None:  # a config the written-out architecture does not model: build it on the meta device
        from diffusers import AutoencoderKL

        with torch.device("meta"):
            parameters = sum(p.numel() for p in AutoencoderKL.from_config(config).parameters())
    channels = list(config.get("block_out_channels", (64,)))
    return VaeShape(parameters, int(channels[min(1, len(channels) - 1)]))


@dataclass(frozen=True)
class RunShape:
    """The knobs of a run that move memory (a TrainConfig's, plus the world size and the device's dtype)."""

    dies: int
    height: int
    width: int
    sampling_steps: int
    trajectories_per_rank: int
    rollout_batch_size: int
    train_micro_batch_size: int
    gradient_checkpointing: bool
    cpu_offload: bool
    use_ema: bool
    reward: str  # the --reward spec: one name, or several as name:weight,...; each model is loaded
    reward_bytes: int = 4  # --reward-dtype fp32 (4) or bf16 (2)
    compute_bytes: int = 2  # bf16 on accelerators; 4 (fp32) on cpu
    text_tokens: int = DEFAULT_TEXT_TOKENS
    adapter_shapes: tuple[tuple[int, ...], ...] = ()  # LoRA A/B matrices; () trains every weight
    frozen_reference: bool = False  # --kl-beta > 0 with full fine-tuning: a second, frozen, sharded base model
    # Extra copies of the trainable weights an objective keeps (NFT's old policy, AWM's EMA policy): fp32 each, sharded
    # like the weights (the adapters only for LoRA).
    policy_copies: int = 0
    # nft/awm: [trajectories, T] latents kept through the update: the fresh noise and each policy copy's velocity.
    objective_latents: int = 0
    # Reward models the held-out evaluation loads on rank 0 besides the training ones (float32, kept for the run).
    eval_rewards: tuple[str, ...] = ()
    # --retain-rollout-graphs: the row-forwards whose graphs the rollout keeps for the update (B·T_train per rank).
    retained_rows: int = 0

    @classmethod
    def from_config(cls, cfg: TrainConfig, dies: int, compute_bytes: int = 2, **extra: Any) -> RunShape:
        objective = objective_entry(cfg.objective)
        rows = objective.rows_per_forward(cfg) if objective.rows_per_forward is not None else 1
        return cls(
            dies=dies,
            height=cfg.height,
            width=cfg.width,
            sampling_steps=cfg.sampling_steps,
            trajectories_per_rank=cfg.trajectories_per_rank,
            rollout_batch_size=cfg.rollout_batch_size,
            train_micro_batch_size=cfg.train_micro_batch_size * rows,  # vgrpo's N_MC pairs are one batched forward
            gradient_checkpointing=cfg.gradient_checkpointing,
            cpu_offload=cfg.cpu_offload,
            use_ema=cfg.use_ema,
            reward=cfg.reward,
            frozen_reference=cfg.kl_beta > 0 and cfg.lora_rank == 0,
            policy_copies=len(objective.policy_copies(cfg)),
            objective_latents=objective.update_latents(cfg),
            reward_bytes=2 if cfg.reward_dtype == "bf16" else 4,
            compute_bytes=compute_bytes,
            eval_rewards=_eval_only_reward_models(cfg),
            retained_rows=cfg.trained_samples_per_rank * cfg.train_timesteps if cfg.retain_rollout_graphs else 0,
            **extra,
        )


def _eval_only_reward_models(cfg: TrainConfig) -> tuple[str, ...]:
    """The reward models evaluation loads on rank 0 (float32, as `fluxgrpo score`): every eval reward except a
    training reward already in float32, whose model it shares (``eval.Evaluator._scorer``)."""
    if cfg.eval_every <= 0:
        return ()

    shared = set(reward_spec_names(cfg.reward)) if cfg.reward_dtype == "fp32" else set()
    return tuple(name for name in eval_reward_names(cfg.reward, cfg.eval_rewards) if name not in shared)


@dataclass
class MemoryEstimate:
    """Bytes per die, term by term, grouped by when they are live."""

    persistent: dict[str, int]
    phases: dict[str, dict[str, int]]  # rollout / decode / update → term → bytes
    reserve: int = RUNTIME_RESERVE_BYTES
    host: dict[str, int] = field(default_factory=dict)  # what --cpu-offload moves to host memory
    sized_from: str = ""  # the model whose shapes these are, in words ("FLUX.1-dev's known shapes …")
    warnings: list[str] = field(default_factory=list)  # e.g. the weights on disk are another model

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda name: sum(self.phases[name].values()))

    @property
    def peak(self) -> int:
        return sum(self.persistent.values()) + sum(self.phases[self.peak_phase].values()) + self.reserve

    def as_dict(self) -> dict[str, Any]:
        def gib(value: int) -> float:
            return round(value / GiB, 2)

        return {
            "peak_gib": gib(self.peak),
            "peak_phase": self.peak_phase,
            "persistent_gib": {k: gib(v) for k, v in self.persistent.items()},
            "phases_gib": {p: {k: gib(v) for k, v in terms.items()} for p, terms in self.phases.items()},
            "reserve_gib": gib(self.reserve),
            "host_gib_per_die": {k: gib(v) for k, v in self.host.items()},
            "sized_from": self.sized_from,
            "warnings": list(self.warnings),
        }

    def lines(self) -> list[str]:
        """A human-readable breakdown, one term per line."""
        out = [f"estimated peak per die: {self.peak / GiB:.1f} GiB (during {self.peak_phase})"]
        if self.sized_from:
            out.append(f"  sized from {self.sized_from}")
        out += [f"  {name}: {value / GiB:.2f} GiB" for name, value in self.persistent.items() if value]
        for phase, terms in self.phases.items():
            detail = ", ".join(f"{k} {v / GiB:.2f}" for k, v in terms.items() if v)
            out.append(f"  {phase} phase: {sum(terms.values()) / GiB:.2f} GiB ({detail})")
        out.append(f"  runtime reserve: {self.reserve / GiB:.2f} GiB")
        if self.host:
            out.append(f"  in host memory per die (--cpu-offload): {sum(self.host.values()) / GiB:.1f} GiB")
        return out


def activation_bytes(model: TransformerShape, run: RunShape, checkpointing: bool) -> int:
    """What one micro-batch's training forward keeps for backward at this resolution."""
    tokens = (run.height // 16) * (run.width // 16) + run.text_tokens
    per_token = tokens * model.width * run.train_micro_batch_size
    scale = run.compute_bytes / 2
    if checkpointing:
        stored_inputs = (model.double_blocks + model.single_blocks) * run.compute_bytes
        return int(per_token * (stored_inputs + DOUBLE_BLOCK_ACTIVATION_BYTES * scale))
    saved = model.double_blocks * DOUBLE_BLOCK_ACTIVATION_BYTES + model.single_blocks * SINGLE_BLOCK_ACTIVATION_BYTES
    return int(per_token * saved * scale)


def retained_bytes(model: TransformerShape, run: RunShape) -> int:
    """What the kept forwards of ``--retain-rollout-graphs`` hold from the rollout to the update: per kept row, what
    one training forward saves (with gradient checkpointing every block's input; the recompute of one block is the
    update's own transient, counted there)."""
    tokens = (run.height // 16) * (run.width // 16) + run.text_tokens
    per_row = tokens * model.width
    if run.gradient_checkpointing:
        per_row *= (model.double_blocks + model.single_blocks) * run.compute_bytes
    else:
        saved = (
            model.double_blocks * DOUBLE_BLOCK_ACTIVATION_BYTES + model.single_blocks * SINGLE_BLOCK_ACTIVATION_BYTES
        )
        per_row = int(per_row * saved * run.compute_bytes / 2)
    return per_row * run.retained_rows


def estimate(model: TransformerShape, vae: VaeShape, run: RunShape) -> MemoryEstimate:
    """The per-die memory of a run (see the module docstring for every term)."""

    dies, cb = run.dies, run.compute_bytes
    base = shard_elements(model.parameter_shapes, dies)
    lora = bool(run.adapter_shapes)
    trainable = shard_elements(list(run.adapter_shapes), dies) if lora else base
    # LoRA: the frozen base is kept in the compute dtype, the adapters in fp32.
    weights = base * cb + 4 * trainable if lora else 4 * base
    optimizer, ema = 8 * trainable, (4 * trainable if run.use_ema else 0)
    # The KL's reference: a LoRA run disables its adapters (no copy); full fine-tuning keeps the base in bf16.
    reference = base * cb if run.frozen_reference else 0
    copies = run.policy_copies * 4 * trainable
    host: dict[str, int] = {}
    if run.cpu_offload:
        host = {"weights": weights, "optimizer": optimizer, "gradients": 4 * trainable, "ema": ema}
        host["kl reference"] = reference
        host["policy copies"] = copies
        weights = optimizer = ema = reference = copies = 0
    latent_tokens = (run.height // 16) * (run.width // 16)
    trajectories = run.trajectories_per_rank
    persistent = {
        "weights": weights,
        "optimizer": optimizer,
        "ema": ema,
        "kl reference": reference,
        "policy copies": copies,
        # Each reward's parameter count and dtype rule are in its record (rewards/registry.py).
        "reward": sum(reward_record(name).weight_bytes(run.reward_bytes) for name in reward_spec_names(run.reward)),
        "eval rewards (rank 0)": sum(reward_record(name).weight_bytes(4) for name in run.eval_rewards),
        "vae": cb * vae.parameters,
        "rollout": trajectories * (run.sampling_steps + 2) * latent_tokens * LATENT_CHANNELS * 4
        + trajectories * 3 * run.height * run.width * 4,
    }
    if dies > 1:
        gathered = cb * (2 * model.block_parameters + model.root_parameters)
        block_grads = 4 * model.block_parameters if not lora else 0
    else:
        # No FSDP: fp32 weights are used in place; autocast caches a compute-dtype copy of each during a forward
        # (a LoRA base already in the compute dtype needs none).
        gathered = 0 if (cb == 4 or lora) else cb * model.parameters
        block_grads = 0
    tokens = latent_tokens + run.text_tokens
    retained = retained_bytes(model, run)  # 0 without --retain-rollout-graphs
    phases = {
        "rollout": {
            "gathered weights": gathered,
            "forward": run.rollout_batch_size * tokens * model.width * ROLLOUT_FORWARD_BYTES * cb // 2,
            "retained graphs": retained,
        },
        "decode": {
            "vae decode": run.rollout_batch_size * VAE_LIVE_MAPS * vae.decode_channels * run.height * run.width * cb,
            "retained graphs": retained,
        },
        "update": {
            "gradients": 0 if run.cpu_offload else 4 * trainable,
            "gathered weights": gathered + block_grads,
            "activations": activation_bytes(model, run, run.gradient_checkpointing),
            "objective latents": run.objective_latents * latent_tokens * LATENT_CHANNELS * 4,
            "retained graphs": retained,
        },
    }
    return MemoryEstimate(persistent=persistent, phases=phases, host=host)


# --------------------------------------------------------------------------------------------- the train hook


@dataclass(frozen=True)
class ModelSource:
    """The model shapes a plan is sized from, and what it says about them."""

    transformer: dict[str, Any]
    vae: dict[str, Any]
    text_tokens: int
    sized_from: str
    warnings: tuple[str, ...] = ()


def model_source(cfg: TrainConfig, from_family: bool) -> ModelSource:
    """The shapes to size ``cfg``'s run from: with ``from_family`` (a dry run) the known shapes of the model the
    config names (``model_family``), else, and for ``model_family: weights``, the config.json files in --model (what
    the run will load). Either way a warning when --model holds another model than the config names."""

    named = KNOWN_MODELS.get(cfg.model_family)
    on_disk: dict[str, Any] | None = None
    try:
        on_disk = json.loads((Path(cfg.model) / "transformer" / "config.json").read_text())
        vae_on_disk = json.loads((Path(cfg.model) / "vae" / "config.json").read_text())
    except (OSError, ValueError):
        on_disk = None
    warnings = []
    if named is not None and on_disk is not None and not named.matches(on_disk):
        warnings.append(
            f"{cfg.model} holds {identify(on_disk)}, not {named.title}, which this config is for (model_family: "
            f"{named.name}): fetch {named.title} there (`fluxgrpo fetch-weights`) or point --model at it before "
            "launching"
        )
    if named is not None and (from_family or on_disk is None):
        matching_embeddings = on_disk is not None and named.matches(on_disk)
        return ModelSource(
            named.transformer,
            named.vae,
            _text_tokens(cfg) if matching_embeddings else named.text_tokens,
            f"{named.title}'s known shapes (model_family: {named.name}; no weights read)",
            tuple(warnings),
        )
    if on_disk is None:
        raise FluxgrpoError(
            f"cannot read transformer/config.json and vae/config.json in {cfg.model} (model_family: weights sizes "
            f"the run from them): run `fluxgrpo fetch-weights --flux-dir {cfg.model}`, or name the model with "
            "--model-family"
        )
    return ModelSource(
        on_disk, vae_on_disk, _text_tokens(cfg), f"the model in {cfg.model} ({identify(on_disk)})", tuple(warnings)
    )


def estimate_for_config(cfg: TrainConfig, dies: int, device_type: str, from_family: bool = False) -> MemoryEstimate:
    """The estimate for a validated config (no weights loaded): sized from the weights in ``cfg.model``, or with
    ``from_family`` from the known shapes of the model the config names (``model_source``)."""
    from fluxgrpo.training.settings import lora_spec  # the run's settings import the model code (diffusers)

    source = model_source(cfg, from_family)
    lora = lora_spec(cfg)
    adapters = lora_adapter_shapes(source.transformer, lora.targets, lora.rank) if lora is not None else ()
    compute_bytes = 4 if device_type == "cpu" else 2
    run = RunShape.from_config(
        cfg, dies, compute_bytes=compute_bytes, text_tokens=source.text_tokens, adapter_shapes=adapters
    )
    result = estimate(transformer_shape(source.transformer), vae_shape(source.vae), run)
    return dataclasses.replace(result, sized_from=source.sized_from, warnings=list(source.warnings))


def _text_tokens(cfg: TrainConfig) -> int:
    """The T5 sequence length of the preprocessed embeddings (the first one's), or FLUX's 512 if unreadable."""

    try:
        root = Path(cfg.data_json_path).parent
        first = json.loads(Path(cfg.data_json_path).read_text())[0]
        embed = torch.load(root / "prompt_embed" / first["prompt_embed_path"], map_location="cpu", weights_only=True)
        return int(embed.shape[-2])
    except (OSError, ValueError, KeyError, IndexError, RuntimeError):
        return DEFAULT_TEXT_TOKENS


def host_memory_per_worker(workers: int) -> int | None:
    """The host's physical memory divided among ``workers`` CPU workers (None where the OS does not say)."""

    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    return total // max(workers, 1) if total > 0 else None


def checked_peak(estimate_: MemoryEstimate, device_type: str) -> int:
    """The peak compared with the memory there is. On cpu the reward models are left out: their sizes are the real
    checkpoints' (the registry's), while a CPU run uses the tiny ones, and what outgrows a host is the activations."""
    if device_type != "cpu":
        return estimate_.peak
    rewards = estimate_.persistent.get("reward", 0) + estimate_.persistent.get("eval rewards (rank 0)", 0)
    return estimate_.peak - rewards


def check_fits(
    cfg: TrainConfig,
    dies: int,
    device_type: str,
    estimate_: MemoryEstimate,
    capacity: int | None,
    from_family: bool = False,
) -> list[str]:
    """Problems (empty when it fits): the estimate exceeds ``capacity`` bytes per die; each problem names the
    knobs that would bring it under, with their estimates."""
    if capacity is None or checked_peak(estimate_, device_type) <= capacity:
        return []

    options = []
    for flag, change in _knobs(cfg, dies):
        changed_cfg = dataclasses.replace(cfg, **change.get("cfg", {}))
        changed = estimate_for_config(changed_cfg, change.get("dies", dies), device_type, from_family)
        marker = "fits" if checked_peak(changed, device_type) <= capacity else "still too much"
        options.append(f"{flag}: {changed.peak / GiB:.1f} GiB ({marker})")
    smaller = _fitting_resolution(cfg, dies, device_type, capacity)
    if smaller is not None:
        options.append(smaller)
    where = (
        f"{capacity / GiB:.1f} GiB of host memory each of the {dies} cpu worker(s) can have"
        if device_type == "cpu"
        else f"{capacity / GiB:.1f} GiB of each {device_type} device"
    )
    return [
        f"estimated peak {checked_peak(estimate_, device_type) / GiB:,.1f} GiB per die (during {estimate_.peak_phase}) exceeds the "
        f"{where}; change one of: " + "; ".join(options)
    ]


def _fitting_resolution(cfg: TrainConfig, dies: int, device_type: str, capacity: int) -> str | None:
    """The largest smaller image (same aspect, multiples of 16, each side shrunk by √2 per try) whose estimate fits:
    at a huge resolution the activations dominate, and no other knob brings them under."""

    for step in range(1, 13):
        scale = math.sqrt(2) ** -step
        height, width = (max(16, int(side * scale) // 16 * 16) for side in (cfg.height, cfg.width))
        changed = estimate_for_config(dataclasses.replace(cfg, height=height, width=width), dies, device_type)
        if checked_peak(changed, device_type) <= capacity:
            return f"--height {height} --width {width}: {changed.peak / GiB:.1f} GiB (fits)"
        if height == 16 and width == 16:
            break
    return None


def _knobs(cfg: TrainConfig, dies: int) -> list[tuple[str, dict[str, Any]]]:
    knobs: list[tuple[str, dict[str, Any]]] = [(f"--dies {dies * 2}", {"dies": dies * 2})]
    if cfg.retain_rollout_graphs:  # the kept forwards of the trained steps: the first thing to give back
        knobs.insert(0, ("--no-retain-rollout-graphs", {"cfg": {"retain_rollout_graphs": False}}))
    if cfg.reward_dtype == "fp32" and any(reward_record(name).casts_weights for name in reward_spec_names(cfg.reward)):
        knobs.append(("--reward-dtype bf16", {"cfg": {"reward_dtype": "bf16"}}))  # HPSv3: 31 → 15.5 GB per die
    if cfg.lora_rank == 0:
        knobs.append(("--lora-rank 64", {"cfg": {"lora_rank": 64}}))
    if not cfg.gradient_checkpointing:
        knobs.append(("--gradient-checkpointing", {"cfg": {"gradient_checkpointing": True}}))
    if cfg.train_micro_batch_size > 1:
        knobs.append(("--train-micro-batch-size 1", {"cfg": {"train_micro_batch_size": 1}}))
    if not cfg.cpu_offload and dies > 1:
        knobs.append(("--cpu-offload", {"cfg": {"cpu_offload": True}}))
    return knobs


# Set to 1 to launch a config the estimate says will not fit (an estimate can be wrong; the device will tell).
IGNORE_ESTIMATE_ENV = "FLUXGRPO_IGNORE_MEMORY_ESTIMATE"


def plan_memory(cfg: TrainConfig, dies: int, device_type: str, dry_run: bool = False) -> MemoryEstimate:
    """The estimate for this launch; refuses (UsageError) a config whose peak exceeds the smallest visible
    device (on cpu: the host's memory shared by the workers), naming the knobs that would fit. No check when no
    device is visible. A ``dry_run`` plans from the known shapes of the model the config names (``model_source``):
    it may be planning a cluster run on a laptop that holds other weights, or none."""

    estimate_ = estimate_for_config(cfg, dies, device_type, from_family=dry_run)
    capacity = host_memory_per_worker(dies) if device_type == "cpu" else None
    if device_type != "cpu":
        try:
            capacity = min((d.total_bytes for d in rt_device.describe_devices(device_type)), default=None)
        except Exception:
            capacity = None
    problems = check_fits(cfg, dies, device_type, estimate_, capacity, from_family=dry_run)
    if problems and os.environ.get(IGNORE_ESTIMATE_ENV) != "1":
        raise UsageError(
            problems[0] + f" (or set {IGNORE_ESTIMATE_ENV}=1 to launch anyway; see fluxgrpo/docs/memory.md)"
        )
    return estimate_
