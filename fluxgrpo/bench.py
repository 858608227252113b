"""``fluxgrpo bench``: where the time of one GRPO iteration goes, and what batching buys, measured side by side.

One GRPO iteration is five phases, each timed between device synchronisations after ``--warmup`` untimed runs,
``--repeats`` times (the median is reported):

- **rollout**: B trajectories × N SDE steps, ``generate_rollout`` in chunks of each ``--rollout-batch-sizes`` value;
- **decode**: the VAE turning the B final x̂0 into images, in the same chunk sizes;
- **reward**: scoring the B images (HPS's scoring path: resize and pad to 224, CLIP normalisation, image tower,
  cached text features, cosine), in the same chunk sizes;
- **update**: ``policy_update`` over the B trajectories' T trained timesteps at each ``--micro-batch-sizes`` value,
  with activation checkpointing on and/or off (forward + backward + gradient clipping, optimizer steps excluded);
- **optimizer**: one AdamW step over the transformer (its time is taken out of the update's).

B (``--trajectories``) defaults to the least common multiple of all batch sizes, so every size does exactly the same
work and the speed-up of batch b is a ratio of two numbers measured in the same run: rate(b) / rate(smallest b).
The update runs with learning rate 0: AdamW still does all of its arithmetic, but the weights never move, so every
configuration trains the same model and the PPO ratio of the stored rollout must stay 1. Each update row reports
max |log ρ| of its first micro-batch, which checks that batch-dependent kernels keep rollout and update consistent.

Memory. ``peak_memory_bytes`` is the device allocator's peak during a phase's timed runs (weights, gradients and
AdamW state included; None on cpu, which keeps no allocator statistics). ``activation_bytes`` (update rows) is
device-independent: the bytes of every distinct storage autograd keeps for backward after one micro-batch forward
(parameters excluded; autocast's low-precision weight copies included, since they are held too), counted with
saved-tensor hooks. Activation checkpointing changes both; the summary reports what it saves and what it costs.

Models. ``tiny`` is the seeded tiny FLUX of ``fetch-weights --source tiny`` (2 + 2 blocks, width 32), built in
memory. ``flux-dev-shaped`` is FLUX.1-dev's transformer architecture with random weights, built on the device without
any download: width 3072 (24 heads × 128), joint_attention_dim 4096, pooled 768, in_channels 64, guidance embedding,
RoPE axes (16, 56, 56), and ``--blocks D,S`` double/single blocks (19, 38 is the real model), with a random VAE of
FLUX.1-dev's configuration. A PATH is a diffusers FLUX folder (real or tiny weights); ``--blocks`` keeps its first D
and S blocks. Text encoders are never loaded: the conditioning is random with the right shape (``--text-tokens``
T5 tokens, 512 as FLUX.1-dev's pipeline pads to; the model's joint_attention_dim; a pooled vector).

The reward phase of the shaped model. HPSv2 is open_clip's ViT-H-14 (986 M parameters), so on an accelerator the
default (``--reward auto``) scores with a randomly initialised ViT-H-14 through the same scoring code: its cost is
the real reward's cost (a forward of the 224² image tower per image; text features are cached per prompt, as in
training, where each prompt is scored G times). On cpu, where one ViT-H-14 image takes seconds, ``auto`` uses the
tiny HPS-shaped CLIP instead, which measures the preprocessing and data movement, not HPS's compute.

Model FLOPs of the FLUX transformer (what MFU counts)
-----------------------------------------------------
Notation: d = heads × head_dim (hidden width), L image tokens ((H/16)·(W/16)), S text tokens, n = L + S, C_in = 64
packed latent channels in, C_out = 64 out, D_t = joint_attention_dim (4096), P = pooled_projection_dim (768),
N_d double blocks, N_s single blocks. A linear layer of shape a→b applied to one token costs 2ab FLOPs (one
multiply and one add per weight); attention over n tokens costs 2n²d for QKᵀ and 2n²d for the weighted sum of V,
4n²d per block, summed over heads (full bidirectional attention, no mask). Element-wise work (norms, RoPE, GELU,
softmax, modulation) is not counted, as MFU conventions do.

Double-stream block (``FluxTransformerBlock``): image and text tokens each go through their *own* weights —
q, k, v (3d²), output projection (d²), MLP d→4d→d (8d²): 12d² parameters per stream, 24d² per block — and
meet in one joint attention over all n tokens. So a token sees 12d² weights: 24·n·d² FLOPs, plus 4n²d for
attention.
Single-stream block (``FluxSingleTransformerBlock``): q, k, v (3d²), MLP-in d→4d (4d²), and one output projection
from the concatenated attention and MLP outputs 5d→d (5d²): 12d² per token again, 24·n·d² + 4n²d per block.
(So "2 × parameters × tokens" would double-count the double blocks: each token uses only half of their weights.)

Per sample (not per token) come the modulations — AdaLayerNormZero d→6d twice per double block, d→3d per single
block, d→2d before the output — and the conditioning embedders (timestep and guidance: 256→d→d each; pooled
text: P→d→d). Per token come the embedders x: C_in→d on L tokens, context: D_t→d on S tokens, and the output
projection d→C_out on L tokens. One forward of one sample therefore costs

    F = (N_d + N_s)·(24·n·d² + 4·n²·d)                              blocks
      + 2·d·(C_in·L + D_t·S + C_out·L)                              token embedders and output projection
      + 2·d²·(12·N_d + 3·N_s + 2)                                   adaLN modulations
      + 2·(g·(256·d + d²) + P·d + d²)      g = 2 with guidance, else 1: conditioning embedders

(``transformer_forward_flops``; the tests check it against a hand count and against torch's FLOP counter.)
A rollout costs B·N·F. A training step costs 3·F per sample (backward = 2 × forward: gradients with respect to
both inputs and weights), the usual model-FLOPs convention; the backward of the first layers computes no input
gradient, so the true count is a hair lower, and activation checkpointing's recomputed forward is hardware work
that MFU deliberately does not count. The update costs 3·B·T·F. For FLUX.1-dev (d = 3072, 19 + 38 blocks) at
720² (L = 2025, S = 512, n = 2537), F ≈ 37.3 TFLOP per image per step: 88% in the 24·n·d² terms, 12% in
attention.

MFU = (model FLOPs / seconds) / peak, per device, against ``runtime.peak.peak_throughput`` (dense bf16 or TF32
datasheet figures, Ascend's cube peak) or ``--peak-tflops``. No peak, no MFU (cpu).

The H200 command (one device, bf16 autocast over fp32 weights, FLUX.1-dev's width, 720², 16 steps, nothing
downloaded). fp32 weights, gradients and AdamW's moments take 16 bytes per parameter, so 8 + 16 blocks (5.05 B
parameters) take 75 GiB of the device's ~140 GiB and leave room for autocast's bf16 weight copies (9 GiB), the
activations of micro-batch 2 without checkpointing (≈ 20 GiB at 720², scaled from the saved-tensor count of a
full-width block pair on cpu), the VAE and the ViT-H-14 reward; 19 + 38 blocks would need 177 GiB before any
activation. Each configuration is 128 rollout forwards or 72 trained samples of ≈ 15.7 TFLOP per forward: about
4 minutes at 40–50 % MFU, under 8 at 25 %. A configuration that does not fit is reported as "out of memory".

    fluxgrpo bench --model flux-dev-shaped --blocks 8,16 --resolution 720 --steps 16 \\
        --rollout-batch-sizes 1,2,4,8 --micro-batch-sizes 1,2 --activation-checkpointing both \\
        --dtype bf16 --repeats 2 --json > bench-h200.jsonl

Multi-device (``--dies N``) runs N workers under torchrun with the transformer FSDP2-sharded as in training; every
rank measures its own B trajectories, rank 0's figures are reported and rates are per device.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fluxgrpo.errors import FluxgrpoError, UsageError
from fluxgrpo.paths import DEFAULT_HPS_DIR

if TYPE_CHECKING:
    import torch
    from torch import nn

    from fluxgrpo.grpo.types import Conditioning, Rollout
    from fluxgrpo.runtime.dist import DistContext

TINY_MODEL = "tiny"
SHAPED_MODEL = "flux-dev-shaped"
CHECKPOINTING_CHOICES = ("both", "on", "off")
DTYPE_CHOICES = ("bf16", "fp32")
REWARD_CHOICES = ("auto", "tiny-clip", "vit-h-14", "brightness", "hpsv2")
PHASES = ("rollout", "decode", "reward", "update", "optimizer")

# DanceGRPO's sampling settings; they change no cost, so they are not flags.
ETA, SHIFT, GUIDANCE = 0.3, 3.0, 3.5
CLIP_RANGE, ADV_CLIP_MAX, MAX_GRAD_NORM = 1e-4, 5.0, 1.0
DEFAULT_TIMESTEP_FRACTION = 0.6
BENCH_CAPTION = "a photograph of a red fox in the snow"
# fp32 weights, gradients and AdamW's two moments: what one trained parameter costs before any activation.
TRAINING_BYTES_PER_PARAMETER = 16

# FLUX.1-dev's transformer/config.json, less the block counts (a flag) and the defaults.
FLUX_DEV_TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 64,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}
FLUX_DEV_BLOCKS = (19, 38)
# FLUX.1-dev's vae/config.json (83.8 M parameters).
FLUX_DEV_VAE_CONFIG: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "block_out_channels": (128, 256, 512, 512),
    "layers_per_block": 2,
    "act_fn": "silu",
    "latent_channels": 16,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    "force_upcast": True,
    "mid_block_add_attention": True,
}


# --------------------------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class BenchConfig:
    """What to measure. Build it with ``build_bench_config`` (parses and validates the flags' strings)."""

    model: str = TINY_MODEL  # tiny | flux-dev-shaped | a diffusers FLUX folder
    blocks: tuple[int, int] | None = None  # (double, single); None: the model's own (FLUX.1-dev: 19, 38)
    resolutions: tuple[tuple[int, int], ...] = ()  # (height, width) each; () : 64² for tiny, 720² otherwise
    steps: int = 16  # N sampling steps
    rollout_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    micro_batch_sizes: tuple[int, ...] = (1, 2)
    activation_checkpointing: str = "both"  # both | on | off (update phase)
    trajectories: int | None = None  # B; None: lcm of every batch size
    train_timesteps: int | None = None  # T per trajectory; None: max(1, int((N−1)·0.6))
    text_tokens: int = 512  # S
    dies: int = 1
    device: str = "auto"
    dtype: str | None = None  # bf16 | fp32; None: the runtime's compute dtype for the device
    attention: str = "sdpa"
    peak_tflops: float | None = None
    repeats: int = 3
    warmup: int = 1
    reward: str = "auto"
    hps_dir: str = DEFAULT_HPS_DIR
    compile: bool = False
    seed: int = 0

    @property
    def num_trajectories(self) -> int:
        if self.trajectories is not None:
            return self.trajectories
        return math.lcm(*self.rollout_batch_sizes, *self.micro_batch_sizes)

    @property
    def num_train_timesteps(self) -> int:
        if self.train_timesteps is not None:
            return self.train_timesteps
        return max(1, int((self.steps - 1) * DEFAULT_TIMESTEP_FRACTION))

    @property
    def checkpointing_modes(self) -> tuple[bool, ...]:
        return {"both": (False, True), "on": (True,), "off": (False,)}[self.activation_checkpointing]

    def resolved_resolutions(self) -> tuple[tuple[int, int], ...]:
        if self.resolutions:
            return self.resolutions
        return ((64, 64),) if self.model == TINY_MODEL else ((720, 720),)

    def problems(self) -> list[str]:
        """Every inconsistency, each naming the flag that fixes it."""
        from fluxgrpo.runtime.adapt import ATTENTION_BACKENDS
        from fluxgrpo.runtime.device import DEVICE_TYPES

        out: list[str] = []
        if self.blocks is not None and (min(self.blocks) < 0 or sum(self.blocks) < 1):
            out.append(f"--blocks {self.blocks[0]},{self.blocks[1]}: counts cannot be negative and need one block")
        for height, width in self.resolutions:
            if height <= 0 or width <= 0 or height % 16 or width % 16:
                out.append(f"--resolution {height}x{width}: both sides must be positive multiples of 16")
        if self.steps < 2:
            out.append(f"--steps {self.steps}: at least 2 (the last transition is never trained)")
        for flag, sizes in (
            ("--rollout-batch-sizes", self.rollout_batch_sizes),
            ("--micro-batch-sizes", self.micro_batch_sizes),
        ):
            if not sizes or min(sizes) < 1:
                out.append(f"{flag} needs positive sizes, got {','.join(map(str, sizes)) or 'none'}")
        sizes = (*self.rollout_batch_sizes, *self.micro_batch_sizes)
        if self.trajectories is not None:
            uneven = [size for size in sizes if size > 0 and self.trajectories % size]
            if self.trajectories < 1 or uneven:
                out.append(f"--trajectories {self.trajectories} must be a positive multiple of every batch size")
        elif all(size >= 1 for size in sizes) and self.num_trajectories > 256:
            out.append(
                f"the batch sizes' least common multiple is {self.num_trajectories} trajectories: "
                "choose sizes that divide each other, or set --trajectories"
            )
        if self.train_timesteps is not None and not 1 <= self.train_timesteps <= self.steps - 1:
            out.append(f"--train-timesteps {self.train_timesteps} must be in 1…{self.steps - 1} (--steps − 1)")
        if self.activation_checkpointing not in CHECKPOINTING_CHOICES:
            out.append(
                f"--activation-checkpointing {self.activation_checkpointing!r}: use {', '.join(CHECKPOINTING_CHOICES)}"
            )
        if self.text_tokens < 1:
            out.append(f"--text-tokens {self.text_tokens} must be at least 1")
        if self.dies < 1:
            out.append(f"--dies {self.dies} must be at least 1")
        if self.device != "auto" and self.device not in DEVICE_TYPES:
            out.append(f"--device {self.device!r}: use auto or one of {', '.join(DEVICE_TYPES)}")
        if self.dtype is not None and self.dtype not in DTYPE_CHOICES:
            out.append(f"--dtype {self.dtype!r}: use {' or '.join(DTYPE_CHOICES)}")
        if self.attention not in ATTENTION_BACKENDS:
            out.append(f"--attention {self.attention!r}: use one of {', '.join(ATTENTION_BACKENDS)}")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            out.append(f"--peak-tflops {self.peak_tflops} must be positive")
        if self.repeats < 1 or self.warmup < 0:
            out.append("--repeats must be at least 1 and --warmup at least 0")
        if self.reward not in REWARD_CHOICES:
            out.append(f"--reward {self.reward!r}: use one of {', '.join(REWARD_CHOICES)}")
        if self.compile and self.dies > 1:
            out.append("--compile is measured on one device only: drop --compile or use --dies 1")
        return out

    def validate(self) -> BenchConfig:
        problems = self.problems()
        if problems:
            raise UsageError("invalid bench settings:\n  - " + "\n  - ".join(problems))
        return self

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["resolutions"] = [f"{h}x{w}" for h, w in self.resolved_resolutions()]
        out["trajectories"] = self.num_trajectories
        out["train_timesteps"] = self.num_train_timesteps
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchConfig:
        """Inverse of ``to_dict`` (the worker processes of ``--dies N`` receive their config this way)."""
        values = dict(data)
        values["blocks"] = tuple(values["blocks"]) if values.get("blocks") is not None else None
        values["resolutions"] = tuple(_parse_resolution_item(item, "--resolution") for item in values["resolutions"])
        values["rollout_batch_sizes"] = tuple(values["rollout_batch_sizes"])
        values["micro_batch_sizes"] = tuple(values["micro_batch_sizes"])
        return cls(**values)


def parse_int_list(text: str, flag: str) -> tuple[int, ...]:
    """'1,2,4,8' → (1, 2, 4, 8), sorted, without duplicates; a UsageError naming ``flag`` otherwise."""
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected comma-separated integers, e.g. 1,2,4,8") from None
    if not values:
        raise UsageError(f"{flag} {text!r}: expected at least one integer")
    return tuple(values)


def parse_blocks(text: str) -> tuple[int, int]:
    """'8,16' → (8, 16): double-stream and single-stream block counts."""
    parts = text.split(",")
    try:
        double, single = (int(part) for part in parts)
    except ValueError:
        raise UsageError(f"--blocks {text!r}: expected two integers D,S (double, single blocks), e.g. 8,16") from None
    return double, single


def _parse_resolution_item(item: str, flag: str) -> tuple[int, int]:
    sides = item.lower().split("x")
    try:
        numbers = [int(side) for side in sides]
    except ValueError:
        numbers = []
    if len(numbers) not in (1, 2):
        raise UsageError(f"{flag} {item!r}: expected a size like 720 (square) or 720x1280 (height x width)")
    return (numbers[0], numbers[-1])


def parse_resolutions(text: str) -> tuple[tuple[int, int], ...]:
    """'512,720' → ((512, 512), (720, 720)); '720x1280' → ((720, 1280),): each entry is measured in turn."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise UsageError(f"--resolution {text!r}: expected sizes like 512,720 or 720x1280")
    return tuple(dict.fromkeys(_parse_resolution_item(item, "--resolution") for item in items))


def build_bench_config(
    *,
    model: str = TINY_MODEL,
    blocks: str | None = None,
    resolution: str | None = None,
    rollout_batch_sizes: str = "1,2,4,8",
    micro_batch_sizes: str = "1,2",
    **values: Any,
) -> BenchConfig:
    """A validated ``BenchConfig`` from the command line's strings (lists as '1,2,4', blocks as 'D,S')."""
    config = BenchConfig(
        model=model,
        blocks=parse_blocks(blocks) if blocks else None,
        resolutions=parse_resolutions(resolution) if resolution else (),
        rollout_batch_sizes=parse_int_list(rollout_batch_sizes, "--rollout-batch-sizes"),
        micro_batch_sizes=parse_int_list(micro_batch_sizes, "--micro-batch-sizes"),
        **values,
    )
    return config.validate()


# --------------------------------------------------------------------------------------------- FLOPs and sizes


@dataclass(frozen=True)
class FluxShape:
    """The sizes of a FluxTransformer2DModel that its cost depends on."""

    double_blocks: int  # N_d
    single_blocks: int  # N_s
    hidden: int  # d = heads × head_dim
    head_dim: int
    in_channels: int  # C_in, packed latent channels (64)
    out_channels: int  # C_out
    text_dim: int  # D_t, joint_attention_dim
    pooled_dim: int  # P, pooled_projection_dim
    guidance: bool  # guidance embedder present (FLUX.1-dev)

    @classmethod
    def from_config(cls, config: Any, blocks: tuple[int, int] | None = None) -> FluxShape:
        """From a transformer config (attribute access or dict); ``blocks`` overrides the block counts."""
        get = config.get if isinstance(config, dict) else (lambda key, default=None: getattr(config, key, default))
        if get("patch_size", 1) != 1:
            raise FluxgrpoError(
                f"the FLOP count assumes FLUX's patch_size 1 (latents packed outside), got {get('patch_size')}"
            )
        heads, head_dim = int(get("num_attention_heads")), int(get("attention_head_dim"))
        double, single = blocks if blocks is not None else (int(get("num_layers")), int(get("num_single_layers")))
        in_channels = int(get("in_channels"))
        return cls(
            double_blocks=double,
            single_blocks=single,
            hidden=heads * head_dim,
            head_dim=head_dim,
            in_channels=in_channels,
            out_channels=int(get("out_channels") or in_channels),
            text_dim=int(get("joint_attention_dim")),
            pooled_dim=int(get("pooled_projection_dim")),
            guidance=bool(get("guidance_embeds")),
        )

    @classmethod
    def from_transformer(cls, transformer: nn.Module) -> FluxShape:
        """From a built model; the block counts are the module lists' lengths (they may have been trimmed)."""
        return cls.from_config(
            transformer.config,
            (len(transformer.transformer_blocks), len(transformer.single_transformer_blocks)),
        )

    def parameter_count(self) -> int:
        """Parameters of the transformer with these sizes (weights and biases; q/k RMSNorm scales)."""
        d, hd = self.hidden, self.head_dim

        def linear(fan_in: int, fan_out: int) -> int:
            return fan_in * fan_out + fan_out

        conditioning = (2 if self.guidance else 1) * (linear(256, d) + linear(d, d))
        conditioning += linear(self.pooled_dim, d) + linear(d, d)
        embedders = linear(self.in_channels, d) + linear(self.text_dim, d)
        double = (
            2 * linear(d, 6 * d)  # norm1, norm1_context
            + 8 * linear(d, d)  # q, k, v, out for each stream
            + 4 * hd  # norm_q, norm_k, norm_added_q, norm_added_k
            + 2 * (linear(d, 4 * d) + linear(4 * d, d))  # ff, ff_context
        )
        single = linear(d, 3 * d) + linear(d, 4 * d) + 3 * linear(d, d) + 2 * hd + linear(5 * d, d)
        output = linear(d, 2 * d) + linear(d, self.out_channels)
        return conditioning + embedders + self.double_blocks * double + self.single_blocks * single + output


def transformer_forward_flops(shape: FluxShape, image_tokens: int, text_tokens: int) -> int:
    """Model FLOPs of one forward of one sample (see the module docstring for the derivation)."""
    d, n = shape.hidden, image_tokens + text_tokens
    blocks = (shape.double_blocks + shape.single_blocks) * (24 * n * d * d + 4 * n * n * d)
    token_linears = (
        2 * d * (shape.in_channels * image_tokens + shape.text_dim * text_tokens + shape.out_channels * image_tokens)
    )
    modulation = 2 * d * d * (12 * shape.double_blocks + 3 * shape.single_blocks + 2)
    embedders = 2 * ((2 if shape.guidance else 1) * (256 * d + d * d) + shape.pooled_dim * d + d * d)
    return blocks + token_linears + modulation + embedders


def rollout_flops(shape: FluxShape, image_tokens: int, text_tokens: int, trajectories: int, steps: int) -> int:
    """B·N forwards."""
    return trajectories * steps * transformer_forward_flops(shape, image_tokens, text_tokens)


def update_flops(shape: FluxShape, image_tokens: int, text_tokens: int, trajectories: int, train_timesteps: int) -> int:
    """B·T forward + backward steps at 3 × forward each (recomputation under checkpointing not counted)."""
    return 3 * trajectories * train_timesteps * transformer_forward_flops(shape, image_tokens, text_tokens)


# --------------------------------------------------------------------------------------------- results


@dataclass(frozen=True)
class PhaseFigure:
    """One measured configuration of one phase (a row of the table, a ``figure`` JSON line)."""

    phase: str  # rollout | decode | reward | update | optimizer
    resolution: str  # "720x720"
    batch_size: int | None  # trajectories per forward (update: micro-batch); None for the optimizer
    activation_checkpointing: bool | None  # update/optimizer rows
    work: int  # what one timed run does, in ``unit``s
    unit: str  # images | samples (trajectory × trained timestep) | steps
    seconds: float | None  # median over the repeats of one run's wall time, device-synchronised
    seconds_min: float | None
    per_second: float | None  # work / seconds
    speedup: float | None  # per_second over this phase's per_second at its smallest batch size
    tflops: float | None  # achieved model TFLOP/s (transformer phases)
    mfu: float | None  # tflops / peak
    peak_memory_bytes: int | None  # allocator peak during the timed runs; None on cpu
    activation_bytes: int | None  # update rows: bytes held for backward after one micro-batch forward
    max_abs_log_ratio: float | None  # update rows: max |log ρ| over the first micro-batch (should be ~0)
    error: str | None = None  # "out of memory" and the like; the other figures are then None

    def to_record(self) -> dict[str, Any]:
        return {"record": "figure", **asdict(self)}


@dataclass
class _Timing:
    seconds: list[float] = field(default_factory=list)  # one per timed run
    peak_memory_bytes: int | None = None  # the highest allocator peak of those runs
    excluded_seconds: list[float] = field(default_factory=list)  # per run: time spent in another phase (optimizer)

    def add(self, seconds: float, peak: int | None, excluded: float = 0.0) -> None:
        self.seconds.append(seconds)
        self.excluded_seconds.append(excluded)
        if peak is not None:
            self.peak_memory_bytes = max(self.peak_memory_bytes or 0, peak)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def _figure(
    phase: str,
    resolution: str,
    batch_size: int | None,
    checkpointing: bool | None,
    work: int,
    unit: str,
    timing: _Timing | None,
    flops: int | None,
    peak_tflops: float | None,
    *,
    error: str | None = None,
    activation_bytes: int | None = None,
    max_abs_log_ratio: float | None = None,
) -> PhaseFigure:
    if timing is None or not timing.seconds:
        return PhaseFigure(
            phase,
            resolution,
            batch_size,
            checkpointing,
            work,
            unit,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            activation_bytes,
            max_abs_log_ratio,
            error or "not measured",
        )
    seconds = timing.median
    tflops = flops / seconds / 1e12 if flops is not None and seconds > 0 else None
    return PhaseFigure(
        phase=phase,
        resolution=resolution,
        batch_size=batch_size,
        activation_checkpointing=checkpointing,
        work=work,
        unit=unit,
        seconds=seconds,
        seconds_min=min(timing.seconds),
        per_second=work / seconds if seconds > 0 else None,
        speedup=None,
        tflops=tflops,
        mfu=tflops / peak_tflops if tflops is not None and peak_tflops else None,
        peak_memory_bytes=timing.peak_memory_bytes,
        activation_bytes=activation_bytes,
        max_abs_log_ratio=max_abs_log_ratio,
        error=error,
    )


def with_speedups(figures: Sequence[PhaseFigure]) -> list[PhaseFigure]:
    """Each figure's rate over the rate of the same phase, resolution and checkpointing at the smallest batch size."""
    baselines: dict[tuple[str, str, bool | None], PhaseFigure] = {}
    for figure in figures:
        if figure.batch_size is None or figure.per_second is None:
            continue
        key = (figure.phase, figure.resolution, figure.activation_checkpointing)
        if key not in baselines or figure.batch_size < baselines[key].batch_size:  # type: ignore[operator]
            baselines[key] = figure
    out = []
    for figure in figures:
        base = baselines.get((figure.phase, figure.resolution, figure.activation_checkpointing))
        if base is not None and figure.per_second is not None and base.per_second:
            figure = replace(figure, speedup=figure.per_second / base.per_second)
        out.append(figure)
    return out


def summarize(figures: Sequence[PhaseFigure], resolution: str) -> dict[str, Any]:
    """One iteration's time at the smallest and at the largest batch sizes (per activation-checkpointing mode), each
    phase's share of it, each phase's speed-up, and what checkpointing saves and costs (a ``summary`` JSON line).

    The bench's update takes one optimizer step (one accumulation window over all B trajectories), so an iteration
    is rollout + decode + reward + update + one optimizer step; decode and reward use the rollout's batch size, as
    the trainer does."""
    rows = [f for f in figures if f.resolution == resolution and f.seconds is not None]
    by_phase = {phase: [f for f in rows if f.phase == phase] for phase in PHASES}
    optimizer_seconds = by_phase["optimizer"][0].seconds if by_phase["optimizer"] else 0.0

    def iteration(chosen: dict[str, PhaseFigure]) -> dict[str, Any]:
        seconds = {phase: figure.seconds for phase, figure in chosen.items()}
        seconds["optimizer"] = optimizer_seconds
        total = sum(seconds.values())
        return {
            "batch_sizes": {phase: figure.batch_size for phase, figure in chosen.items()},
            "seconds": total,
            "images_per_second": chosen["rollout"].work / total,
            "share": {phase: value / total for phase, value in seconds.items()},
        }

    iterations = []
    sampling = ("rollout", "decode", "reward")
    if all(by_phase[phase] for phase in (*sampling, "update")):
        common = set.intersection(*({f.batch_size for f in by_phase[phase]} for phase in sampling))
        for checkpointing in sorted({bool(f.activation_checkpointing) for f in by_phase["update"]}):
            updates = [f for f in by_phase["update"] if f.activation_checkpointing == checkpointing]
            if not common:
                break
            ends = {}
            for end, pick in (("smallest", min), ("largest", max)):
                size = pick(common)
                chosen = {phase: next(f for f in by_phase[phase] if f.batch_size == size) for phase in sampling}
                chosen["update"] = pick(updates, key=lambda f: f.batch_size)
                ends[end] = iteration(chosen)
            iterations.append(
                {
                    "activation_checkpointing": checkpointing,
                    **ends,
                    "speedup": ends["smallest"]["seconds"] / ends["largest"]["seconds"],
                }
            )
    speedups = {}
    for phase in ("rollout", "decode", "reward", "update"):
        for checkpointing in sorted({f.activation_checkpointing for f in by_phase[phase]}, key=str):
            candidates = [f for f in by_phase[phase] if f.activation_checkpointing == checkpointing]
            low, top = min(candidates, key=lambda f: f.batch_size), max(candidates, key=lambda f: f.batch_size)
            suffix = "" if checkpointing is None else (" ckpt" if checkpointing else " no-ckpt")
            speedups[phase + suffix] = {
                "batch_size": top.batch_size,
                "vs_batch_size": low.batch_size,
                "speedup": top.speedup,
            }
    checkpointing_cost = {}
    for size in sorted({f.batch_size for f in by_phase["update"]}):
        on = next((f for f in by_phase["update"] if f.batch_size == size and f.activation_checkpointing), None)
        off = next((f for f in by_phase["update"] if f.batch_size == size and not f.activation_checkpointing), None)
        if on is None or off is None:
            continue
        checkpointing_cost[str(size)] = {
            "peak_memory_saved_bytes": _difference(off.peak_memory_bytes, on.peak_memory_bytes),
            "activation_bytes_saved": _difference(off.activation_bytes, on.activation_bytes),
            "time_ratio_on_over_off": on.seconds / off.seconds,
        }
    return {
        "record": "summary",
        "resolution": resolution,
        "iterations": iterations,
        "speedups": speedups,
        "activation_checkpointing_by_micro_batch": checkpointing_cost,
    }


def _difference(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a - b


# --------------------------------------------------------------------------------------------- models


def random_hps_reward(architecture: str, device: Any, seed: int) -> Any:
    """HPSv2's reward (``models.reward.load_reward("hpsv2", ...)``, the trainer's own code) with random weights.

    ``architecture`` is "tiny-clip" (the tiny HPS-shaped CLIP of ``fetch-weights --source tiny``) or "vit-h-14"
    (HPSv2's open_clip ViT-H-14, 986 M parameters). The weights are written to a temporary folder in the HPS layout
    and loaded the way training loads them: same preprocessing, towers, text-feature cache and cosine score, so
    the reward phase costs what the real reward costs. For ViT-H-14 that is a 4 GB file written and read once.
    """
    import tempfile

    import torch

    from fluxgrpo.models.reward import REAL_REWARD_ARCH, load_reward
    from fluxgrpo.weights.layout import HPS_CHECKPOINT, OPEN_CLIP_WEIGHTS

    with tempfile.TemporaryDirectory(prefix="fluxgrpo-bench-reward-") as folder:
        if architecture == "tiny-clip":
            from fluxgrpo.weights.tiny import write_tiny_reward

            write_tiny_reward(Path(folder), seed)
        else:
            import open_clip

            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = open_clip.create_model(REAL_REWARD_ARCH, pretrained=None, precision="fp32", device="cpu")
            # The initial open_clip weights hold every key; an HPS checkpoint with one key then overrides just it.
            torch.save(model.state_dict(), Path(folder, OPEN_CLIP_WEIGHTS))
            torch.save({"state_dict": {"logit_scale": model.logit_scale.detach()}}, Path(folder, HPS_CHECKPOINT))
            del model
        return load_reward("hpsv2", folder, device)


@dataclass
class BenchModel:
    """The parts one rank measures."""

    name: str
    transformer: nn.Module
    vae: nn.Module
    reward: Callable[[Any, list[str]], Any]
    reward_name: str
    reward_parameters: int | None
    shape: FluxShape


def resolve_reward(cfg: BenchConfig, device_type: str, shape: FluxShape) -> str:
    """``auto``: HPSv2's ViT-H-14 (random weights) beside a FLUX.1-dev-width transformer on an accelerator, the
    tiny HPS-shaped CLIP otherwise (on cpu one ViT-H-14 image takes seconds)."""
    if cfg.reward != "auto":
        return cfg.reward
    full_width = (
        shape.hidden
        >= FLUX_DEV_TRANSFORMER_CONFIG["num_attention_heads"] * FLUX_DEV_TRANSFORMER_CONFIG["attention_head_dim"]
    )
    return "vit-h-14" if full_width and device_type != "cpu" else "tiny-clip"


def _device_memory_bytes(ctx: DistContext) -> int | None:
    from fluxgrpo.runtime import device as rt_device

    devices = rt_device.describe_devices(ctx.device_type)
    index = ctx.local_rank if ctx.device_type != "cpu" else 0
    total = devices[index].total_bytes if index < len(devices) else 0
    return total or None


def check_training_memory(shape: FluxShape, ctx: DistContext, model: str) -> None:
    """Refuse a model whose fp32 weights, gradients and AdamW state alone exceed the devices' memory."""
    total = _device_memory_bytes(ctx)
    if total is None:
        return
    needed = shape.parameter_count() * TRAINING_BYTES_PER_PARAMETER / ctx.world_size
    if needed > total:
        raise UsageError(
            f"{model} with {shape.double_blocks} double + {shape.single_blocks} single blocks has "
            f"{shape.parameter_count() / 1e9:.2f} B parameters: fp32 weights, gradients and AdamW state need "
            f"{needed / 2**30:.0f} GiB per device before any activation, more than the {total / 2**30:.0f} GiB "
            "there: pass fewer --blocks D,S (e.g. 8,16 on a 141 GB device) or shard over more --dies"
        )


def _trim_blocks(transformer: nn.Module, blocks: tuple[int, int] | None, model: str) -> None:
    if blocks is None:
        return
    double, single = blocks
    have = (len(transformer.transformer_blocks), len(transformer.single_transformer_blocks))
    if double > have[0] or single > have[1]:
        raise UsageError(f"--blocks {double},{single}: {model} has only {have[0]} double and {have[1]} single blocks")
    del transformer.transformer_blocks[double:]
    del transformer.single_transformer_blocks[single:]


def build_bench_model(cfg: BenchConfig, ctx: DistContext, compute_dtype: torch.dtype) -> BenchModel:
    """Transformer (fp32 master weights, adapted to the device), VAE (compute dtype) and reward on ``ctx.device``."""
    import torch

    from fluxgrpo.runtime.adapt import adapt_transformer

    device = ctx.device
    if cfg.model == TINY_MODEL:
        from fluxgrpo.models.tiny import build_tiny_flux_pipeline

        pipeline = build_tiny_flux_pipeline(cfg.seed)
        transformer, vae = pipeline.transformer, pipeline.vae
        _trim_blocks(transformer, cfg.blocks, cfg.model)
    elif cfg.model == SHAPED_MODEL:
        from diffusers import AutoencoderKL, FluxTransformer2DModel

        double, single = cfg.blocks or FLUX_DEV_BLOCKS
        config = {**FLUX_DEV_TRANSFORMER_CONFIG, "num_layers": double, "num_single_layers": single}
        check_training_memory(FluxShape.from_config(config), ctx, cfg.model)
        torch.manual_seed(cfg.seed)
        with device:  # random init on the device itself: 12 B parameters would take minutes on the host
            transformer = FluxTransformer2DModel(**config)
            vae = AutoencoderKL(**FLUX_DEV_VAE_CONFIG)
    else:
        from fluxgrpo.models.flux import (
            load_transformer,
            load_vae,
            read_transformer_config,
        )

        check_training_memory(FluxShape.from_config(read_transformer_config(cfg.model), cfg.blocks), ctx, cfg.model)
        transformer = load_transformer(cfg.model, dtype=torch.float32, device="cpu")
        _trim_blocks(transformer, cfg.blocks, cfg.model)
        vae = load_vae(cfg.model, dtype=torch.float32, device="cpu")
    # Every builder and loader above yields fp32 weights (the trainer's masters); only the VAE changes dtype.
    transformer = transformer.to(device).requires_grad_(True)
    adapt_transformer(transformer, ctx.device_type, attention=cfg.attention, compute_dtype=compute_dtype)
    vae = vae.to(device) if vae.dtype == compute_dtype else vae.to(device=device, dtype=compute_dtype)
    vae.eval().requires_grad_(False)
    shape = FluxShape.from_transformer(transformer)

    reward_name = resolve_reward(cfg, ctx.device_type, shape)
    if reward_name in ("tiny-clip", "vit-h-14"):
        reward = random_hps_reward(reward_name, device, cfg.seed)
    else:
        from fluxgrpo.models.reward import load_reward

        reward = load_reward(reward_name, cfg.hps_dir, device)
    reward_model = getattr(reward, "model", None)
    reward_parameters = sum(p.numel() for p in reward_model.parameters()) if reward_model is not None else None
    return BenchModel(cfg.model, transformer, vae, reward, reward_name, reward_parameters, shape)


# --------------------------------------------------------------------------------------------- measuring


class _TimedOptimizer:
    """Delegates to an optimizer, timing each ``step()`` between device synchronisations.

    ``policy_update`` only calls ``step`` and ``zero_grad``. The update's own peak memory up to the step is read
    before the allocator's peak is reset for the step, so the two phases' peaks stay apart.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.optimizer = optimizer
        self.device = device
        self.step_peak_bytes: int | None = None  # the highest allocator peak of any step so far
        self.seconds_since_reset = 0.0
        self.update_peak_bytes: int | None = None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def reset(self) -> None:
        """Forget the steps of the previous update run (their time, the update's peak before them)."""
        self.seconds_since_reset = 0.0
        self.update_peak_bytes = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        from fluxgrpo.runtime import device as rt_device

        rt_device.synchronize(self.device)
        peak = rt_device.peak_memory_bytes(self.device)
        if peak is not None:
            self.update_peak_bytes = max(self.update_peak_bytes or 0, peak)
        rt_device.reset_peak_memory(self.device)
        start = time.perf_counter()
        self.optimizer.step()
        rt_device.synchronize(self.device)
        self.seconds_since_reset += time.perf_counter() - start
        peak = rt_device.peak_memory_bytes(self.device)
        if peak is not None:
            self.step_peak_bytes = max(self.step_peak_bytes or 0, peak)
        rt_device.reset_peak_memory(self.device)  # what follows the step is the update's again


class _ConstantSchedule:
    def step(self) -> None:
        """The learning rate stays 0."""


def _materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Allocate AdamW's moments now (one zero-gradient step at learning rate 0), so every phase runs with the
    memory training has: weights, moments, and (during the update) gradients."""
    import torch

    for group in optimizer.param_groups:
        for parameter in group["params"]:
            parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _storage_pointer(tensor: torch.Tensor) -> int:
    """The address of a tensor's storage (a DTensor's local shard's); 0 when it has none (meta, fake tensors)."""
    to_local = getattr(tensor, "to_local", None)
    if callable(to_local):
        tensor = to_local()
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


def saved_activation_bytes(run: Callable[[], Any], parameters: Sequence[torch.Tensor]) -> tuple[int, Any]:
    """Bytes of the distinct storages autograd saves for backward while ``run()`` builds its graph, parameters'
    own storages excluded; returns them and ``run()``'s result (keep it alive until backward)."""
    import torch

    parameter_storages = {_storage_pointer(p) for p in parameters}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        pointer = _storage_pointer(tensor)
        if pointer and pointer not in parameter_storages:
            saved[pointer] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = run()
    return sum(saved.values()), result


@dataclass
class _Inputs:
    """Everything one resolution's phases consume, shared by every batch size."""

    cond: Conditioning  # B rows, one caption repeated (one group, as G generations of one prompt)
    noise: torch.Tensor  # [B, L, C] fp32 z_0
    sigmas: torch.Tensor  # [N+1]
    img_ids: torch.Tensor  # [L, 3]
    advantages: torch.Tensor  # [B]
    height: int
    width: int
    image_tokens: int  # L


def _make_inputs(
    cfg: BenchConfig, bench_model: BenchModel, height: int, width: int, device: torch.device, rank: int
) -> _Inputs:
    import torch

    from fluxgrpo.grpo.latents import image_ids, latent_shape
    from fluxgrpo.grpo.schedule import sigma_schedule
    from fluxgrpo.grpo.types import Conditioning

    shape = latent_shape(height, width)
    count = cfg.num_trajectories
    generator = torch.Generator(device=device).manual_seed(cfg.seed * 1_000_003 + rank)
    cond = Conditioning(
        prompt_embeds=torch.randn(
            count, cfg.text_tokens, bench_model.shape.text_dim, generator=generator, device=device
        ),
        pooled=torch.randn(count, bench_model.shape.pooled_dim, generator=generator, device=device),
        text_ids=torch.zeros(cfg.text_tokens, 3, device=device),
        captions=(BENCH_CAPTION,) * count,
    )
    return _Inputs(
        cond=cond,
        noise=torch.randn(count, *shape.packed, generator=generator, device=device),
        sigmas=sigma_schedule(cfg.steps, SHIFT).to(device),
        img_ids=image_ids(height, width, device=device),
        advantages=torch.linspace(-1.0, 1.0, count, device=device),
        height=height,
        width=width,
        image_tokens=shape.num_tokens,
    )


@dataclass
class _Run:
    """What one call of a measured function reports besides its result."""

    result: Any
    excluded_seconds: float = 0.0  # time inside the call that belongs to another phase (optimizer steps)
    peak_floor_bytes: int | None = None  # a peak reached inside the call before the allocator was reset


class _Sweep:
    """One rank's measurements at one resolution after another; each phase's figures are emitted as soon as the
    phase has been measured at every batch size (so that their speed-ups are known)."""

    def __init__(
        self,
        cfg: BenchConfig,
        ctx: DistContext,
        bench_model: BenchModel,
        compute_dtype: torch.dtype,
        peak_tflops: float | None,
        emit: Callable[[dict[str, Any]], None],
        log: Callable[[str], None],
    ):
        import torch

        self.cfg, self.ctx, self.model = cfg, ctx, bench_model
        self.compute_dtype, self.peak_tflops = compute_dtype, peak_tflops
        self.emit, self.log = emit, log
        self.figures: list[PhaseFigure] = []
        trainable = [p for p in bench_model.transformer.parameters() if p.requires_grad]
        # Learning rate 0: the full AdamW arithmetic, weights unchanged (see the module docstring).
        self.optimizer = _TimedOptimizer(
            torch.optim.AdamW(trainable, lr=0.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-4), ctx.device
        )
        _materialize_optimizer_state(self.optimizer.optimizer)

    # ------------------------------------------------------------------ helpers
    def _measure(self, label: str, call: Callable[[], _Run]) -> tuple[_Timing, Any]:
        """``--warmup`` untimed calls, then ``--repeats`` timed ones; returns the timing and the last result."""
        from fluxgrpo.runtime import device as rt_device

        timing, run = _Timing(), None
        for _ in range(self.cfg.warmup):
            run = call()
        for _ in range(self.cfg.repeats):
            run = None  # the previous result's memory must not count in this call's peak
            rt_device.synchronize(self.ctx.device)
            rt_device.reset_peak_memory(self.ctx.device)
            start = time.perf_counter()
            run = call()
            rt_device.synchronize(self.ctx.device)
            elapsed = time.perf_counter() - start - run.excluded_seconds
            peak = rt_device.peak_memory_bytes(self.ctx.device)
            if run.peak_floor_bytes is not None:
                peak = max(peak or 0, run.peak_floor_bytes)
            timing.add(elapsed, peak, run.excluded_seconds)
        self.log(f"  {label}: {timing.median:.4f} s")
        return timing, None if run is None else run.result

    def _attempt(
        self, label: str, measure: Callable[[], tuple[_Timing, Any]]
    ) -> tuple[_Timing | None, Any, str | None]:
        """``measure()``, with the device running out of memory recorded (as the figure's error) instead of
        ending the bench; any other exception propagates."""
        import gc

        from fluxgrpo.runtime import device as rt_device
        from fluxgrpo.runtime.peak import is_out_of_memory

        try:
            timing, result = measure()
            return timing, result, None
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
        # Past the except clause the exception and the frames it pinned are gone, so their tensors can go too.
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        rt_device.empty_cache(self.ctx.device)
        self.log(f"  {label}: out of memory (recorded; moving on)")
        return None, None, "out of memory"

    def _publish(self, figures: list[PhaseFigure]) -> None:
        for figure in with_speedups(figures):
            self.figures.append(figure)
            self.emit(figure.to_record())

    # ------------------------------------------------------------------ phases
    def rollout(self, inputs: _Inputs, resolution: str) -> Rollout | None:
        """Rollout rows; returns a rollout for the later phases (None if every size ran out of memory)."""
        import torch

        from fluxgrpo.grpo.rollout import generate_rollout

        count = self.cfg.num_trajectories
        flops = rollout_flops(self.model.shape, inputs.image_tokens, self.cfg.text_tokens, count, self.cfg.steps)
        kept, figures = None, []
        for size in self.cfg.rollout_batch_sizes:

            def call(size: int = size) -> _Run:
                generator = torch.Generator(device=self.ctx.device).manual_seed(self.cfg.seed + 17)
                return _Run(
                    generate_rollout(
                        self.model.transformer,
                        inputs.cond,
                        inputs.noise,
                        inputs.sigmas,
                        eta=ETA,
                        guidance=GUIDANCE,
                        img_ids=inputs.img_ids,
                        rollout_batch_size=size,
                        device_type=self.ctx.device_type,
                        generator=generator,
                        compute_dtype=self.compute_dtype,
                    )
                )

            label = f"rollout {resolution} batch {size}"
            timing, result, error = self._attempt(label, lambda label=label, call=call: self._measure(label, call))
            kept = result if result is not None else kept
            figures.append(
                _figure(
                    "rollout", resolution, size, None, count, "images", timing, flops, self.peak_tflops, error=error
                )
            )
        self._publish(figures)
        return kept

    def decode_and_reward(self, rollout: Rollout, inputs: _Inputs, resolution: str) -> None:
        """Decode rows, then reward rows, both in chunks of each rollout batch size (as the trainer does)."""
        import torch

        from fluxgrpo.grpo.latents import unpack_latents
        from fluxgrpo.models.flux import decode_latents
        from fluxgrpo.runtime.device import autocast

        count = self.cfg.num_trajectories
        captions = list(inputs.cond.captions or ())
        images, figures = None, []
        for size in self.cfg.rollout_batch_sizes:

            @torch.no_grad()
            def decode(size: int = size) -> _Run:
                chunks = []
                for start in range(0, count, size):
                    latents = unpack_latents(rollout.final_x0[start : start + size], inputs.height, inputs.width)
                    with autocast(self.ctx.device_type, self.compute_dtype):
                        chunks.append(decode_latents(self.model.vae, latents))
                return _Run(torch.cat(chunks))

            label = f"decode {resolution} batch {size}"
            timing, result, error = self._attempt(label, lambda label=label, call=decode: self._measure(label, call))
            images = result if result is not None else images
            figures.append(_figure("decode", resolution, size, None, count, "images", timing, None, None, error=error))
        self._publish(figures)
        if images is None:
            return
        figures = []
        for size in self.cfg.rollout_batch_sizes:

            @torch.no_grad()
            def score(size: int = size) -> _Run:
                return _Run(
                    torch.cat(
                        [
                            self.model.reward(images[start : start + size], captions[start : start + size]).float()
                            for start in range(0, count, size)
                        ]
                    )
                )

            label = f"reward {resolution} batch {size}"
            timing, _, error = self._attempt(label, lambda label=label, call=score: self._measure(label, call))
            figures.append(_figure("reward", resolution, size, None, count, "images", timing, None, None, error=error))
        self._publish(figures)

    def update(self, rollout: Rollout, inputs: _Inputs, resolution: str) -> None:
        """Update rows for every (checkpointing, micro-batch size), then one optimizer row."""
        import torch

        from fluxgrpo.grpo.update import policy_update

        count, trained = self.cfg.num_trajectories, self.cfg.num_train_timesteps
        # (T + ½)/(N − 1): int((N − 1)·fraction) is exactly T whatever the rounding.
        fraction = min(1.0, (trained + 0.5) / (self.cfg.steps - 1))
        flops = update_flops(self.model.shape, inputs.image_tokens, self.cfg.text_tokens, count, trained)
        transformer, optimizer = self.model.transformer, self.optimizer
        optimizer.step_peak_bytes = None
        step_timing = _Timing()  # every timed update run takes exactly one optimizer step
        figures = []
        for checkpointing in self.cfg.checkpointing_modes:
            if checkpointing:
                transformer.enable_gradient_checkpointing()
            else:
                transformer.disable_gradient_checkpointing()
            for size in self.cfg.micro_batch_sizes:

                def call(size: int = size) -> _Run:
                    optimizer.reset()
                    stats = policy_update(
                        transformer,
                        rollout,
                        inputs.cond,
                        inputs.advantages,
                        timestep_fraction=fraction,
                        clip_range=CLIP_RANGE,
                        adv_clip_max=ADV_CLIP_MAX,
                        micro_batch_size=size,
                        # one optimizer step per update at every micro-batch size: rows differ only in batching
                        grad_accum_steps=math.ceil(count / size),
                        max_grad_norm=MAX_GRAD_NORM,
                        optimizer=optimizer,
                        lr_scheduler=_ConstantSchedule(),
                        device_type=self.ctx.device_type,
                        generator_cpu=torch.Generator().manual_seed(self.cfg.seed + 29),
                        compute_dtype=self.compute_dtype,
                    )
                    return _Run(stats, optimizer.seconds_since_reset, optimizer.update_peak_bytes)

                label = f"update {resolution} micro-batch {size} checkpointing {'on' if checkpointing else 'off'}"

                def measure(
                    label: str = label, size: int = size, call: Callable[[], _Run] = call
                ) -> tuple[_Timing, Any]:
                    activation_bytes = self._activation_probe(rollout, inputs, size)
                    timing, stats = self._measure(label, call)
                    return timing, (stats, activation_bytes)

                timing, result, error = self._attempt(label, measure)
                stats, activation_bytes = result if result is not None else (None, None)
                if timing is not None:
                    step_timing.seconds.extend(timing.excluded_seconds)
                figure = _figure(
                    "update",
                    resolution,
                    size,
                    checkpointing,
                    count * trained,
                    "samples",
                    timing,
                    flops,
                    self.peak_tflops,
                    error=error,
                    activation_bytes=activation_bytes,
                    max_abs_log_ratio=None if stats is None else stats.as_floats()["first_abs_log_ratio"],
                )
                if stats is not None and stats.skipped_steps:
                    figure = replace(figure, error="non-finite gradient norm: the optimizer step was skipped")
                figures.append(figure)
        step_timing.peak_memory_bytes = optimizer.step_peak_bytes
        figures.append(_figure("optimizer", resolution, None, None, 1, "steps", step_timing, None, None))
        self._publish(figures)

    def _activation_probe(self, rollout: Rollout, inputs: _Inputs, size: int) -> int:
        """Saved-for-backward bytes of one micro-batch forward at the first timestep (then its backward, which
        leaves FSDP2 in its usual state, and the gradients dropped)."""
        import torch

        from fluxgrpo.grpo.rollout import predict_velocity
        from fluxgrpo.grpo.schedule import model_timesteps
        from fluxgrpo.grpo.sde import sde_step

        transformer = self.model.transformer
        transformer.train()
        device = self.ctx.device
        # Copies, as the update's gather makes them: a view would pin (and count) the whole trajectory buffer.
        current, following = (rollout.latents[:size, index].to(device).clone() for index in (0, 1))

        def forward() -> torch.Tensor:
            velocity = predict_velocity(
                transformer,
                current,
                inputs.cond.rows(0, size),
                model_timesteps(inputs.sigmas)[0].expand(size),
                torch.full((size,), GUIDANCE, device=device),
                inputs.img_ids,
                self.ctx.device_type,
                self.compute_dtype,
            )
            step = sde_step(current, velocity, inputs.sigmas[0], inputs.sigmas[1], ETA, prev_sample=following)
            return step.log_prob.mean()

        held, loss = saved_activation_bytes(forward, list(transformer.parameters()))
        loss.backward()
        self.optimizer.zero_grad(set_to_none=True)
        return held


# --------------------------------------------------------------------------------------------- running


def _compute_dtype(cfg: BenchConfig, device_type: str) -> tuple[torch.dtype, str]:
    import torch

    from fluxgrpo.runtime import device as rt_device

    if cfg.dtype is None:
        dtype = rt_device.compute_dtype(device_type)
    else:
        dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
    return dtype, "bf16" if dtype == torch.bfloat16 else "fp32"


def bench_on_rank(
    cfg: BenchConfig, ctx: DistContext, emit: Callable[[dict[str, Any]], None], log: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Every measurement on this rank (one process; with FSDP2 sharding when the world is larger than one).

    ``emit`` receives each record as soon as it exists: ``config``, ``device``, ``versions``, ``model``, then a
    ``figure`` per measured configuration and a ``summary`` per resolution. Returns the records.
    """
    import platform

    import torch

    from fluxgrpo import __version__
    from fluxgrpo.grpo.latents import latent_shape
    from fluxgrpo.runtime.peak import accelerator_stack, device_name, peak_throughput
    from fluxgrpo.runtime.report import package_versions

    records: list[dict[str, Any]] = []

    def keep(record: dict[str, Any]) -> None:
        records.append(record)
        emit(record)

    compute_dtype, dtype_name = _compute_dtype(cfg, ctx.device_type)
    name = device_name(ctx.device)
    peak = peak_throughput(ctx.device_type, name, dtype_name, cfg.peak_tflops)
    keep({"record": "config", **cfg.to_dict(), "dtype": dtype_name})
    keep(
        {
            "record": "device",
            "type": ctx.device_type,
            "name": name,
            "world_size": ctx.world_size,
            "memory_bytes": _device_memory_bytes(ctx),
            "peak_tflops": peak.tflops,
            "peak_source": peak.source,
            "compute_dtype": dtype_name,
            "threads": torch.get_num_threads() if ctx.device_type == "cpu" else None,
        }
    )
    keep(
        {
            "record": "versions",
            "fluxgrpo": __version__,
            "python": platform.python_version(),
            **package_versions(),
            "accelerator": accelerator_stack(ctx.device_type),
        }
    )

    log(f"building {cfg.model} on {ctx.device_type} ({name})")
    bench_model = build_bench_model(cfg, ctx, compute_dtype)
    if ctx.distributed:
        import warnings

        from fluxgrpo.grpo.trainer import shard_transformer

        # As in the trainer: FLUX blocks return views, which FSDP2 warns about on every forward; nothing here
        # modifies a block output in place, so the warning is noise.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        shard_transformer(bench_model.transformer, cpu_offload=False, compute_dtype=compute_dtype)
    if cfg.compile:
        bench_model.transformer.compile()
    shape = bench_model.shape
    keep(
        {
            "record": "model",
            "name": cfg.model,
            "double_blocks": shape.double_blocks,
            "single_blocks": shape.single_blocks,
            "hidden": shape.hidden,
            "head_dim": shape.head_dim,
            "transformer_parameters": sum(p.numel() for p in bench_model.transformer.parameters()),
            "vae_parameters": sum(p.numel() for p in bench_model.vae.parameters()),
            "reward": bench_model.reward_name,
            "reward_parameters": bench_model.reward_parameters,
            "text_tokens": cfg.text_tokens,
            "trajectories": cfg.num_trajectories,
            "steps": cfg.steps,
            "train_timesteps": cfg.num_train_timesteps,
            "compile": cfg.compile,
            "forward_flops_per_sample": {
                f"{h}x{w}": transformer_forward_flops(shape, latent_shape(h, w).num_tokens, cfg.text_tokens)
                for h, w in cfg.resolved_resolutions()
            },
        }
    )
    sweep = _Sweep(cfg, ctx, bench_model, compute_dtype, peak.tflops, keep, log)
    for height, width in cfg.resolved_resolutions():
        resolution = f"{height}x{width}"
        inputs = _make_inputs(cfg, bench_model, height, width, ctx.device, ctx.rank)
        start = len(sweep.figures)
        rollout = sweep.rollout(inputs, resolution)
        if rollout is not None:
            sweep.decode_and_reward(rollout, inputs, resolution)
            sweep.update(rollout, inputs, resolution)
        del rollout, inputs
        keep(summarize(sweep.figures[start:], resolution))
    return records


def run_bench(
    cfg: BenchConfig,
    emit: Callable[[dict[str, Any]], None] = lambda record: None,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
) -> list[dict[str, Any]]:
    """Run the benchmark: in this process for ``--dies 1``, else on ``--dies`` torchrun workers (rank 0 reports).

    Returns the records (see ``bench_on_rank``); ``emit`` gets them as they come (after the workers end when
    ``--dies`` > 1), ``log`` gets progress lines.
    """
    cfg.validate()
    if cfg.dies == 1:
        from fluxgrpo.runtime import dist as rt_dist

        ctx = rt_dist.init_distributed(cfg.device)
        try:
            return bench_on_rank(cfg, ctx, emit, log)
        finally:
            rt_dist.teardown()
    return _launch_workers(cfg, emit, log)


WORKER_MODULE = "fluxgrpo.bench"


def _launch_workers(
    cfg: BenchConfig, emit: Callable[[dict[str, Any]], None], log: Callable[[str], None]
) -> list[dict[str, Any]]:
    import json
    import tempfile

    from fluxgrpo.runtime import device as rt_device
    from fluxgrpo.runtime.launch import (
        LaunchSpec,
        build_torchrun_argv,
        run_torchrun,
        worker_env_defaults,
    )

    device_type = rt_device.resolve_device_type(cfg.device)
    if device_type != "cpu" and cfg.dies > rt_device.device_count(device_type):
        raise UsageError(
            f"--dies {cfg.dies} but only {rt_device.device_count(device_type)} {device_type} device(s) are visible"
        )
    with tempfile.TemporaryDirectory(prefix="fluxgrpo-bench-") as folder:
        config_path, records_path = Path(folder, "config.json"), Path(folder, "records.jsonl")
        config_path.write_text(json.dumps({**asdict(cfg), "resolutions": [f"{h}x{w}" for h, w in cfg.resolutions]}))
        argv = build_torchrun_argv(
            WORKER_MODULE,
            ["--config", str(config_path), "--records", str(records_path)],
            LaunchSpec(nproc_per_node=cfg.dies),
            python=sys.executable,
        )
        log("launching: " + " ".join(argv))
        run_torchrun(argv, env=worker_env_defaults(device_type))
        records = [json.loads(line) for line in records_path.read_text().splitlines() if line.strip()]
    for record in records:
        emit(record)
    return records


def _worker(config_path: Path, records_path: Path) -> None:
    import json

    import torch

    from fluxgrpo.runtime import dist as rt_dist

    cfg = BenchConfig.from_dict(json.loads(config_path.read_text())).validate()
    ctx = rt_dist.init_distributed(cfg.device)
    try:
        if ctx.device_type == "cpu" and ctx.distributed:
            torch.set_num_threads(1)  # the workers share the host's cores
        with records_path.open("a") as out:

            def emit(record: dict[str, Any]) -> None:
                if ctx.is_main:
                    out.write(json.dumps(record, default=str) + "\n")
                    out.flush()

            bench_on_rank(cfg, ctx, emit, lambda line: rt_dist.rank0_print(ctx, line))
    finally:
        rt_dist.teardown()


def main(argv: list[str] | None = None) -> None:
    """Worker entry point under torchrun: ``python -m fluxgrpo.bench --config CONFIG.json --records OUT.jsonl``."""
    import argparse

    from fluxgrpo.runtime.launch import worker_errors

    parser = argparse.ArgumentParser(description="fluxgrpo bench worker (started by `fluxgrpo bench --dies N`)")
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--records", required=True, type=Path)
    args = parser.parse_args(argv)
    worker_errors(_worker)(args.config, args.records)


if __name__ == "__main__":
    main()
