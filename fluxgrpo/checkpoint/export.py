"""The diffusers-format export a checkpoint holds beside its resume state: the transformer (or a LoRA run's
adapter) as ``from_pretrained`` / ``load_lora_weights`` read it."""

from __future__ import annotations

import errno
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from diffusers.utils import CONFIG_NAME, SAFE_WEIGHTS_INDEX_NAME, SAFETENSORS_WEIGHTS_NAME
from huggingface_hub import split_torch_state_dict_into_shards
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule

from fluxgrpo.checkpoint.layout import (
    EMA_LORA_DIR,
    EMA_TRANSFORMER_DIR,
    LORA_DIR,
    TRANSFORMER_DIR,
    fsync_path,
    io_error,
    write_durably,
)
from fluxgrpo.lora import adapter_metadata, is_lora_model, write_lora_file
from fluxgrpo.paths import give_default_mode
from fluxgrpo.runtime import dist as rt_dist
from fluxgrpo.runtime.dist import DistContext

DEFAULT_MAX_SHARD_SIZE = "10GB"


def _tensors(state: Mapping[str, object]) -> dict[str, torch.Tensor]:
    """A model's state dict, which holds tensors only (DCP types its values more widely): checked, not assumed."""
    tensors = {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}
    if len(tensors) != len(state):
        other = next(name for name in state if name not in tensors)
        raise TypeError(f"the model's state dict holds a {type(state[other]).__name__} at {other}, not a tensor")
    return tensors


def export_model(
    directory: Path, ctx: DistContext, model: torch.nn.Module, export_dtype: torch.dtype, max_shard_size: int | str
) -> None:

    # A collective: each rank contributes its shards; with cpu_offload only rank 0 receives the full tensors.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ctx.is_main:
        write_diffusers_folder(directory, diffusers_config(model), _tensors(full), export_dtype, max_shard_size)
    del full


def export_lora(directory: Path, ctx: DistContext, model: torch.nn.Module) -> None:

    # A collective, like export_model, for the adapters only.
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    adapters = get_model_state_dict(model, options=options)
    if ctx.is_main:
        write_lora_file(directory, _tensors(adapters), adapter_metadata(model))


def diffusers_config(model: torch.nn.Module) -> dict[str, Any]:
    """The model's config as diffusers' ``save_config`` writes it, naming the diffusers class.

    ``fully_shard`` swaps the instance's class for a generated ``FSDP<Name>`` subclass, and ``torch.compile``
    wraps the module; ``_class_name`` must still say ``FluxTransformer2DModel`` for pipelines to load it.
    """

    base = getattr(model, "_orig_mod", model)
    config = json.loads(base.to_json_string())  # type: ignore[operator]  # a peft/diffusers method reached through nn.Module.__getattr__
    config["_class_name"] = next(k for k in type(base).__mro__ if not issubclass(k, FSDPModule)).__name__
    return config


def write_diffusers_folder(
    directory: Path,
    config: dict[str, Any],
    state_dict: dict[str, torch.Tensor],
    export_dtype: torch.dtype,
    max_shard_size: int | str,
) -> None:
    """config.json + safetensors shards named and indexed the way diffusers' ``save_pretrained`` does."""

    def dtype_of(tensor: torch.Tensor) -> torch.dtype:
        return export_dtype if tensor.is_floating_point() else tensor.dtype

    directory.mkdir(parents=True, exist_ok=True)
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    write_durably(directory / CONFIG_NAME, lambda f: f.write(text.encode()))

    # Sized with meta stand-ins in the export dtype, so shards stay under the limit after the cast and no
    # second full copy of the weights is ever held: each shard is cast, written and dropped in turn.
    sizing = {name: torch.empty(t.shape, dtype=dtype_of(t), device="meta") for name, t in state_dict.items()}
    pattern = SAFETENSORS_WEIGHTS_NAME.replace(".safetensors", "{suffix}.safetensors")
    split = split_torch_state_dict_into_shards(sizing, filename_pattern=pattern, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        shard = {name: state_dict[name].to(dtype_of(state_dict[name])).contiguous() for name in names}
        try:
            safetensors.torch.save_file(shard, str(directory / filename), metadata={"format": "pt"})
        except Exception as exc:  # safetensors reports I/O errors as SafetensorError, the OS error only in its text
            full = "No space left on device" in str(exc) or "os error 28" in str(exc)
            cause = OSError(errno.ENOSPC if full else errno.EIO, str(exc), str(directory / filename))
            raise io_error(cause, "writing", directory) from None
        give_default_mode(directory / filename)
        fsync_path(directory / filename)
        del shard
    if split.is_sharded:
        index = {"metadata": dict(split.metadata), "weight_map": split.tensor_to_filename}
        index_text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        write_durably(directory / SAFE_WEIGHTS_INDEX_NAME, lambda f: f.write(index_text.encode()))


def write_exports(
    folder: Path,
    name: str,
    ctx: DistContext,
    model: torch.nn.Module,
    ema: Any,
    export_dtype: torch.dtype,
    max_shard_size: int | str,
) -> None:
    """The weights (and the EMA's, when there is one) in diffusers' format inside the checkpoint ``folder``:
    ``transformer/`` (``transformer_ema/``), or for a LoRA run the adapter in ``lora/`` (``lora_ema/``). A collective;
    rank 0 writes while the others wait on its heartbeat (``name`` says which checkpoint in their messages)."""
    lora = is_lora_model(model)
    if lora:
        export_lora(folder / LORA_DIR, ctx, model)
    else:
        export_model(folder / TRANSFORMER_DIR, ctx, model, export_dtype, max_shard_size)
    rt_dist.wait_for_rank0(ctx, f"writing {name}'s weights")
    if ema is not None:
        ema_weights = ema.full_state_dict()
        if ctx.is_main and lora:
            write_lora_file(folder / EMA_LORA_DIR, ema_weights, adapter_metadata(model))
        elif ctx.is_main:
            write_diffusers_folder(
                folder / EMA_TRANSFORMER_DIR, diffusers_config(model), ema_weights, export_dtype, max_shard_size
            )
        del ema_weights
        rt_dist.wait_for_rank0(ctx, f"writing {name}'s EMA weights")
