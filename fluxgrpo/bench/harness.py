"""The phase bench on one rank: every phase of a GRPO iteration timed at every batch size.

One GRPO iteration is five phases, each timed between device synchronisations after ``--warmup`` untimed runs,
``--repeats`` times (the median is reported):

- **rollout**: B trajectories × N SDE steps of ``--sampler``, the trainer's ``rollout_stage`` in chunks of each
  ``--rollout-batch-sizes`` value;
- **decode**: the VAE turning the B final x̂0 into images, in the same chunk sizes;
- **reward**: scoring the B images (HPS's scoring path: resize and pad to 224, CLIP normalisation, image tower,
  cached text features, cosine), in the same chunk sizes;
- **update**: the trainer's ``update_stage`` (``--objective grpo``) over the B trajectories' T trained timesteps at
  each ``--micro-batch-sizes`` value,
  with activation checkpointing on and/or off (forward + backward + gradient clipping, optimizer steps excluded);
- **optimizer**: one AdamW step over the transformer (its time is taken out of the update's).

B (``--trajectories``) defaults to the least common multiple of all batch sizes, so every size does exactly the same
work and the speed-up of batch b is a ratio of two numbers measured in the same run: rate(b) / rate(smallest b).
The update runs with learning rate 0: AdamW still does all of its arithmetic, but the weights never move, so every
configuration trains the same model and the PPO ratio of the stored rollout must stay 1. Each update row reports
max |log ρ| of its first micro-batch, which checks that batch-dependent kernels keep rollout and update consistent.

Memory. ``peak_memory_bytes`` is the device allocator's peak during a phase's timed runs (weights, gradients and
AdamW state included; None on cpu, which keeps no allocator statistics). ``activation_bytes`` (update rows) is
device-independent: the bytes of every distinct storage autograd keeps for backward after one micro-batch forward
(parameters excluded; autocast's low-precision weight copies included, since they are held too), counted with
saved-tensor hooks. Activation checkpointing changes both; the summary reports what it saves and what it costs.
"""

from __future__ import annotations

import gc
import math
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

import fluxgrpo.training.stages
from fluxgrpo import __version__
from fluxgrpo.bench.compile_cost import ConstantSchedule, measure_compile_costs
from fluxgrpo.bench.config import TRAINING_DEFAULTS, BenchConfig
from fluxgrpo.bench.figures import MeasuredRow, PhaseFigure, Timing, phase_figure, summarize, with_speedups
from fluxgrpo.bench.flops import rollout_flops, transformer_forward_flops, update_flops
from fluxgrpo.bench.models import BenchModel, build_bench_model, device_memory_bytes
from fluxgrpo.grpo.latents import image_ids, latent_shape
from fluxgrpo.grpo.objectives.grpo.loss import GrpoObjective, GrpoSettings
from fluxgrpo.grpo.rollout import RolloutSettings, predict_velocity
from fluxgrpo.grpo.samplers import make_sampler
from fluxgrpo.grpo.schedule import model_timesteps, sigma_schedule
from fluxgrpo.grpo.types import Conditioning
from fluxgrpo.grpo.update import UpdatePlumbing
from fluxgrpo.models.flux import set_activation_checkpointing
from fluxgrpo.runtime import device as rt_device
from fluxgrpo.runtime.adapt import compile_backend
from fluxgrpo.runtime.dist import shard_transformer
from fluxgrpo.runtime.peak import accelerator_stack, device_name, is_out_of_memory, peak_throughput
from fluxgrpo.runtime.report import package_versions
from fluxgrpo.training.stages import RolloutDraws, decode_images, score_images, update_stage

if TYPE_CHECKING:
    from fluxgrpo.grpo.types import Rollout
    from fluxgrpo.runtime.dist import DistContext

BENCH_CAPTION = "a photograph of a red fox in the snow"


