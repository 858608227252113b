"""A training run's output folder: one live run at a time, and never another run's files.

- ``lock_run_folder`` holds an exclusive lock (``flock`` on ``<folder>/.fluxgrpo.lock``) for the run's life.
  A second run on the same folder is refused at once, naming the holder (pid, host, start time). The kernel
  drops the lock when its process dies, however it dies, so a lock left by a dead run is simply taken over.
  The lock file stays (removing it would let a run that opened it just before lock a file no one else sees).
- ``previous_run`` lists what an earlier run left (config.yaml, metrics.jsonl, checkpoints): a new run without
  ``--resume`` is refused there instead of truncating its metrics and mixing checkpoints, unless
  ``--overwrite``, which moves those files aside (``move_previous_run``), never deletes them.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fluxgrpo.errors import FluxgrpoError

LOCK_FILE = ".fluxgrpo.lock"
RUN_FILES = ("config.yaml", "metrics.jsonl", "run_info.json")
CHECKPOINT_PATTERN = "checkpoint-*"


def _holder_text(holder: dict[str, Any]) -> str:
    if not holder:
        return "another process"
    return f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"


def _read_holder(fd: int) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        os.lseek(fd, 0, os.SEEK_SET)
        return json.loads(os.read(fd, 65536).decode() or "{}")
    return {}


def _in_use_error(folder: Path, holder: dict[str, Any]) -> FluxgrpoError:
    return FluxgrpoError(
        f"--output-dir {folder} is in use by another run ({_holder_text(holder)}): wait for it to end or stop it, "
        "or choose another --output-dir"
    )


@contextlib.contextmanager
def lock_run_folder(folder: str | Path) -> Iterator[dict[str, Any]]:
    """Hold the folder's run lock while the block runs; yields the holder record of a dead run it took over
    (empty when the lock was free of any record).

    Raises:
        FluxgrpoError: another live process holds the lock (the message names it).
    """
    folder = Path(folder)
    if sys.platform == "win32":  # no flock: the folder is not guarded
        yield {}
        return
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _in_use_error(folder, _read_holder(fd)) from None
        previous = _read_holder(fd)
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "command": " ".join(sys.argv),
        }
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(record).encode())
        try:
            yield previous
        finally:
            os.ftruncate(fd, 0)  # nobody holds it now; the kernel releases the lock when fd closes
    finally:
        os.close(fd)


def check_not_in_use(folder: str | Path) -> None:
    """Raise if a live run holds ``folder``'s lock now (a probe: the lock is released again at once)."""
    if Path(folder, LOCK_FILE).is_file():
        with lock_run_folder(folder):
            pass


def previous_run(folder: str | Path) -> list[str]:
    """The names of an earlier run's files in ``folder`` (empty when there are none)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [name for name in RUN_FILES if (folder / name).exists()]
    return found + sorted(p.name for p in folder.glob(CHECKPOINT_PATTERN))


def replaced_folder(folder: str | Path) -> Path:
    """Where ``--overwrite`` moves an earlier run: ``<folder>.replaced-<UTC time>`` beside it."""
    folder = Path(folder)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return folder.with_name(f"{folder.name}.replaced-{stamp}")


def move_previous_run(folder: str | Path) -> Path:
    """Move everything in ``folder`` but its lock file to ``replaced_folder(folder)``; returns that folder.

    Call it while holding the folder's lock: no live run's files are moved.
    """
    folder = Path(folder)
    target = replaced_folder(folder)
    target.mkdir(parents=True)
    for entry in sorted(folder.iterdir()):
        if entry.name != LOCK_FILE:
            entry.rename(target / entry.name)
    return target
