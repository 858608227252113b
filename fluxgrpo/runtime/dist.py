"""Process group bring-up and teardown from torchrun's environment, the few collectives we use, FSDP2 helpers.

A single process (no torchrun variables) is a world of size 1 and never creates a process group, so
``--dies 1`` runs in-process with no rendezvous.

Collectives are bounded (``CollectiveTimeout``, ``--collective-timeout``): the launcher hands the two values to
the workers in ``$FLUXGRPO_COLLECTIVE_TIMEOUT``; the process group starts with the start-up value (loading,
the first iteration), and ``steady_state`` shortens it once the first iteration is done, as torchtitan does.
Where rank 0 works alone (``wait_for_rank0``: finishing a checkpoint, scoring an evaluation) the others wait on
its heartbeat instead (``runtime/liveness.py``), so that long lone work never trips the timeout and a dead
rank 0 is noticed within it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fluxgrpo.errors import UsageError
from fluxgrpo.runtime import device as rt_device
from fluxgrpo.runtime import liveness
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
    device: torch.device
    backend: str  # hccl | nccl | gloo

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


COLLECTIVE_TIMEOUT_ENV = "FLUXGRPO_COLLECTIVE_TIMEOUT"  # "<start-up seconds>,<steady seconds>", set by the launcher
UNBOUNDED_COLLECTIVE_MINUTES = 30  # a worker started without the variable (torchrun run by hand)


@dataclass(frozen=True)
class CollectiveTimeout:
    """How long a rank waits for its peers in a collective: ``startup`` seconds until the first iteration of this
    start of the workers is done (loading weights, compiling, the first rollout), ``steady`` seconds after it."""

    startup: float = 300.0
    steady: float = 100.0

    @classmethod
    def parse(cls, text: str) -> CollectiveTimeout:
        """``"300,100"`` (start-up, steady) or ``"100"`` (both); seconds."""
        parts = [p.strip() for p in str(text).split(",")]
        try:
            values = [float(p) for p in parts]
        except ValueError:
            values = []
        if len(values) == 1:
            values = values * 2
        if len(values) != 2 or min(values) <= 0:
            raise UsageError(
                f"--collective-timeout {text!r}: give seconds as STARTUP,STEADY (e.g. 300,100) or one value for both"
            )
        return cls(values[0], values[1])

    def validate(self) -> None:
        if self.startup < self.steady:
            raise UsageError(
                f"--collective-timeout {self.text()}: the start-up value (first) must be at least the steady one"
            )

    def text(self) -> str:
        return f"{self.startup:g},{self.steady:g}"


_timeout_now: float | None = None  # the collective timeout in force in this process


def collective_timeout_from_env() -> CollectiveTimeout | None:
    text = os.environ.get(COLLECTIVE_TIMEOUT_ENV)
    return CollectiveTimeout.parse(text) if text else None


def torchrun_env() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's variables; (0, 0, 1) outside torchrun."""
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return rank, local_rank, world_size


def init_distributed(requested_device: str | None = None) -> DistContext:
    """Pick the device from LOCAL_RANK, set matmul precision, and join the process group when world > 1.

    On NPU the recipe's environment defaults are applied first (the user's values win). The group waits the
    start-up collective timeout; every rank then registers in the store and starts its heartbeat.
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
        timeouts = collective_timeout_from_env()
        timeout = (
            datetime.timedelta(seconds=timeouts.startup)
            if timeouts
            else datetime.timedelta(minutes=UNBOUNDED_COLLECTIVE_MINUTES)
        )
        dist.init_process_group(backend=backend, timeout=timeout)
        global _timeout_now
        _timeout_now = timeout.total_seconds()
        _start_liveness(rank, world_size)
    return DistContext(rank, local_rank, world_size, device_type, device, backend)


def _start_liveness(rank: int, world_size: int) -> None:
    """Register this rank and start its heartbeat under a prefix new to this start of the workers (after an
    elastic restart the store still holds the last start's keys)."""
    import uuid

    import torch.distributed as dist

    box = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    store = dist.PrefixStore(f"fluxgrpo/{box[0]}/", dist.distributed_c10d._get_default_store())
    node = int(os.environ.get("GROUP_RANK", "0"))
    liveness.install(liveness.Liveness(store, rank, world_size, node))


def steady_state(ctx: DistContext) -> None:
    """The first iteration is done: collectives now wait the steady-state timeout (a no-op without one)."""
    timeouts = collective_timeout_from_env()
    if ctx.distributed and timeouts is not None:
        import torch.distributed as dist

        dist.set_timeout(datetime.timedelta(seconds=timeouts.steady))
        global _timeout_now
        _timeout_now = timeouts.steady


def current_timeout_seconds() -> float | None:
    """The collective timeout in force now (None outside a distributed run)."""
    return _timeout_now


def wait_for_rank0(ctx: DistContext, what: str) -> None:
    """A barrier after work that rank 0 does alone (``what``: "finishing checkpoint-40"): the other ranks wait
    as long as rank 0's heartbeat goes on, and fail, naming rank 0, as soon as it fails or stays silent for the
    steady collective timeout; only then do they enter the barrier, which rank 0 has reached."""
    if not ctx.distributed:
        return
    watch = liveness.current()
    if watch is not None:
        timeouts = collective_timeout_from_env() or CollectiveTimeout()
        watch.wait_for_rank0(what, timeouts.steady)
    barrier(ctx)


def mark(position: str) -> None:
    """What this rank is doing now, named if it stops or falls behind (``liveness.mark``)."""
    liveness.mark(position)


def mark_phase_done(phase: str) -> None:
    """A phase of the marked position is done (``PhaseClock.lap`` says it)."""
    liveness.mark_phase_done(phase)


def teardown(*, failed: bool = False) -> None:
    """Leave the process group; after a failure skip the barrier, which would wait forever for busy peers."""
    import torch.distributed as dist

    liveness.install(None)
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
