"""The Ascend environment defaults from the Atlas A3 recipe, applied only where the user has not set them."""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass


@dataclass(frozen=True)
class NpuEnvVar:
    name: str
    recommended: str
    purpose: str


NPU_ENV_DEFAULTS: tuple[NpuEnvVar, ...] = (
    NpuEnvVar("TASK_QUEUE_ENABLE", "2", "two-stage operator dispatch pipeline (level 2 also moves workspace tasks)"),
    NpuEnvVar("COMBINED_ENABLE", "1", "optimise combinations of non-contiguous operators"),
    NpuEnvVar(
        "PYTORCH_NPU_ALLOC_CONF",
        "expandable_segments:True",
        "caching allocator with virtual-memory segments: less fragmentation over long runs",
    ),
    NpuEnvVar("HCCL_CONNECT_TIMEOUT", "1200", "seconds HCCL waits for links at start-up (16 dies start slowly)"),
)

# Shown by env-check but never set by us: they depend on the cluster.
NPU_ENV_INFORMATIONAL: tuple[str, ...] = (
    "ASCEND_RT_VISIBLE_DEVICES",
    "HCCL_EXEC_TIMEOUT",
    "HCCL_IF_IP",
    "HCCL_SOCKET_IFNAME",
    "HCCL_BUFFSIZE",
    "ASCEND_LAUNCH_BLOCKING",
    "TORCH_DEVICE_BACKEND_AUTOLOAD",
    "ASCEND_HOME_PATH",
)


def apply_npu_env_defaults(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set each recommended NPU variable that is not already set.

    Args:
        environ: the mapping to update (``os.environ`` by default; a worker's env dict when launching).

    Returns:
        The variables this call set, name → value (the user's own values are never overridden).
    """
    environ = os.environ if environ is None else environ
    applied = {}
    for var in NPU_ENV_DEFAULTS:
        if var.name not in environ:
            environ[var.name] = var.recommended
            applied[var.name] = var.recommended
    return applied
