"""Cheap checks that a weights file placed by hand is whole: the safetensors header parses and the file is as long
as the header says. A folder fetched by ``fetch-weights`` has a manifest with sizes instead; a folder copied in by
hand has neither, so a truncated copy would otherwise pass every check and fail deep inside model loading.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

# A safetensors file starts with the byte length of its JSON header (u64, little endian); headers are kilobytes to a
# few megabytes, so anything near this is damage, not a header.
_MAX_HEADER_BYTES = 100 * 2**20


def safetensors_problem(path: str | Path) -> str | None:
    """Why ``path`` is not a whole safetensors file, or None when its header parses and its length matches."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                return f"{path} is truncated ({size} bytes, shorter than a safetensors header)"
            (header_bytes,) = struct.unpack("<Q", prefix)
            if header_bytes > _MAX_HEADER_BYTES:
                return f"{path} has a damaged header (it claims {header_bytes} header bytes)"
            if header_bytes > size - 8:
                return f"{path} is truncated ({size} bytes, shorter than its {header_bytes}-byte header)"
            header = json.loads(f.read(header_bytes))
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror or exc})"
    except (ValueError, UnicodeDecodeError):
        return f"{path} has a damaged header (not the JSON a safetensors file starts with)"
    if not isinstance(header, dict):
        return f"{path} has a damaged header (not a JSON object)"
    try:
        data_bytes = max(
            (int(entry["data_offsets"][1]) for name, entry in header.items() if name != "__metadata__"), default=0
        )
    except (KeyError, TypeError, ValueError, IndexError):
        return f"{path} has a damaged header (a tensor entry without data_offsets)"
    expected = 8 + header_bytes + data_bytes
    if size != expected:
        return f"{path} is {'truncated' if size < expected else 'longer than its header says'} ({size} bytes, expected {expected})"
    return None


def folder_safetensors_problems(folder: str | Path) -> list[str]:
    """``safetensors_problem`` of every ``*.safetensors`` file directly in ``folder``."""
    found = (safetensors_problem(p) for p in sorted(Path(folder).glob("*.safetensors")))
    return [problem for problem in found if problem is not None]
