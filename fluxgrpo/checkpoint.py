"""Training checkpoints: an exact resume, written atomically, with a diffusers-format export beside it.

``output_dir/checkpoint-{k}/`` holds the state *after* k iterations (DanceGRPO saves at the start of step
k, one update early, and keeps no optimizer state; see dancegrpo-spec.md §7):

    transformer/        config.json + diffusion_pytorch_model[-0000i-of-0000n].safetensors (+ index json):
                        ``FluxTransformer2DModel.from_pretrained`` loads it; ``sample`` uses it.
    transformer_ema/    the same, with the EMA weights (only when an EMA is kept).
    lora/, lora_ema/    instead of the two above for a LoRA run (--lora-rank): pytorch_lora_weights.safetensors,
                        the adapter in diffusers' format (``FluxPipeline.load_lora_weights`` loads it). The resume
                        state then holds the adapters and their optimizer state only; the frozen base comes from
                        the base model's files.
    state/              torch.distributed.checkpoint (DCP) files for {"model", "optim", "lr_scheduler", "ema"},
                        trainer_state.json, rng_rank{r}.pt for every rank (tensors and plain values only), and
                        checksums_rank{r}.json: the sha256 of each file rank r wrote, verified on resume.
    COMPLETE            written last; JSON facts about the checkpoint (iteration, world size, what it holds).

Atomicity: everything is written into ``checkpoint-{k}.tmp/``; only when every rank has finished does rank 0
write ``COMPLETE`` and rename the folder. A folder with a ``.tmp`` (or ``.trash``) suffix, or without
``COMPLETE``, is never taken for a checkpoint, so an interrupted save (Ctrl-C, a killed worker, a full disk)
never looks complete; its leftovers are removed by the next save. Deletions (keep-last pruning, replacing a
checkpoint of the same iteration) rename the folder to ``.trash`` first, so a half-deleted checkpoint is
never taken for a complete one either.

With more than one process ``output_dir`` must be on a filesystem every rank sees (DCP requires it anyway).

Loading runs no code from the folder: the RNG files are read with ``torch.load(weights_only=True)`` and the DCP
files through ``fluxgrpo.safe_load`` (see there), so a checkpoint from someone else is data, not a program.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from fluxgrpo import run_folder
from fluxgrpo.errors import FluxgrpoError, UsageError
from fluxgrpo.lora import adapter_metadata, is_lora_model, write_lora_file
from fluxgrpo.paths import give_default_mode
from fluxgrpo.runtime import device as rt_device
from fluxgrpo.runtime import dist as rt_dist
from fluxgrpo.runtime.dist import DistContext

CHECKPOINT_PREFIX = "checkpoint-"
TMP_SUFFIX = ".tmp"
TRASH_SUFFIX = ".trash"
COMPLETE_MARKER = "COMPLETE"
TRANSFORMER_DIR = "transformer"
EMA_TRANSFORMER_DIR = "transformer_ema"
LORA_DIR = "lora"
EMA_LORA_DIR = "lora_ema"
BEST_DIR = run_folder.BEST_DIR  # --keep-best: the best evaluated checkpoint, never rotated by --keep-last
BEST_FILE = "BEST.json"  # in best/: which checkpoint it is and why (iteration, metric, value)
STATE_DIR = "state"
TRAINER_STATE_FILE = "trainer_state.json"
# 2: rng_rank{r}.pt holds tensors and plain values (version 1 pickled numpy arrays, unreadable safely).
FORMAT_VERSION = 2
# diffusers' own default for save_pretrained: FLUX.1-dev's 47.6 GB fp32 transformer becomes 5 shards.
DEFAULT_MAX_SHARD_SIZE = "10GB"

_COMPLETE_NAME = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")
_LEFTOVER_NAME = re.compile(rf"^{CHECKPOINT_PREFIX}\d+({re.escape(TMP_SUFFIX)}|{re.escape(TRASH_SUFFIX)})$")


@dataclass
class LoadedState:
    """What ``load_checkpoint`` hands back after restoring the model, optimizer, scheduler, EMA and global RNGs."""

    trainer_state: dict[str, Any]  # the dict given to save_checkpoint (identical on every rank)
    rng_states: dict[str, Any]  # this rank's ``rng_states`` as given to save_checkpoint (caller-owned generators)
    iteration: int  # iterations completed when the checkpoint was written
    path: Path  # the checkpoint folder


# --------------------------------------------------------------------------------------------- discovery


def checkpoint_dir(output_dir: str | Path, iteration: int) -> Path:
    """Where the checkpoint of ``iteration`` lives once complete."""
    return Path(output_dir) / f"{CHECKPOINT_PREFIX}{iteration}"


def checkpoint_iteration(path: str | Path) -> int | None:
    """The iteration in a ``checkpoint-{k}`` folder name; None for any other name (``.tmp`` included)."""
    match = _COMPLETE_NAME.match(Path(path).name)
    return int(match.group(1)) if match else None


def is_complete_checkpoint(path: str | Path) -> bool:
    """True for a ``checkpoint-{k}`` folder whose save finished (it holds the ``COMPLETE`` marker)."""
    path = Path(path)
    return checkpoint_iteration(path) is not None and (path / COMPLETE_MARKER).is_file()


def is_best_checkpoint(path: str | Path) -> bool:
    """True for a complete ``best/`` folder (``--keep-best``): a copy of a complete checkpoint under another name."""
    path = Path(path)
    return path.name == BEST_DIR and (path / COMPLETE_MARKER).is_file() and (path / BEST_FILE).is_file()


def is_usable_checkpoint(path: str | Path) -> bool:
    """A complete ``checkpoint-{k}`` or ``best/``: what ``sample``, ``export`` and ``read_checkpoint_info`` take."""
    return is_complete_checkpoint(path) or is_best_checkpoint(path)


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """The complete checkpoints in ``output_dir``, oldest iteration first; [] when the folder does not exist."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and is_complete_checkpoint(p)]
    return sorted(found, key=lambda p: checkpoint_iteration(p) or 0)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest iteration, or None."""
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def read_checkpoint_info(path: str | Path) -> dict[str, Any]:
    """The facts in a complete checkpoint's ``COMPLETE`` marker (iteration, world_size, has_ema, ...).

    Raises:
        FluxgrpoError: ``path`` is not a complete checkpoint.
    """
    path = Path(path)
    if not is_usable_checkpoint(path):
        raise FluxgrpoError(_not_complete_message(path, path.parent))
    info = _read_json(path / COMPLETE_MARKER)
    if (
        not isinstance(info, dict)
        or not isinstance(info.get("iteration"), int)
        or not isinstance(info.get("world_size"), int)
        or info["world_size"] < 1
    ):
        raise FluxgrpoError(f"{path / COMPLETE_MARKER} is malformed (not the JSON fluxgrpo writes): {_DAMAGED_FIX}")
    if path.name == BEST_DIR:  # sample/export/--resume-from best/ never take a damaged best record silently
        _read_best_record(path)
    return info


def read_trainer_state(path: str | Path) -> dict[str, Any]:
    """The ``trainer_state`` a complete checkpoint was saved with (iteration, sampler positions, config).

    Raises:
        FluxgrpoError: the file is missing, truncated or not a JSON object.
    """
    from fluxgrpo.state_checks import check_trainer_state

    file = Path(path) / STATE_DIR / TRAINER_STATE_FILE
    info = read_checkpoint_info(path)
    state = check_trainer_state(_read_json(file), file, info["world_size"], _DAMAGED_FIX)
    if state["iteration"] != info["iteration"]:
        raise FluxgrpoError(
            f"{file} is malformed (it is the state after iteration {state['iteration']}, but {COMPLETE_MARKER} says "
            f"{info['iteration']}): {_DAMAGED_FIX}"
        )
    return state


# What to do about a checkpoint whose files were damaged after it was written.
_DAMAGED_FIX = "resume from another checkpoint with --resume-from, or start a new run from its exported transformer"


def _read_json(path: Path) -> Any:
    """A JSON file of a checkpoint; a missing, truncated or garbled one is one FluxgrpoError naming it."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FluxgrpoError(f"{path} is missing: {_DAMAGED_FIX}") from None
    except (OSError, ValueError) as exc:
        raise FluxgrpoError(f"{path} is damaged ({exc}): {_DAMAGED_FIX}") from None


