"""`fluxgrpo bench`: the FLOP formula (by hand and against torch's counter), the peak table, flag parsing, the
summaries' arithmetic, and a smoke run of the whole bench on the tiny model (structure only: no time is asserted)."""

from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch
from typer.testing import CliRunner

from fluxgrpo.bench.config import BenchConfig, build_bench_config, parse_resolutions
from fluxgrpo.bench.figures import PhaseFigure, summarize, with_speedups
from fluxgrpo.bench.flops import FluxShape, rollout_flops, transformer_forward_flops, update_flops
from fluxgrpo.bench.harness import saved_activation_bytes
from fluxgrpo.bench.models import FLUX_DEV_BLOCKS, FLUX_DEV_TRANSFORMER_CONFIG, check_training_memory
from fluxgrpo.bench.run import run_bench
from fluxgrpo.cli.app import app
from fluxgrpo.errors import UsageError
from fluxgrpo.runtime.peak import peak_throughput

runner = CliRunner()


def tiny_flux_config(double: int, single: int) -> dict:
    from fluxgrpo.models.tiny import TINY_TRANSFORMER_CONFIG

    return {**TINY_TRANSFORMER_CONFIG, "num_layers": double, "num_single_layers": single}


# ------------------------------------------------------------------------------------------------ FLOPs


def test_forward_flops_hand_count():
    shape = FluxShape.from_config(tiny_flux_config(1, 1))
    # d = 2 heads × 16 = 32, 1 double + 1 single block, L = 16 image tokens, S = 8 text tokens, n = 24:
    #   blocks      2 · (24·24·32² + 4·24²·32)            = 2 · (589,824 + 73,728)   = 1,327,104
    #   embedders   2·32 · (64·16 + 32·8 + 64·16)          = 64 · 2,304               =   147,456
    #   adaLN       2·32² · (12·1 + 3·1 + 2)               = 2,048 · 17               =    34,816
    #   conditioning 2·(2·(256·32 + 32²) + 32·32 + 32²)    = 2 · (18,432 + 2,048)     =    40,960
    #                                                                          total     1,550,336
    assert transformer_forward_flops(shape, image_tokens=16, text_tokens=8) == 1_550_336
    # rollout: B·N forwards; update: 3 × forward per trained sample
    assert rollout_flops(shape, 16, 8, trajectories=4, steps=3) == 12 * 1_550_336
    assert update_flops(shape, 16, 8, trajectories=4, train_timesteps=2) == 3 * 8 * 1_550_336


@pytest.mark.parametrize(("double", "single"), [(2, 1), (1, 2)])
def test_forward_flops_equal_torch_flop_counter(double, single):
    from diffusers import FluxTransformer2DModel
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = FluxTransformer2DModel(**tiny_flux_config(double, single))
    batch, image_tokens, text_tokens = 2, 16, 8
    # The math attention backend is plain matmuls, which the counter sees (the fused cpu kernel it does not).
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(
            hidden_states=torch.randn(batch, image_tokens, 64),
            encoder_hidden_states=torch.randn(batch, text_tokens, 32),
            pooled_projections=torch.randn(batch, 32),
            timestep=torch.full((batch,), 0.5),
            img_ids=torch.zeros(image_tokens, 3),
            txt_ids=torch.zeros(text_tokens, 3),
            guidance=torch.full((batch,), 3.5),
            return_dict=False,
        )
    shape = FluxShape.from_transformer(model)
    assert counter.get_total_flops() == batch * transformer_forward_flops(shape, image_tokens, text_tokens)
    assert shape.parameter_count() == sum(p.numel() for p in model.parameters())


def test_flux_dev_shape_matches_the_real_architecture():
    from diffusers import FluxTransformer2DModel

    config = {**FLUX_DEV_TRANSFORMER_CONFIG, "num_layers": FLUX_DEV_BLOCKS[0], "num_single_layers": FLUX_DEV_BLOCKS[1]}
    with torch.device("meta"):
        model = FluxTransformer2DModel(**config)
    shape = FluxShape.from_config(config)
    assert shape.parameter_count() == sum(p.numel() for p in model.parameters()) == 11_901_408_320
    # The module docstring's figure: ≈ 37.3 TFLOP per 720² image per step (n = 2025 + 512 = 2537 tokens),
    # 88 % of it in the blocks' 24·n·d² terms and 12 % in attention (4·n²·d per block).
    flops = transformer_forward_flops(shape, image_tokens=45 * 45, text_tokens=512)
    assert round(flops / 1e12, 1) == 37.3
    assert round(57 * 24 * 2537 * 3072**2 / flops, 2) == 0.88
    assert round(57 * 4 * 2537**2 * 3072 / flops, 2) == 0.12


