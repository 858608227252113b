"""Reading the pickles fluxgrpo writes (tensor files, RNG state) and the weights folders it loads, without letting
them run code.

A pickle can call any function while it loads, so a file someone handed you could run code on ``--resume`` or
``train``. Tensor files go through torch's ``weights_only`` loader (tensors, plain containers, numbers, strings);
``load_plain`` turns its refusal, or a truncated file, into one line naming the file. DCP checkpoints (the training
state) are read in ``safe_dcp.py``: torch.distributed.checkpoint takes seconds to import, and the launching command,
which reads the embeddings through ``load_plain`` before any worker starts, never needs it.
"""

from __future__ import annotations

import logging
import pickle
import re
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fluxgrpo.errors import FluxgrpoError


class UnsafeFileError(FluxgrpoError):
    """A file that should hold only data asks to run code (or to build objects we do not admit)."""


def refused_global(exc: BaseException) -> str | None:
    """The function or class a pickle asked for that the ``weights_only`` unpickler refused, if that was the
    refusal (a file that is not a pickle at all is refused too, for an unknown opcode: that is damage)."""
    found = re.search(r"GLOBAL ([\w.]+)", str(exc))
    return found.group(1) if found else None


def load_plain(path: str | Path, fix: str, *, mmap: bool = False) -> Any:
    """``torch.load`` of a file that must hold only tensors and plain values, on the CPU.

    Args:
        fix: what the user should do about a bad file (ends the message).

    Raises:
        FileNotFoundError: ``path`` does not exist (callers name the command that makes it).
        UnsafeFileError: the file asks to run code or build other objects; nothing of it ran.
        FluxgrpoError: the file is truncated or not a torch file.
    """
    path = Path(path)
    try:
        with warnings.catch_warnings():
            # A hand-made pickle (protocol 4) makes torch warn before refusing it; the refusal says enough.
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise
    except pickle.UnpicklingError as exc:
        if refused_global(exc):
            raise UnsafeFileError(
                f"{path} holds more than tensors and plain values (it asks to call {refused_global(exc)}), so it was "
                f"not loaded: {fix}"
            ) from None
        raise FluxgrpoError(f"{path} is damaged or not a torch file (not a tensor pickle): {fix}") from None
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        # torch's own messages are paragraphs (and with mmap, about mmap); say what is wrong with the file.
        if path.is_file() and not zipfile.is_zipfile(path):
            reason = "not a torch zip archive: truncated, or some other file"
        else:
            reason = str(exc).split(". ")[0] if str(exc) else type(exc).__name__
        raise FluxgrpoError(f"{path} is damaged or not a torch file ({reason}): {fix}") from None


def _causes(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def library_load_error(exc: Exception, what: str, where: str | Path, fix: str) -> FluxgrpoError:
    """One line for a library loader's failure on a weights folder or file: a refused pickle says what it asked to
    call (never torch's advice to load it with ``weights_only=False``, which would run it), anything else its first
    line (a truncated shard, a renamed key, a missing file)."""
    # diffusers wraps torch's refusal in an OSError ("Unable to load weights from checkpoint file"): look inside
    refusal = next(
        (e for e in _causes(exc) if isinstance(e, pickle.UnpicklingError) or "Weights only load failed" in str(e)),
        None,
    )
    if refusal is not None:
        asked = refused_global(refusal)
        reason = f"it asks to call {asked}" if asked else "it is not a plain tensor pickle"
        return FluxgrpoError(
            f"cannot load {what} from {where}: a weights file holds more than tensors ({reason}), so it was not "
            f"loaded (nothing in it ran): {fix}"
        )
    first_line = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    return FluxgrpoError(f"cannot load {what} from {where} ({type(exc).__name__}: {first_line[:300]}): {fix}")


# What diffusers logs when a folder has a ``.bin`` instead of safetensors, before reading it with
# ``torch.load(weights_only=True)``: "unsafe" is not true of that read, and our own line says what the file held.
_FALLBACK_LINES = ("Defaulting to unsafe serialization", "An error occurred while trying to fetch")


class _DropPickleFallbackLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(line in record.getMessage() for line in _FALLBACK_LINES)


def load_pretrained(load: Callable[[], Any], what: str, where: str | Path, fix: str) -> Any:
    """Run a transformers/diffusers loader (``from_pretrained``, ``load_lora_weights``); any failure is one line
    (``library_load_error``). Both libraries read ``.bin`` files with ``torch.load(weights_only=True)``, and
    diffusers' lines calling that read unsafe are dropped."""
    logger = logging.getLogger("diffusers.models.modeling_utils")
    quiet = _DropPickleFallbackLines()
    logger.addFilter(quiet)
    try:
        with warnings.catch_warnings():
            # A hand-made pickle (protocol 4) makes torch warn before refusing it; the refusal says enough.
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            return load()
    except FluxgrpoError:
        raise
    except Exception as exc:  # the libraries raise OSError, ValueError, RuntimeError, EOFError, SafetensorError, ...
        raise library_load_error(exc, what, where, fix) from exc
    finally:
        logger.removeFilter(quiet)
