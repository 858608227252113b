"""``torch_npu.utils.get_cann_version`` as the stand-in reports it (tests may edit CANN_VERSIONS)."""

from __future__ import annotations

# What torch_npu answers per CANN module; '' is its answer for an unknown module or a CANN older than 8.1.RC1.
CANN_VERSIONS: dict[str, str] = {"CANN": "8.3.RC1", "RUNTIME": "8.3.RC1", "HCCL": "8.3.RC1"}


def get_cann_version(module: str = "CANN") -> str:
    return CANN_VERSIONS.get(module, "")
