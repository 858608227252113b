"""The σ (noise level) table of DanceGRPO's FLUX sampler, the quantised timesteps the model is fed, and which
steps of a rollout are stochastic (and trained) and how the others are integrated: MixGRPO's window.

DanceGRPO samples every one of the N steps with the SDE and trains on a random subset of the first N−1. With
``--sde-window W`` only the W consecutive transitions [start, start+W) are SDE steps, and only they are trained;
every other step is a deterministic ODE step (MixGRPO; Flow-GRPO-Fast's branch steps with ``random``). Outside the
window the ODE is integrated with Euler on the σ table, or with ``dpm2`` after the window: DPM-Solver++(2M) on a
shorter σ grid (MixGRPO-Flash), which saves model calls since the trained steps all lie in the window.

Where the window sits at iteration k (1-based) is a pure function of (settings, k) for ``sliding`` and of a
generator seeded from (seed, k) for ``random``, so an exact resume reproduces it from the iteration alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def sigma_schedule(num_steps: int, shift: float) -> torch.Tensor:
    """σ_i = s·t/(1+(s−1)·t) for t = 1 − i/N, i = 0…N: a float32 tensor [N+1] running from 1 to 0.

    Computed exactly as DanceGRPO does (``linspace(1, 0, N+1)`` in float32, then the SD3-style time shift in
    float32), so the table is bit-identical to the original's.
    """
    if num_steps < 1 or shift <= 0:  # TrainConfig and the sample options validate these for the user
        raise ValueError(f"a σ table needs at least 1 step and a positive shift, got {num_steps} steps, shift {shift}")
    t = torch.linspace(1, 0, num_steps + 1, dtype=torch.float32)
    return (shift * t) / (1 + (shift - 1) * t)


def model_timesteps(sigmas: torch.Tensor) -> torch.Tensor:
    """floor(1000·σ)/1000 in float32, same shape as ``sigmas``: the σ the transformer is fed.

    DanceGRPO truncates 1000·σ to an integer timestep and sends it divided by 1000, so the model sees a
    quantised σ while the SDE update uses the exact one. Kept for parity with the original's trained models.
    (FluxTransformer2DModel multiplies the value by 1000 again internally.)
    """
    scaled = sigmas.to(torch.float32) * 1000
    return torch.floor(scaled) / 1000


@dataclass(frozen=True)
class StepPlan:
    """One rollout's step kinds on a σ table of N steps.

    Transitions ``sde_start ≤ i < sde_stop`` are SDE steps and the only trainable ones. The last transition
    N−1 → N is an SDE step too when ``last_step_sde`` (DanceGRPO's sampler: it never trains, its noise never reaches
    the decoded x̂0). Other transitions are ODE steps: Euler on the table, except after the window when
    ``tail_sigmas`` is given: then the rollout leaves the table at σ[sde_stop] and follows ``tail_sigmas`` (from
    σ[sde_stop] to 0) with DPM-Solver++(2M).
    """

    sde_start: int
    sde_stop: int
    last_step_sde: bool = False
    tail_sigmas: torch.Tensor | None = None  # [n] fp32, tail_sigmas[0] == σ[sde_stop], tail_sigmas[-1] == 0

    @classmethod
    def every_step(cls, num_steps: int) -> StepPlan:
        """DanceGRPO: every step SDE, transitions 0…N−2 trainable."""
        return cls(sde_start=0, sde_stop=num_steps - 1, last_step_sde=True)

    @property
    def trainable(self) -> range:
        return range(self.sde_start, self.sde_stop)

    def is_sde(self, step: int, num_steps: int) -> bool:
        return self.sde_start <= step < self.sde_stop or (self.last_step_sde and step == num_steps - 1)

    def table_steps(self, num_steps: int) -> int:
        """How many transitions follow the σ table (the rest follow ``tail_sigmas``)."""
        return num_steps if self.tail_sigmas is None else self.sde_stop

    def model_calls(self, num_steps: int) -> int:
        """Transformer forwards per trajectory."""
        tail = 0 if self.tail_sigmas is None else self.tail_sigmas.shape[0] - 1
        return self.table_steps(num_steps) + tail


def tail_schedule(sigmas: torch.Tensor, sde_stop: int, shift: float, compress_ratio: float) -> torch.Tensor:
    """MixGRPO-Flash's σ grid after the window: n = max(int((N − ℓ)·r), 2) points, ℓ = sde_stop − 1 the window's
    last step, time-shifted like the table from t = 1 − (ℓ+1)/N to 0; its first point is σ[sde_stop] exactly.

    MixGRPO allows n = 1, which would leave the image at σ > 0; two points (one Euler step to 0) is the minimum here.
    """
    num_steps = sigmas.shape[0] - 1
    count = max(int((num_steps - (sde_stop - 1)) * compress_ratio), 2)
    t = torch.linspace(1 - sde_stop / num_steps, 0, count, dtype=torch.float32)
    tail = (shift * t) / (1 + (shift - 1) * t)
    tail[0] = sigmas[sde_stop].to(torch.float32)
    return tail.to(sigmas.device)


def window_start(
    iteration: int,
    num_steps: int,
    window: int,
    policy: str,
    shift_every: int,
    stride: int,
    wrap: bool,
    generator: torch.Generator,
) -> int:
    """The first SDE step at ``iteration`` (1-based): windows [start, start+W) lie within 0…N−2.

    ``sliding`` (MixGRPO's "progressive"): starts at 0 and moves ``stride`` steps towards the data every
    ``shift_every`` iterations (0: never moves). Past the last position it holds there, or with ``wrap`` starts over
    at 0 (MixGRPO's --roll_back). MixGRPO's own last position is an empty window (a crash); here the window always
    holds W steps. ``random``: uniform over all positions each iteration, drawn from ``generator``; ``random-early``:
    uniform over the starts 0 … N/2 − W (Flow-GRPO-Fast's window range (0, N/2)).
    """
    last = num_steps - 1 - window
    if policy == "random":
        return int(torch.randint(0, last + 1, (1,), generator=generator))
    if policy == "random-early":  # Flow-GRPO-Fast's SD3/Qwen configs: starts in 0 … N/2 − W only
        return int(torch.randint(0, min(num_steps // 2 - window, last) + 1, (1,), generator=generator))
    moves = (iteration - 1) // shift_every if shift_every > 0 else 0
    if stride == 0 or moves == 0:
        return 0
    if wrap:
        positions = last // stride + 1
        return (moves % positions) * stride
    return min(moves * stride, last)


@dataclass(frozen=True)
class PlanSettings:
    """The step-plan options (``TrainConfig``'s names; ``training.settings.plan_settings`` builds them)."""

    sde_window: int  # 0: DanceGRPO, every step SDE
    sde_window_policy: str
    sde_window_shift_every: int
    sde_window_stride: int
    sde_window_wrap: bool
    ode_solver: str
    ode_compress_ratio: float
    shift: float


def plan_for_iteration(
    settings: PlanSettings, sigmas: torch.Tensor, iteration: int, generator: torch.Generator
) -> StepPlan:
    """The step plan of ``iteration`` on the σ table ``sigmas`` [N+1]."""
    num_steps = sigmas.shape[0] - 1
    if settings.sde_window == 0:
        return StepPlan.every_step(num_steps)
    start = window_start(
        iteration,
        num_steps,
        settings.sde_window,
        settings.sde_window_policy,
        settings.sde_window_shift_every,
        settings.sde_window_stride,
        settings.sde_window_wrap,
        generator,
    )
    stop = start + settings.sde_window
    tail = None
    if settings.ode_solver == "dpm2":
        tail = tail_schedule(sigmas, stop, settings.shift, settings.ode_compress_ratio)
    return StepPlan(sde_start=start, sde_stop=stop, tail_sigmas=tail)
