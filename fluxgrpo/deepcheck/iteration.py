"""Checks 2 and 3: one GRPO iteration at learning rate 0 on a FLUX.1-dev-shaped model, per sampler.

The iteration is the bench's and the trainer's own code: ``bench.models.build_bench_model`` builds the model (the
``flux-dev-shaped`` architecture with fewer blocks on an accelerator, the tiny FLUX on cpu) adapted to the device as
training adapts it, ``bench.harness`` draws the inputs and runs ``training.stages.rollout_stage``,
``training.stages.decode_images`` / ``score_images`` and ``update_stage`` (through ``bench.harness.PhaseSetup``)
run the phases. Nothing of the iteration is re-implemented here.

**On-policy start** (one result per sampler). At learning rate 0 the update scores exactly the trajectories the
rollout sampled with the same weights, so the PPO ratio of the first micro-batch must be 1: what it measures is
how far the update's recomputed log-probs sit from the rollout's. Rollout (``rollout_batch_size`` per forward)
and update (``train_micro_batch_size`` per forward, train mode, checkpointing as configured) may differ only by
batch-dependent kernel rounding: a different accumulation order moves some outputs by one ulp of the compute
dtype. A systematic error moves all of them: the rollout run in another dtype, a kernel swapped in one phase only.

The rule compares the two on the spot. Each sampler's trajectories are also sampled once with the rollout in the
*other* precision (fp32 when training computes in bf16, bf16 when it computes in fp32) and scored by the same
update: that ``reference`` |log ρ| is what one rounding of every rollout output gives at this model, resolution,
sampler and η. The check passes when ``first_abs_log_ratio`` ≤ ``reference`` / 4. Why this and not a fixed
number: |log ρ| is a mean over a sample's L·64 latent elements of terms of random sign, so the same per-element
error gives 1e-3 at 64² and 1e-4 at 720² (√L), and ``cps``'s log-prob (no 1/(2s²)) is 20× smaller than
``dance``'s (measured on the tiny model at 64²: a bf16 rollout under an fp32 update gives 1.4e-3 to 2.8e-3 for dance
and flow-grpo, 6e-5 to 1e-4 for cps; the same-dtype rollout gives 0 at every batch split on cpu). A fixed bf16
tolerance loose enough for 64² would miss a dtype error at 720²; one at a quarter of the measured rounding
effect separates "some outputs one ulp apart" from "every output rounded differently" at any shape.

**Memory model** (one result). Every phase's peak of the device allocator (weights, AdamW state, reward and VAE
included) against ``training.memory.estimate`` for the same model, resolution, batch sizes and one die, its reward
term set to the reward model actually loaded. Fails when the estimate is below the measured peak. The measured
terms (persistent bytes after the build, each phase's peak) go to the JSON for calibrating the model. The cpu has
no allocator statistics: there the measurement is this process's resident-set rise over the whole build and
iteration (``hostmem``), labelled as such; it over-counts (Python objects, the allocator's cache) rather than
under-counts, so the rule still means "the estimate is not optimistic".
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fluxgrpo.bench.config import BenchConfig
from fluxgrpo.bench.harness import BenchTrainee, PhaseSetup, _make_inputs, _materialize_optimizer_state
from fluxgrpo.bench.models import build_bench_model
from fluxgrpo.deepcheck.hostmem import HostPeak
from fluxgrpo.deepcheck.result import FAILED, PASSED, SKIPPED, CheckResult
from fluxgrpo.models.flux import set_activation_checkpointing
from fluxgrpo.runtime import device as rt_device
from fluxgrpo.training import memory
from fluxgrpo.training.stages import decode_images, score_images

if TYPE_CHECKING:
    from fluxgrpo.runtime.dist import DistContext
    from fluxgrpo.training.memory import MemoryEstimate

# The on-policy tolerance is the |log ρ| a rollout rounded once to the other precision gives, divided by this.
ROUNDING_FRACTION = 4
GiB = 2**30


@dataclass(frozen=True)
class IterationSettings:
    """What the iteration runs: the model, the run's shape, and the GRPO constants of the configuration."""

    model: str  # bench.config.TINY_MODEL or SHAPED_MODEL
    blocks: tuple[int, int] | None  # (double, single) of the shaped model; None keeps the model's own
    height: int
    width: int
    sampling_steps: int
    rollout_batch_size: int
    micro_batch_size: int
    text_tokens: int
    samplers: tuple[str, ...]
    eta: float
    guidance: float
    shift: float
    clip_range: float
    max_grad_norm: float
    gradient_checkpointing: bool
    attention: str
    timestep_fraction: float = 0.5
    # bench's reward choice: "auto" (a random ViT-H-14, HPSv2's size, beside the shaped model; the tiny CLIP on cpu)
    reward_model: str = "auto"
    seed: int = 0

    @property
    def trajectories(self) -> int:
        return math.lcm(self.rollout_batch_size, self.micro_batch_size)

    @property
    def train_timesteps(self) -> int:
        """T trained per trajectory, as the trainer counts it (DanceGRPO's sampler: int((N−1)·fraction))."""
        return max(1, int((self.sampling_steps - 1) * self.timestep_fraction))


