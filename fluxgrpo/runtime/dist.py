"""Process group bring-up and teardown from torchrun's environment, the few collectives we use, FSDP2 helpers.

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
    from torch import nn


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
    """``obj`` from rank ``src`` on every rank (picklable objects; ``obj`` itself when not distributed)."""
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


# --------------------------------------------------------------------------------------------- FSDP2


def shard_transformer(transformer: nn.Module, cpu_offload: bool, compute_dtype: torch.dtype | None = None) -> None:
    """FSDP2: one unit per double and single block, then the root (embedders, norm_out, proj_out).

    With a reduced compute dtype the all-gathered parameters are cast to it once per gather (half the traffic,
    no per-forward casts of every weight under autocast) while gradients are reduced and kept in fp32 against
    the fp32 master shards. The rollout and the update run the same forward, so the ratio is still 1.
    None means float32.
    """
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {"offload_policy": CPUOffloadPolicy()} if cpu_offload else {}
    if compute_dtype is not None and compute_dtype != torch.float32:
        # Inputs are not cast: FLUX casts the timestep to the latents' dtype, and the RoPE cos/sin reach every
        # block as inputs; both must stay float32 (DanceGRPO feeds fp32 latents; the Ascend guide keeps RoPE fp32).
        # Autocast still runs the matmuls in the compute dtype.
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=compute_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
    for block in [*transformer.transformer_blocks, *transformer.single_transformer_blocks]:  # type: ignore[misc]  # FLUX/diffusers attribute reached through nn.Module.__getattr__
        fully_shard(block, **kwargs)
    fully_shard(transformer, **kwargs)


def reshard_sharded_modules(module: nn.Module) -> None:
    """Return every FSDP2 submodule to its sharded state; a no-op for plain modules.

    After a forward without gradients FSDP2 leaves the root's parameters unsharded (it reshards the root only
    after backward), and while they are, ``parameters()`` yields the full plain tensors instead of the sharded
    DTensors that the optimizer holds. Anything that walks the parameters (gradient clipping, the EMA) must
    see the sharded ones.
    """
    from torch.distributed.fsdp import FSDPModule

    for submodule in module.modules():
        if isinstance(submodule, FSDPModule):
            submodule.reshard()


def has_sharded_modules(module: nn.Module) -> bool:
    """Whether any submodule is FSDP2-sharded (``fully_shard``)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(submodule, FSDPModule) for submodule in module.modules())
