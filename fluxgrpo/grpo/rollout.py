"""Sampling: SDE trajectories with what the GRPO update needs, or the ODE's final latents only (NFT, AWM)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from fluxgrpo.grpo.retain import RetainedGraphs
from fluxgrpo.grpo.samplers import Sampler, dpm_solver_2m_step, euler_step
from fluxgrpo.grpo.schedule import StepPlan, model_timesteps
from fluxgrpo.grpo.types import Conditioning, FinalSamples, Rollout
from fluxgrpo.runtime.device import autocast
from fluxgrpo.runtime.dist import has_sharded_modules, reshard_sharded_modules


def predict_velocity(
    transformer: nn.Module,
    latents: torch.Tensor,
    cond: Conditioning,
    timesteps: torch.Tensor,
    guidance: torch.Tensor,
    img_ids: torch.Tensor,
    device_type: str,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One FluxTransformer2DModel forward under the device's autocast: v for [b, L, C] latents.

    ``timesteps`` [b] are σ-valued (in [0, 1]) and ``guidance`` [b] is the raw guidance scale: diffusers'
    Flux transformer multiplies both by 1000 itself. Shared by rollout and update so that both feed the
    model identically. ``compute_dtype`` overrides the runtime's autocast dtype (``fluxgrpo bench --dtype``).
    """
    with autocast(device_type, compute_dtype):
        return transformer(
            hidden_states=latents,
            encoder_hidden_states=cond.prompt_embeds,
            pooled_projections=cond.pooled,
            timestep=timesteps,
            img_ids=img_ids,
            txt_ids=cond.text_ids,
            guidance=guidance,
            return_dict=False,
        )[0]


@dataclass(frozen=True)
class RolloutSettings:
    """How one rollout samples (the loop builds it from the config)."""

    sampler: Sampler  # the stochastic step of the SDE steps; the update scores with the same one
    guidance: float  # FLUX distilled-guidance value (3.5)
    rollout_batch_size: int  # trajectories per forward
    compute_dtype: torch.dtype | None = None  # autocast dtype; None is the runtime's choice
    keep_means: bool = False  # also keep each SDE step's mean μ_old (GRPO-Guard's ratio needs it)
    retain_graphs: bool = False  # keep the trained steps' forwards for the update (``retain.py``)


def _chunks(num_trajectories: int, batch_size: int) -> list[tuple[int, int]]:
    if batch_size < 1:  # TrainConfig validates it for the user
        raise ValueError(f"rollout_batch_size must be at least 1, got {batch_size}")
    return [(start, min(start + batch_size, num_trajectories)) for start in range(0, num_trajectories, batch_size)]


class _TrajectoryStore:
    """The kept latents z_0 … z_{K−1} and, when fewer than all N+1 are kept, the current z beyond them."""

    def __init__(self, initial_noise: torch.Tensor, kept: int, num_steps: int, device: torch.device) -> None:
        num_trajectories = initial_noise.shape[0]
        self.kept = kept
        self.latents = torch.empty(
            (num_trajectories, kept, *initial_noise.shape[1:]), dtype=torch.float32, device=device
        )
        self.latents[:, 0] = initial_noise.to(device=device, dtype=torch.float32)
        self.current = self.latents[:, 0].clone() if kept < num_steps + 1 else None

    def at(self, position: int, start: int, stop: int) -> torch.Tensor:
        if position < self.kept:
            return self.latents[start:stop, position]
        assert self.current is not None  # positions past ``kept`` exist only when z is tracked beyond them
        return self.current[start:stop]

    def store(self, position: int, start: int, stop: int, value: torch.Tensor) -> None:
        if position < self.kept:
            self.latents[start:stop, position] = value
        if self.current is not None:
            self.current[start:stop] = value


