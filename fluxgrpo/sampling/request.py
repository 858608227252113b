"""What a sampling job is: its settings, the validated request every rank runs, and each image's seed."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fluxgrpo.checkpoint.layout import EMA_LORA_DIR, EMA_TRANSFORMER_DIR, LORA_DIR, TRANSFORMER_DIR
from fluxgrpo.errors import UsageError
from fluxgrpo.grpo.latents import image_size_problem
from fluxgrpo.lora import LORA_WEIGHTS_NAME
from fluxgrpo.runtime.adapt import ATTENTION_BACKENDS

# --------------------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class SampleSettings:
    """How images are generated; everything except ``batch_size`` changes the pixels."""

    height: int = 720  # pixels, a multiple of 16 (the training recipe's 720)
    width: int = 720
    steps: int = 28  # denoising steps of the pipeline's Euler flow-matching sampler
    guidance: float = 3.5  # FLUX-dev's distilled guidance value
    seed: int = 0  # S in image_seed(S, i, j)
    images_per_prompt: int = 1  # K
    batch_size: int = 1  # images per transformer forward (the noise and prompts do not depend on it)
    max_sequence_length: int = 512  # T5 tokens per prompt
    attention: str = "sdpa"
    compile: bool = False  # FLUX's repeated blocks compiled regionally (models/compile.py); pixels equal to rounding

    def validate(self) -> SampleSettings:
        """Raise UsageError naming the flag for the first bad value."""

        size_problem = image_size_problem(self.height, self.width)
        if size_problem is not None:
            raise UsageError(f"{size_problem}: set --height and --width to multiples of 16, e.g. 720 or 1024")
        for flag, value in (
            ("--steps", self.steps),
            ("--images-per-prompt", self.images_per_prompt),
            ("--batch-size", self.batch_size),
            ("--max-sequence-length", self.max_sequence_length),
        ):
            if value < 1:
                raise UsageError(f"{flag} must be at least 1 (got {value})")
        if self.seed < 0:
            raise UsageError(f"--seed must be >= 0 (got {self.seed})")
        if self.attention not in ATTENTION_BACKENDS:
            raise UsageError(f"--attention {self.attention!r}: use one of {', '.join(ATTENTION_BACKENDS)}")
        return self


@dataclass(frozen=True)
class SampleRequest:
    """A validated sampling job: what ``sample`` runs on every rank (JSON-serialisable for the workers)."""

    model: str  # FLUX diffusers folder
    prompts: list[str]  # prompt i is row i of the grid
    out_dir: str
    checkpoint: str | None  # a complete checkpoint-{k} folder, or None for the base model
    ema: bool  # load checkpoint/transformer_ema instead of checkpoint/transformer
    settings: SampleSettings
    device: str = "auto"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SampleRequest:
        return cls(**{**data, "settings": SampleSettings(**data["settings"])})

    @property
    def transformer_dir(self) -> Path | None:
        """The diffusers folder of the transformer to sample with; None means the base model's own (also for a
        LoRA checkpoint, whose adapter ``lora_file`` is loaded into it)."""

        if self.checkpoint is None or self.lora_file is not None:
            return None
        return Path(self.checkpoint) / (EMA_TRANSFORMER_DIR if self.ema else TRANSFORMER_DIR)

    @property
    def lora_file(self) -> Path | None:
        """The checkpoint's adapter (``pytorch_lora_weights.safetensors``) for a LoRA run's checkpoint, else None."""

        if self.checkpoint is None:
            return None
        path = Path(self.checkpoint) / (EMA_LORA_DIR if self.ema else LORA_DIR) / LORA_WEIGHTS_NAME
        return path if path.is_file() else None


@dataclass(frozen=True)
class SampledImage:
    """One image of a run, as ``index.json`` lists it."""

    file: str  # name inside the output folder, <i:04d>_<j:02d>.png
    prompt: str
    prompt_index: int  # i
    image_index: int  # j
    seed: int  # image_seed(S, i, j)


def image_seed(seed: int, prompt_index: int, image_index: int) -> int:
    """The 63-bit generator seed of image ``image_index`` of prompt ``prompt_index`` in a run seeded ``seed``."""
    digest = hashlib.sha256(f"fluxgrpo-sample:{seed}:{prompt_index}:{image_index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


def image_filename(prompt_index: int, image_index: int) -> str:
    return f"{prompt_index:04d}_{image_index:02d}.png"