# ------------------------------------------------------------------------------------------------ peaks


def test_peak_table():
    assert peak_throughput("cuda", "NVIDIA H200", "bf16").tflops == 989.4
    assert peak_throughput("cuda", "NVIDIA H100 80GB HBM3", "bf16").tflops == 989.4
    assert peak_throughput("cuda", "NVIDIA H100 PCIe", "bf16").tflops == 756.5
    assert peak_throughput("cuda", "NVIDIA A100-SXM4-80GB", "fp32").tflops == 156.0  # TF32
    assert peak_throughput("cuda", "Some Future GPU", "bf16").tflops is None
    assert peak_throughput("cpu", "Intel Xeon", "fp32").tflops is None
    # Ascend: 24 cube cores × 1850 MHz × 16·16·16·2 FLOP = 363.7 TFLOPS; no fp32 (HF32) figure.
    assert round(peak_throughput("npu", "Ascend910_9391", "bf16").tflops, 1) == 363.7
    assert peak_throughput("npu", "Ascend910_9391", "fp32").tflops is None
    override = peak_throughput("cpu", "Intel Xeon", "fp32", override=2.5)
    assert override.tflops == 2.5 and override.source == "--peak-tflops"


# ------------------------------------------------------------------------------------------------ flags


def test_flag_parsing_and_validation():
    assert parse_resolutions("512,720") == ((512, 512), (720, 720))
    assert parse_resolutions("720x1280") == ((720, 1280),)
    cfg = build_bench_config(
        model="flux-dev-shaped", blocks="8,16", resolution="720", rollout_batch_sizes="4,1,2", micro_batch_sizes="2,1"
    )
    assert cfg.blocks == (8, 16) and cfg.rollout_batch_sizes == (1, 2, 4)
    assert cfg.num_trajectories == 4  # lcm(1, 2, 4, 1, 2)
    assert cfg.num_train_timesteps == 9  # int((16 − 1)·0.6)
    assert BenchConfig(steps=2).num_train_timesteps == 1
    assert BenchConfig(rollout_batch_sizes=(3,), micro_batch_sizes=(2,)).num_trajectories == 6
    assert BenchConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))).resolved_resolutions() == ((720, 720),)
    for bad in (
        {"resolution": "700"},
        {"blocks": "8"},
        {"rollout_batch_sizes": "1,x"},
        {"steps": 1},
        {"trajectories": 3},
        {"dtype": "fp16"},
        {"activation_checkpointing": "sometimes"},
        {"compile": True, "dies": 2},
        {"train_timesteps": 16},
    ):
        with pytest.raises(UsageError):
            build_bench_config(**bad)


def test_memory_check_refuses_what_cannot_train(monkeypatch):
    from fluxgrpo.bench import models
    from fluxgrpo.runtime.dist import DistContext

    monkeypatch.setattr(models, "device_memory_bytes", lambda ctx: 139 * 2**30)  # one H200
    one, two = (
        DistContext(
            rank=0, local_rank=0, world_size=size, device_type="cpu", device=torch.device("cpu"), backend="gloo"
        )
        for size in (1, 2)
    )

    def shape(double, single):
        return FluxShape.from_config({**FLUX_DEV_TRANSFORMER_CONFIG, "num_layers": double, "num_single_layers": single})

    # 19 + 38 blocks: 11.90 B parameters × 16 bytes = 177 GiB > 139 GiB on one device; 88.7 GiB each on two.
    with pytest.raises(UsageError, match="--blocks"):
        check_training_memory(shape(19, 38), one, "flux-dev-shaped")
    check_training_memory(shape(19, 38), two, "flux-dev-shaped")
    check_training_memory(shape(8, 16), one, "flux-dev-shaped")  # 5.05 B × 16 bytes = 75 GiB


