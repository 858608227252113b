"""Load the FLUX transformer once per job, not once per rank: build it empty, shard it, read each shard from disk.

``FluxTransformer2DModel.from_pretrained(...).to(device)`` on every rank holds a full fp32 copy per rank in host
memory (two without ``accelerate``, which would first initialise random weights) and a full copy on every die
before FSDP2 shards it: 16 × 47.6 GB of host memory for FLUX.1-dev on a 16-die node. Here, as torchtitan does:

1. ``empty_transformer`` builds the model on the meta device (no memory);
2. the caller adapts it to the device, enables checkpointing and shards it with ``fully_shard``;
3. ``fill_transformer`` allocates only this rank's shards (``to_empty``) and reads into each shard just the rows
   it owns, straight from the safetensors files (``pread`` of that byte range; dtype converted on the way).

So every byte of the checkpoint is read once per job, host memory holds one copy of the weights summed over the
ranks (plus one in-flight slice per rank), and no die ever holds more than its shards. The reader parses the
safetensors header itself (8-byte length + JSON), so nothing in a weights file can run code. Plain (unsharded)
parameters, as with ``--dies 1``, are read whole, still without the random initialisation or a second copy.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import FluxTransformer2DModel
from torch.distributed.tensor import Shard

from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.models.flux import read_transformer_config

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"

# safetensors dtype names (the format's spec) → torch dtypes
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER_BYTES = 100 * 2**20  # the format's own limit on the JSON header


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor lives in a safetensors file."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the first element in the file

    @property
    def row_bytes(self) -> int:
        """Bytes of one index along dim 0 (the whole tensor for a scalar)."""
        inner = math.prod(self.shape[1:]) if self.shape else 1
        return inner * torch.empty((), dtype=self.dtype).element_size()


def read_safetensors_header(path: Path) -> dict[str, StoredTensor]:
    """Tensor name → location, from a safetensors file's header alone (no tensor data is read)."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > _MAX_HEADER_BYTES:
                raise ValueError(f"header of {length} bytes is larger than the format allows")
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as exc:
        raise FluxgrpoError(
            f"cannot read the safetensors header of {path} ({exc}): the file is damaged or incomplete; "
            "run `fluxgrpo fetch-weights` again"
        ) from exc
    data_start = 8 + length
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in SAFETENSORS_DTYPES:
            raise FluxgrpoError(f"{path}: tensor {name} has dtype {entry['dtype']}, which fluxgrpo cannot load")
        begin, _ = entry["data_offsets"]
        out[name] = StoredTensor(path, SAFETENSORS_DTYPES[entry["dtype"]], tuple(entry["shape"]), data_start + begin)
    return out


def transformer_weight_files(flux_dir: str | Path) -> list[Path]:
    """The transformer's safetensors files, as diffusers picks them: the index's shards, or the single file."""
    folder = Path(flux_dir) / "transformer"
    index = folder / WEIGHTS_INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    if (folder / WEIGHTS_NAME).is_file():
        return [folder / WEIGHTS_NAME]
    raise FluxgrpoError(
        f"{folder} has neither {WEIGHTS_NAME} nor {WEIGHTS_INDEX_NAME}: run `fluxgrpo fetch-weights --flux-dir "
        f"{flux_dir}` (fluxgrpo loads the safetensors transformer only)"
    )


def empty_transformer(flux_dir: str | Path) -> FluxTransformer2DModel:
    """The FLUX transformer from ``transformer/config.json`` on the meta device (no storage), in torch's default
    dtype (fp32), in eval mode and naming its source as ``from_pretrained`` leaves it."""

    config = read_transformer_config(flux_dir)
    with torch.device("meta"):
        model = FluxTransformer2DModel.from_config(config)
    model.register_to_config(_name_or_path=str(flux_dir))
    return model.eval()


