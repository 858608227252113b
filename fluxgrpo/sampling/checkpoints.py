"""Which complete checkpoint ``--checkpoint`` names, and that its transformer fits the base model."""

from __future__ import annotations

import json
from pathlib import Path

from fluxgrpo.checkpoint.layout import (
    CHECKPOINT_PREFIX,
    EMA_LORA_DIR,
    EMA_TRANSFORMER_DIR,
    LORA_DIR,
    TRANSFORMER_DIR,
    is_usable_checkpoint,
    latest_checkpoint,
    read_checkpoint_info,
)
from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.lora import LORA_WEIGHTS_NAME, check_adapter_file
from fluxgrpo.models.flux import read_transformer_config
from fluxgrpo.weights.config_guard import folder_config_problems
from fluxgrpo.weights.integrity import folder_safetensors_problems


def resolve_checkpoint(path: str | Path, ema: bool) -> Path:
    """The complete checkpoint ``--checkpoint`` names: the folder itself, or a training output folder's latest.

    Raises:
        FluxgrpoError: no complete checkpoint there, or ``ema`` but the checkpoint holds no EMA weights.
    """

    given = Path(path).expanduser()
    if is_usable_checkpoint(given):
        found = given
    elif given.is_dir() and (latest := latest_checkpoint(given)) is not None:
        found = latest
    else:
        if not given.exists():
            why = "it does not exist"
        elif given.name.startswith(CHECKPOINT_PREFIX):
            why = "it is not a complete checkpoint (an interrupted save has no COMPLETE marker)"
        else:
            why = f"it holds no complete {CHECKPOINT_PREFIX}<k> folder"
        raise FluxgrpoError(
            f"--checkpoint {given}: {why}; pass a checkpoint-<k> folder, a run's best/ (--keep-best) or the training "
            "--output-dir (its latest complete checkpoint is used), or drop --checkpoint to sample the base model"
        )
    info = read_checkpoint_info(found)
    lora = bool(info.get("lora"))
    ema_dir = EMA_LORA_DIR if lora else EMA_TRANSFORMER_DIR
    if ema and (not info.get("has_ema", False) or not (found / ema_dir).is_dir()):
        raise FluxgrpoError(
            f"--ema: {found} has no EMA weights ({ema_dir}/; the run was trained without --use-ema): "
            "drop --ema to sample its trained weights"
        )
    if lora:
        weights = found / (EMA_LORA_DIR if ema else LORA_DIR) / LORA_WEIGHTS_NAME
        if not weights.is_file():
            raise FluxgrpoError(f"{weights} is missing: the checkpoint is damaged; pass another --checkpoint")

        check_adapter_file(weights, "the checkpoint is damaged; pass another --checkpoint")
        return found
    weights = found / (EMA_TRANSFORMER_DIR if ema else TRANSFORMER_DIR)
    if not (weights / "config.json").is_file():
        raise FluxgrpoError(f"{weights}/config.json is missing: the checkpoint is damaged; pass another --checkpoint")

    damaged = folder_config_problems(weights) + folder_safetensors_problems(weights)
    if damaged:
        raise FluxgrpoError(f"the checkpoint is damaged: {damaged[0]}; pass another --checkpoint")
    return found


# Transformer sizes that must agree for a checkpoint to run in the base model's pipeline.
_SHAPE_KEYS = (
    "in_channels",
    "joint_attention_dim",
    "pooled_projection_dim",
    "num_layers",
    "num_single_layers",
    "num_attention_heads",
    "attention_head_dim",
)


def check_checkpoint_fits_model(transformer_dir: Path, model: str | Path) -> None:
    """Raise FluxgrpoError when the checkpoint's transformer was not trained from a model shaped like ``model``."""

    base = read_transformer_config(model)
    try:
        trained = json.loads((transformer_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise FluxgrpoError(f"cannot read {transformer_dir}/config.json ({exc}): pass another --checkpoint") from None
    differ = [key for key in _SHAPE_KEYS if base.get(key) != trained.get(key)]
    if differ:
        key = differ[0]
        raise FluxgrpoError(
            f"{transformer_dir} was trained from another model than {model} ({key} {trained.get(key)} vs "
            f"{base.get(key)}): pass the --model the checkpoint was trained from"
        )
