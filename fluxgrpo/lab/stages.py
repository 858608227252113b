"""The builder's stages on disk: each stage's output, so that a build longer than one sitting resumes where it stopped.

``python -m fluxgrpo.lab.build --out DIR`` writes ``DIR/stages/<stage>/`` after each long stage (the VAE; the flow
transformer with the text encoders trained beside it) with a ``STAGE.json`` saying the plan it was built under and its
record for ``build.json``. ``--resume`` reads a stage back instead of training it again when that file names the same
plan (every field a stage's output depends on); a stage from another plan is trained again. Each stage seeds itself,
and weights are written in float32 safetensors, so a resumed build writes the same files as one that never stopped.
``--stop-after STAGE`` ends a build after that stage: a long build in several sittings.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fluxgrpo.errors import UsageError
from fluxgrpo.lab.plan import BuildPlan

if TYPE_CHECKING:
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel

STAGES = ("vae", "transformer", "distillation", "hps")
STAGES_DIR = "stages"
STAGE_RECORD = "STAGE.json"
# Plan fields no stage's weights depend on: how many threads ran it, and what only the last stage (the HPS) reads.
_NOT_A_STAGE_INPUT = ("threads",)


def stage_dir(out: Path, stage: str) -> Path:
    return Path(out) / STAGES_DIR / stage


def plan_key(plan: BuildPlan) -> dict[str, Any]:
    """The plan as a stage records it: every field but those no weights depend on."""
    return {k: v for k, v in asdict(plan).items() if k not in _NOT_A_STAGE_INPUT}


def finished(out: Path, stage: str, plan: BuildPlan) -> dict[str, Any] | None:
    """The record of ``stage`` in ``out`` when it was built under ``plan``; None when absent, unreadable or built
    under another plan (then it is built again)."""
    path = stage_dir(out, stage) / STAGE_RECORD
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(document, dict) or document.get("plan") != plan_key(plan):
        return None
    record = document.get("record")
    return record if isinstance(record, dict) else None


def mark_finished(out: Path, stage: str, plan: BuildPlan, record: dict[str, Any]) -> None:
    """Write ``STAGE.json`` last: a stage folder without it is unfinished and is built again."""
    folder = stage_dir(out, stage)
    folder.mkdir(parents=True, exist_ok=True)
    temporary = folder / f".{STAGE_RECORD}.tmp"
    temporary.write_text(json.dumps({"plan": plan_key(plan), "record": record}, indent=2) + "\n")
    temporary.replace(folder / STAGE_RECORD)


def forget(out: Path, stage: str) -> None:
    """Drop a stage's record before it is rebuilt, so a crash mid-write never leaves a stale one behind."""
    (stage_dir(out, stage) / STAGE_RECORD).unlink(missing_ok=True)


def save_vae(out: Path, vae: AutoencoderKL) -> None:
    vae.save_pretrained(stage_dir(out, "vae") / "vae")


def load_vae(out: Path) -> AutoencoderKL:
    from diffusers import AutoencoderKL

    return AutoencoderKL.from_pretrained(stage_dir(out, "vae") / "vae").eval().requires_grad_(False)


def save_transformer_stage(
    out: Path, transformer: FluxTransformer2DModel, clip: CLIPTextModel, t5: T5EncoderModel
) -> None:
    folder = stage_dir(out, "transformer")
    transformer.save_pretrained(folder / "transformer")
    clip.save_pretrained(folder / "text_encoder")
    t5.save_pretrained(folder / "text_encoder_2")


def load_transformer_stage(out: Path) -> tuple[FluxTransformer2DModel, CLIPTextModel, T5EncoderModel]:
    from diffusers import FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel

    folder = stage_dir(out, "transformer")
    transformer = FluxTransformer2DModel.from_pretrained(folder / "transformer")
    clip = CLIPTextModel.from_pretrained(folder / "text_encoder")
    t5 = T5EncoderModel.from_pretrained(folder / "text_encoder_2")
    return (
        transformer.eval().requires_grad_(False),
        clip.eval().requires_grad_(False),
        t5.eval().requires_grad_(False),
    )


def check_stop_after(stage: str | None) -> None:
    if stage is not None and stage not in STAGES:
        raise UsageError(f"--stop-after {stage}: the stages are {', '.join(STAGES)}")
