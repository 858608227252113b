"""Errors the CLI turns into one clear line and an exit code.

Every message says what went wrong, why, and what to do (the flag or command that fixes it).
"""

import errno
import os
import shutil


class FluxgrpoError(Exception):
    """A runtime failure the user can act on; the CLI prints it and exits 1."""

    exit_code = 1


class UsageError(FluxgrpoError):
    """Bad flags or inconsistent settings; the CLI prints it and exits 2."""

    exit_code = 2


def not_usable(what: str, problems: list[str], fix: str | None) -> FluxgrpoError:
    """The one message for inputs that failed their check: ``<what> are not usable (<problems>): <fix>``.

    Args:
        what: the inputs and where they are, e.g. "FLUX weights in data/flux".
        problems: each thing found wrong, joined with "; ".
        fix: the command or flag that fixes it.
    """
    return FluxgrpoError(f"{what} are not usable ({'; '.join(problems)}): {fix}")


def _chain(exc: BaseException):
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _is_disk_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    # shutil.copytree gathers its failures as text, and safetensors reports the OS error only in its message
    text = str(exc)
    return "No space left on device" in text or "os error 28" in text or "Disk quota exceeded" in text


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error in its chain) is a write that ran out of space."""
    return any(_is_disk_full(e) for e in _chain(exc))


def _free_text(folder) -> str:
    try:
        return f"{shutil.disk_usage(folder).free / 2**20:.1f} MiB free there now"
    except OSError:
        return "its free space unknown"


def os_error_reason(exc: OSError) -> str:
    """What went wrong in an OSError, in a few words: shutil.copytree gathers its failures in one ``shutil.Error``
    list (then the first one's), else the error's own text."""

    first = exc.args[0][0] if isinstance(exc, shutil.Error) and exc.args and exc.args[0] else None
    return first[2] if first else (exc.strerror or str(exc))


def disk_full_error(exc: BaseException, folder=None, need_bytes: int | None = None) -> FluxgrpoError | None:
    """One line for a write that ran out of space (ENOSPC, EDQUOT anywhere in ``exc``'s chain), naming the folder
    and its free space (and what the write needs, when the caller knows); None for any other error."""

    full = next((e for e in _chain(exc) if _is_disk_full(e)), None)
    if full is None:
        return None
    filename = getattr(full, "filename", None)
    if folder is None:
        folder = os.path.dirname(os.path.abspath(filename)) if filename else os.getcwd()
    existing = folder  # the free space of the filesystem it was going to (the folder may be removed by now)
    while existing and not os.path.isdir(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    need = f"it needs about {need_bytes / 2**20:.1f} MiB, " if need_bytes else ""
    return FluxgrpoError(
        f"no space left on device writing into {folder} ({need}{_free_text(existing)}): free space there, or choose "
        "another output folder, and run the command again"
    )
