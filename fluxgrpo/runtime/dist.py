"""Process group bring-up and teardown from torchrun's environment, and the few collectives we use.

A single process (no torchrun variables) is a world of size 1 and never creates a process group, so
``--dies 1`` runs in-process with no rendezvous.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fluxgrpo.runtime import device as rt_device
from fluxgrpo.runtime.npu_env import apply_npu_env_defaults

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the job."""

    rank: int
    local_rank: int
    world_size: int
    device_type: str  # npu | cuda | cpu
    device: Any  # torch.device
    backend: str  # hccl | nccl | gloo

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def torchrun_env() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's variables; (0, 0, 1) outside torchrun."""
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return rank, local_rank, world_size


def init_distributed(requested_device: str | None = None, timeout_minutes: int = 30) -> DistContext:
    """Pick the device from LOCAL_RANK, set matmul precision, and join the process group when world > 1.

    On NPU the recipe's environment defaults are applied first (the user's values win).
    """
    import torch.distributed as dist

    rank, local_rank, world_size = torchrun_env()
    device_type = rt_device.resolve_device_type(requested_device)
    if device_type == "npu":
        apply_npu_env_defaults()
    device = rt_device.device_for_local_rank(device_type, local_rank)
    rt_device.set_matmul_precision(device_type)
    backend = rt_device.backend_for(device_type)
    if world_size > 1 and not dist.is_initialized():
        kwargs: dict[str, Any] = {"backend": backend, "timeout": datetime.timedelta(minutes=timeout_minutes)}
        dist.init_process_group(**kwargs)
    return DistContext(rank, local_rank, world_size, device_type, device, backend)


def teardown(*, failed: bool = False) -> None:
    """Leave the process group; after a failure skip the barrier, which would wait forever for busy peers."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if not failed:
            with contextlib.suppress(Exception):
                dist.barrier()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        import torch.distributed as dist

        dist.barrier()


def all_gather_tensor(ctx: DistContext, tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate equally shaped tensors from all ranks along dim 0, in rank order."""
    if not ctx.distributed:
        return tensor
    import torch
    import torch.distributed as dist

    tensor = tensor.contiguous()  # HCCL requires contiguous inputs
    parts = [torch.empty_like(tensor) for _ in range(ctx.world_size)]
    dist.all_gather(parts, tensor)
    return torch.cat(parts, dim=0)


def all_gather_object(ctx: DistContext, obj: Any) -> list[Any]:
    if not ctx.distributed:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def all_reduce_sum(ctx: DistContext, tensor: torch.Tensor) -> torch.Tensor:
    """In-place sum over ranks (float32/int tensors only: HCCL cannot reduce fp64 or bool)."""
    if ctx.distributed:
        import torch.distributed as dist

        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(ctx: DistContext, tensor: torch.Tensor) -> torch.Tensor:
    if ctx.distributed:
        import torch.distributed as dist

        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def broadcast_object(ctx: DistContext, obj: Any, src: int = 0) -> Any:
    if not ctx.distributed:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def rank0_print(ctx: DistContext, *args: Any) -> None:
    """Log to stderr from rank 0 only."""
    if ctx.is_main:
        print(*args, file=sys.stderr, flush=True)
