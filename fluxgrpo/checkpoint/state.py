"""The exact-resume state: model, optimizer, scheduler, EMA and extra holders (one ``TrainingState``), written
with torch.distributed.checkpoint beside the RNG files and checksums, and read back safely."""

from __future__ import annotations

import contextlib
import hashlib
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from fluxgrpo.checkpoint.export import (
    DEFAULT_MAX_SHARD_SIZE,
    write_exports,
)
from fluxgrpo.checkpoint.layout import (
    COMPLETE_MARKER,
    DAMAGED_FIX,
    FORMAT_VERSION,
    LORA_DIR,
    STATE_DIR,
    TMP_SUFFIX,
    TRAINER_STATE_FILE,
    TRANSFORMER_DIR,
    checkpoint_dir,
    io_error,
    is_disk_full,
    prune_checkpoints,
    publish_folder,
    read_checkpoint_info,
    read_trainer_state,
    remove_leftovers,
    write_durably,
)
from fluxgrpo.errors import FluxgrpoError, UsageError
from fluxgrpo.lora import adapter_metadata, is_lora_model
from fluxgrpo.runtime import device as rt_device
from fluxgrpo.runtime import dist as rt_dist
from fluxgrpo.runtime.dist import DistContext
from fluxgrpo.safe_dcp import SafeFileSystemReader, SafeLoadPlanner
from fluxgrpo.safe_load import load_plain
from fluxgrpo.state_checks import check_checksum_record


@dataclass
class TrainingState:
    """Everything an exact resume restores in place, built exactly as for a fresh run (same sharding): what
    ``save_checkpoint`` saves and ``load_checkpoint`` fills again.

    - model: the transformer, plain or FSDP2-sharded (``fully_shard``); any wrapper that
      ``torch.distributed.checkpoint.state_dict`` understands.
    - lr_scheduler: anything with ``state_dict()`` / ``load_state_dict()`` (a torch LR scheduler), or None.
    - ema: optional, with ``state_dict()`` (what resume needs, sharded or not), ``load_state_dict()`` and
      ``full_state_dict()`` (full CPU tensors keyed like the model's state dict, at least on rank 0; called on
      every rank, so it may be a collective).
    - extra_states: name → object with ``state_dict()`` / ``load_state_dict()`` (sharded or not) saved with the
      resume state only (e.g. DiffusionNFT's old policy); a resume needs the same names.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any = None
    ema: Any = None
    extra_states: dict[str, Any] = field(default_factory=dict)

    def state_options(self) -> Any:
        """A LoRA run's resume state leaves out the frozen base: it is the base model's, read again on resume."""

        return StateDictOptions(ignore_frozen_params=is_lora_model(self.model))

    def state_dict(self) -> dict[str, Any]:
        """The one DCP state dict, saved and loaded alike: DCP loads in place into tensors laid out the way this
        run shards them; ``get_state_dict`` gives that layout (and materialises an untouched optimizer's state so
        there is somewhere to load into)."""

        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=self.state_options())
        state: dict[str, Any] = {"model": model_state, "optim": optim_state}
        if self.lr_scheduler is not None:
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        if self.ema is not None:
            state["ema"] = self.ema.state_dict()
        for name, holder in self.extra_states.items():
            state[f"extra_{name}"] = holder.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Hand a loaded ``state_dict()`` back to the objects."""

        lora = is_lora_model(self.model)
        # A LoRA state has no frozen base to set: the adapters alone (DCP has already refused any missing key).
        options = StateDictOptions(ignore_frozen_params=lora, strict=not lora)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=options,
        )
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if self.ema is not None:
            self.ema.load_state_dict(state["ema"])
        for name, holder in self.extra_states.items():
            holder.load_state_dict(state[f"extra_{name}"])


@dataclass
class LoadedState:
    """What ``load_checkpoint`` hands back after restoring the model, optimizer, scheduler, EMA and global RNGs."""

    trainer_state: dict[str, Any]  # the dict given to save_checkpoint (identical on every rank)
    rng_states: dict[str, Any]  # this rank's ``rng_states`` as given to save_checkpoint (caller-owned generators)
    iteration: int  # iterations completed when the checkpoint was written
    path: Path  # the checkpoint folder


# --------------------------------------------------------------------------------------------- save