@dataclass(frozen=True)
class _ModelCall:
    """Everything one transformer forward of a rollout shares across steps and chunks."""

    transformer: nn.Module
    cond: Conditioning
    chunks: list[tuple[int, int]]
    guidance_values: torch.Tensor  # [B]
    img_ids: torch.Tensor
    device_type: str
    compute_dtype: torch.dtype | None
    retained: RetainedGraphs | None = None  # keeps the trained steps' forwards (``--retain-rollout-graphs``)

    def velocity(
        self, x: torch.Tensor, start: int, stop: int, timestep: torch.Tensor, step: int | None = None
    ) -> torch.Tensor:
        """v for the trajectories ``start:stop`` at the model-fed ``timestep`` (a scalar tensor); at a σ-table
        ``step`` with ``retained``, the rows that train there run with gradients and their graph is kept."""
        if self.retained is None or step is None:
            return self._forward(x, self.cond.rows(start, stop), self.guidance_values[start:stop], timestep)
        return self.retained.velocity(
            lambda rows, x_rows: self._rows_forward(rows, x_rows, timestep), x, start, stop, step
        )

    def _rows_forward(self, rows: torch.Tensor, x: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        """v of the trajectories ``rows`` [r] (global indices, ascending) at ``x`` [r, L, C]."""
        first, count = int(rows[0]), rows.numel()
        if int(rows[-1]) - first + 1 == count:  # contiguous: views, as the plain rollout feeds them
            return self._forward(x, self.cond.rows(first, first + count), self.guidance_values[first:first + count],
                                 timestep)  # fmt: skip
        index = rows.to(self.guidance_values.device)
        cond = Conditioning(self.cond.prompt_embeds[index], self.cond.pooled[index], self.cond.text_ids)
        return self._forward(x, cond, self.guidance_values[index], timestep)

    def _forward(
        self, x: torch.Tensor, cond: Conditioning, guidance: torch.Tensor, timestep: torch.Tensor
    ) -> torch.Tensor:
        return predict_velocity(
            self.transformer,
            x,
            cond,
            timestep.expand(x.shape[0]),
            guidance,
            self.img_ids,
            self.device_type,
            self.compute_dtype,
        )


@contextlib.contextmanager
def _sampling_mode(
    transformer: nn.Module, device_type: str, compute_dtype: torch.dtype | None, cast_once: bool = True
) -> Iterator[None]:
    """Eval mode for the rollout, one autocast region around it, and on the way out FSDP2 parameters resharded and
    the module's train/eval mode restored.

    Autocast keeps every weight's low-precision copy until its outermost region ends, so a full copy of the model is
    alive at the end of each forward anyway: spanning the whole loop costs no extra peak memory and replaces
    steps × chunks casts of every weight by one (the results are bit-identical either way; the steps work in fp32 on
    fp32 inputs, which autocast leaves alone). Not for FSDP2-sharded modules: their cached copies would be keyed to
    unsharded parameters that FSDP2 frees and re-gathers, an implementation detail not to lean on (FSDP2's own mixed
    precision is the way to skip those casts). Nor when the rollout keeps graphs (``cast_once`` False): a weight's
    cached copy cast without gradients would carry none to the weight, so each forward casts in its own region, as the
    update's forward does.
    """
    was_training = transformer.training
    transformer.eval()
    one_region = cast_once and not has_sharded_modules(transformer)
    region = autocast(device_type, compute_dtype) if one_region else contextlib.nullcontext()
    try:
        with region:
            yield
    finally:
        reshard_sharded_modules(transformer)
        transformer.train(was_training)


@dataclass
class _StepRecords:
    """What the table steps write besides the latents: per-step log-probs, SDE means, and the x̂0 history."""

    log_probs: torch.Tensor  # [B, N], NaN at ODE steps
    means: torch.Tensor | None  # [B, K−1, L, C] with ``keep_means``
    final_x0: torch.Tensor  # x̂0 of the last model call
    previous_x0: torch.Tensor  # the same, as DPM-Solver++'s history


@torch.no_grad()
def sample_trajectories(
    transformer: nn.Module,
    cond: Conditioning,
    initial_noise: torch.Tensor,
    sigmas: torch.Tensor,
    settings: RolloutSettings,
    *,
    img_ids: torch.Tensor,
    device_type: str,
    generator: torch.Generator,
    plan: StepPlan | None = None,
    train_indices: torch.Tensor | None = None,
) -> Rollout:
    """Sample B trajectories z_0 … z_N with the SDE step, in chunks of ``rollout_batch_size`` per forward.

    The transformer runs in eval mode, without gradients, under ``autocast(device_type)``; each step's SDE
    update runs in fp32. The step noise comes from ``generator`` (on any device), drawn per step for all B
    trajectories at once, so the samples do not depend on ``rollout_batch_size`` and the stream can be
    saved and restored for an exact resume. The loop makes no host sync. On return the module is back in
    its previous train/eval mode, with FSDP2 parameters resharded.

    With a ``plan`` (an SDE window), steps outside the window are ODE steps (Euler, or DPM-Solver++(2M) on the
    plan's tail grid). Noise is still drawn for every step on the σ table, so the stream, and each SDE step's noise,
    do not depend on where the window is. Only z_0 … z_{sde_stop} are kept then (all the update reads).

    An unsharded module's fp32 weights are cast to the compute dtype once per rollout, not once per forward
    (one autocast region spans the loop, so autocast's weight-cast cache lives that long); the results are
    bit-identical either way.

    The rollout batch size is a speed knob, not a semantic one, but batch-dependent kernels can make the
    rollout's log-probs differ slightly from the update's recomputation at another micro-batch size; the
    update reports |log ρ| of its first micro-batch so the training loop can check ratio ≈ 1.

    Args:
        transformer: a FluxTransformer2DModel (plain or FSDP2-sharded) or any module with its forward.
        cond: conditioning with one row per trajectory; computation happens on ``cond.prompt_embeds.device``.
        initial_noise: [B, L, C] z_0 (any float dtype; DanceGRPO draws it in bf16).
        sigmas: [N+1] exact σ table from ``sigma_schedule``.
        settings: the sampler, guidance, batch size, dtype and what to keep.
        img_ids: [L, 3] image position ids.
        device_type: the runtime device type, for autocast.
        generator: RNG for the step noise.
        plan: which steps are SDE; None is DanceGRPO's (every step).
        train_indices: [B, T] the steps the update will train, with ``settings.retain_graphs``: their forwards run
            with gradients and are kept (``Rollout.retained``, ``retain.py``); the samples are the same.
    """
    num_trajectories = initial_noise.shape[0]
    chunks = _chunks(num_trajectories, settings.rollout_batch_size)
    if cond.num_rows != num_trajectories:
        raise ValueError(f"{cond.num_rows} conditioning rows for {num_trajectories} trajectories")
    device = cond.prompt_embeds.device
    sigmas = sigmas.to(device=device, dtype=torch.float32)
    num_steps = sigmas.shape[0] - 1
    plan = plan if plan is not None else StepPlan.every_step(num_steps)
    kept = num_steps + 1 if plan.tail_sigmas is None and plan.last_step_sde else plan.sde_stop + 1
    guidance_values = torch.full((num_trajectories,), settings.guidance, dtype=torch.float32, device=device)
    retained = _retained(settings, train_indices, plan, num_trajectories, num_steps)
    call = _ModelCall(
        transformer, cond, chunks, guidance_values, img_ids.to(device), device_type, settings.compute_dtype, retained
    )
    store = _TrajectoryStore(initial_noise, kept, num_steps, device)
    records = _StepRecords(
        log_probs=torch.full((num_trajectories, num_steps), float("nan"), dtype=torch.float32, device=device),
        means=torch.zeros_like(store.latents[:, 1:]) if settings.keep_means else None,
        final_x0=torch.empty_like(store.latents[:, 0]),
        previous_x0=torch.empty_like(store.latents[:, 0]),
    )
    with _sampling_mode(transformer, device_type, settings.compute_dtype, cast_once=retained is None):
        _table_steps(call, sigmas, plan, settings.sampler, store, records, generator)
        if plan.tail_sigmas is not None:
            assert store.current is not None  # the tail's steps lie past the kept ones
            _integrate_tail(
                call, plan.tail_sigmas, sigmas[plan.sde_stop - 1], store.current, records.previous_x0, records.final_x0
            )

    return Rollout(
        latents=store.latents,
        log_probs=records.log_probs,
        final_x0=records.final_x0,
        sigmas=sigmas,
        img_ids=call.img_ids,
        guidance=float(settings.guidance),
        sampler=settings.sampler,
        captions=cond.captions,
        sde_steps=(plan.sde_start, plan.sde_stop),
        means=records.means,
        final_latent=store.current if store.current is not None else store.latents[:, -1],
        retained=retained,
    )


def _retained(
    settings: RolloutSettings, train_indices: torch.Tensor | None, plan: StepPlan, trajectories: int, steps: int
) -> RetainedGraphs | None:
    """The store of kept forwards when the settings ask for them (the trained steps must lie in the SDE window)."""
    if not settings.retain_graphs:
        return None
    if train_indices is None or train_indices.shape[0] != trajectories:
        raise ValueError(f"retain_graphs needs the [{trajectories}, T] steps the update trains (train_indices)")
    if train_indices.numel() and not (
        plan.sde_start <= int(train_indices.min()) <= int(train_indices.max()) < plan.sde_stop
    ):
        raise ValueError(f"the trained steps must lie in the SDE window {plan.sde_start}…{plan.sde_stop - 1}")
    return RetainedGraphs(train_indices, steps)


def _table_steps(
    call: _ModelCall,
    sigmas: torch.Tensor,
    plan: StepPlan,
    sampler: Sampler,
    store: _TrajectoryStore,
    records: _StepRecords,
    generator: torch.Generator,
) -> None:
    """The steps on the σ table: the sampler's SDE step inside the plan's window, Euler outside it. Each step's noise
    is drawn for all B trajectories at once, whether the step is SDE or not (see ``sample_trajectories``)."""
    num_steps = sigmas.shape[0] - 1
    fed_timesteps = model_timesteps(sigmas)
    for step in range(plan.table_steps(num_steps)):
        step_noise = torch.randn(
            store.latents[:, 0].shape, generator=generator, device=generator.device, dtype=torch.float32
        ).to(sigmas.device)
        for start, stop in call.chunks:
            x = store.at(step, start, stop)
            velocity = call.velocity(x, start, stop, fed_timesteps[step], step)
            if plan.is_sde(step, num_steps):
                result = sampler.step(x, velocity, sigmas[step], sigmas[step + 1], noise=step_noise[start:stop])
                records.log_probs[start:stop, step] = result.log_prob
                if records.means is not None and step < store.kept - 1:
                    records.means[start:stop, step] = result.mean
                following, x0_pred = result.prev_sample, result.x0_pred
            else:
                following = euler_step(x, velocity, sigmas[step], sigmas[step + 1])
                x0_pred = x.to(torch.float32) - sigmas[step] * velocity.to(torch.float32)
            store.store(step + 1, start, stop, following)
            records.final_x0[start:stop] = x0_pred
            records.previous_x0[start:stop] = x0_pred


@torch.no_grad()
def sample_final_latents(
    transformer: nn.Module,
    cond: Conditioning,
    initial_noise: torch.Tensor,
    sigmas: torch.Tensor,
    *,
    guidance: float,
    rollout_batch_size: int,
    img_ids: torch.Tensor,
    device_type: str,
    compute_dtype: torch.dtype | None = None,
    keep_path: bool = False,
) -> FinalSamples:
    """The deterministic DPM-Solver++(2M) ODE on the σ table, keeping the final latents (DiffusionNFT's and AWM's
    rollouts: their objectives need no per-step log-prob), and with ``keep_path`` the latent at every grid point
    (Neighbor GRPO's candidates).

    The first step and the last (to σ = 0) are first order (Euler, DDIM at η = 0), the others second order, as the
    authors' ``dpm2`` solver. Eval mode, no gradients, chunks of ``rollout_batch_size`` (the result does not
    depend on it); the module's train/eval mode is restored and FSDP2 parameters resharded on return.
    """
    num_trajectories = initial_noise.shape[0]
    chunks = _chunks(num_trajectories, rollout_batch_size)
    if cond.num_rows != num_trajectories:
        raise ValueError(f"{cond.num_rows} conditioning rows for {num_trajectories} trajectories")
    device = cond.prompt_embeds.device
    sigmas = sigmas.to(device=device, dtype=torch.float32)
    img_ids = img_ids.to(device)
    current = initial_noise.to(device=device, dtype=torch.float32).clone()
    previous_x0 = torch.empty_like(current)
    path = None
    if keep_path:
        path = torch.empty((num_trajectories, sigmas.shape[0], *current.shape[1:]), dtype=torch.float32, device=device)
        path[:, 0] = current
    guidance_values = torch.full((num_trajectories,), guidance, dtype=torch.float32, device=device)
    call = _ModelCall(transformer, cond, chunks, guidance_values, img_ids, device_type, compute_dtype)
    with _sampling_mode(transformer, device_type, compute_dtype):
        _integrate_tail(
            call, sigmas, sigmas[0], current, previous_x0, torch.empty_like(current), first_order_start=True, path=path
        )
    return FinalSamples(
        final_x0=current, sigmas=sigmas, img_ids=img_ids, guidance=float(guidance), captions=cond.captions, path=path
    )


def _integrate_tail(
    call: _ModelCall,
    tail_sigmas: torch.Tensor,
    previous_sigma: torch.Tensor,
    current: torch.Tensor,
    previous_x0: torch.Tensor,
    final_x0: torch.Tensor,
    *,
    first_order_start: bool = False,
    path: torch.Tensor | None = None,
) -> None:
    """DPM-Solver++(2M) from ``tail_sigmas[0]`` to 0, in place on ``current``; the history starts with the x̂0 of
    the window's last step (at ``previous_sigma``); the last step, to σ = 0, is first order (Euler), and so is the
    first with ``first_order_start`` (no history yet). ``path`` [B, n+1, …], when given, receives the latent after
    each step j at index j+1."""
    fed = model_timesteps(tail_sigmas)
    for j in range(tail_sigmas.shape[0] - 1):
        sigma, sigma_next = tail_sigmas[j], tail_sigmas[j + 1]
        sigma_previous = previous_sigma if j == 0 else tail_sigmas[j - 1]
        for start, stop in call.chunks:
            x = current[start:stop]
            velocity = call.velocity(x, start, stop, fed[j]).to(torch.float32)
            x0_pred = x - sigma * velocity
            if j == tail_sigmas.shape[0] - 2 or (first_order_start and j == 0):
                current[start:stop] = euler_step(x, velocity, sigma, sigma_next)
            else:
                current[start:stop] = dpm_solver_2m_step(
                    x, x0_pred, previous_x0[start:stop], sigma_previous, sigma, sigma_next
                )
            previous_x0[start:stop] = x0_pred
            final_x0[start:stop] = x0_pred
            if path is not None:
                path[start:stop, j + 1] = current[start:stop]
