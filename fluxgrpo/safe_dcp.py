"""Reading a DCP checkpoint (the training state) without letting it run code.

DCP stores two pickles: the ``.metadata`` index (read with a plain ``pickle.load`` by ``FileSystemReader``) and,
inside the ``.distcp`` shards, every non-tensor value such as the LR scheduler's state (read with
``torch.load(weights_only=False)`` by ``DefaultLoadPlanner``). A pickle can call any function while it loads, so a
checkpoint folder could run code. Here the metadata goes through an unpickler
that admits only DCP's own metadata classes and the few torch values they hold, and non-tensor values go through
torch's ``weights_only`` loader (plain containers, numbers, strings, tensors). Tensors were already read that way.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.safe_load import UnsafeFileError, refused_global

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
