"""A training run's output folder: its layout, one live run at a time, and never another run's files.

- The names of what a run writes are here (``CONFIG_FILE``, ``METRICS_FILE``, ``RUN_INFO_FILE``, ``EVAL_DIR`` with
  ``INDEX_FILE``, ``IMAGES_DIR``, ``LOGS_DIR`` with ``ERRORS_FILE``, ``LOCK_FILE``).
- Every file the run writes by name goes through ``open_run_file`` (append/read-write, in place) or
  ``write_run_file`` (atomic replace): neither follows a symbolic link, and each accepts only a regular file, so
  whoever can write the folder cannot make the run overwrite a file elsewhere (a link), hang (a FIFO) or crash (a
  directory). ``check_run_files`` refuses such an entry before anything starts, ``--dry-run`` included.

- ``lock_run_folder`` holds an exclusive lock (``flock`` on ``<folder>/.fluxgrpo.lock``) for the run's life.
  A second run on the same folder is refused at once, naming the holder (pid, host, start time). The kernel
  drops the lock when its process dies, however it dies, so a lock left by a dead run is simply taken over.
  A run that ends removes the file while still holding it; a run that opened it a moment before finds, once it
  has the lock, that the file at the path is another (or none) and opens it again, so no two runs hold it.
- ``previous_run`` lists what an earlier run left (config.yaml, metrics.jsonl, checkpoints): a new run without
  ``--resume`` is refused there instead of truncating its metrics and mixing checkpoints, unless
  ``--overwrite``, which moves those files aside (``move_previous_run``), never deletes them.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import fluxgrpo.paths
from fluxgrpo.errors import FluxgrpoError

LOCK_FILE = ".fluxgrpo.lock"
CONFIG_FILE = "config.yaml"  # the resolved config, loadable with --config
METRICS_FILE = "metrics.jsonl"  # one JSON line per iteration (and per evaluation)
RUN_INFO_FILE = "run_info.json"  # versions and hardware
WANDB_ID_FILE = "wandb_run_id"
EVAL_DIR = "eval"  # eval/iteration-<k>[-ema]/ : a `fluxgrpo sample` folder per evaluation
INDEX_FILE = "index.json"  # written last in each evaluation (and sample) folder
IMAGES_DIR = "images"  # --save-images-every's flux_<rank>_<idx>.png
LOGS_DIR = "logs"  # the workers' logs
ERRORS_FILE = "errors.txt"  # in LOGS_DIR: every rank's error and traceback after a failed run
RUN_FILES = (CONFIG_FILE, METRICS_FILE, RUN_INFO_FILE)
CHECKPOINT_PATTERN = "checkpoint-*"
BEST_DIR = "best"  # --keep-best's checkpoint (checkpoint.BEST_DIR)
# Everything a run writes in its folder besides checkpoints: what --overwrite moves aside.
RUN_OUTPUTS = frozenset(
    {
        *RUN_FILES,
        WANDB_ID_FILE,
        EVAL_DIR,
        IMAGES_DIR,
        LOGS_DIR,
        BEST_DIR,
        "tensorboard",
        "wandb",
        "report.html",
        "report.png",
    }
)
# Written by name into the folder (the lock, and what a resume reads back).
NAMED_FILES = (LOCK_FILE, *RUN_FILES, WANDB_ID_FILE)

_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _not_regular(path: Path, kind: str) -> FluxgrpoError:
    return FluxgrpoError(
        f"{path} is {kind}, not a regular file: fluxgrpo writes the run's files only as regular files in the "
        "folder; remove it, or choose another --output-dir"
    )


def check_regular_or_absent(path: str | Path) -> None:
    """Raise FluxgrpoError (one line) when ``path`` exists as anything but a regular file, a link included."""
    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise _not_regular(path, _kind(mode))


def check_run_files(folder: str | Path) -> None:
    """Refuse, before anything starts, a run folder whose named files (the lock, config.yaml, metrics.jsonl,
    run_info.json, wandb_run_id) are links, directories, FIFOs or sockets, or whose eval/, images/ or logs/ is a
    link (the run would write wherever it points)."""
    for name in NAMED_FILES:
        check_regular_or_absent(Path(folder, name))
    for name in (EVAL_DIR, IMAGES_DIR, LOGS_DIR):  # folders the run writes into: real folders, not links out
        path = Path(folder, name)
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            raise FluxgrpoError(
                f"{path} is {'a symbolic link' if path.is_symlink() else 'not a folder'}: the run writes its "
                f"{name}/ files only into a real folder inside --output-dir; remove it, or choose another --output-dir"
            )


def _open_fd(path: Path, flags: int, mode: int = 0o666) -> int:
    """os.open without following a link; a FIFO is opened without blocking and then refused like any non-file."""
    try:
        fd = os.open(path, flags | _NO_FOLLOW | os.O_NONBLOCK, mode)
    except OSError:
        with contextlib.suppress(OSError):
            kind = os.lstat(path).st_mode
            if not stat.S_ISREG(kind):
                raise _not_regular(path, _kind(kind)) from None
        raise
    kind = os.fstat(fd).st_mode
    if not stat.S_ISREG(kind):
        os.close(fd)
        raise _not_regular(path, _kind(kind))
    os.set_blocking(fd, True)
    return fd


def open_run_file(path: str | Path, mode: str = "a") -> IO[Any]:
    """Open a run file in place: ``"a"`` appends (created if absent), ``"r"`` reads text, ``"rb"`` bytes; never
    through a link, and only a regular file (else one-line FluxgrpoError)."""
    flags = {"a": os.O_WRONLY | os.O_APPEND | os.O_CREAT, "r": os.O_RDONLY, "rb": os.O_RDONLY}[mode]
    fd = _open_fd(Path(path), flags)
    if mode == "rb":
        return os.fdopen(fd, mode)
    return os.fdopen(fd, mode, buffering=1 if mode == "a" else -1, encoding="utf-8")


def write_run_file(path: str | Path, text: str) -> Path:
    """Replace ``path`` with ``text`` atomically (``paths.write_atomic``), refusing a link or non-file there."""

    check_regular_or_absent(path)
    return fluxgrpo.paths.write_atomic(path, text)


def read_run_file(path: str | Path) -> str:
    """A run file's text, read without following a link (one-line FluxgrpoError for a non-file)."""
    with open_run_file(path, "r") as f:
        return f.read()


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

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    for _attempt in range(3):
        fd = _open_fd(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise _in_use_error(folder, holder) from None
        if _same_file(fd, path):
            break
        # the run that held it removed the file as it ended, after we opened it: lock the file there now
        os.close(fd)
    else:
        raise FluxgrpoError(f"cannot lock {path}: it keeps being replaced; is another run starting there?")
    try:
        previous = _read_holder(fd)
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "command": " ".join(sys.argv),
        }
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        try:
            os.write(fd, json.dumps(record).encode())
        except OSError as exc:  # a full disk: name the file, so the one line names the folder
            exc.filename = exc.filename or str(folder / LOCK_FILE)
            raise
        try:
            yield previous
        finally:
            # A finished run leaves no lock file behind. Removed while still held: a run that opened it a moment
            # ago finds its flock refused now, or (once this one is closed) a file no longer there, and retries.
            with contextlib.suppress(OSError):
                os.unlink(path)
    finally:
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``fd`` is still the file at ``path`` (not one unlinked since it was opened)."""
    try:
        there = os.lstat(path)
    except OSError:
        return False
    mine = os.fstat(fd)
    return (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino)


def check_not_in_use(folder: str | Path) -> None:
    """Raise if a live run holds ``folder``'s lock now. A probe that writes nothing (``--dry-run`` uses it): a
    shared lock, released at once, that fails while a run holds the exclusive one."""
    path = Path(folder, LOCK_FILE)
    check_regular_or_absent(path)
    if sys.platform == "win32" or not path.is_file():
        return

    fd = _open_fd(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _in_use_error(Path(folder), _read_holder(fd)) from None
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def previous_run(folder: str | Path) -> list[str]:
    """The names of an earlier run's files in ``folder``; empty when there are none, and when the run never
    completed an iteration (no checkpoint, no metrics record): a start that failed (weights that cannot be loaded,
    a full disk, out of memory at the first forward) does not block its own re-run. A run file fluxgrpo did not
    write (``foreign_run_files``) always counts: it is someone's file, never a failed start's."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    checkpoints = sorted(p.name for p in folder.glob(CHECKPOINT_PATTERN))
    metrics = folder / METRICS_FILE
    if not checkpoints and not (metrics.is_file() and metrics.stat().st_size > 0):
        return foreign_run_files(folder)
    found = [name for name in RUN_FILES if (folder / name).exists()]
    return found + checkpoints


