"""Nominal die-to-die bandwidth, for ``env-check --deep``'s collectives check.

Figures are per device and per direction, in GB/s (10⁹ bytes), the "bus bandwidth" a ring all-reduce can reach
(nccl-tests' busbw): NVLink 4 on H100/H200 SXM is 900 GB/s bidirectional, 450 each way; NVLink 3 on A100 SXM 600,
300 each way. PCIe cards and Ascend's HCCS are not listed (their topology decides what a ring sees), so no ratio is
reported for them.
"""

from __future__ import annotations

NOMINAL_BUS_GBPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 0.0),  # listed to stop the "H100" match below: no NVLink ring figure
    ("H200 NVL", 0.0),
    ("H100 NVL", 0.0),
    ("H200", 450.0),
    ("H100", 450.0),
    ("A100-SXM", 300.0),
)


def nominal_bus_gbps(device_type: str, device_name: str) -> tuple[float | None, str]:
    """(GB/s per direction, where it comes from); (None, why) when unknown."""
    if device_type == "cuda":
        for fragment, gbps in NOMINAL_BUS_GBPS:
            if fragment.lower() in device_name.lower():
                if gbps:
                    return gbps, f"NVLink of {fragment}: {gbps:.0f} GB/s per direction"
                break
    return None, f"no nominal die-to-die figure for {device_type} {device_name!r}"
