"""``fluxgrpo export``: a checkpoint's weights as a standalone diffusers transformer (or a LoRA adapter file).

A full fine-tuning checkpoint already holds a diffusers transformer (``transformer/``, or ``transformer_ema/``): it
is copied. A LoRA checkpoint holds the adapter only (``lora/pytorch_lora_weights.safetensors``): without ``merge``
the adapter file is copied (``FluxPipeline.load_lora_weights`` takes it); with ``merge`` it is loaded into the base
transformer with diffusers' ``load_lora_adapter``, fused (W + α/r·B·A, in float32) and written as a plain
``FluxTransformer2DModel`` folder that loads without peft.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fluxgrpo.errors import FluxgrpoError


@dataclass(frozen=True)
class ExportResult:
    checkpoint: str
    out: str
    kind: str  # "transformer" (a diffusers folder) or "lora" (an adapter file)
    merged: bool  # a LoRA adapter was fused into the base weights
    base_model: str | None  # the base model a LoRA was merged into

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def trained_from(checkpoint: Path) -> str | None:
    """The ``--model`` the run was trained from, as its checkpoint recorded it."""
    from fluxgrpo.checkpoint import STATE_DIR, TRAINER_STATE_FILE

    try:
        return json.loads((checkpoint / STATE_DIR / TRAINER_STATE_FILE).read_text())["config"]["model"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def export_checkpoint(
    checkpoint: str | Path, out: str | Path, *, merge: bool, ema: bool = False, model: str | None = None
) -> ExportResult:
    """Write ``checkpoint``'s (EMA) weights to ``out`` (see the module docstring).

    Raises:
        FluxgrpoError: no complete checkpoint; ``out`` exists and is not empty; the base model is missing.
    """
    from fluxgrpo.checkpoint import EMA_LORA_DIR, EMA_TRANSFORMER_DIR, LORA_DIR, TRANSFORMER_DIR, read_checkpoint_info
    from fluxgrpo.lora import LORA_WEIGHTS_NAME
    from fluxgrpo.sample import resolve_checkpoint

    found = resolve_checkpoint(checkpoint, ema)
    destination = Path(out)
    if destination.exists() and (not destination.is_dir() or any(destination.iterdir())):
        raise FluxgrpoError(f"--out {destination} exists and is not an empty folder: pass a new folder")
    if not read_checkpoint_info(found).get("lora"):
        shutil.copytree(found / (EMA_TRANSFORMER_DIR if ema else TRANSFORMER_DIR), destination, dirs_exist_ok=True)
        return ExportResult(str(found), str(destination), "transformer", merged=False, base_model=None)
    adapter = found / (EMA_LORA_DIR if ema else LORA_DIR) / LORA_WEIGHTS_NAME
    if not merge:
        destination.mkdir(parents=True, exist_ok=True)
        shutil.copy2(adapter, destination / LORA_WEIGHTS_NAME)
        return ExportResult(str(found), str(destination), "lora", merged=False, base_model=None)
    base = model or trained_from(found)
    if base is None:
        raise FluxgrpoError(
            f"{found} does not record its base model: pass the FLUX folder it was trained from with --model"
        )
    merge_lora(base, adapter, destination)
    return ExportResult(str(found), str(destination), "transformer", merged=True, base_model=str(base))


def merge_lora(model: str | Path, adapter: Path, destination: Path) -> None:
    """Base transformer (float32) + adapter, fused, saved as a diffusers folder without any LoRA layer."""
    import torch

    from fluxgrpo.models.flux import load_transformer

    transformer = load_transformer(model, dtype=torch.float32)
    transformer.load_lora_adapter(str(adapter.parent), weight_name=adapter.name, prefix="transformer")
    transformer.fuse_lora(lora_scale=1.0)
    transformer.unload_lora()
    transformer.save_pretrained(destination)
