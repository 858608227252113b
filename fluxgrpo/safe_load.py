"""Reading the pickles fluxgrpo writes (tensor files, RNG state, DCP checkpoints) without letting them run code.

A pickle can call any function while it loads, so a file someone handed you could run code on ``--resume`` or
``train``. Tensor files go through torch's ``weights_only`` loader (tensors, plain containers, numbers, strings);
``load_plain`` turns its refusal, or a truncated file, into one line naming the file.

DCP stores two pickles: the ``.metadata`` index (read with a plain ``pickle.load`` by ``FileSystemReader``) and,
inside the ``.distcp`` shards, every non-tensor value such as the LR scheduler's state (read with
``torch.load(weights_only=False)`` by ``DefaultLoadPlanner``). A pickle can call any function while it loads, so a
checkpoint folder could run code. Here the metadata goes through an unpickler
that admits only DCP's own metadata classes and the few torch values they hold, and non-tensor values go through
torch's ``weights_only`` loader (plain containers, numbers, strings, tensors). Tensors were already read that way.
"""

from __future__ import annotations

import io
import logging
import pickle
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from fluxgrpo.errors import FluxgrpoError

METADATA_FILE = ".metadata"

# Every class DCP's filesystem writer pickles into ``.metadata`` (torch 2.4 – 2.14): dataclasses and one Enum whose
# construction only stores fields, plus torch's value types.
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        (_METADATA_MODULE, "Metadata"),
        (_METADATA_MODULE, "StorageMeta"),
        (_METADATA_MODULE, "TensorStorageMetadata"),
        (_METADATA_MODULE, "BytesStorageMetadata"),
        (_METADATA_MODULE, "ChunkStorageMetadata"),
        (_METADATA_MODULE, "TensorProperties"),
        (_METADATA_MODULE, "MetadataIndex"),
        (_METADATA_MODULE, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),  # turns a layout's name ("torch.strided") back into the layout
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
    }
)


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
        import zipfile

        # torch's own messages are paragraphs (and with mmap, about mmap); say what is wrong with the file.
        if path.is_file() and not zipfile.is_zipfile(path):
            reason = "not a torch zip archive: truncated, or some other file"
        else:
            reason = str(exc).split(". ")[0] if str(exc) else type(exc).__name__
        raise FluxgrpoError(f"{path} is damaged or not a torch file ({reason}): {fix}") from None


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)  # dtypes are pickled by name: torch.float32, torch.bfloat16, ...
        raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata class")


def read_dcp_metadata(path: Path) -> Metadata:
    """Unpickle a DCP ``.metadata`` file, admitting only DCP's own metadata classes.

    Raises:
        FluxgrpoError: the file is missing, truncated, or not DCP metadata (naming the file and what to do);
            ``UnsafeFileError`` when it asks for anything else (it never runs).
    """
    fix = "resume from another checkpoint with --resume-from, or start a new run from its exported transformer"
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise FluxgrpoError(f"{path} is missing, so the training state cannot be read: {fix}") from None
    except pickle.UnpicklingError as exc:
        if "is not a DCP metadata class" in str(exc):
            raise UnsafeFileError(
                f"{path} is not a checkpoint index written by fluxgrpo: it asks to load {str(exc).split()[0]}, "
                f"which could run code, so it was not read; {fix}"
            ) from None
        raise FluxgrpoError(f"{path} is damaged ({exc}): {fix}") from None
    except (OSError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as exc:
        raise FluxgrpoError(f"{path} is damaged ({type(exc).__name__}: {exc}): {fix}") from None
    if not isinstance(metadata, Metadata):
        raise FluxgrpoError(f"{path} is not DCP metadata (it holds a {type(metadata).__name__}): {fix}")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata comes from ``read_dcp_metadata`` (read once, before DCP's collectives)."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self._metadata = read_dcp_metadata(Path(path) / METADATA_FILE)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        storage_meta = getattr(self._metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = self._metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return self._metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor values with torch's ``weights_only`` loader."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            what = f"it asks to call {refused_global(exc)}" if refused_global(exc) else "it is not a plain pickle"
            raise UnsafeFileError(
                f"the value {fqn!r} in this checkpoint's .distcp files is not plain data ({what}), so it was not read"
            ) from None
        # The two branches of DefaultLoadPlanner.load_bytes, with the value it would have unpickled unchecked.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


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