def resolve_resume(output_dir: str | Path, resume: str | bool | None) -> Path | None:
    """The checkpoint ``--resume`` points at.

    - None / False: no resume (None).
    - True or ``"latest"`` (``--resume`` with no value): the latest complete checkpoint in ``output_dir``, or
      None when there is none yet, so the same command both starts a run and continues it after a preemption.
    - a path (or a folder name inside ``output_dir``, e.g. ``checkpoint-40``): that checkpoint.

    Raises:
        FluxgrpoError: the given folder is missing or not a complete checkpoint; the message lists the complete
            ones in ``output_dir``.
    """
    if resume is None or resume is False:
        return None
    if resume is True or (isinstance(resume, str) and resume.strip().lower() == "latest"):
        return latest_checkpoint(output_dir)
    given = Path(resume).expanduser()
    candidates = [given] if given.is_absolute() else [given, Path(output_dir) / given]
    for candidate in candidates:
        if is_complete_checkpoint(candidate):
            return candidate
    existing = next((c for c in candidates if c.exists()), given)
    raise FluxgrpoError(_not_complete_message(existing, Path(output_dir)))


def _not_complete_message(path: Path, output_dir: Path) -> str:
    if not path.exists():
        why = "it does not exist"
    elif path.name.endswith((TMP_SUFFIX, TRASH_SUFFIX)):
        why = "it is the leftover of an interrupted save or delete"
    elif checkpoint_iteration(path) is None:
        why = f"its name is not {CHECKPOINT_PREFIX}<iteration>"
    else:
        why = f"it has no {COMPLETE_MARKER} marker (the save was interrupted)"
    complete = [p.name for p in list_checkpoints(output_dir)]
    if complete:
        hint = (
            f"complete checkpoints in {output_dir}: {', '.join(complete)}; pass one of them to --resume-from, "
            "or use --resume for the latest"
        )
    else:
        hint = f"there is no complete checkpoint in {output_dir}; drop --resume-from to start a new run"
    return f"{path} is not a complete checkpoint ({why}): {hint}"


