"""``fluxgrpo bench --compile``: what compiling costs and what it pays, eager, regional and whole-model side by side.

One GRPO iteration (rollout at the largest ``--rollout-batch-sizes`` value, decode, reward, update at the largest
``--micro-batch-sizes`` value; activation checkpointing on unless ``--activation-checkpointing off``) is run on the
same model, inputs and weights in three modes:

- **eager**: no compilation;
- **regional**: FLUX's repeated blocks compiled (``models.compile``, what ``train --compile`` does);
- **whole-model**: the whole transformer compiled (``nn.Module.compile``), the unit the regional one replaces.

Each compiled mode's first iteration compiles: its compile seconds and graph count come from TorchDynamo's compile
callbacks. Then ``--repeats`` rounds time one iteration per mode, the modes interleaved within each round so that
a machine shared with other work slows every mode alike (the medians are compared). Per compiled mode:
speed-up = eager s/iteration ÷ its s/iteration, and break-even = compile seconds ÷ seconds saved per iteration,
the iteration after which compiling has paid for itself (None when it saves nothing). The update runs at learning
rate 0 (the harness's optimizer), so every mode trains the same weights: each compiled mode's rollout (same noise)
is compared with eager's through its final x̂0 (max |Δ| over max |x̂0|), and the update's |log ρ| of its first
micro-batch is reported (1 is the ratio of a compiled rollout to a compiled update).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from fluxgrpo.models.compile import (
    compile_repeated_blocks,
    compile_tally,
    uncompile_repeated_blocks,
    watch_compilations,
)
from fluxgrpo.models.flux import set_activation_checkpointing
from fluxgrpo.runtime import device as rt_device
from fluxgrpo.training.stages import decode_images, score_images

if TYPE_CHECKING:
    from fluxgrpo.bench.harness import _Inputs, _Sweep

COMPILE_MODES = ("eager", "regional", "whole-model")


class ConstantSchedule:
    """The bench's learning-rate schedule (here, below the harness that uses it too): none, the rate stays 0."""

    last_epoch = 0  # the optimizer steps a run's schedule counts (``update_stage``): none that moved a weight

    def step(self) -> None:
        """The learning rate stays 0."""


class _ModeSwitch:
    """Puts one transformer in each mode in turn; compiled code is kept across switches (compiling once)."""

    def __init__(self, transformer: torch.nn.Module, backend: str) -> None:
        self.transformer, self.backend = transformer, backend
        self.whole_model_call: Any = None

    def set(self, mode: str) -> None:
        uncompile_repeated_blocks(self.transformer)
        # nn.Module.compile keeps its compiled __call__ in _compiled_call_impl; None runs the module eagerly.
        self.transformer._compiled_call_impl = None
        if mode == "regional":
            compile_repeated_blocks(self.transformer, self.backend)
        elif mode == "whole-model":
            if self.whole_model_call is None:
                self.whole_model_call = torch.compile(self.transformer._call_impl, backend=self.backend)
            self.transformer._compiled_call_impl = self.whole_model_call


def _iteration(sweep: _Sweep, inputs: _Inputs, checkpointing: bool) -> tuple[float, Any, float]:
    """One GRPO iteration; returns its seconds, the rollout's final x̂0 and the update's first |log ρ|."""

    cfg, ctx, model = sweep.cfg, sweep.ctx, sweep.model
    rollout_size, micro_size = max(cfg.rollout_batch_sizes), max(cfg.micro_batch_sizes)
    transformer = model.transformer
    set_activation_checkpointing(transformer, checkpointing)
    rt_device.synchronize(ctx.device)
    start = time.perf_counter()
    rollout = sweep.setup.rollout(transformer, inputs, rollout_size, sweep.compute_dtype)
    images = decode_images(
        model.vae, rollout.final_x0, inputs.height, inputs.width, rollout_size, ctx.device_type, sweep.compute_dtype
    )
    score_images(model.reward, images, inputs.cond.captions or (), rollout_size)
    sweep.optimizer.reset()
    stats = sweep.setup.update(sweep.trainee, rollout, inputs, micro_size, sweep.compute_dtype)
    rt_device.synchronize(ctx.device)
    return time.perf_counter() - start, rollout.final_x0, stats.as_floats()["first_abs_log_ratio"]


def measure_compile_costs(
    sweep: _Sweep, inputs: _Inputs, resolution: str, backend: str, log: Callable[[str], None]
) -> list[dict[str, Any]]:
    """The ``compile`` record of each mode and one ``compile_summary`` (see the module docstring); leaves the
    transformer in regional mode, as ``train --compile`` runs it."""

    watch_compilations()
    checkpointing = sweep.cfg.activation_checkpointing != "off"
    switch = _ModeSwitch(sweep.model.transformer, backend)
    first: dict[str, dict[str, Any]] = {}
    eager_x0 = None
    for mode in COMPILE_MODES:  # eager first: it also warms the allocator and the reward's caches
        switch.set(mode)
        before = compile_tally()
        seconds, final_x0, abs_log_ratio = _iteration(sweep, inputs, checkpointing)
        compiled = compile_tally() - before
        if eager_x0 is None:
            eager_x0 = final_x0
        first[mode] = {
            "first_iteration_seconds": seconds,
            "compile_seconds": compiled.seconds,
            "compiles": compiled.compiles,
            # the whole rollout (every step's forward, the SDE noise identical) against eager's
            "max_relative_x0_difference": float((final_x0 - eager_x0).abs().max() / eager_x0.abs().max()),
            "max_abs_log_ratio": abs_log_ratio,
        }
        log(f"  compile {mode}: first iteration {seconds:.2f} s, compiling {compiled.seconds:.1f} s")
    timed: dict[str, list[float]] = {mode: [] for mode in COMPILE_MODES}
    before = compile_tally()
    for round_index in range(sweep.cfg.repeats):
        for mode in COMPILE_MODES:
            switch.set(mode)
            timed[mode].append(_iteration(sweep, inputs, checkpointing)[0])
        log(f"  compile round {round_index + 1}: " + ", ".join(f"{m} {timed[m][-1]:.2f} s" for m in COMPILE_MODES))
    recompiles = (compile_tally() - before).compiles
    switch.set("regional")

    eager = statistics.median(timed["eager"])
    records = []
    for mode in COMPILE_MODES:
        seconds = statistics.median(timed[mode])
        saved = eager - seconds
        is_compiled = mode != "eager"
        records.append(
            {
                "record": "compile",
                "resolution": resolution,
                "mode": mode,
                "activation_checkpointing": checkpointing,
                "rollout_batch_size": max(sweep.cfg.rollout_batch_sizes),
                "micro_batch_size": max(sweep.cfg.micro_batch_sizes),
                "iteration_seconds": seconds,
                "iteration_seconds_runs": timed[mode],
                "speedup": eager / seconds if is_compiled else None,
                "break_even_iterations": first[mode]["compile_seconds"] / saved if is_compiled and saved > 0 else None,
                **first[mode],
            }
        )
    by_mode = {record["mode"]: record for record in records}
    whole = by_mode["whole-model"]["compile_seconds"]
    summary = {
        "record": "compile_summary",
        "resolution": resolution,
        "backend": backend,
        "repeats": sweep.cfg.repeats,
        "regional_over_whole_model_compile_seconds": by_mode["regional"]["compile_seconds"] / whole if whole else None,
        "recompiles_in_timed_rounds": recompiles,
    }
    return [*records, summary]