def _bench_config(settings: IterationSettings) -> BenchConfig:
    return BenchConfig(
        model=settings.model,
        blocks=settings.blocks,
        resolutions=((settings.height, settings.width),),
        steps=settings.sampling_steps,
        rollout_batch_sizes=(settings.rollout_batch_size,),
        micro_batch_sizes=(settings.micro_batch_size,),
        trajectories=settings.trajectories,
        text_tokens=settings.text_tokens,
        attention=settings.attention,
        reward=settings.reward_model,
        seed=settings.seed,
    ).validate()


class _PhasePeaks:
    """The device allocator's peak of each phase, and the allocated bytes after the build (None on cpu)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peaks: dict[str, int | None] = {}

    def start(self) -> None:
        rt_device.synchronize(self.device)
        rt_device.reset_peak_memory(self.device)

    def stop(self, phase: str) -> None:
        rt_device.synchronize(self.device)
        peak = rt_device.peak_memory_bytes(self.device)
        previous = self.peaks.get(phase)
        self.peaks[phase] = peak if previous is None or peak is None else max(previous, peak)


def run_iteration(
    settings: IterationSettings, ctx: DistContext, *, rollout_dtype: torch.dtype | None = None
) -> list[CheckResult]:
    """The on-policy result of every sampler, then the memory-model result.

    ``rollout_dtype`` runs the rollout's forwards in another autocast dtype than the update's (None: the same,
    the runtime's); only a test sets it, to prove the check catches a rollout/update mismatch.
    """

    compute_dtype = rt_device.compute_dtype(ctx.device_type)
    dtype_name = "bf16" if compute_dtype == torch.bfloat16 else "fp32"
    bench_cfg = _bench_config(settings)
    peaks = _PhasePeaks(ctx.device)
    results: list[CheckResult] = []
    with HostPeak() as host:
        peaks.start()
        model = build_bench_model(bench_cfg, ctx, compute_dtype)
        transformer = model.transformer
        set_activation_checkpointing(transformer, settings.gradient_checkpointing)
        trainable = [p for p in transformer.parameters() if p.requires_grad]
        # Learning rate 0: AdamW's full arithmetic and state, weights unchanged, so the ratio must stay 1.
        optimizer = torch.optim.AdamW(trainable, lr=0.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-4)
        _materialize_optimizer_state(optimizer)
        peaks.stop("build")
        peaks.start()
        peaks.stop("persistent")  # right after a reset the peak is what is allocated now
        inputs = _make_inputs(bench_cfg, model, settings.height, settings.width, ctx.device, ctx.rank)
        trainee = BenchTrainee(transformer, optimizer, _NoSchedule())
        reference_dtype = torch.float32 if compute_dtype == torch.bfloat16 else torch.bfloat16

        def on_policy(sampler: str, dtype: torch.dtype, first: bool) -> dict[str, float]:
            """Rollout with forwards in ``dtype``, (decode and score once), update: the update's statistics."""
            peaks.start()
            setup = PhaseSetup(
                sampler, settings.eta, settings.guidance, settings.clip_range, settings.max_grad_norm,
                settings.train_timesteps, ctx.device_type, settings.seed,
            )  # fmt: skip
            rollout = setup.rollout(transformer, inputs, settings.rollout_batch_size, dtype)
            peaks.stop("rollout")
            if first:  # decode and score once: they do not depend on the sampler
                peaks.start()
                images = decode_images(
                    model.vae,
                    rollout.final_x0,
                    settings.height,
                    settings.width,
                    settings.rollout_batch_size,
                    ctx.device_type,
                    compute_dtype,
                )
                peaks.stop("decode")
                peaks.start()
                score_images(model.reward, images, inputs.cond.captions or (), settings.rollout_batch_size)
                peaks.stop("reward")
                del images
            peaks.start()
            stats = setup.update(trainee, rollout, inputs, settings.micro_batch_size, compute_dtype)
            peaks.stop("update")
            return stats.as_floats()

        for index, sampler in enumerate(settings.samplers):
            start = time.perf_counter()
            figures = on_policy(sampler, rollout_dtype or compute_dtype, first=index == 0)
            with warnings.catch_warnings():  # torch's note that bf16 q/k meet an fp32 norm weight: intended here
                warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
                reference = on_policy(sampler, reference_dtype, first=False)["first_abs_log_ratio"]
            results.append(
                _on_policy_result(
                    sampler, figures, reference, settings, dtype_name, rollout_dtype, time.perf_counter() - start
                )
            )
    results.append(_memory_result(settings, model, peaks.peaks, host.to_dict(), ctx.device_type, compute_dtype))
    return results


def _on_policy_result(
    sampler: str,
    figures: dict[str, float],
    reference: float,
    settings: IterationSettings,
    dtype_name: str,
    rollout_dtype: torch.dtype | None,
    seconds: float,
) -> CheckResult:
    ratio = figures["first_abs_log_ratio"]
    tolerance = reference / ROUNDING_FRACTION
    ok = math.isfinite(ratio) and ratio <= tolerance and not figures["skipped_steps"]
    setup = f"{dtype_name}, rollout batch {settings.rollout_batch_size}, micro-batch {settings.micro_batch_size}" + (
        "" if rollout_dtype is None else f", rollout in {str(rollout_dtype).removeprefix('torch.')}"
    )
    detail = (
        f"max |log ρ| {ratio:.2e} ≤ {tolerance:.2e} ({setup})"
        if ok
        else f"max |log ρ| {ratio:.2e} > {tolerance:.2e} at learning rate 0 ({setup}): the update does not "
        "recompute the rollout's log-probs; look for a rollout/update dtype or kernel mismatch"
    )
    return CheckResult(
        f"on-policy start ({sampler})",
        PASSED if ok else FAILED,
        ratio,
        "|log ρ|",
        f"first_abs_log_ratio ≤ 1/{ROUNDING_FRACTION} of a one-rounding rollout's",
        detail,
        measured={k: v for k, v in figures.items() if k != "loss"}
        | {"sampler": sampler, "reference_abs_log_ratio": reference, "tolerance": tolerance, "dtype": dtype_name},
        seconds=round(seconds, 3),
    )


class _NoSchedule:
    last_epoch = 0  # the optimizer steps a run's schedule counts: none that moved a weight

    def step(self) -> None:
        """The learning rate stays 0."""


def estimate_for_iteration(
    settings: IterationSettings, transformer_config: dict[str, Any], vae_config: dict[str, Any], reward_bytes: int,
    compute_bytes: int,
) -> MemoryEstimate:  # fmt: skip
    """``training.memory``'s estimate of this iteration on one die, its reward term set to ``reward_bytes``."""

    run = memory.RunShape(
        dies=1,
        height=settings.height,
        width=settings.width,
        sampling_steps=settings.sampling_steps,
        trajectories_per_rank=settings.trajectories,
        rollout_batch_size=settings.rollout_batch_size,
        train_micro_batch_size=settings.micro_batch_size,
        gradient_checkpointing=settings.gradient_checkpointing,
        cpu_offload=False,
        use_ema=False,
        reward="brightness",  # no reward parameters; the loaded reward model's bytes are set below
        compute_bytes=compute_bytes,
        text_tokens=settings.text_tokens,
    )
    estimate = memory.estimate(memory.transformer_shape(transformer_config), memory.vae_shape(vae_config), run)
    estimate.persistent["reward"] = reward_bytes
    return estimate


def _memory_result(
    settings: IterationSettings,
    model: Any,
    peaks: dict[str, int | None],
    host: dict[str, Any],
    device_type: str,
    compute_dtype: torch.dtype,
) -> CheckResult:
    compute_bytes = 4 if compute_dtype == torch.float32 else 2
    reward_model = getattr(model.reward, "model", None)
    reward_bytes = (
        sum(p.numel() * p.element_size() for p in reward_model.parameters()) if reward_model is not None else 0
    )
    estimate = estimate_for_iteration(
        settings, dict(model.transformer.config), dict(model.vae.config), reward_bytes, compute_bytes
    )
    device_peak = max((value for value in peaks.values() if value is not None), default=None)
    if device_peak is not None:
        measured, source = device_peak, f"{device_type} allocator peak"
    else:
        measured, source = host["rise_bytes"], f"host resident-set rise ({host['method']}; cpu has no allocator)"
    rule = "estimate ≥ measured peak"
    terms = {
        "measured_source": source,
        "measured_peak_bytes": measured,
        "phase_peak_bytes": peaks,
        "host": host,
        "estimate_peak_bytes": estimate.peak,
        "estimate_without_reserve_bytes": estimate.peak - estimate.reserve,
        "estimate": estimate.as_dict(),
        "settings": {
            "blocks": settings.blocks,
            "resolution": f"{settings.height}x{settings.width}",
            "trajectories": settings.trajectories,
            "rollout_batch_size": settings.rollout_batch_size,
            "train_micro_batch_size": settings.micro_batch_size,
            "sampling_steps": settings.sampling_steps,
            "gradient_checkpointing": settings.gradient_checkpointing,
            "text_tokens": settings.text_tokens,
            "reward_bytes": reward_bytes,
        },
    }
    if measured is None:
        return CheckResult("memory model", SKIPPED, None, "×", rule, f"no measurement: {source}", terms)
    ratio = estimate.peak / measured
    ok = estimate.peak >= measured
    detail = (
        f"estimate {estimate.peak / GiB:.2f} GiB / measured {measured / GiB:.2f} GiB ({source})"
        if ok
        else f"estimate {estimate.peak / GiB:.2f} GiB is below the measured {measured / GiB:.2f} GiB ({source}): "
        "train --dry-run under-estimates; send env-check-deep.json with an issue"
    )
    return CheckResult(
        "memory model", PASSED if ok else FAILED, round(ratio, 3), "× estimate/measured", rule, detail, terms
    )