# --------------------------------------------------------------------------------------------- save


def save_checkpoint(
    output_dir: str | Path,
    iteration: int,
    ctx: DistContext,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    *,
    ema: Any = None,
    trainer_state: dict[str, Any],
    keep_last: int | None,
    extra_states: dict[str, Any] | None = None,
    export_dtype: torch.dtype = torch.float32,
    rng_states: dict[str, Any] | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write ``output_dir/checkpoint-{iteration}/`` atomically; a collective: every rank calls it.

    Args:
        iteration: iterations completed; the checkpoint holds the weights after this many updates.
        model: the transformer, plain or FSDP2-sharded (``fully_shard``); any wrapper that
            ``torch.distributed.checkpoint.state_dict`` understands.
        lr_scheduler: anything with ``state_dict()`` / ``load_state_dict()`` (a torch LR scheduler).
        ema: optional, with ``state_dict()`` (what resume needs, sharded or not), ``load_state_dict()`` and
            ``full_state_dict()`` (full CPU tensors keyed like the model's state dict, at least on rank 0; called on
            every rank, so it may be a collective).
        extra_states: name → object with ``state_dict()`` / ``load_state_dict()`` (sharded or not) saved with the
            resume state only (e.g. DiffusionNFT's old policy); ``load_checkpoint`` needs the same names.
        trainer_state: JSON-serialisable, identical on every rank (iteration, sampler position, resolved config);
            rank 0 writes it.
        keep_last: keep this many complete checkpoints (highest iterations), deleting older ones; the one just
            written is always kept. None keeps every checkpoint.
        export_dtype: dtype of the floating-point tensors in the diffusers export (the resume state keeps the
            training dtype).
        rng_states: this rank's extra RNG states (e.g. a sampler's ``torch.Generator.get_state()``); the global
            python/numpy/torch/device RNGs are always saved. Returned by ``load_checkpoint`` as ``rng_states``.
        max_shard_size: the export is split into diffusers-style shards above this size.

    Returns:
        The complete checkpoint folder.

    Raises:
        UsageError: ``keep_last`` < 1 or ``iteration`` < 0.
        TypeError: ``trainer_state`` is not JSON-serialisable.
    """
    if keep_last is not None and keep_last < 1:
        raise UsageError(f"keep_last is {keep_last}: keep at least 1 checkpoint, or leave it unset to keep them all")
    if iteration < 0:
        raise UsageError(f"checkpoint iteration must be >= 0, got {iteration}")
    # Checked on every rank before any collective, so a bad dict fails everywhere instead of hanging the others.
    trainer_state_json = json.dumps(trainer_state, indent=2) + "\n"
    extra_rng = dict(rng_states or {})
    _check_plain(extra_rng, "rng_states")

    root = Path(output_dir)
    final = checkpoint_dir(root, iteration)
    tmp = final.with_name(final.name + TMP_SUFFIX)
    if ctx.is_main:
        root.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(root)
        tmp.mkdir()  # new: never a folder (or a link to one) someone left under this name
        (tmp / STATE_DIR).mkdir()
    # Rank 0 works alone at these points (old leftovers, the exports): the others wait on its heartbeat, not in a
    # collective that a large export would outlast (``--collective-timeout``).
    rt_dist.wait_for_rank0(ctx, f"preparing {final.name}")

    lora = is_lora_model(model)
    if lora:
        _export_lora(tmp / LORA_DIR, ctx, model)
    else:
        _export_model(tmp / TRANSFORMER_DIR, ctx, model, export_dtype, max_shard_size)
    rt_dist.wait_for_rank0(ctx, f"writing {final.name}'s weights")
    if ema is not None:
        ema_weights = ema.full_state_dict()
        if ctx.is_main and lora:
            write_lora_file(tmp / EMA_LORA_DIR, ema_weights, adapter_metadata(model))
        elif ctx.is_main:
            _write_diffusers_folder(
                tmp / EMA_TRANSFORMER_DIR, _diffusers_config(model), ema_weights, export_dtype, max_shard_size
            )
        del ema_weights
        rt_dist.wait_for_rank0(ctx, f"writing {final.name}'s EMA weights")

    _save_training_state(tmp / STATE_DIR, ctx, model, optimizer, lr_scheduler, ema, extra_states or {})
    _write_durably(
        tmp / STATE_DIR / f"rng_rank{ctx.rank}.pt",
        lambda f: torch.save({"global": _plain_rng_state(rt_device.rng_state(ctx.device)), "extra": extra_rng}, f),
    )
    if ctx.is_main:
        _write_durably(tmp / STATE_DIR / TRAINER_STATE_FILE, lambda f: f.write(trainer_state_json.encode()))
    write_state_checksums(tmp / STATE_DIR, ctx.rank)
    # Every rank's files are on disk before rank 0 declares the checkpoint complete.
    rt_dist.barrier(ctx)

    if ctx.is_main:
        info = {
            "format_version": FORMAT_VERSION,
            "iteration": iteration,
            "world_size": ctx.world_size,
            "has_ema": ema is not None,
            "extra_states": sorted(extra_states or {}),
            "has_lr_scheduler": lr_scheduler is not None,
            "export_dtype": str(export_dtype).removeprefix("torch."),
            "lora": adapter_metadata(model) if lora else None,
            "checksums": True,  # state/checksums_rank<r>.json: every resume verifies each rank's files
        }
        _write_durably(tmp / COMPLETE_MARKER, lambda f: f.write((json.dumps(info, indent=2) + "\n").encode()))
        _publish(tmp, final)
        if keep_last is not None:
            _prune(root, keep_last, keep=final)
    rt_dist.wait_for_rank0(ctx, f"finishing {final.name}")
    return final


def publish_best(checkpoint: str | Path, facts: dict[str, Any]) -> Path:
    """Make the complete ``checkpoint`` the run's ``best/`` (rank 0, after the save): returns ``best/``.

    Its files are hard-linked (a checkpoint's files are never rewritten once it is complete, so a link costs no
    space and no time; copied where the filesystem has no hard links) into ``best.tmp/`` with ``BEST.json``
    (``facts``: iteration, metric, value) written last, then renamed over the previous ``best/`` as a checkpoint is
    published: an interrupted update leaves the previous ``best/`` or the new one, never a mix. ``--keep-last``
    pruning deletes ``checkpoint-{k}`` folders only; the linked files live on in ``best/``.
    """
    source = Path(checkpoint)
    final = source.parent / BEST_DIR
    tmp = final.with_name(final.name + TMP_SUFFIX)
    _remove_tree(tmp)

    def link_or_copy(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    try:
        shutil.copytree(source, tmp, copy_function=link_or_copy)
        record = {**facts, "checkpoint": source.name}
        _write_durably(tmp / BEST_FILE, lambda f: f.write((json.dumps(record, indent=2) + "\n").encode()))
    except OSError as exc:
        raise _io_error(exc, "writing", tmp) from None
    _publish(tmp, final)
    return final


def read_best(output_dir: str | Path) -> dict[str, Any] | None:
    """``best/BEST.json`` of a run (iteration, metric, value, checkpoint), or None when it keeps no best."""
    path = Path(output_dir) / BEST_DIR
    return _read_best_record(path) if is_best_checkpoint(path) else None


def _read_best_record(best: Path) -> dict[str, Any]:
    from fluxgrpo.state_checks import best_damaged_message, check_best_record

    try:
        record = json.loads((best / BEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise FluxgrpoError(best_damaged_message(best / BEST_FILE, type(exc).__name__)) from None
    return check_best_record(record, best / BEST_FILE)


def _export_model(
    directory: Path, ctx: DistContext, model: torch.nn.Module, export_dtype: torch.dtype, max_shard_size: int | str
) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # A collective: each rank contributes its shards; with cpu_offload only rank 0 receives the full tensors.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ctx.is_main:
        _write_diffusers_folder(directory, _diffusers_config(model), full, export_dtype, max_shard_size)  # type: ignore[arg-type]  # a model's state dict holds tensors only
    del full


def _export_lora(directory: Path, ctx: DistContext, model: torch.nn.Module) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # A collective, like _export_model, for the adapters only.
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    adapters = get_model_state_dict(model, options=options)
    if ctx.is_main:
        write_lora_file(directory, adapters, adapter_metadata(model))  # type: ignore[arg-type]  # a model's state dict holds tensors only


def _state_options(model: torch.nn.Module) -> Any:
    """A LoRA run's resume state leaves out the frozen base: it is the base model's, read again on resume."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=is_lora_model(model))


def _save_training_state(
    directory: Path, ctx: DistContext, model, optimizer, lr_scheduler, ema, extra_states: dict[str, Any]
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer, options=_state_options(model))
    state: dict[str, Any] = {"model": model_state, "optim": optim_state}
    if lr_scheduler is not None:
        state["lr_scheduler"] = lr_scheduler.state_dict()
    if ema is not None:
        state["ema"] = ema.state_dict()
    for name, holder in extra_states.items():
        state[f"extra_{name}"] = holder.state_dict()
    with _quiet_single_process_dcp(), _dcp_errors("writing", directory):
        dcp.save(state, checkpoint_id=str(directory), no_dist=not ctx.distributed)


@contextlib.contextmanager
def _dcp_errors(doing: str, directory: Path):
    """DCP reports any rank's failure as ``CheckpointException ranks:dict_keys([0, 1])`` plus tracebacks; say
    what happened instead, preferring a full disk (the likeliest cause, and the same on every rank)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        failures = sorted((rank, cause) for rank, (cause, _trace) in exc.failures.items())
        full = [(rank, cause) for rank, cause in failures if _is_disk_full(cause)]
        rank, cause = (full or failures)[0]
        if isinstance(cause, FluxgrpoError):
            raise cause from None
        raise _io_error(cause, doing, directory, rank) from None


def _is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def _io_error(exc: BaseException, doing: str, directory: Path, rank: int | None = None) -> FluxgrpoError:
    """One line for a failed checkpoint read or write."""
    where = Path(exc.filename) if isinstance(exc, OSError) and exc.filename else directory
    if _is_disk_full(exc):
        return FluxgrpoError(
            f"no space left on device writing {where}: free space there, lower --keep-last, or choose another "
            "--output-dir (the unfinished checkpoint is removed by the next save)"
        )
    on_rank = "" if rank is None else f" on rank {rank}"
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"
    reason = reason.splitlines()[0] if reason else type(exc).__name__
    if doing == "reading":
        return FluxgrpoError(f"cannot read the training state in {where}{on_rank} ({reason}): {_DAMAGED_FIX}")
    return FluxgrpoError(f"cannot write {where}{on_rank} ({reason}): choose a writable --output-dir with free space")


@contextlib.contextmanager
def _quiet_single_process_dcp():
    """DCP warns on every single-process save/load that it is assuming one process; that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _diffusers_config(model: torch.nn.Module) -> dict[str, Any]:
    """The model's config as diffusers' ``save_config`` writes it, naming the diffusers class.

    ``fully_shard`` swaps the instance's class for a generated ``FSDP<Name>`` subclass, and ``torch.compile``
    wraps the module; ``_class_name`` must still say ``FluxTransformer2DModel`` for pipelines to load it.
    """
    from torch.distributed.fsdp import FSDPModule

    base = getattr(model, "_orig_mod", model)
    config = json.loads(base.to_json_string())  # type: ignore[operator]  # a peft/diffusers method reached through nn.Module.__getattr__
    config["_class_name"] = next(k for k in type(base).__mro__ if not issubclass(k, FSDPModule)).__name__
    return config


def _write_diffusers_folder(
    directory: Path,
    config: dict[str, Any],
    state_dict: dict[str, torch.Tensor],
    export_dtype: torch.dtype,
    max_shard_size: int | str,
) -> None:
    """config.json + safetensors shards named and indexed the way diffusers' ``save_pretrained`` does."""
    from diffusers.utils import CONFIG_NAME, SAFE_WEIGHTS_INDEX_NAME, SAFETENSORS_WEIGHTS_NAME
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    def dtype_of(tensor: torch.Tensor) -> torch.dtype:
        return export_dtype if tensor.is_floating_point() else tensor.dtype

    directory.mkdir(parents=True, exist_ok=True)
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    _write_durably(directory / CONFIG_NAME, lambda f: f.write(text.encode()))

    # Sized with meta stand-ins in the export dtype, so shards stay under the limit after the cast and no
    # second full copy of the weights is ever held: each shard is cast, written and dropped in turn.
    sizing = {name: torch.empty(t.shape, dtype=dtype_of(t), device="meta") for name, t in state_dict.items()}
    pattern = SAFETENSORS_WEIGHTS_NAME.replace(".safetensors", "{suffix}.safetensors")
    split = split_torch_state_dict_into_shards(sizing, filename_pattern=pattern, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        shard = {name: state_dict[name].to(dtype_of(state_dict[name])).contiguous() for name in names}
        try:
            save_file(shard, str(directory / filename), metadata={"format": "pt"})
        except Exception as exc:  # safetensors reports I/O errors as SafetensorError, the OS error only in its text
            full = "No space left on device" in str(exc) or "os error 28" in str(exc)
            cause = OSError(errno.ENOSPC if full else errno.EIO, str(exc), str(directory / filename))
            raise _io_error(cause, "writing", directory) from None
        give_default_mode(directory / filename)
        _fsync(directory / filename)
        del shard
    if split.is_sharded:
        index = {"metadata": dict(split.metadata), "weight_map": split.tensor_to_filename}
        index_text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        _write_durably(directory / SAFE_WEIGHTS_INDEX_NAME, lambda f: f.write(index_text.encode()))


# --------------------------------------------------------------------------------------------- load


def load_checkpoint(
    path: str | Path,
    ctx: DistContext,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    *,
    ema: Any = None,
    extra_states: dict[str, Any] | None = None,
) -> LoadedState:
    """Restore model, optimizer, scheduler, EMA and this rank's global RNGs from a complete checkpoint.

    A collective: every rank calls it, with the objects built exactly as for a fresh run (same sharding).
    The global python/numpy/torch/device RNG states are restored last, so call this right before training
    continues; extra generators saved through ``rng_states`` come back in ``LoadedState.rng_states``.

    Raises:
        FluxgrpoError: ``path`` is not a complete checkpoint; it was written by a different number of
            processes; or ``ema`` is given but the checkpoint has no EMA state.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    from fluxgrpo.safe_load import SafeFileSystemReader, SafeLoadPlanner

    path = Path(path)
    info = read_checkpoint_info(path)
    if int(info.get("format_version", 1)) < 2:
        raise FluxgrpoError(
            f"{path} was written by an older fluxgrpo whose RNG files pickle numpy objects, which cannot be read "
            "without letting the file run code: resume from a checkpoint written by this version, or start a new "
            f"run (its exported weights in {path / TRANSFORMER_DIR} still work with `fluxgrpo sample --checkpoint`)"
        )
    saved_world = int(info["world_size"])
    if saved_world != ctx.world_size:
        raise FluxgrpoError(
            f"{path} was saved by {saved_world} process(es) but this run has {ctx.world_size}: resuming on a "
            f"different number of processes is not supported (each rank's RNG and data position would not match); "
            f"resume with --dies {saved_world}, or start a new run from the exported weights in "
            f"{path / TRANSFORMER_DIR}"
        )
    if ema is not None and not info.get("has_ema", False):
        raise FluxgrpoError(
            f"{path} has no EMA state (it was saved without --use-ema): resume without --use-ema, "
            "or start a new run from its exported weights"
        )
    extra_states = extra_states or {}
    missing = sorted(set(extra_states) - set(info.get("extra_states", [])))
    if missing:
        raise FluxgrpoError(
            f"{path} has no {', '.join(missing)} state (it was trained with another --objective): resume with the "
            "--objective the checkpoint was trained with, or start a new run from its exported weights"
        )
    if lr_scheduler is not None and not info.get("has_lr_scheduler", True):
        raise FluxgrpoError(
            f"{path} has no learning-rate scheduler state, so it cannot resume a run that uses one: resume from "
            "another checkpoint with --resume-from, or start a new run from its exported transformer"
        )

    # DCP loads in place into tensors laid out the way this run shards them; get_state_dict gives that
    # layout (and materialises an untouched optimizer's state so there is somewhere to load into).
    if bool(info.get("lora")) != is_lora_model(model):
        kinds = ("a LoRA adapter", "full weights") if info.get("lora") else ("full weights", "a LoRA adapter")
        raise FluxgrpoError(
            f"{path} holds {kinds[0]} but this run trains {kinds[1]}: resume with the --lora-rank the checkpoint "
            f"was trained with ({(info.get('lora') or {}).get('r', 0)})"
        )
    options = _state_options(model)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    state: dict[str, Any] = {"model": model_state, "optim": optim_state}
    if lr_scheduler is not None:
        state["lr_scheduler"] = lr_scheduler.state_dict()
    if ema is not None:
        state["ema"] = ema.state_dict()
    for name, holder in extra_states.items():
        state[f"extra_{name}"] = holder.state_dict()
    if info.get("checksums"):
        _verify_checksums(path / STATE_DIR, ctx.rank)
    # Read (and vetted) here, on every rank, before DCP's collectives start.
    reader = SafeFileSystemReader(path / STATE_DIR)
    with _quiet_single_process_dcp(), _dcp_errors("reading", path / STATE_DIR):
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=not ctx.distributed)
    # A LoRA state has no frozen base to set: the adapters alone (DCP has already refused any missing key).
    set_options = StateDictOptions(ignore_frozen_params=options.ignore_frozen_params, strict=not is_lora_model(model))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=set_options
    )
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(state["lr_scheduler"])
    if ema is not None:
        ema.load_state_dict(state["ema"])
    for name, holder in extra_states.items():
        holder.load_state_dict(state[f"extra_{name}"])

    trainer_state = read_trainer_state(path)
    rng = _load_rng_file(path / STATE_DIR / f"rng_rank{ctx.rank}.pt", ctx.rank)
    rt_device.set_rng_state(ctx.device, _rng_state_from_plain(rng["global"]))
    return LoadedState(
        trainer_state=trainer_state, rng_states=rng["extra"], iteration=int(info["iteration"]), path=path
    )


# --------------------------------------------------------------------------------------------- RNG files


def _plain_rng_state(state: dict[str, Any]) -> dict[str, Any]:
    """``runtime.device.rng_state()`` with numpy's key array as a tensor, so ``weights_only`` can read it back.

    Python's state is a tuple of ints; torch's and the device's are uint8 tensors; numpy's is
    ``(name, uint32 array, pos, has_gauss, cached_gaussian)``.
    """
    name, keys, pos, has_gauss, cached_gaussian = state["numpy"]
    plain = dict(state)
    plain["numpy"] = {
        "bit_generator": str(name),
        "keys": torch.from_numpy(keys.astype("int64")),  # torch has no uint32 tensors before 2.3
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached_gaussian),
    }
    return plain


def _rng_state_from_plain(plain: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    numpy_state = plain["numpy"]
    state = dict(plain)
    state["numpy"] = (
        numpy_state["bit_generator"],
        numpy_state["keys"].numpy().astype(np.uint32),
        numpy_state["pos"],
        numpy_state["has_gauss"],
        numpy_state["cached_gaussian"],
    )
    return state


def _check_plain(value: Any, what: str) -> None:
    """Refuse, at save time, anything the ``weights_only`` loader would refuse at resume time."""
    if isinstance(value, torch.Tensor) or value is None or isinstance(value, (bool, int, float, str, bytes)):
        return
    if isinstance(value, dict):
        for key, item in value.items():
            _check_plain(key, what)
            _check_plain(item, what)
        return
    if isinstance(value, (list, tuple)):
        for item in value:
            _check_plain(item, what)
        return
    raise TypeError(f"{what} may hold only tensors and plain values (a resume reads them safely), not {type(value)}")


def _load_rng_file(rng_file: Path, rank: int) -> dict[str, Any]:
    from fluxgrpo.safe_load import load_plain

    try:
        rng = load_plain(rng_file, _DAMAGED_FIX)
    except FileNotFoundError:
        raise FluxgrpoError(f"{rng_file} is missing, so rank {rank} cannot resume exactly: {_DAMAGED_FIX}") from None
    if not isinstance(rng, dict) or not isinstance(rng.get("global"), dict) or "numpy" not in rng["global"]:
        raise FluxgrpoError(f"{rng_file} is malformed (not the RNG state fluxgrpo writes): {_DAMAGED_FIX}")
    return rng


# --------------------------------------------------------------------------------------------- checksums

CHECKSUMS_FILE = "checksums_rank{rank}.json"
_HASH_CHUNK = 8 << 20


def _files_of_rank(state_dir: Path, rank: int) -> list[Path]:
    """The state files rank ``rank`` wrote: its DCP shards and RNG file (rank 0 also the metadata and trainer
    state), so each rank hashes (and on resume verifies) its own share, in parallel."""
    own = [*state_dir.glob(f"__{rank}_*.distcp"), state_dir / f"rng_rank{rank}.pt"]
    if rank == 0:
        own += [state_dir / ".metadata", state_dir / TRAINER_STATE_FILE]
    return sorted(path for path in own if path.is_file())


def _sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_state_checksums(state_dir: Path, rank: int) -> None:
    sums = {path.name: _sha256(path) for path in _files_of_rank(state_dir, rank)}
    text = json.dumps(sums, indent=2) + "\n"
    _write_durably(state_dir / CHECKSUMS_FILE.format(rank=rank), lambda f: f.write(text.encode()))


def _verify_checksums(state_dir: Path, rank: int) -> None:
    """Raise FluxgrpoError (one line) when a file this rank wrote no longer has the sha256 recorded at save time:
    corruption inside a tensor's bytes that no header check sees."""
    from fluxgrpo.state_checks import check_checksum_record

    record = state_dir / CHECKSUMS_FILE.format(rank=rank)
    try:
        sums = json.loads(record.read_text())
    except (OSError, ValueError) as exc:
        raise FluxgrpoError(f"{record} is missing or damaged ({type(exc).__name__}): {_DAMAGED_FIX}") from None
    required = [f"rng_rank{rank}.pt", *((".metadata", TRAINER_STATE_FILE) if rank == 0 else ())]
    for name in required:
        if not (state_dir / name).is_file():
            raise FluxgrpoError(f"{state_dir / name} is missing: the checkpoint is damaged; {_DAMAGED_FIX}")
    check_checksum_record(sums, record, _files_of_rank(state_dir, rank), _DAMAGED_FIX)
    for name, expected in sorted(sums.items()):
        path = state_dir / Path(str(name)).name
        if not path.is_file():
            raise FluxgrpoError(f"{path} is missing: the checkpoint is damaged; {_DAMAGED_FIX}")
        if _sha256(path) != expected:
            raise FluxgrpoError(
                f"{path} does not match the checksum recorded when the checkpoint was saved (its bytes changed "
                f"since): {_DAMAGED_FIX}"
            )


# --------------------------------------------------------------------------------------------- filesystem


def _fsync(path: Path) -> None:
    # Some filesystems (and all directories on some platforms) refuse fsync; durability is then best effort.
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_durably(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write a file through ``write`` and fsync it, so the COMPLETE marker never precedes its data on disk."""
    try:
        with open(path, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        exc.filename = exc.filename or str(path)
        raise _io_error(exc, "writing", path.parent) from None


def _rename(src: Path, dst: Path) -> None:
    """One atomic rename on a POSIX filesystem (a separate function so tests can interrupt a save here)."""
    os.replace(src, dst)
    _fsync(dst.parent)


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished tmp folder to its final name, replacing a checkpoint of the same iteration."""
    if final.exists():
        trash = final.with_name(final.name + TRASH_SUFFIX)
        _remove_tree(trash)
        _rename(final, trash)
        _rename(tmp, final)
        _remove_tree(trash)
    else:
        _rename(tmp, final)


def _remove_leftovers(output_dir: Path) -> None:
    """Delete ``.tmp`` / ``.trash`` folders left by an interrupted save or delete."""
    for entry in output_dir.iterdir():
        if _LEFTOVER_NAME.match(entry.name) and (entry.is_dir() or entry.is_symlink()):
            _remove_tree(entry)


def _remove_tree(path: Path) -> None:
    """Delete a folder we wrote; a link planted in its place is removed itself, never what it points at."""
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)


def _prune(output_dir: Path, keep_last: int, keep: Path) -> None:
    """Delete complete checkpoints beyond the ``keep_last`` highest iterations, never ``keep``."""
    complete = list_checkpoints(output_dir)
    survivors = set(complete[-keep_last:]) | {keep}
    for path in complete:
        if path in survivors:
            continue
        trash = path.with_name(path.name + TRASH_SUFFIX)
        _remove_tree(trash)
        _rename(path, trash)
        _remove_tree(trash)