def own_rows(parameter: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(this rank's local tensor, index of its first row in the full tensor) for a plain or Shard(0) parameter."""
    placements = getattr(parameter, "placements", None)
    if placements is None:
        return parameter.data, 0

    if len(placements) != 1 or placements[0] != Shard(0):
        raise FluxgrpoError(
            f"cannot fill a parameter sharded as {placements}: fluxgrpo loads FSDP2's default dim-0 sharding only"
        )
    mesh = parameter.device_mesh  # type: ignore[attr-defined]  # an FSDP2 parameter is a DTensor
    rows_per_rank = math.ceil(parameter.shape[0] / mesh.size()) if parameter.dim() else 0
    # FSDP2 splits dim 0 as torch.chunk does: ceil(rows / ranks) per rank, the last ones shorter or empty.
    return parameter.to_local(), min(  # type: ignore[attr-defined]  # an FSDP2 parameter is a DTensor
        mesh.get_local_rank() * rows_per_rank, parameter.shape[0] if parameter.dim() else 0
    )


def _read_rows(stored: StoredTensor, first_row: int, rows: int, fd: int) -> torch.Tensor:
    """Rows [first_row, first_row + rows) of a stored tensor, in its stored dtype, on the host."""
    shape = (rows, *stored.shape[1:]) if stored.shape else ()
    out = torch.empty(shape, dtype=stored.dtype)
    raw = out.view(-1).view(torch.uint8).numpy() if out.numel() else None
    if raw is None:
        return out
    start = stored.offset + first_row * stored.row_bytes
    view, done = memoryview(raw), 0  # type: ignore[arg-type]  # ndarray has the buffer protocol; numpy's stubs lack __buffer__ before 3.12
    while done < len(view):  # pread may return less than asked for very large reads
        count = os.preadv(fd, [view[done:]], start + done)
        if count <= 0:
            raise FluxgrpoError(f"{stored.path} ended early: the file is truncated; run `fluxgrpo fetch-weights` again")
        done += count
    return out


def _named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*model.named_parameters(), *model.named_buffers()]


@torch.no_grad()
def fill_transformer(
    model: torch.nn.Module,
    flux_dir: str | Path,
    device: torch.device | str,
    stored_name: Callable[[str], str | None] = lambda name: name,
) -> None:
    """Allocate the (possibly FSDP2-sharded) meta ``model`` on ``device`` and read its weights from the
    transformer's safetensors, each rank reading only the rows of each tensor that it owns. Each tensor is
    converted to the dtype the model gives it (fp32, or the compute dtype for a frozen LoRA base).

    ``stored_name`` maps a parameter's name to its name in the files; None leaves that tensor allocated but
    unread (a LoRA adapter, which the caller initialises).

    Raises:
        FluxgrpoError: a parameter is missing from the files or has another shape (names the fix).
    """
    files = transformer_weight_files(flux_dir)
    stored: dict[str, StoredTensor] = {}
    for path in files:
        stored.update(read_safetensors_header(path))
    names = [stored_name(name) for name, _ in _named_tensors(model)]
    missing = [name for name in names if name is not None and name not in stored]
    if missing:
        raise FluxgrpoError(
            f"{Path(flux_dir) / 'transformer'} lacks {len(missing)} of the model's weights (e.g. {missing[:3]}): it "
            f"is not a FLUX transformer matching its config.json; run `fluxgrpo fetch-weights --flux-dir {flux_dir}`"
        )
    model.to_empty(device=device)
    descriptors = {path: os.open(path, os.O_RDONLY) for path in files}
    try:
        # to_empty may replace the tensors, so they are listed again, in the same order
        for (_, tensor), name in zip(_named_tensors(model), names, strict=True):
            if name is None:
                continue
            entry = stored[name]
            if tuple(tensor.shape) != entry.shape:
                raise FluxgrpoError(
                    f"{entry.path}: {name} has shape {list(entry.shape)} but the model built from config.json "
                    f"expects {list(tensor.shape)}; run `fluxgrpo fetch-weights --flux-dir {flux_dir}` again"
                )
            local, first_row = own_rows(tensor)
            rows = local.shape[0] if local.dim() else 0
            local.copy_(_read_rows(entry, first_row, rows, descriptors[entry.path]))
    finally:
        for fd in descriptors.values():
            os.close(fd)
