"""The phase bench's settings: ``BenchConfig``, built from the command line's strings and validated (every problem
listed, each naming the flag that fixes it). The GRPO constants it does not expose as flags (η, shift, guidance,
clip ranges, gradient clip, the trained-timestep fraction) are the trainer's defaults, read from ``TrainConfig``."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from fluxgrpo.config import SAMPLERS, TrainConfig
from fluxgrpo.errors import UsageError
from fluxgrpo.paths import DEFAULT_HPS_DIR, HPS_DIR_HELP
from fluxgrpo.runtime.adapt import ATTENTION_BACKENDS
from fluxgrpo.runtime.device import DEVICE_TYPES

TINY_MODEL = "tiny"
SHAPED_MODEL = "flux-dev-shaped"
CHECKPOINTING_CHOICES = ("both", "on", "off")
DTYPE_CHOICES = ("bf16", "fp32")
REWARD_CHOICES = ("auto", "tiny-clip", "vit-h-14", "brightness", "hpsv2")

# DanceGRPO's recipe as the trainer defaults to it: the sampling and update constants change no cost, so the bench
# takes them from here rather than from flags.
TRAINING_DEFAULTS = TrainConfig()


# --------------------------------------------------------------------------------------------- configuration


def _flag(
    default: Any, help: str, *, typed: tuple[Any, Any] | None = None, name: str | None = None, flag: str | None = None
) -> Any:
    """A ``BenchConfig`` field that is a `fluxgrpo bench` flag. ``typed`` = (the flag's type, its default) when the
    command line gives a string that ``build_bench_config`` parses; ``name``/``flag``: the command's parameter and
    flag when not the field's own."""
    return field(default=default, metadata={"help": help, "typed": typed, "name": name, "flag": flag})


@dataclass(frozen=True)
class BenchConfig:
    """What to measure. Build it with ``build_bench_config`` (parses and validates the flags' strings)."""

    # Each field is one `fluxgrpo bench` flag (``cli/bench.py`` generates them from here): its help, and for a field
    # parsed from a string, the flag's name, type and default as typed.
    model: str = _flag(
        TINY_MODEL,
        "tiny, flux-dev-shaped (FLUX.1-dev's architecture, random weights, nothing downloaded), or a diffusers FLUX folder.",
    )
    blocks: tuple[int, int] | None = _flag(  # (double, single); None: the model's own (FLUX.1-dev: 19, 38)
        None, "D,S double and single blocks (FLUX.1-dev: 19,38); fewer to fit one device.", typed=(str | None, None)
    )
    resolutions: tuple[tuple[int, int], ...] = _flag(  # (height, width) each; (): 64² for tiny, 720² otherwise
        (),
        "Image sizes to measure in turn: 512,720 (squares) or 720x1280 (default: 64 for tiny, else 720).",
        typed=(str | None, None),
        name="resolution",
    )
    steps: int = _flag(16, "Sampling steps N per trajectory.")
    sampler: str = _flag(
        "dance",
        "The SDE step the rollout samples with and the update scores with, as `fluxgrpo train --sampler`: "
        f"{', '.join(SAMPLERS)} (at train's default --eta).",
    )
    rollout_batch_sizes: tuple[int, ...] = _flag(
        (1, 2, 4, 8), "Trajectories per forward to compare (rollout, decode, reward).", typed=(str, "1,2,4,8")
    )
    micro_batch_sizes: tuple[int, ...] = _flag(
        (1, 2), "Training micro-batch sizes to compare (update).", typed=(str, "1,2")
    )
    activation_checkpointing: str = _flag("both", "Update with checkpointing: both, on or off.")
    trajectories: int | None = _flag(  # B; None: lcm of every batch size
        None, "Trajectories B per iteration (default: the least common multiple of the batch sizes)."
    )
    train_timesteps: int | None = _flag(  # T per trajectory; None: max(1, int((N−1)·0.6))
        None, "Trained timesteps T per trajectory (default: int((N-1)·0.6), at least 1)."
    )
    text_tokens: int = _flag(512, "T5 tokens of the random conditioning.")  # S
    dies: int = _flag(1, "Devices; more than 1 runs torchrun workers with the transformer sharded as in training.")
    device: str = _flag("auto", "auto, or a device type (see `fluxgrpo env-check`).")
    dtype: str | None = _flag(  # None: the runtime's compute dtype for the device
        None, "Compute dtype bf16 or fp32, weights staying fp32 (default: bf16 on accelerators, fp32 on cpu)."
    )
    attention: str = _flag("sdpa", "Attention kernel, as `fluxgrpo train --attention`.")
    peak_tflops: float | None = _flag(None, "Dense peak TFLOPS of one device for MFU (default: from the device table).")
    repeats: int = _flag(
        3,
        "Timed runs per configuration (the median is shown); with --algorithms, training runs per algorithm, "
        "in interleaved rounds (median and min-max shown).",
    )
    warmup: int = _flag(1, "Untimed runs before them.")
    reward: str = _flag(
        "auto", "auto, tiny-clip, vit-h-14 (random weights), brightness, or hpsv2 (weights from --hps-dir)."
    )
    hps_dir: str = _flag(DEFAULT_HPS_DIR, HPS_DIR_HELP)
    compile: bool = _flag(
        False,
        "First measure torch.compile side by side: eager, regional (as train --compile) and whole-model, one "
        "iteration at the largest batch sizes: compile seconds, speed-up, break-even; the phases then run "
        "regionally compiled.",
        name="compile_model",
        flag="--compile",
    )
    seed: int = _flag(0, "Seed for the weights (and the phase bench's conditioning and noise).")

    @property
    def num_trajectories(self) -> int:
        if self.trajectories is not None:
            return self.trajectories
        return math.lcm(*self.rollout_batch_sizes, *self.micro_batch_sizes)

    @property
    def num_train_timesteps(self) -> int:
        if self.train_timesteps is not None:
            return self.train_timesteps
        return max(1, dataclasses.replace(TRAINING_DEFAULTS, sampling_steps=self.steps).train_timesteps)

    @property
    def checkpointing_modes(self) -> tuple[bool, ...]:
        return {"both": (False, True), "on": (True,), "off": (False,)}[self.activation_checkpointing]

    def resolved_resolutions(self) -> tuple[tuple[int, int], ...]:
        if self.resolutions:
            return self.resolutions
        return ((64, 64),) if self.model == TINY_MODEL else ((720, 720),)

    def problems(self) -> list[str]:
        """Every inconsistency, each naming the flag that fixes it."""

        out: list[str] = []
        if self.blocks is not None and (min(self.blocks) < 0 or sum(self.blocks) < 1):
            out.append(f"--blocks {self.blocks[0]},{self.blocks[1]}: counts cannot be negative and need one block")
        for height, width in self.resolutions:
            if height <= 0 or width <= 0 or height % 16 or width % 16:
                out.append(f"--resolution {height}x{width}: both sides must be positive multiples of 16")
        if self.steps < 2:
            out.append(f"--steps {self.steps}: at least 2 (the last transition is never trained)")
        if self.sampler not in SAMPLERS:
            out.append(f"--sampler {self.sampler!r}: use one of {', '.join(SAMPLERS)}")
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
