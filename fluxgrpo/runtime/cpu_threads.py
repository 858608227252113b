"""How many intra-op threads each CPU worker runs: the cores this process may use (its affinity, capped by a
container's CPU quota) that other work is not already using, shared out among the node's workers, at least one each.

"Not already using" is read now, from ``/proc/stat`` over a quarter of a second on this process's cores, not from the
load average: that decays over about a minute, so for some 40 s after a 1-core job of a few minutes ends (the previous
command of a script) it still reads above 0.5, and one worker then ran on 1 thread of an idle 2-core machine, 1.1–1.3×
slower than on 2 (dance's iterations, 2026-12-07, results/performance.md). The load average stays the fallback where
``/proc/stat`` cannot be read.

torch's own default is every core of the machine whatever else runs on it: on a busy 2-core machine a single
worker's 2 threads spin against the other jobs (an evaluation took 732 s there, 18 s with one thread, #50.10). The
launcher decides once per command (``plan_cpu_threads``), hands the number to the workers in ``THREADS_ENV`` and
says it in the start-up line; ``OMP_NUM_THREADS`` or ``FLUXGRPO_CPU_THREADS``, when the user sets them, win.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

THREADS_ENV = "FLUXGRPO_CPU_THREADS"  # the workers' intra-op threads (the launcher's choice, or the user's)
_CGROUP = Path("/sys/fs/cgroup")
_PROC_STAT = Path("/proc/stat")
SAMPLE_SECONDS = 0.25  # long enough to see a busy core (the kernel counts in 10 ms ticks), short at start-up


@dataclass(frozen=True)
class CpuThreads:
    threads: int  # intra-op threads per worker
    reason: str  # what they were chosen from, for the start-up line

    def text(self) -> str:
        return f"{self.threads} CPU thread{'s' if self.threads != 1 else ''} per worker ({self.reason})"


def _positive_int(text: str | None) -> int | None:
    try:
        value = int(str(text).strip())
    except ValueError:
        return None
    return value if value > 0 else None


def _quota_cores(root: Path = _CGROUP) -> int | None:
    """The container's CPU quota in whole cores (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``); None: none."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    if quota == "max" or (_positive_int(quota) is None) or (_positive_int(period) is None):
        return None
    return max(1, math.ceil(int(quota) / int(period)))


def available_cores(root: Path = _CGROUP) -> int:
    """The cores this process may run on: its CPU affinity, capped by a container's quota."""
    cores = len(_own_cpus())
    quota = _quota_cores(root)
    return max(1, min(cores, quota) if quota else cores)


def _cpu_times(cpus: set[int], stat: Path) -> dict[int, tuple[int, int]]:
    """Each of ``cpus``' (busy, total) clock ticks since boot, from ``/proc/stat``'s per-CPU lines."""
    times: dict[int, tuple[int, int]] = {}
    for line in stat.read_text().splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        ticks = [int(field) for field in fields[:8]]  # user nice system idle iowait irq softirq steal
        idle = ticks[3] + ticks[4]
        times[int(name[3:])] = (sum(ticks) - idle, sum(ticks))
    return times


def busy_cores_now(cpus: set[int], stat: Path = _PROC_STAT, seconds: float = SAMPLE_SECONDS) -> float | None:
    """How many of ``cpus`` other work keeps busy right now (this process sleeps while it measures); None where
    ``/proc/stat`` cannot be read (not Linux)."""
    try:
        before = _cpu_times(cpus, stat)
        time.sleep(seconds)
        after = _cpu_times(cpus, stat)
    except (OSError, ValueError, IndexError):
        return None
    busy = 0.0
    for cpu, (busy_after, total_after) in after.items():
        busy_before, total_before = before.get(cpu, (busy_after, total_after))
        if total_after > total_before:
            busy += (busy_after - busy_before) / (total_after - total_before)
    return busy if after else None


def _own_cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def other_work(cpus: set[int]) -> tuple[float, str]:
    """The cores other work is using, and how it was read, for the start-up line."""
    busy = busy_cores_now(cpus)
    if busy is not None:
        return busy, f"{busy:.1f} busy now"
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    return load, f"load {load:.1f}"


def choose_threads(workers: int, cores: int, load: float) -> int:
    """Threads per worker for ``workers`` on this node, from ``cores`` and the ``load`` other work puts on them."""
    idle = max(1, min(cores, round(cores - load)))
    return max(1, idle // max(1, workers))


@lru_cache(maxsize=8)
def plan_cpu_threads(workers: int) -> CpuThreads:
    """The command's choice, once per process (the start-up line and the workers agree)."""
    for name in (THREADS_ENV, "OMP_NUM_THREADS"):
        given = _positive_int(os.environ.get(name))
        if given is not None:
            return CpuThreads(given, f"{name}={given}")
    cores = available_cores()
    load, reading = other_work(_own_cpus())
    threads = choose_threads(workers, cores, load)
    shared = f" shared by {workers} workers" if workers > 1 else ""
    return CpuThreads(threads, f"{cores} cores{shared}, {reading}")


def apply_cpu_threads(distributed: bool) -> None:
    """In a CPU worker: the launcher's thread count (``THREADS_ENV``); without one, 1 when several workers share
    the host (a worker started by other means)."""

    threads = _positive_int(os.environ.get(THREADS_ENV))
    if threads is not None:
        torch.set_num_threads(threads)
    elif distributed:
        torch.set_num_threads(1)  # N workers share the host's cores; oversubscription is far slower
