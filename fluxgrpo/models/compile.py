"""Regional ``torch.compile``: FLUX's repeated blocks compiled once per kind, the code reused by every block.

FLUX.1-dev is 19 identical double-stream blocks and 38 identical single-stream blocks (diffusers names their classes
in ``FluxTransformer2DModel._repeated_blocks``). Compiling the whole transformer traces all 57 and the glue around
them; compiling each block's ``forward`` traces one block of each kind: TorchDynamo caches compiled code on the
function's code object, and since the parameters are graph inputs (not constants), every other block of that kind
runs the same compiled code with its own weights. The module tree, its parameter names and its hooks are untouched
(only the blocks' ``forward`` is replaced), so checkpoints, LoRA adapters, activation checkpointing and FSDP2 (whose
hooks run around ``forward``, outside the compiled region) work as before.

Shapes. A compiled region is specialised to what it was traced with, and each new shape would trace again. Here
the same blocks see the rollout's batch, the update's micro-batch, the last short chunk and the evaluation's
resolution, so every call goes through ``_RegionalForward``, which makes the region's inputs uniform before they
reach the compiled code:

- every dimension but the last (batch, tokens; not the features) is marked dynamic before the first trace, so one
  graph serves every batch size and resolution. Size 1 is the exception TorchDynamo makes: a batch of one gets
  its own graph (once);
- tensor inputs are made contiguous and given their own storage: the first single block receives slices of one
  tensor (non-contiguous, aliasing each other) and the first double block a view, the others fresh tensors; left
  alone, each would be a separate graph;
- an empty ``joint_attention_kwargs`` is passed as None (FluxPipeline passes ``{}``, the training forward None, and
  the blocks read ``joint_attention_kwargs or {}``), so the evaluation's sampling reuses the rollout's graphs.

So which compiled graph runs depends only on the call (its shapes, gradient mode, adapters on or off), never on
which calls came before: a resumed run runs the same kernels as the uninterrupted one, which exact resume needs.

``CompileTally`` counts the compilations and their seconds in this process (TorchDynamo's compile callbacks), for
metrics.jsonl and the bench.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch._dynamo.callback import CallbackTrigger, callback_handler
from torch.distributed.fsdp import FSDPModule

if TYPE_CHECKING:
    from torch._dynamo.callback import CallbackArgs

# diffusers' FluxTransformer2DModel._repeated_blocks; listed here too so any module with FLUX's blocks qualifies.
FLUX_REPEATED_BLOCKS = ("FluxTransformerBlock", "FluxSingleTransformerBlock")
# Compiled graphs TorchDynamo may keep per block kind (see compile_repeated_blocks).
RECOMPILE_LIMIT = 16


def _uniform_input(value: Any) -> Any:
    """A tensor made contiguous, with its own storage and every dimension but the last marked dynamic; tuples and
    lists (FLUX's RoPE cos/sin pair) element by element; an empty dict as None; anything else as it is."""
    if isinstance(value, torch.Tensor):
        if not value.is_contiguous() or value._base is not None:
            value = value.clone(memory_format=torch.contiguous_format)
        for dim in range(value.dim() - 1):
            torch._dynamo.maybe_mark_dynamic(value, dim)
        return value
    if isinstance(value, tuple | list):
        return type(value)(_uniform_input(item) for item in value)
    if isinstance(value, dict) and not value:
        return None  # joint_attention_kwargs: FLUX's blocks read `kwargs or {}`; the pipeline passes {}, training None
    return value


class _RegionalForward:
    """A block's compiled ``forward``, called with uniform inputs (see the module docstring)."""

    def __init__(self, forward: Callable[..., Any], compiled: Callable[..., Any]) -> None:
        self.eager_forward = forward  # the block's own bound forward, kept for ``uncompiled_forward``
        self.compiled = compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args = tuple(_uniform_input(value) for value in args)
        kwargs = {name: _uniform_input(value) for name, value in kwargs.items()}
        return self.compiled(*args, **kwargs)


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """Every FLUX double- and single-stream block in ``model`` (the units regional compilation compiles)."""
    names = set(getattr(model, "_repeated_blocks", None) or FLUX_REPEATED_BLOCKS)
    return [module for module in model.modules() if _class_name(module) in names]


def _class_name(module: nn.Module) -> str:
    """The block's own class name (FSDP2 swaps a sharded module's class for a generated ``FSDP<Name>``)."""

    return next(k for k in type(module).__mro__ if not issubclass(k, FSDPModule)).__name__


def compile_repeated_blocks(model: nn.Module, backend: str = "inductor") -> int:
    """Compile the forward of every repeated block of ``model`` in place; returns how many blocks now run compiled.

    Idempotent: a block already compiled is left alone. ``backend`` is ``torch.compile``'s (inductor on CPUs and
    GPUs). Raises ValueError when ``model`` has no FLUX blocks (nothing to compile is a caller's mistake).
    """
    blocks = repeated_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no {' or '.join(FLUX_REPEATED_BLOCKS)} to compile")
    watch_compilations()
    # Graphs per block kind: (rollout and evaluation | update | LoRA reference with adapters off | ...) × (batch of
    # one | larger), a bounded set, but it can exceed TorchDynamo's default of 8, past which it silently runs eager.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    for block in blocks:
        if isinstance(block.__dict__.get("forward"), _RegionalForward):
            continue
        forward = block.forward
        # One torch.compile per block, but TorchDynamo's cache is keyed on forward's code object, which every block
        # of a kind shares: the first block of each kind compiles, the others find its code.
        # An instance attribute shadows the class's forward (as nn.Module.compile does with _call_impl).
        block.forward = _RegionalForward(forward, torch.compile(forward, backend=backend))
    return len(blocks)


def uncompile_repeated_blocks(model: nn.Module) -> None:
    """Undo ``compile_repeated_blocks``: the blocks run their own forward again (TorchDynamo keeps the compiled
    code, so compiling again costs nothing). The bench switches between eager and compiled with it."""
    for block in repeated_blocks(model):
        if isinstance(block.__dict__.get("forward"), _RegionalForward):
            del block.forward


def is_compiled(model: nn.Module) -> bool:
    """True when ``model``'s repeated blocks run compiled (``compile_repeated_blocks``)."""
    return any(isinstance(block.__dict__.get("forward"), _RegionalForward) for block in repeated_blocks(model))


# --------------------------------------------------------------------------------------------- compile tally


@dataclass(frozen=True)
class CompileTally:
    """Compilations in this process so far: how many graphs TorchDynamo traced (first compiles and recompiles; a
    backward compiled later belongs to its forward's) and the seconds all compile work took (tracing, AOTAutograd,
    code generation, deferred backward compiles)."""

    compiles: int = 0
    seconds: float = 0.0

    def __sub__(self, earlier: CompileTally) -> CompileTally:
        return CompileTally(self.compiles - earlier.compiles, self.seconds - earlier.seconds)

    def as_record(self) -> dict[str, float]:
        """The metrics.jsonl fields."""
        return {"compiles": self.compiles, "compile_seconds": self.seconds}


class _CompileCallbacks:
    """TorchDynamo's compile start/end callbacks, summed (registered once per process)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.compiles = 0
        self.seconds = 0.0
        self.started: float | None = None

    def start(self, args: CallbackArgs) -> None:
        with self.lock:
            self.started = time.perf_counter()

    def end(self, args: CallbackArgs) -> None:
        with self.lock:
            if self.started is not None:
                self.seconds += time.perf_counter() - self.started
                self.started = None
            if args.callback_trigger == CallbackTrigger.DYNAMO:
                self.compiles += 1

    def tally(self) -> CompileTally:
        with self.lock:
            return CompileTally(self.compiles, self.seconds)


_callbacks: _CompileCallbacks | None = None
_callbacks_lock = threading.Lock()


def watch_compilations() -> None:
    """Count compilations in this process from now on (idempotent); ``compile_tally`` reads the count."""
    global _callbacks
    # torch._dynamo.callback is the hook torch's own compile-time telemetry uses; it runs once per outermost
    # compilation (nested ones are folded into it). torch.compiler.reset() drops every callback, so registration
    # is checked on each call, not assumed.

    with _callbacks_lock:
        if _callbacks is None:
            _callbacks = _CompileCallbacks()
        if _callbacks.start not in callback_handler.start_callbacks:
            callback_handler.register_start_callback(_callbacks.start)
            callback_handler.register_end_callback(_callbacks.end)


def compile_tally() -> CompileTally:
    """Compilations since ``watch_compilations`` was first called in this process (zero before)."""
    return _callbacks.tally() if _callbacks is not None else CompileTally()


class CompileMeter:
    """The compilations of each interval (an iteration, an evaluation): ``lap()`` returns those since the last."""

    def __init__(self) -> None:
        watch_compilations()
        self._last = compile_tally()

    def lap(self) -> CompileTally:
        now = compile_tally()
        interval, self._last = now - self._last, now
        return interval