# How the files a run writes begin: config.yaml (``config.save_resolved``) and run_info.json (``metrics.run_info``).
RESOLVED_CONFIG_HEADER = b"# Resolved fluxgrpo training config"
_RUN_INFO_KEYS = frozenset({"versions", "hardware"})


def _written_by_a_run(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return False  # unreadable: not provably ours
    if path.name == CONFIG_FILE:
        return head.startswith(RESOLVED_CONFIG_HEADER)
    if path.name == RUN_INFO_FILE:
        try:
            info = json.loads(head)
        except ValueError:
            return False
        return isinstance(info, dict) and (not info or set(info) >= _RUN_INFO_KEYS)  # {}: a start cut short
    return True


def foreign_run_files(folder: str | Path) -> list[str]:
    """The run files in ``folder`` (config.yaml, run_info.json) that fluxgrpo did not write: a user's own
    ``config.yaml`` is never replaced by a run's resolved one, nor taken for a failed start's."""
    folder = Path(folder)
    return [
        name
        for name in (CONFIG_FILE, RUN_INFO_FILE)
        if (folder / name).is_file() and (folder / name).stat().st_size > 0 and not _written_by_a_run(folder / name)
    ]


def replaced_folder(folder: str | Path) -> Path:
    """Where ``--overwrite`` moves an earlier run: ``<folder>.replaced-<UTC time>`` beside it (``-2``, ``-3``, ...
    appended when a run was already moved there within the same second)."""
    folder = Path(os.path.abspath(folder))  # a name to put beside it even for `.` or `..`
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    target = folder.with_name(f"{folder.name}.replaced-{stamp}")
    count = 1
    while target.exists() or target.is_symlink():
        count += 1
        target = folder.with_name(f"{folder.name}.replaced-{stamp}-{count}")
    return target


def run_entries(folder: str | Path) -> list[Path]:
    """What a run wrote in ``folder`` (RUN_OUTPUTS and checkpoints, finished or not); never the lock, and never
    another file that happens to be there (the folder may be a working directory holding the user's own files)."""
    folder = Path(folder)
    return sorted(
        entry
        for entry in folder.iterdir()
        if entry.name in RUN_OUTPUTS
        or entry.match(CHECKPOINT_PATTERN)
        or entry.match(CHECKPOINT_PATTERN + ".*")
        or entry.match(BEST_DIR + ".*")
    )


def move_previous_run(folder: str | Path) -> Path:
    """Move an earlier run's files (``run_entries``) in ``folder`` to ``replaced_folder(folder)``; returns that
    folder. Everything else in ``folder`` stays where it is.

    Call it while holding the folder's lock: no live run's files are moved.

    Raises:
        FluxgrpoError: the files cannot be moved (one line naming the folder).
    """
    folder = Path(folder)
    target = replaced_folder(folder)
    try:
        target.mkdir(parents=True)
        for entry in run_entries(folder):
            entry.rename(target / entry.name)
    except OSError as exc:
        raise FluxgrpoError(
            f"--overwrite could not move the earlier run in {folder} to {target} ({exc.strerror or exc}): move or "
            "delete it yourself, or choose another --output-dir"
        ) from None
    return target


def is_run_folder(folder: str | Path) -> bool:
    """A training run's ``--output-dir``: it holds the run's lock, a resolved config, metrics or a checkpoint."""
    folder = Path(folder)
    config = folder / CONFIG_FILE
    return (
        (folder / LOCK_FILE).exists()
        or (folder / METRICS_FILE).is_file()
        or (config.is_file() and _written_by_a_run(config))
        or any(entry.is_dir() for entry in folder.glob(CHECKPOINT_PATTERN))
    )


def enclosing_run(path: str | Path) -> Path | None:
    """The training run folder ``path`` is (or lies inside), or None: a run's eval/iteration-<k>/ is its record of
    that evaluation, never another command's output folder."""
    path = Path(os.path.abspath(path))
    for folder in (path, *path.parents):
        if folder.is_dir() and is_run_folder(folder):
            return folder
    return None


def move_aside(folder: str | Path, flag: str) -> Path | None:
    """Move ``folder`` (when it holds anything) to ``replaced_folder(folder)`` beside it and leave it empty;
    returns where it went (None when there was nothing to move). Never deletes.

    Raises:
        FluxgrpoError: it cannot be moved (one line naming ``flag``).
    """
    folder = Path(folder)
    if not folder.is_dir() or not any(folder.iterdir()):
        return None
    target = replaced_folder(folder)
    try:
        folder.rename(target)
        folder.mkdir()
    except OSError as exc:
        raise FluxgrpoError(
            f"{flag} could not move {folder} to {target} ({exc.strerror or exc}): move it yourself, or choose "
            f"another {flag.split()[0]}"
        ) from None
    return target
