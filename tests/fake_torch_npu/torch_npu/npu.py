"""The device-query part of ``torch_npu.npu`` (tests may edit DEVICE_NAMES; one entry per visible die)."""

from __future__ import annotations

DEVICE_NAMES: list[str] = ["Ascend910_9391", "Ascend910_9391"]


def is_available() -> bool:
    return bool(DEVICE_NAMES)


def device_count() -> int:
    return len(DEVICE_NAMES)


def get_device_name(device: int | None = None) -> str:
    index = 0 if device is None else int(device)
    if not 0 <= index < len(DEVICE_NAMES):
        raise RuntimeError(f"invalid device index {index}: {len(DEVICE_NAMES)} visible")
    return DEVICE_NAMES[index]
