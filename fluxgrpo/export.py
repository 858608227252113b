"""``fluxgrpo export``: a checkpoint's weights as a standalone diffusers transformer (or a LoRA adapter file).

A full fine-tuning checkpoint already holds a diffusers transformer (``transformer/``, or ``transformer_ema/``): it
is copied. A LoRA checkpoint holds the adapter only (``lora/pytorch_lora_weights.safetensors``): without ``merge``
the adapter file is copied (``FluxPipeline.load_lora_weights`` takes it); with ``merge`` it is loaded into the base
transformer with diffusers' ``load_lora_adapter``, fused (W + α/r·B·A, in float32) and written as a plain
``FluxTransformer2DModel`` folder that loads without peft.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from fluxgrpo.checkpoint.layout import (
    EMA_LORA_DIR,
    EMA_TRANSFORMER_DIR,
    LORA_DIR,
    STATE_DIR,
    TRAINER_STATE_FILE,
    TRANSFORMER_DIR,
    read_checkpoint_info,
)
from fluxgrpo.errors import FluxgrpoError, disk_full_error, os_error_reason
from fluxgrpo.lora import LORA_WEIGHTS_NAME, check_adapter_file
from fluxgrpo.models.flux import load_transformer
from fluxgrpo.safe_load import load_pretrained
from fluxgrpo.sampling.checkpoints import resolve_checkpoint


@dataclass(frozen=True)
class ExportResult:
    checkpoint: str
    out: str
    kind: str  # "transformer" (a diffusers folder) or "lora" (an adapter file)
    merged: bool  # a LoRA adapter was fused into the base weights
    base_model: str | None  # the base model a LoRA was merged into

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _tree_bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@contextlib.contextmanager
def _writing(destination: Path, need_bytes: int | None = None) -> Iterator[Path]:
    """Yield a staging folder beside ``destination`` to write the export into; it becomes ``destination`` only
    once complete, and a failed write (a full or read-only disk) leaves nothing behind: one line naming --out."""
    staging = destination.with_name(f".{destination.name}.export-{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir(parents=True)
        yield staging
        if destination.is_dir():
            destination.rmdir()  # checked empty before the export began
        staging.rename(destination)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        full = disk_full_error(exc, destination.parent, need_bytes)  # safetensors' errors are no OSError
        if full is not None:
            raise full from None
        if not isinstance(exc, OSError):
            raise
        reason = os_error_reason(exc)
        raise FluxgrpoError(
            f"cannot write the export to {destination} ({reason}): pass a writable --out (nothing was left there)"
        ) from None


def trained_from(checkpoint: Path) -> str | None:
    """The ``--model`` the run was trained from, as its checkpoint recorded it."""

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

    found = resolve_checkpoint(checkpoint, ema)
    destination = Path(out)
    if destination.exists() and (not destination.is_dir() or any(destination.iterdir())):
        raise FluxgrpoError(f"--out {destination} exists and is not an empty folder: pass a new folder")
    if not read_checkpoint_info(found).get("lora"):
        source = found / (EMA_TRANSFORMER_DIR if ema else TRANSFORMER_DIR)
        with _writing(destination, _tree_bytes(source)) as staging:
            shutil.copytree(source, staging, dirs_exist_ok=True)
        return ExportResult(str(found), str(destination), "transformer", merged=False, base_model=None)
    adapter = found / (EMA_LORA_DIR if ema else LORA_DIR) / LORA_WEIGHTS_NAME
    if not merge:
        with _writing(destination, _tree_bytes(adapter)) as staging:
            shutil.copy2(adapter, staging / LORA_WEIGHTS_NAME)
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

    fix = "the checkpoint is damaged: pass another --checkpoint"
    layers = check_adapter_file(adapter, fix)
    transformer = load_transformer(model, dtype=torch.float32)
    load_pretrained(
        lambda: transformer.load_lora_adapter(str(adapter.parent), weight_name=adapter.name, prefix="transformer"),
        "the LoRA adapter",
        adapter,
        fix,
    )
    loaded = sum(1 for name, _ in transformer.named_modules() if name.endswith(".lora_A"))
    if loaded != layers:
        raise FluxgrpoError(
            f"{adapter} adapts {layers} layers but {loaded} of them exist in {model}'s transformer (renamed keys, or "
            "another base model): pass the --model it was trained from, or another --checkpoint"
        )
    transformer.fuse_lora(lora_scale=1.0)
    transformer.unload_lora()
    need = sum(t.numel() * t.element_size() for t in transformer.state_dict().values())
    with _writing(destination, need) as staging:
        transformer.save_pretrained(staging)