def save_checkpoint(
    output_dir: str | Path,
    iteration: int,
    ctx: DistContext,
    state: TrainingState,
    *,
    trainer_state: dict[str, Any],
    keep_last: int | None,
    export_dtype: torch.dtype = torch.float32,
    rng_states: dict[str, Any] | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write ``output_dir/checkpoint-{iteration}/`` atomically; a collective: every rank calls it.

    Args:
        iteration: iterations completed; the checkpoint holds the weights after this many updates.
        state: the model, optimizer, scheduler, EMA and extra holders (see ``TrainingState``).
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
        remove_leftovers(root)
        tmp.mkdir()  # new: never a folder (or a link to one) someone left under this name
        (tmp / STATE_DIR).mkdir()
    # Rank 0 works alone at these points (old leftovers, the exports): the others wait on its heartbeat, not in a
    # collective that a large export would outlast (``--collective-timeout``).
    rt_dist.wait_for_rank0(ctx, f"preparing {final.name}")

    write_exports(tmp, final.name, ctx, state.model, state.ema, export_dtype, max_shard_size)

    _save_training_state(tmp / STATE_DIR, ctx, state)
    write_durably(
        tmp / STATE_DIR / f"rng_rank{ctx.rank}.pt",
        lambda f: torch.save({"global": _plain_rng_state(rt_device.rng_state(ctx.device)), "extra": extra_rng}, f),
    )
    if ctx.is_main:
        write_durably(tmp / STATE_DIR / TRAINER_STATE_FILE, lambda f: f.write(trainer_state_json.encode()))
    write_state_checksums(tmp / STATE_DIR, ctx.rank)
    # Every rank's files are on disk before rank 0 declares the checkpoint complete.
    rt_dist.barrier(ctx)

    if ctx.is_main:
        info = _complete_facts(iteration, ctx, state, export_dtype)
        write_durably(tmp / COMPLETE_MARKER, lambda f: f.write((json.dumps(info, indent=2) + "\n").encode()))
        publish_folder(tmp, final)
        if keep_last is not None:
            prune_checkpoints(root, keep_last, keep=final)
    rt_dist.wait_for_rank0(ctx, f"finishing {final.name}")
    return final


def _complete_facts(
    iteration: int, ctx: DistContext, state: TrainingState, export_dtype: torch.dtype
) -> dict[str, Any]:
    """What the ``COMPLETE`` marker says about the checkpoint (``read_checkpoint_info`` reads it back)."""
    lora = is_lora_model(state.model)
    return {
        "format_version": FORMAT_VERSION,
        "iteration": iteration,
        "world_size": ctx.world_size,
        "has_ema": state.ema is not None,
        "extra_states": sorted(state.extra_states),
        "has_lr_scheduler": state.lr_scheduler is not None,
        "export_dtype": str(export_dtype).removeprefix("torch."),
        "lora": adapter_metadata(state.model) if lora else None,
        "checksums": True,  # state/checksums_rank<r>.json: every resume verifies each rank's files
    }


def _save_training_state(directory: Path, ctx: DistContext, state: TrainingState) -> None:
    with _quiet_single_process_dcp(), _dcp_errors("writing", directory):
        dcp.save(state.state_dict(), checkpoint_id=str(directory), no_dist=not ctx.distributed)


@contextlib.contextmanager
def _dcp_errors(doing: str, directory: Path):
    """DCP reports any rank's failure as ``CheckpointException ranks:dict_keys([0, 1])`` plus tracebacks; say
    what happened instead, preferring a full disk (the likeliest cause, and the same on every rank)."""

    try:
        yield
    except CheckpointException as exc:
        failures = sorted((rank, cause) for rank, (cause, _trace) in exc.failures.items())
        full = [(rank, cause) for rank, cause in failures if is_disk_full(cause)]
        rank, cause = (full or failures)[0]
        if isinstance(cause, FluxgrpoError):
            raise cause from None
        raise io_error(cause, doing, directory, rank) from None


@contextlib.contextmanager
def _quiet_single_process_dcp():
    """DCP warns on every single-process save/load that it is assuming one process; that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


# --------------------------------------------------------------------------------------------- load


def load_checkpoint(path: str | Path, ctx: DistContext, state: TrainingState) -> LoadedState:
    """Restore ``state`` (model, optimizer, scheduler, EMA, extra holders) and this rank's global RNGs from a
    complete checkpoint.

    A collective: every rank calls it, with the objects built exactly as for a fresh run (same sharding).
    The global python/numpy/torch/device RNG states are restored last, so call this right before training
    continues; extra generators saved through ``rng_states`` come back in ``LoadedState.rng_states``.

    Raises:
        FluxgrpoError: ``path`` is not a complete checkpoint; it was written by a different number of
            processes; or ``ema`` is given but the checkpoint has no EMA state.
    """

    model, ema, extra_states, lr_scheduler = state.model, state.ema, state.extra_states, state.lr_scheduler
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

    if bool(info.get("lora")) != is_lora_model(model):
        saved_rank = _saved_lora_rank(path, info)
        if saved_rank is None:  # a "lora" entry that names no rank the folder holds: the marker, not the flag
            raise FluxgrpoError(
                f'{path / COMPLETE_MARKER} is damaged (its "lora" entry names no LoRA adapter this checkpoint '
                f"holds): {DAMAGED_FIX}"
            )
        kinds = ("a LoRA adapter", "full weights") if saved_rank else ("full weights", "a LoRA adapter")
        raise FluxgrpoError(
            f"{path} holds {kinds[0]} but this run trains {kinds[1]}: resume with the --lora-rank the checkpoint "
            f"was trained with ({saved_rank})"
        )
    loaded = state.state_dict()
    if info.get("checksums"):
        _verify_checksums(path / STATE_DIR, ctx.rank)
    # Read (and vetted) here, on every rank, before DCP's collectives start.
    reader = SafeFileSystemReader(path / STATE_DIR)
    with _quiet_single_process_dcp(), _dcp_errors("reading", path / STATE_DIR):
        dcp.load(loaded, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=not ctx.distributed)
    state.load_state_dict(loaded)

    trainer_state = read_trainer_state(path)
    rng = _load_rng_file(path / STATE_DIR / f"rng_rank{ctx.rank}.pt", ctx.rank)
    rt_device.set_rng_state(ctx.device, _rng_state_from_plain(rng["global"]))
    return LoadedState(
        trainer_state=trainer_state, rng_states=rng["extra"], iteration=int(info["iteration"]), path=path
    )


def _saved_lora_rank(path: Path, info: dict[str, Any]) -> int | None:
    """The LoRA rank the checkpoint was trained with (0: full weights); None when its marker's ``lora`` entry is
    damaged: no rank of at least 1, or no adapter folder (``lora/``) beside it, or full weights (``transformer/``)."""
    entry = info.get("lora")
    if not entry:
        return 0
    rank = entry.get("r") if isinstance(entry, dict) else None
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        return None
    if not (path / LORA_DIR).is_dir() or (path / TRANSFORMER_DIR).is_dir():
        return None
    return rank


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
    try:
        rng = load_plain(rng_file, DAMAGED_FIX)
    except FileNotFoundError:
        raise FluxgrpoError(f"{rng_file} is missing, so rank {rank} cannot resume exactly: {DAMAGED_FIX}") from None
    if not isinstance(rng, dict) or not isinstance(rng.get("global"), dict) or "numpy" not in rng["global"]:
        raise FluxgrpoError(f"{rng_file} is malformed (not the RNG state fluxgrpo writes): {DAMAGED_FIX}")
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
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_state_checksums(state_dir: Path, rank: int) -> None:
    sums = {path.name: _sha256(path) for path in _files_of_rank(state_dir, rank)}
    text = json.dumps(sums, indent=2) + "\n"
    write_durably(state_dir / CHECKSUMS_FILE.format(rank=rank), lambda f: f.write(text.encode()))


def _verify_checksums(state_dir: Path, rank: int) -> None:
    """Raise FluxgrpoError (one line) when a file this rank wrote no longer has the sha256 recorded at save time:
    corruption inside a tensor's bytes that no header check sees."""

    record = state_dir / CHECKSUMS_FILE.format(rank=rank)
    try:
        sums = json.loads(record.read_text())
    except (OSError, ValueError) as exc:
        raise FluxgrpoError(f"{record} is missing or damaged ({type(exc).__name__}): {DAMAGED_FIX}") from None
    required = [f"rng_rank{rank}.pt", *((".metadata", TRAINER_STATE_FILE) if rank == 0 else ())]
    for name in required:
        if not (state_dir / name).is_file():
            raise FluxgrpoError(f"{state_dir / name} is missing: the checkpoint is damaged; {DAMAGED_FIX}")
    check_checksum_record(sums, record, _files_of_rank(state_dir, rank), DAMAGED_FIX)  # no file left unverified
    for name, expected in sorted(sums.items()):
        path = state_dir / Path(str(name)).name
        if not path.is_file():
            raise FluxgrpoError(f"{path} is missing: the checkpoint is damaged; {DAMAGED_FIX}")
        if _sha256(path) != expected:
            raise FluxgrpoError(
                f"{path} does not match the checksum recorded when the checkpoint was saved (its bytes changed "
                f"since): {DAMAGED_FIX}"
            )