# ------------------------------------------------------------------------------------------------ summaries


def _row(phase, batch, seconds, work=8, checkpointing=None, **extra):
    return PhaseFigure(
        phase,
        "64x64",
        batch,
        checkpointing,
        work,
        "images",
        seconds,
        seconds,
        work / seconds,
        None,
        None,
        None,
        extra.get("peak"),
        extra.get("activations"),
        None,
    )


def test_speedups_and_iteration_summary_by_hand():
    figures = with_speedups(
        [
            _row("rollout", 1, 4.0),
            _row("rollout", 4, 1.6),
            _row("decode", 1, 0.4),
            _row("decode", 4, 0.2),
            _row("reward", 1, 0.2),
            _row("reward", 4, 0.1),
            _row("update", 1, 3.0, checkpointing=False, peak=900, activations=500),
            _row("update", 2, 2.0, checkpointing=False, peak=1300, activations=1000),
            _row("update", 1, 4.0, checkpointing=True, peak=600, activations=100),
            _row("update", 2, 3.0, checkpointing=True, peak=700, activations=150),
            PhaseFigure(
                "optimizer", "64x64", None, None, 1, "steps", 0.4, 0.4, 2.5, None, None, None, None, None, None
            ),
        ]
    )
    rollout = {f.batch_size: f.speedup for f in figures if f.phase == "rollout"}
    assert rollout == {1: 1.0, 4: pytest.approx(2.5)}  # (8/1.6) / (8/4)
    updates = {(f.batch_size, f.activation_checkpointing): f.speedup for f in figures if f.phase == "update"}
    assert updates[(2, False)] == pytest.approx(1.5) and updates[(2, True)] == pytest.approx(4 / 3)

    summary = summarize(figures, "64x64")
    off = next(it for it in summary["iterations"] if not it["activation_checkpointing"])
    # batch 1: 4 + 0.4 + 0.2 + 3 + 0.4 = 8.0 s; largest: 1.6 + 0.2 + 0.1 + 2 + 0.4 = 4.3 s
    assert off["smallest"]["seconds"] == pytest.approx(8.0) and off["largest"]["seconds"] == pytest.approx(4.3)
    assert off["speedup"] == pytest.approx(8.0 / 4.3)
    assert off["smallest"]["share"]["rollout"] == pytest.approx(0.5)
    assert off["largest"]["images_per_second"] == pytest.approx(8 / 4.3)
    saved = summary["activation_checkpointing_by_micro_batch"]
    assert saved["2"] == {
        "peak_memory_saved_bytes": 600,
        "activation_bytes_saved": 850,
        "time_ratio_on_over_off": pytest.approx(1.5),
    }
    assert summary["speedups"]["rollout"] == {"batch_size": 4, "vs_batch_size": 1, "speedup": pytest.approx(2.5)}


def test_saved_activation_bytes_counts_what_backward_keeps():
    weight = torch.nn.Parameter(torch.ones(4))
    inputs = torch.randn(4)  # 4 fp32 = 16 bytes
    # mul keeps its non-parameter operand (16 bytes) for the weight's gradient, sin keeps its input (16 bytes);
    # the parameter itself is not an activation.
    held, out = saved_activation_bytes(lambda: torch.sin(inputs * weight).sum(), [weight])
    assert held == 32
    out.backward()
    assert weight.grad is not None


# ------------------------------------------------------------------------------------------------ rollout speed


