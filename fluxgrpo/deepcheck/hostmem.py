"""Host memory of this process: resident set now, and its peak since a reset (Linux ``/proc``).

On entry the C heap's free pages are returned to the kernel first, so that what the block allocates shows as a
rise even where it reuses memory freed earlier. The peak is the kernel's own high-water mark (``VmHWM``), reset by writing 5 to ``/proc/self/clear_refs``, so a
short allocation between two reads is never missed. Where that reset is refused, a thread samples ``VmRSS`` every
few milliseconds instead (``HostPeak.method`` says which). Both are None where ``/proc`` is missing (macOS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from pathlib import Path
from typing import Any

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_SAMPLE_SECONDS = 0.005


def _status_bytes(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        return None
    return None


def rss_bytes() -> int | None:
    """Resident set size of this process now."""
    return _status_bytes("VmRSS")


def _release_free_heap() -> None:
    """Hand the C heap's free pages back to the kernel (glibc's ``malloc_trim``), so that memory freed before the
    block and reused inside it counts in the block's rise instead of hiding in the resident set already."""

    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl, macOS): the rise may under-count reused memory
        return


class HostPeak:
    """The peak resident set of this process while the ``with`` block runs, and its rise over the start.

    ``start`` is the resident set on entry, ``peak`` the highest during the block, ``rise`` = peak − start.
    """

    def __init__(self) -> None:
        self.start: int | None = None
        self.peak: int | None = None
        self.method = "unavailable"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sampled = 0

    def __enter__(self) -> HostPeak:
        _release_free_heap()
        self.start = rss_bytes()
        if self.start is None:
            return self
        try:
            _CLEAR_REFS.write_text("5")  # the kernel resets VmHWM to the current resident set
            self.method = "VmHWM"
        except OSError:
            self.method = "sampled VmRSS"
            self._sampled = self.start
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(_SAMPLE_SECONDS):
            self._sampled = max(self._sampled, rss_bytes() or 0)

    def __exit__(self, *exc: Any) -> None:
        if self.method == "VmHWM":
            self.peak = _status_bytes("VmHWM")
        elif self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak = max(self._sampled, rss_bytes() or 0)

    @property
    def rise(self) -> int | None:
        return None if self.start is None or self.peak is None else max(0, self.peak - self.start)

    def to_dict(self) -> dict[str, Any]:
        return {"start_bytes": self.start, "peak_bytes": self.peak, "rise_bytes": self.rise, "method": self.method}
