"""Default locations, the same as DanceGRPO's so existing data keeps working. Every one is a flag."""

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from fluxgrpo.errors import FluxgrpoError, is_disk_full

DEFAULT_FLUX_DIR = "data/flux"
DEFAULT_HPS_DIR = "hps_ckpt"
DEFAULT_PROMPTS_DIR = "data/eval_prompts"  # benchmark prompt sets (`fetch-weights --only hpdv2-prompts`)
# --hps-dir's help wherever a command reads reward weights from it (train, env-check, score, bench).
HPS_DIR_HELP = (
    "Folder of the reward weights (`fetch-weights --hps-dir`): the HPS and open_clip files, pickscore/, imagereward/, "
    "hpsv3/."
)
DEFAULT_EMBEDDINGS_DIR = "data/rl_embeddings"
DEFAULT_OUTPUT_DIR = "data/outputs/grpo"
EMBEDDINGS_INDEX = "videos2caption.json"
DEFAULT_SAMPLES_DIR = "data/outputs/samples"


def ensure_writable_dir(folder, what: str, flag: str) -> None:
    """Create ``folder`` if needed and prove it writable, before any model loads.

    Args:
        what: what goes there, for the message ("embeddings", "images", "checkpoints").
        flag: the flag that chooses the folder ("--out", "--output-dir").

    Raises:
        FluxgrpoError: it cannot be created or written, naming the flag that picks another.
    """

    folder = Path(folder)
    if _created_scopes:  # remember the outermost folder this call creates, to remove it if the command fails
        top, existing = None, folder
        while not existing.exists() and existing != existing.parent:
            top, existing = existing, existing.parent
        if top is not None:
            _created_scopes[-1].append(top)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-probe-{os.getpid()}.tmp"  # per process: ranks may probe one folder at once
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise FluxgrpoError(
            f"cannot write {what} to {folder} ({exc.strerror or exc}): pass a writable folder with {flag}"
        ) from None


_created_scopes: list[list[Any]] = []


@contextmanager
def empty_folders_removed_on_failure() -> Iterator[None]:
    """When the block fails, remove again the folders :func:`ensure_writable_dir` created inside it, as far as they
    hold no file (bottom-up ``rmdir``: nothing written is ever deleted), so a failed command leaves no empty output
    folder behind."""

    created: list[Any] = []
    _created_scopes.append(created)
    try:
        yield
    except BaseException:
        for top in reversed(created):
            for dirpath, _, _ in os.walk(top, topdown=False):
                with suppress(OSError):  # it holds a file (an image, an embedding already written): kept
                    os.rmdir(dirpath)
        raise
    finally:
        _created_scopes.pop()


def check_replaceable_output(path, flag: str, signature: bytes, what: str):
    """``path`` may be written by a command: it is new, or a regular file that command wrote earlier (``signature``
    is among its first 4 KiB). Never a link, a folder, an input, a checkpoint or any other file we did not write.

    Returns:
        ``path`` as a Path.

    Raises:
        FluxgrpoError: one line naming ``flag``.
    """

    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return path
    if stat.S_ISDIR(mode):
        raise FluxgrpoError(f"{flag} {path} is a folder: pass a file name")
    if not stat.S_ISREG(mode):
        raise FluxgrpoError(
            f"{flag} {path} is not a regular file (a link?): fluxgrpo never writes through it; choose another {flag}"
        )
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError as exc:
        raise FluxgrpoError(f"cannot read {path} ({exc.strerror or exc}): choose another {flag}") from None
    if signature not in head:
        raise FluxgrpoError(
            f"{flag} {path} already exists and is not {what}: fluxgrpo replaces only a file it wrote itself; "
            f"choose another {flag}, or move that file away first"
        )
    return path


def _umask() -> int:

    # os.umask can only be read by setting it; put it straight back (no file is created in between).
    current = os.umask(0o022)
    os.umask(current)
    return current


def give_default_mode(path) -> None:
    """Give a file the mode every other file gets (0644 under the usual umask 022).

    safetensors (0.5+) writes through a private temporary file and keeps its 0600, so weights and checkpoints
    would be unreadable by the rest of a team sharing the folder.
    """

    os.chmod(path, 0o666 & ~_umask())


def write_atomic(path, data, *, durable: bool = False):
    """Write ``data`` to ``path`` so a reader never sees a half-written file: a hidden temporary name beside it
    (unique per process, so ranks never collide), then one rename over the old file.

    Args:
        data: ``str`` (written as UTF-8), ``bytes``, or a function that writes into a binary file object (for
            ``torch.save`` and the like).
        durable: fsync the file before the rename and the folder after it, so it also survives a power cut.

    Returns:
        ``path`` as a Path.
    """

    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    # The temporary name is predictable: never write through a link or into a file someone left there.
    tmp.unlink(missing_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        with os.fdopen(os.open(tmp, flags, 0o666), "wb") as f:
            if isinstance(data, str):
                f.write(data.encode("utf-8"))
            elif isinstance(data, bytes | bytearray | memoryview):
                f.write(data)
            else:
                data(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if is_disk_full(exc) and getattr(exc, "filename", None) is None:
            # PIL's and torch.save's writes carry no file name (torch's is not even an OSError): name this one
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from exc
        raise
    if durable:
        _fsync_folder(path.parent)
    return path


def _fsync_folder(folder) -> None:

    # Some filesystems (and all directories on some platforms) refuse fsync; durability is then best effort.
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
