"""Checks 4 and 5, run on every die through the one launcher (``runtime.launch.run_workers``).

**Collectives.** Time to join the process group, then all-reduce and all-gather of ``collective_bytes`` (fp32),
timed over a few repeats after a warm-up, as bus bandwidth (the collective benchmarks' convention: all-reduce algbw·2(n−1)/n,
all-gather algbw·(n−1)/n, algbw = bytes / seconds). Rule: every result is exact (a sum of rank numbers, each rank's
shard in place) and, where the device's nominal figure is known (``runtime/interconnect.py``), the all-reduce
reaches at least ``MIN_NOMINAL_FRACTION`` of it (a ring that falls back to PCIe or the host gets a tenth or less).
One process has nothing to exchange: skipped.

**Loading.** The trainer's own ``training.parts.build_transformer`` (meta-device build, FSDP2 sharding, each rank
reading only its rows) on the FLUX weights at ``flux_dir``, timed, with each rank's host resident-set rise
(``hostmem``) summed over the node. Rule: every parameter is materialised and finite, and the node's rise stays
within what one copy needs: the parameters that live in host memory (all of them on cpu, none on an accelerator)
plus one in-flight tensor per rank plus ``LOAD_SLACK_BYTES``; a per-rank full copy (``from_pretrained`` on every
rank) breaks it as soon as there are two ranks.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from diffusers import FluxTransformer2DModel  # noqa: F401  (imported with this module: its import is not the load's cost)

from fluxgrpo.config import TrainConfig
from fluxgrpo.deepcheck.hostmem import HostPeak
from fluxgrpo.models.shard_loading import read_safetensors_header, transformer_weight_files
from fluxgrpo.runtime import device as rt_device
from fluxgrpo.runtime import dist as rt_dist
from fluxgrpo.runtime.peak import device_name
from fluxgrpo.runtime.worker import worker_session
from fluxgrpo.training.parts import build_transformer

if TYPE_CHECKING:
    from fluxgrpo.runtime.dist import DistContext

MIN_NOMINAL_FRACTION = 0.25
LOAD_SLACK_BYTES = 1 << 30
WARMUP, REPEATS = 1, 3


def _collectives(ctx: DistContext, collective_bytes: int) -> dict[str, Any]:
    world = ctx.world_size
    elements = max(world, collective_bytes // 4 // world * world)
    out: dict[str, Any] = {"bytes": elements * 4, "world_size": world}
    value = torch.full((elements,), float(ctx.rank + 1), device=ctx.device)
    expected_sum = world * (world + 1) / 2
    shard = torch.full((elements // world,), float(ctx.rank + 1), device=ctx.device)
    gathered = torch.empty(elements, device=ctx.device)
    # Newer torch names it all_gather_single (and warns on the old name); older torch has only the old one.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    for name, run, factor in (
        ("all_reduce", lambda: dist.all_reduce(value), 2 * (world - 1) / world),
        ("all_gather", lambda: all_gather(gathered, shard), (world - 1) / world),
    ):
        seconds = []
        for repeat in range(WARMUP + REPEATS):
            if name == "all_reduce":
                value.fill_(float(ctx.rank + 1))
            rt_device.synchronize(ctx.device)
            start = time.perf_counter()
            run()
            rt_device.synchronize(ctx.device)
            if repeat >= WARMUP:
                seconds.append(time.perf_counter() - start)
        best = min(seconds)
        out[name] = {"seconds": best, "bus_gbps": elements * 4 / best * factor / 1e9}
    out["all_reduce"]["exact"] = bool(torch.all(value == expected_sum))
    expected = torch.arange(1, world + 1, device=ctx.device, dtype=torch.float32).repeat_interleave(elements // world)
    out["all_gather"]["exact"] = bool(torch.equal(gathered, expected))
    return out


def _load(ctx: DistContext, config: dict[str, Any]) -> dict[str, Any]:
    cfg = TrainConfig(**config)

    # The biggest tensor in flight on one rank: its stored bytes read, plus their fp32 conversion.
    largest = max(
        stored.row_bytes * (stored.shape[0] if stored.shape else 1) * (1 + 4 // stored.dtype.itemsize)
        for path in transformer_weight_files(cfg.model)
        for stored in read_safetensors_header(path).values()
    )
    rt_device.synchronize(ctx.device)
    with HostPeak() as host:
        start = time.perf_counter()
        transformer = build_transformer(cfg, ctx)
        rt_device.synchronize(ctx.device)
        seconds = time.perf_counter() - start
    local = [getattr(p, "to_local", lambda p=p: p)() for p in transformer.parameters()]
    materialised = all(not t.is_meta for t in local)
    finite = materialised and all(bool(torch.isfinite(t).all()) for t in local)
    local_bytes = sum(t.numel() * t.element_size() for t in local)
    return {
        "seconds": seconds,
        "host": host.to_dict(),
        "materialised": materialised,
        "finite": finite,
        "local_parameter_bytes": local_bytes,
        "host_resident_parameter_bytes": local_bytes if ctx.device_type == "cpu" or cfg.cpu_offload else 0,
        "largest_tensor_bytes": largest,
    }


def worker_entry(payload: dict[str, Any]) -> dict[str, Any]:
    """Every rank: join the group (timed), the collectives, then the load; rank 0 returns every rank's figures."""

    start = time.perf_counter()
    with worker_session(payload["device"]) as ctx:
        joined = time.perf_counter() - start
        # torchrun numbers ranks node by node, so a rank's node is its rank over the workers per node
        node = ctx.rank // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        figures: dict[str, Any] = {"rank": ctx.rank, "node": node, "join_seconds": joined}
        if ctx.distributed:
            first = time.perf_counter()
            rt_dist.barrier(ctx)  # the first collective builds the communicators
            figures["first_barrier_seconds"] = time.perf_counter() - first
            figures["collectives"] = _collectives(ctx, payload["collective_bytes"])
        if payload["load"] is not None:
            figures["load"] = _load(ctx, payload["load"])
        ranks = rt_dist.all_gather_object(ctx, figures)
        return {"device_type": ctx.device_type, "device_name": device_name(ctx.device), "ranks": ranks}