class _TimedOptimizer:
    """Delegates to an optimizer, timing each ``step()`` between device synchronisations.

    The update only calls ``step`` and ``zero_grad``. The update's own peak memory up to the step is read
    before the allocator's peak is reset for the step, so the two phases' peaks stay apart.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.optimizer = optimizer
        self.device = device
        self.step_peak_bytes: int | None = None  # the highest allocator peak of any step so far
        self.seconds_since_reset = 0.0
        self.update_peak_bytes: int | None = None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def reset(self) -> None:
        """Forget the steps of the previous update run (their time, the update's peak before them)."""
        self.seconds_since_reset = 0.0
        self.update_peak_bytes = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        rt_device.synchronize(self.device)
        peak = rt_device.peak_memory_bytes(self.device)
        if peak is not None:
            self.update_peak_bytes = max(self.update_peak_bytes or 0, peak)
        rt_device.reset_peak_memory(self.device)
        start = time.perf_counter()
        self.optimizer.step()
        rt_device.synchronize(self.device)
        self.seconds_since_reset += time.perf_counter() - start
        peak = rt_device.peak_memory_bytes(self.device)
        if peak is not None:
            self.step_peak_bytes = max(self.step_peak_bytes or 0, peak)
        rt_device.reset_peak_memory(self.device)  # what follows the step is the update's again


@dataclass
class BenchTrainee:
    """What the bench's update trains (``training.stages.TrainedModel``): no KL reference, no EMA."""

    transformer: Any
    optimizer: Any
    lr_scheduler: Any
    reference: None = None
    ema: None = None


@dataclass(frozen=True)
class PhaseSetup:
    """How the bench and the deep check run the trainer's own rollout and update stages (GRPO, learning rate 0)."""

    sampler: str  # --sampler
    eta: float
    guidance: float
    clip_range: float
    max_grad_norm: float
    num_train_timesteps: int
    device_type: str
    seed: int

    def objective(self) -> Any:
        return GrpoObjective(GrpoSettings(self.num_train_timesteps, self.clip_range))

    def rollout(self, transformer: Any, inputs: _Inputs, batch_size: int, compute_dtype: torch.dtype | None) -> Rollout:
        """B trajectories by ``training.stages.rollout_stage``, ``batch_size`` per forward."""

        sigma_max = float(inputs.sigmas[1]) if inputs.sigmas.shape[0] > 2 else 0.0
        settings = RolloutSettings(
            make_sampler(self.sampler, self.eta, sigma_max), self.guidance, batch_size, compute_dtype
        )
        generator = torch.Generator(device=inputs.noise.device).manual_seed(self.seed + 17)
        rollout = fluxgrpo.training.stages.rollout_stage(
            transformer, self.objective(), settings, inputs.cond, inputs.noise, inputs.sigmas, inputs.img_ids,
            device_type=self.device_type, draws=RolloutDraws(generator),
        )  # fmt: skip
        return rollout  # type: ignore[return-value]  # a GRPO objective keeps the trajectory

    def update(
        self, trainee: BenchTrainee, rollout: Rollout, inputs: _Inputs, micro_batch_size: int,
        compute_dtype: torch.dtype | None,
    ) -> Any:  # fmt: skip
        """``training.stages.update_stage`` on the rollout, one optimizer step at any micro-batch size."""

        count = rollout.num_trajectories
        # one optimizer step per update at every micro-batch size: rows differ only in batching
        plumbing = UpdatePlumbing(
            micro_batch_size, math.ceil(count / micro_batch_size), self.max_grad_norm, compute_dtype
        )
        return update_stage(
            trainee, self.objective(), rollout, inputs.cond, inputs.advantages, plumbing,
            device_type=self.device_type, generator_cpu=torch.Generator().manual_seed(self.seed + 29),
        )  # fmt: skip


def _materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Allocate AdamW's moments now (one zero-gradient step at learning rate 0), so every phase runs with the
    memory training has: weights, moments, and (during the update) gradients."""

    for group in optimizer.param_groups:
        for parameter in group["params"]:
            parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _storage_pointer(tensor: torch.Tensor) -> int:
    """The address of a tensor's storage (a DTensor's local shard's); 0 when it has none (meta, fake tensors)."""
    to_local = getattr(tensor, "to_local", None)
    if callable(to_local):
        tensor = to_local()
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


def saved_activation_bytes(run: Callable[[], Any], parameters: Sequence[torch.Tensor]) -> tuple[int, Any]:
    """Bytes of the distinct storages autograd saves for backward while ``run()`` builds its graph, parameters'
    own storages excluded; returns them and ``run()``'s result (keep it alive until backward)."""

    parameter_storages = {_storage_pointer(p) for p in parameters}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        pointer = _storage_pointer(tensor)
        if pointer and pointer not in parameter_storages:
            saved[pointer] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = run()
    return sum(saved.values()), result


@dataclass
class _Inputs:
    """Everything one resolution's phases consume, shared by every batch size."""

    cond: Conditioning  # B rows, one caption repeated (one group, as G generations of one prompt)
    noise: torch.Tensor  # [B, L, C] fp32 z_0
    sigmas: torch.Tensor  # [N+1]
    img_ids: torch.Tensor  # [L, 3]
    advantages: torch.Tensor  # [B]
    height: int
    width: int
    image_tokens: int  # L


def _make_inputs(
    cfg: BenchConfig, bench_model: BenchModel, height: int, width: int, device: torch.device, rank: int
) -> _Inputs:
    shape = latent_shape(height, width)
    count = cfg.num_trajectories
    generator = torch.Generator(device=device).manual_seed(cfg.seed * 1_000_003 + rank)
    cond = Conditioning(
        prompt_embeds=torch.randn(
            count, cfg.text_tokens, bench_model.shape.text_dim, generator=generator, device=device
        ),
        pooled=torch.randn(count, bench_model.shape.pooled_dim, generator=generator, device=device),
        text_ids=torch.zeros(cfg.text_tokens, 3, device=device),
        captions=(BENCH_CAPTION,) * count,
    )
    return _Inputs(
        cond=cond,
        noise=torch.randn(count, *shape.packed, generator=generator, device=device),
        sigmas=sigma_schedule(cfg.steps, TRAINING_DEFAULTS.shift).to(device),
        img_ids=image_ids(height, width, device=device),
        advantages=torch.linspace(-1.0, 1.0, count, device=device),
        height=height,
        width=width,
        image_tokens=shape.num_tokens,
    )


@dataclass
class _Run:
    """What one call of a measured function reports besides its result."""

    result: Any
    excluded_seconds: float = 0.0  # time inside the call that belongs to another phase (optimizer steps)
    peak_floor_bytes: int | None = None  # a peak reached inside the call before the allocator was reset


class _Sweep:
    """One rank's measurements at one resolution after another; each phase's figures are emitted as soon as the
    phase has been measured at every batch size (so that their speed-ups are known)."""

    def __init__(
        self,
        cfg: BenchConfig,
        ctx: DistContext,
        bench_model: BenchModel,
        compute_dtype: torch.dtype,
        peak_tflops: float | None,
        emit: Callable[[dict[str, Any]], None],
        log: Callable[[str], None],
    ):
        self.cfg, self.ctx, self.model = cfg, ctx, bench_model
        self.compute_dtype, self.peak_tflops = compute_dtype, peak_tflops
        self.emit, self.log = emit, log
        self.figures: list[PhaseFigure] = []
        self.setup = PhaseSetup(
            cfg.sampler, TRAINING_DEFAULTS.eta, TRAINING_DEFAULTS.guidance, TRAINING_DEFAULTS.clip_range,
            TRAINING_DEFAULTS.max_grad_norm, cfg.num_train_timesteps, ctx.device_type, cfg.seed,
        )  # fmt: skip
        trainable = [p for p in bench_model.transformer.parameters() if p.requires_grad]
        # Learning rate 0: the full AdamW arithmetic, weights unchanged (see the module docstring).
        self.optimizer = _TimedOptimizer(
            torch.optim.AdamW(trainable, lr=0.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-4), ctx.device
        )
        _materialize_optimizer_state(self.optimizer.optimizer)
        self.trainee = BenchTrainee(bench_model.transformer, self.optimizer, ConstantSchedule())

    # ------------------------------------------------------------------ helpers
    def _measure(self, label: str, call: Callable[[], _Run]) -> tuple[Timing, Any]:
        """``--warmup`` untimed calls, then ``--repeats`` timed ones; returns the timing and the last result."""

        timing, run = Timing(), None
        for _ in range(self.cfg.warmup):
            run = call()
        for _ in range(self.cfg.repeats):
            run = None  # the previous result's memory must not count in this call's peak
            rt_device.synchronize(self.ctx.device)
            rt_device.reset_peak_memory(self.ctx.device)
            start = time.perf_counter()
            run = call()
            rt_device.synchronize(self.ctx.device)
            elapsed = time.perf_counter() - start - run.excluded_seconds
            peak = rt_device.peak_memory_bytes(self.ctx.device)
            if run.peak_floor_bytes is not None:
                peak = max(peak or 0, run.peak_floor_bytes)
            timing.add(elapsed, peak, run.excluded_seconds)
        self.log(f"  {label}: {timing.median:.4f} s")
        return timing, None if run is None else run.result

    def _attempt(self, label: str, measure: Callable[[], tuple[Timing, Any]]) -> tuple[Timing | None, Any, str | None]:
        """``measure()``, with the device running out of memory recorded (as the figure's error) instead of
        ending the bench; any other exception propagates."""

        try:
            timing, result = measure()
            return timing, result, None
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
        # Past the except clause the exception and the frames it pinned are gone, so their tensors can go too.
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        rt_device.empty_cache(self.ctx.device)
        self.log(f"  {label}: out of memory (recorded; moving on)")
        return None, None, "out of memory"

    def _publish(self, figures: list[PhaseFigure]) -> None:
        for figure in with_speedups(figures):
            self.figures.append(figure)
            self.emit(figure.to_record())

    # ------------------------------------------------------------------ phases
    def rollout(self, inputs: _Inputs, resolution: str) -> Rollout | None:
        """Rollout rows; returns a rollout for the later phases (None if every size ran out of memory)."""
        count = self.cfg.num_trajectories
        flops = rollout_flops(self.model.shape, inputs.image_tokens, self.cfg.text_tokens, count, self.cfg.steps)
        kept, figures = None, []
        for size in self.cfg.rollout_batch_sizes:

            def call(size: int = size) -> _Run:
                return _Run(self.setup.rollout(self.model.transformer, inputs, size, self.compute_dtype))

            label = f"rollout {resolution} batch {size}"
            timing, result, error = self._attempt(label, lambda label=label, call=call: self._measure(label, call))  # type: ignore[misc]  # default arguments bind the loop values
            kept = result if result is not None else kept
            figures.append(
                phase_figure(
                    MeasuredRow("rollout", resolution, size, None, count, "images"),
                    timing,
                    flops,
                    self.peak_tflops,
                    error=error,
                )
            )
        self._publish(figures)
        return kept

    def decode_and_reward(self, rollout: Rollout, inputs: _Inputs, resolution: str) -> None:
        """Decode rows, then reward rows, both in chunks of each rollout batch size, by the trainer's own stages."""

        count = self.cfg.num_trajectories
        captions = inputs.cond.captions or ()
        images, figures = None, []
        for size in self.cfg.rollout_batch_sizes:

            def decode(size: int = size) -> _Run:
                return _Run(
                    decode_images(
                        self.model.vae,
                        rollout.final_x0,
                        inputs.height,
                        inputs.width,
                        size,
                        self.ctx.device_type,
                        self.compute_dtype,
                    )
                )

            label = f"decode {resolution} batch {size}"
            timing, result, error = self._attempt(label, lambda label=label, call=decode: self._measure(label, call))  # type: ignore[misc]  # default arguments bind the loop values
            images = result if result is not None else images
            figures.append(
                phase_figure(MeasuredRow("decode", resolution, size, None, count, "images"), timing, error=error)
            )
        self._publish(figures)
        if images is None:
            return
        figures = []
        for size in self.cfg.rollout_batch_sizes:

            def score(size: int = size) -> _Run:
                return _Run(score_images(self.model.reward, images, captions, size))

            label = f"reward {resolution} batch {size}"
            timing, _, error = self._attempt(label, lambda label=label, call=score: self._measure(label, call))  # type: ignore[misc]  # default arguments bind the loop values
            figures.append(
                phase_figure(MeasuredRow("reward", resolution, size, None, count, "images"), timing, error=error)
            )
        self._publish(figures)

    def update(self, rollout: Rollout, inputs: _Inputs, resolution: str) -> None:
        """Update rows for every (checkpointing, micro-batch size), then one optimizer row."""
        count, trained = self.cfg.num_trajectories, self.cfg.num_train_timesteps
        flops = update_flops(self.model.shape, inputs.image_tokens, self.cfg.text_tokens, count, trained)
        transformer, optimizer = self.model.transformer, self.optimizer
        optimizer.step_peak_bytes = None
        step_timing = Timing()  # every timed update run takes exactly one optimizer step
        figures = []
        for checkpointing in self.cfg.checkpointing_modes:
            set_activation_checkpointing(transformer, checkpointing)
            for size in self.cfg.micro_batch_sizes:

                def call(size: int = size) -> _Run:
                    optimizer.reset()
                    stats = self.setup.update(self.trainee, rollout, inputs, size, self.compute_dtype)
                    return _Run(stats, optimizer.seconds_since_reset, optimizer.update_peak_bytes)

                label = f"update {resolution} micro-batch {size} checkpointing {'on' if checkpointing else 'off'}"

                def measure(
                    label: str = label, size: int = size, call: Callable[[], _Run] = call
                ) -> tuple[Timing, Any]:
                    activation_bytes = self._activation_probe(rollout, inputs, size)
                    timing, stats = self._measure(label, call)
                    return timing, (stats, activation_bytes)

                timing, result, error = self._attempt(label, measure)
                stats, activation_bytes = result if result is not None else (None, None)
                if timing is not None:
                    step_timing.seconds.extend(timing.excluded_seconds)
                figure = phase_figure(
                    MeasuredRow("update", resolution, size, checkpointing, count * trained, "samples"),
                    timing,
                    flops,
                    self.peak_tflops,
                    error=error,
                    activation_bytes=activation_bytes,
                    max_abs_log_ratio=None if stats is None else stats.as_floats()["first_abs_log_ratio"],
                )
                if stats is not None and stats.skipped_steps:
                    figure = replace(figure, error="non-finite gradient norm: the optimizer step was skipped")
                figures.append(figure)
        step_timing.peak_memory_bytes = optimizer.step_peak_bytes
        figures.append(phase_figure(MeasuredRow("optimizer", resolution, None, None, 1, "steps"), step_timing))
        self._publish(figures)

    def _activation_probe(self, rollout: Rollout, inputs: _Inputs, size: int) -> int:
        """Saved-for-backward bytes of one micro-batch forward at the first timestep (then its backward, which
        leaves FSDP2 in its usual state, and the gradients dropped)."""

        transformer = self.model.transformer
        transformer.train()
        device = self.ctx.device
        # Copies, as the update's gather makes them: a view would pin (and count) the whole trajectory buffer.
        current, following = (rollout.latents[:size, index].to(device).clone() for index in (0, 1))

        def forward() -> torch.Tensor:
            velocity = predict_velocity(
                transformer,
                current,
                inputs.cond.rows(0, size),
                model_timesteps(inputs.sigmas)[0].expand(size),
                torch.full((size,), TRAINING_DEFAULTS.guidance, device=device),
                inputs.img_ids,
                self.ctx.device_type,
                self.compute_dtype,
            )
            step = rollout.sampler.step(current, velocity, inputs.sigmas[0], inputs.sigmas[1], prev_sample=following)
            return step.log_prob.mean()

        held, loss = saved_activation_bytes(forward, list(transformer.parameters()))
        loss.backward()
        self.optimizer.zero_grad(set_to_none=True)
        return held


def _compute_dtype(cfg: BenchConfig, device_type: str) -> tuple[torch.dtype, str]:
    if cfg.dtype is None:
        dtype = rt_device.compute_dtype(device_type)
    else:
        dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
    return dtype, "bf16" if dtype == torch.bfloat16 else "fp32"


def _environment_records(
    cfg: BenchConfig, ctx: DistContext, name: str, dtype_name: str, peak_tflops: float | None, peak_source: str
) -> list[dict[str, Any]]:
    """The ``config``, ``device`` and ``versions`` records: what a figure was measured on."""

    return [
        {"record": "config", **cfg.to_dict(), "dtype": dtype_name},
        {
            "record": "device",
            "type": ctx.device_type,
            "name": name,
            "world_size": ctx.world_size,
            "memory_bytes": device_memory_bytes(ctx),
            "peak_tflops": peak_tflops,
            "peak_source": peak_source,
            "compute_dtype": dtype_name,
            "threads": torch.get_num_threads() if ctx.device_type == "cpu" else None,
        },
        {
            "record": "versions",
            "fluxgrpo": __version__,
            "python": platform.python_version(),
            **package_versions(),
            "accelerator": accelerator_stack(ctx.device_type),
        },
    ]


def _model_record(cfg: BenchConfig, bench_model: BenchModel) -> dict[str, Any]:
    """The ``model`` record: the shape measured and the FLOPs of one transformer forward per resolution."""

    shape = bench_model.shape
    return {
        "record": "model",
        "name": cfg.model,
        "double_blocks": shape.double_blocks,
        "single_blocks": shape.single_blocks,
        "hidden": shape.hidden,
        "head_dim": shape.head_dim,
        "transformer_parameters": sum(p.numel() for p in bench_model.transformer.parameters()),
        "vae_parameters": sum(p.numel() for p in bench_model.vae.parameters()),
        "reward": bench_model.reward_name,
        "reward_parameters": bench_model.reward_parameters,
        "text_tokens": cfg.text_tokens,
        "trajectories": cfg.num_trajectories,
        "steps": cfg.steps,
        "train_timesteps": cfg.num_train_timesteps,
        "compile": cfg.compile,
        "forward_flops_per_sample": {
            f"{h}x{w}": transformer_forward_flops(shape, latent_shape(h, w).num_tokens, cfg.text_tokens)
            for h, w in cfg.resolved_resolutions()
        },
    }


def bench_on_rank(
    cfg: BenchConfig, ctx: DistContext, emit: Callable[[dict[str, Any]], None], log: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Every measurement on this rank (one process; with FSDP2 sharding when the world is larger than one).

    ``emit`` receives each record as soon as it exists: ``config``, ``device``, ``versions``, ``model``, then a
    ``figure`` per measured configuration and a ``summary`` per resolution. Returns the records.
    """

    records: list[dict[str, Any]] = []

    def keep(record: dict[str, Any]) -> None:
        records.append(record)
        emit(record)

    compute_dtype, dtype_name = _compute_dtype(cfg, ctx.device_type)
    name = device_name(ctx.device)
    peak = peak_throughput(ctx.device_type, name, dtype_name, cfg.peak_tflops)
    for record in _environment_records(cfg, ctx, name, dtype_name, peak.tflops, peak.source):
        keep(record)

    log(f"building {cfg.model} on {ctx.device_type} ({name})")
    bench_model = build_bench_model(cfg, ctx, compute_dtype)
    if ctx.distributed:
        shard_transformer(bench_model.transformer, cpu_offload=False, compute_dtype=compute_dtype)
    keep(_model_record(cfg, bench_model))
    sweep = _Sweep(cfg, ctx, bench_model, compute_dtype, peak.tflops, keep, log)
    compiled = False
    for height, width in cfg.resolved_resolutions():
        resolution = f"{height}x{width}"
        inputs = _make_inputs(cfg, bench_model, height, width, ctx.device, ctx.rank)
        if cfg.compile and not compiled:  # once, at the first resolution; the phases then run regionally compiled
            for record in measure_compile_costs(sweep, inputs, resolution, compile_backend(ctx.device_type), log):
                keep(record)
            compiled = True
        start = len(sweep.figures)
        rollout = sweep.rollout(inputs, resolution)
        if rollout is not None:
            sweep.decode_and_reward(rollout, inputs, resolution)
            sweep.update(rollout, inputs, resolution)
        del rollout, inputs
        keep(summarize(sweep.figures[start:], resolution))
    return records