def test_rollout_casts_each_weight_once_not_once_per_forward():
    from torch.utils._python_dispatch import TorchDispatchMode
    from training_helpers import sde_rollout

    from fluxgrpo.grpo.latents import image_ids
    from fluxgrpo.grpo.schedule import sigma_schedule
    from fluxgrpo.grpo.types import Conditioning

    class CountCasts(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.sources: list[int] = []  # data pointers of the cast fp32 tensors

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            is_cast = func is torch.ops.aten._to_copy.default
            if is_cast and (args[0].dtype, out.dtype) == (torch.float32, torch.bfloat16):
                self.sources.append(args[0].data_ptr())
            return out

    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(**tiny_flux_config(1, 1))
    cond = Conditioning(torch.randn(4, 8, 32), torch.randn(4, 32), torch.zeros(8, 3))
    noise = torch.randn(4, 16, 64)

    def rollout(outer: contextlib.AbstractContextManager):
        with CountCasts() as counter, outer:
            result = sde_rollout(
                model,
                cond,
                noise,
                sigma_schedule(3, 3.0),
                eta=0.3,
                guidance=3.5,
                img_ids=image_ids(64, 64),
                rollout_batch_size=2,
                device_type="cpu",
                generator=torch.Generator().manual_seed(1),
                compute_dtype=torch.bfloat16,
            )
        return counter.sources, result

    casts, result = rollout(contextlib.nullcontext())
    # 3 steps × 2 chunks = 6 forwards, yet each weight is cast to bf16 once.
    for weight in (model.transformer_blocks[0].ff.net[2].weight, model.single_transformer_blocks[0].proj_out.weight):
        assert casts.count(weight.data_ptr()) == 1
    # The same rollout under a caller's autocast region (the old per-forward casts cannot differ): bit-identical.
    _, again = rollout(torch.autocast("cpu", dtype=torch.bfloat16))
    assert torch.equal(result.latents, again.latents) and torch.equal(result.log_probs, again.log_probs)


# ------------------------------------------------------------------------------------------------ smoke runs


def test_bench_smoke_json_lines():
    result = runner.invoke(
        app,
        [
            "bench",
            "--model",
            "tiny",
            "--steps",
            "2",
            "--rollout-batch-sizes",
            "1,2,4",
            "--micro-batch-sizes",
            "1,2",
            "--repeats",
            "1",
            "--warmup",
            "1",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    kinds = [record["record"] for record in records]
    assert kinds[:4] == ["config", "device", "versions", "model"] and kinds[-1] == "summary"
    config, device, model = records[0], records[1], records[3]
    assert config["trajectories"] == 4 and config["train_timesteps"] == 1 and config["dtype"] == "fp32"
    assert device["type"] == "cpu" and device["peak_tflops"] is None
    assert model["double_blocks"] == 2 and model["single_blocks"] == 2 and model["reward"] == "tiny-clip"
    shape = FluxShape.from_config(tiny_flux_config(2, 2))
    forward = transformer_forward_flops(shape, image_tokens=16, text_tokens=512)
    assert model["forward_flops_per_sample"] == {"64x64": forward}

    figures = [record for record in records if record["record"] == "figure"]
    assert all(figure["error"] is None for figure in figures), figures
    table = {(f["phase"], f["batch_size"], f["activation_checkpointing"]): f for f in figures}
    for phase in ("rollout", "decode", "reward"):
        assert {key[1] for key in table if key[0] == phase} == {1, 2, 4}
        assert table[(phase, 1, None)]["speedup"] == 1.0
        assert all(table[(phase, size, None)]["speedup"] > 0 for size in (2, 4))
        assert all(table[(phase, size, None)]["work"] == 4 for size in (1, 2, 4))
    rollout = table[("rollout", 4, None)]
    assert rollout["tflops"] == pytest.approx(4 * 2 * forward / rollout["seconds"] / 1e12)  # B·N forwards
    assert rollout["mfu"] is None and rollout["peak_memory_bytes"] is None  # cpu: no peak, no allocator stats
    for size in (1, 2):
        off, on = table[("update", size, False)], table[("update", size, True)]
        assert off["work"] == 4 and off["tflops"] == pytest.approx(3 * 4 * forward / off["seconds"] / 1e12)
        assert on["activation_bytes"] < off["activation_bytes"]  # checkpointing keeps less for backward
        assert off["max_abs_log_ratio"] < 1e-5 and on["max_abs_log_ratio"] < 1e-5  # ratio 1: same weights
    assert table[("optimizer", None, None)]["seconds"] > 0

    summary = records[-1]
    assert {it["activation_checkpointing"] for it in summary["iterations"]} == {False, True}
    for iteration in summary["iterations"]:
        assert iteration["smallest"]["batch_sizes"] == {"rollout": 1, "decode": 1, "reward": 1, "update": 1}
        assert iteration["largest"]["batch_sizes"] == {"rollout": 4, "decode": 4, "reward": 4, "update": 2}
        assert math.isclose(sum(iteration["largest"]["share"].values()), 1.0)
        assert iteration["speedup"] > 0
    assert set(summary["speedups"]) == {"rollout", "decode", "reward", "update no-ckpt", "update ckpt"}
    assert set(summary["activation_checkpointing_by_micro_batch"]) == {"1", "2"}


def test_bench_smoke_table_with_a_given_peak():
    result = runner.invoke(
        app,
        [
            "bench",
            "--model",
            "tiny",
            "--steps",
            "2",
            "--rollout-batch-sizes",
            "1,2",
            "--micro-batch-sizes",
            "2",
            "--activation-checkpointing",
            "off",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--peak-tflops",
            "0.5",
        ],
    )
    assert result.exit_code == 0, result.output
    for text in (
        "rollout",
        "decode",
        "reward",
        "update no-ckpt",
        "optimizer",
        "MFU",
        "iteration speed-up",
        "0.5 TFLOPS (--peak-tflops)",
    ):
        assert text in result.stdout, text


def test_bench_rejects_bad_flags():
    result = runner.invoke(app, ["bench", "--resolution", "100"])
    assert result.exit_code == 2 and "multiples of 16" in result.output


def test_run_bench_in_process_with_bf16_autocast():
    """The accelerator code path (bf16 autocast, a VAE in bf16, the ratio check) exercised on cpu."""
    records = run_bench(
        build_bench_config(
            steps=2,
            rollout_batch_sizes="2",
            micro_batch_sizes="2",
            activation_checkpointing="on",
            repeats=1,
            warmup=0,
            dtype="bf16",
        ),
        log=lambda line: None,
    )
    figures = [record for record in records if record["record"] == "figure"]
    assert records[0]["dtype"] == "bf16" and all(figure["error"] is None for figure in figures)
    update = next(figure for figure in figures if figure["phase"] == "update")
    assert update["max_abs_log_ratio"] < 1e-3  # bf16 forward in rollout and update alike: ratio stays ≈ 1


def test_out_of_memory_is_recorded_and_the_bench_goes_on(monkeypatch):
    from fluxgrpo.bench import harness

    build = harness.build_bench_model

    def build_with_a_small_device(cfg, ctx, compute_dtype):
        model = build(cfg, ctx, compute_dtype)

        def refuse_big_batches(module, args, kwargs):
            if kwargs["hidden_states"].shape[0] >= 4:
                raise torch.OutOfMemoryError("out of memory: tried to allocate 1 GiB (simulated)")

        model.transformer.register_forward_pre_hook(refuse_big_batches, with_kwargs=True)
        return model

    monkeypatch.setattr(harness, "build_bench_model", build_with_a_small_device)
    records = run_bench(
        build_bench_config(
            steps=2,
            rollout_batch_sizes="1,4",
            micro_batch_sizes="1,4",
            activation_checkpointing="off",
            repeats=1,
            warmup=0,
        ),
        log=lambda line: None,
    )
    figures = {(r["phase"], r["batch_size"]): r for r in records if r["record"] == "figure"}
    for key in (("rollout", 4), ("update", 4)):
        assert figures[key]["error"] == "out of memory" and figures[key]["seconds"] is None
    for key in (("rollout", 1), ("decode", 4), ("reward", 4), ("update", 1), ("optimizer", None)):
        assert figures[key]["error"] is None and figures[key]["seconds"] > 0, key
    assert records[-1]["record"] == "summary"


def test_a_model_folder_with_fewer_blocks(tiny_weights):
    records = run_bench(
        build_bench_config(
            model=str(tiny_weights.flux_dir),
            blocks="1,1",
            resolution="32",
            steps=2,
            rollout_batch_sizes="2",
            micro_batch_sizes="2",
            activation_checkpointing="off",
            repeats=1,
            warmup=0,
        ),
        log=lambda line: None,
    )
    model = next(r for r in records if r["record"] == "model")
    assert (model["double_blocks"], model["single_blocks"]) == (1, 1)
    assert model["transformer_parameters"] == FluxShape.from_config(tiny_flux_config(1, 1)).parameter_count()
    assert all(r["error"] is None for r in records if r["record"] == "figure")
    with pytest.raises(UsageError, match="has only 2 double"):
        run_bench(build_bench_config(model=str(tiny_weights.flux_dir), blocks="3,1"), log=lambda line: None)


@pytest.mark.slow
def test_two_workers_with_a_sharded_transformer():
    result = runner.invoke(
        app,
        [
            "bench",
            "--model",
            "tiny",
            "--steps",
            "2",
            "--rollout-batch-sizes",
            "1,2",
            "--micro-batch-sizes",
            "2",
            "--activation-checkpointing",
            "off",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--dies",
            "2",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    device = next(r for r in records if r["record"] == "device")
    assert device["world_size"] == 2
    figures = [r for r in records if r["record"] == "figure"]
    assert {r["phase"] for r in figures} == {"rollout", "decode", "reward", "update", "optimizer"}
    assert all(r["error"] is None for r in figures)
    update = next(r for r in figures if r["phase"] == "update")
    assert update["max_abs_log_ratio"] < 1e-5


def test_each_phase_reports_its_own_memory_peak(monkeypatch):
    """cpu keeps no allocator statistics, so a stand-in allocator whose peak the model and optimizer raise: the
    update's peak must not include the optimizer step's, and the optimizer row must get it."""
    from fluxgrpo.bench import harness
    from fluxgrpo.runtime import device as rt_device

    peak = {"bytes": 0}
    monkeypatch.setattr(rt_device, "reset_peak_memory", lambda device: peak.update(bytes=0))
    monkeypatch.setattr(rt_device, "peak_memory_bytes", lambda device: peak["bytes"])

    def raise_peak(value):
        peak["bytes"] = max(peak["bytes"], value)

    build = harness.build_bench_model

    def build_with_footprints(cfg, ctx, compute_dtype):
        model = build(cfg, ctx, compute_dtype)
        model.transformer.register_forward_pre_hook(lambda module, args: raise_peak(500 if module.training else 300))
        return model

    monkeypatch.setattr(harness, "build_bench_model", build_with_footprints)
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    handle = register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: raise_peak(1000))
    try:
        records = run_bench(
            build_bench_config(
                steps=2,
                rollout_batch_sizes="2",
                micro_batch_sizes="2",
                activation_checkpointing="off",
                repeats=1,
                warmup=0,
            ),
            log=lambda line: None,
        )
    finally:
        handle.remove()
    peaks = {r["phase"]: r["peak_memory_bytes"] for r in records if r["record"] == "figure"}
    assert peaks == {"rollout": 300, "decode": 0, "reward": 0, "update": 500, "optimizer": 1000}


def test_bench_honours_the_sampler(monkeypatch):
    """`bench --sampler` reaches the rollout the bench measures and the update that scores it (it was ignored)."""
    from fluxgrpo.training import stages

    real_stage, seen = stages.rollout_stage, []

    def recording_stage(*args, **kwargs):
        rollout = real_stage(*args, **kwargs)
        seen.append(rollout)
        return rollout

    monkeypatch.setattr(stages, "rollout_stage", recording_stage)
    options = dict(steps=3, rollout_batch_sizes="2", micro_batch_sizes="2", activation_checkpointing="off")
    by_sampler = {}
    for sampler in ("dance", "cps"):
        seen.clear()
        records = run_bench(build_bench_config(**options, repeats=1, warmup=0, sampler=sampler), log=lambda _: None)
        assert records[0]["sampler"] == sampler and {rollout.sampler.name for rollout in seen} == {sampler}
        update = next(r for r in records if r["record"] == "figure" and r["phase"] == "update")
        assert update["error"] is None and update["max_abs_log_ratio"] < 1e-3  # scored with the rollout's sampler
        by_sampler[sampler] = seen[-1]
    dance, cps = by_sampler["dance"], by_sampler["cps"]
    assert torch.equal(dance.latents[:, 0], cps.latents[:, 0])  # the same inputs and step noise …
    assert not torch.allclose(dance.log_probs[:, :-1], cps.log_probs[:, :-1])  # … another step: other log-probs
    with pytest.raises(UsageError, match="--sampler 'euler'"):
        build_bench_config(sampler="euler")
