"""Where a checkpoint lives and when it is one: the folder names, discovery, ``--resume``, and the atomic
filesystem steps (durable writes, publish by rename, keep-last pruning) every part of a save goes through."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from fluxgrpo import run_folder
from fluxgrpo.errors import FluxgrpoError, UsageError
from fluxgrpo.state_checks import best_damaged_message, check_best_record

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

_COMPLETE_NAME = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")
_LEFTOVER_NAME = re.compile(rf"^{CHECKPOINT_PREFIX}\d+({re.escape(TMP_SUFFIX)}|{re.escape(TRASH_SUFFIX)})$")


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
    info = read_json(path / COMPLETE_MARKER)
    if (
        not isinstance(info, dict)
        or not isinstance(info.get("iteration"), int)
        or not isinstance(info.get("world_size"), int)
        or info["world_size"] < 1
    ):
        raise FluxgrpoError(f"{path / COMPLETE_MARKER} is malformed (not the JSON fluxgrpo writes): {DAMAGED_FIX}")
    if path.name == BEST_DIR:  # sample/export/report never take a damaged best record silently
        read_best_record(path)
    return info


def read_trainer_state(path: str | Path) -> dict[str, Any]:
    """The ``trainer_state`` a complete checkpoint was saved with (iteration, sampler positions, config).

    Raises:
        FluxgrpoError: the file is missing, truncated or not a JSON object.
    """
    state = read_json(Path(path) / STATE_DIR / TRAINER_STATE_FILE)
    if not isinstance(state, dict):
        raise FluxgrpoError(f"{Path(path) / STATE_DIR / TRAINER_STATE_FILE} is malformed: {DAMAGED_FIX}")
    return state


def read_best_record(best: Path) -> dict[str, Any]:
    """``best/BEST.json`` checked to have the shape fluxgrpo writes (``state_checks.check_best_record``).

    Raises:
        FluxgrpoError: one line naming the file and saying what to remove.
    """

    try:
        record = json.loads((best / BEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise FluxgrpoError(best_damaged_message(best / BEST_FILE, type(exc).__name__)) from None
    return check_best_record(record, best / BEST_FILE)


# What to do about a checkpoint whose files were damaged after it was written.
DAMAGED_FIX = "resume from another checkpoint with --resume-from, or start a new run from its exported transformer"


def read_json(path: Path) -> Any:
    """A JSON file of a checkpoint; a missing, truncated or garbled one is one FluxgrpoError naming it."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FluxgrpoError(f"{path} is missing: {DAMAGED_FIX}") from None
    except (OSError, ValueError) as exc:
        raise FluxgrpoError(f"{path} is damaged ({exc}): {DAMAGED_FIX}") from None


def resolve_resume(output_dir: str | Path, resume: str | bool | None) -> Path | None:
    """The checkpoint ``--resume`` points at.

    - None / False: no resume (None).
    - True or ``"latest"`` (``--resume`` with no value): the latest complete checkpoint in ``output_dir``, or
      None when there is none yet, so the same command both starts a run and continues it after a preemption.
    - a path (or a folder name inside ``output_dir``, e.g. ``checkpoint-40``): that checkpoint.

    Raises:
        UsageError: the given folder is missing or not a complete checkpoint (exit 2); the message lists the
            complete ones in ``output_dir``.
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
    raise UsageError(_not_complete_message(existing, Path(output_dir)))  # the flag's value is wrong: exit 2


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


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def io_error(exc: BaseException, doing: str, directory: Path, rank: int | None = None) -> FluxgrpoError:
    """One line for a failed checkpoint read or write."""
    where = Path(exc.filename) if isinstance(exc, OSError) and exc.filename else directory
    if is_disk_full(exc):
        return FluxgrpoError(
            f"no space left on device writing {where}: free space there, lower --keep-last, or choose another "
            "--output-dir (the unfinished checkpoint is removed by the next save)"
        )
    on_rank = "" if rank is None else f" on rank {rank}"
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"
    reason = reason.splitlines()[0] if reason else type(exc).__name__
    if doing == "reading":
        return FluxgrpoError(f"cannot read the training state in {where}{on_rank} ({reason}): {DAMAGED_FIX}")
    return FluxgrpoError(f"cannot write {where}{on_rank} ({reason}): choose a writable --output-dir with free space")


# --------------------------------------------------------------------------------------------- filesystem


def fsync_path(path: Path) -> None:
    # Some filesystems (and all directories on some platforms) refuse fsync; durability is then best effort.
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_durably(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write a file through ``write`` and fsync it, so the COMPLETE marker never precedes its data on disk."""
    try:
        with open(path, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        exc.filename = exc.filename or str(path)
        raise io_error(exc, "writing", path.parent) from None


def rename_atomically(src: Path, dst: Path) -> None:
    """One atomic rename on a POSIX filesystem (a separate function so tests can interrupt a save here)."""
    os.replace(src, dst)
    fsync_path(dst.parent)


def publish_folder(tmp: Path, final: Path) -> None:
    """Rename the finished tmp folder to its final name, replacing a checkpoint of the same iteration."""
    if final.exists():
        trash = final.with_name(final.name + TRASH_SUFFIX)
        remove_tree(trash)
        rename_atomically(final, trash)
        rename_atomically(tmp, final)
        remove_tree(trash)
    else:
        rename_atomically(tmp, final)


def remove_leftovers(output_dir: Path) -> None:
    """Delete ``.tmp`` / ``.trash`` folders left by an interrupted save or delete."""
    for entry in output_dir.iterdir():
        if _LEFTOVER_NAME.match(entry.name) and (entry.is_dir() or entry.is_symlink()):
            remove_tree(entry)


def remove_tree(path: Path) -> None:
    """Delete a folder we wrote; a link planted in its place is removed itself, never what it points at."""
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)


def prune_checkpoints(output_dir: Path, keep_last: int, keep: Path) -> None:
    """Delete complete checkpoints beyond the ``keep_last`` highest iterations, never ``keep``."""
    complete = list_checkpoints(output_dir)
    survivors = set(complete[-keep_last:]) | {keep}
    for path in complete:
        if path in survivors:
            continue
        trash = path.with_name(path.name + TRASH_SUFFIX)
        remove_tree(trash)
        rename_atomically(path, trash)
        remove_tree(trash)
