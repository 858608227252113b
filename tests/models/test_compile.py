"""``--compile``: FLUX's repeated blocks compiled regionally (fluxgrpo/models/compile.py) in train, sample and bench.

Inductor compiles C++ kernels, which takes tens of seconds even for the tiny blocks, so one test compiles with it
(the numerics: compiled forward = eager within fp32 rounding, one graph per block kind whatever the batch and
resolution). The training, sample and bench tests compile with ``FLUXGRPO_COMPILE_BACKEND=eager``: TorchDynamo
captures exactly the graphs inductor would get, with the same guards (so graph counts, recompiles and which graph
serves which call are exercised), and runs them as captured. Every test points inductor's cache at its own tmp
folder and empties TorchDynamo's caches before and after.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from training_helpers import run, tiny_config
from typer.testing import CliRunner

from fluxgrpo.cli.app import app
from fluxgrpo.errors import UsageError
from fluxgrpo.grpo.latents import image_ids, latent_shape
from fluxgrpo.models.compile import (
    CompileMeter,
    compile_repeated_blocks,
    is_compiled,
    repeated_blocks,
    uncompile_repeated_blocks,
)
from fluxgrpo.models.flux import load_transformer
from fluxgrpo.runtime.adapt import COMPILE_BACKEND_ENV, NPU_COMPILE_REFUSAL, compile_backend

runner = CliRunner()


@pytest.fixture
def hermetic_compile(tmp_path, monkeypatch):
    """Inductor's on-disk cache in this test's folder; TorchDynamo's in-memory caches emptied before and after."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-cache"))
    torch.compiler.reset()
    yield
    torch.compiler.reset()


@pytest.fixture
def captured_graphs(hermetic_compile, monkeypatch):
    monkeypatch.setenv(COMPILE_BACKEND_ENV, "eager")


def _forward(transformer, batch: int, side: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    tokens = latent_shape(side, side).num_tokens
    with torch.no_grad():
        return transformer(
            hidden_states=torch.randn(batch, tokens, 64, generator=generator),
            encoder_hidden_states=torch.randn(batch, 8, 32, generator=generator),
            pooled_projections=torch.randn(batch, 32, generator=generator),
            timestep=torch.full((batch,), 0.6),
            img_ids=image_ids(side, side),
            txt_ids=torch.zeros(8, 3),
            guidance=torch.full((batch,), 3.5),
            return_dict=False,
        )[0]


def test_compiled_blocks_match_eager_with_one_graph_per_block_kind(tiny_weights, hermetic_compile):
    eager = load_transformer(tiny_weights.flux_dir)
    compiled = load_transformer(tiny_weights.flux_dir)
    names = list(compiled.state_dict())
    assert compile_repeated_blocks(compiled, compile_backend("cpu")) == 4  # 2 double + 2 single blocks
    assert is_compiled(compiled) and list(compiled.state_dict()) == names  # nothing renamed: checkpoints unchanged
    meter = CompileMeter()
    # The rollout's batch at the training resolution, then another batch and resolution (a last short chunk, an
    # evaluation at another size): the second reuses the first's graphs, dynamic in batch and tokens.
    for batch, side, graphs in ((4, 64, 2), (3, 32, 0)):
        reference, result = _forward(eager, batch, side), _forward(compiled, batch, side)
        relative = ((result - reference).abs().max() / reference.abs().max()).item()
        assert relative < 1e-5, (batch, side, relative)
        tally = meter.lap()
        assert tally.compiles == graphs, (batch, side, tally)  # one graph per block kind, not per block or shape
    assert tally.seconds == 0.0
    uncompile_repeated_blocks(compiled)
    assert not is_compiled(compiled)
    assert torch.equal(_forward(compiled, 2, 32), _forward(eager, 2, 32))  # eager again, bit for bit


def test_compiled_training_resumes_exactly_with_its_ratio_at_one_and_no_recompiles(
    tiny_weights, tiny_embeddings, tmp_path, captured_graphs
):
    """Rollout (no grad), update (forward + backward under activation checkpointing), EMA and a resume, compiled."""
    from test_train import exported_weights

    settings = {"compile": True, "gradient_checkpointing": True, "use_ema": True, "ema_decay": 0.9}
    straight = run(tiny_config(tiny_weights, tiny_embeddings, tmp_path / "straight", max_train_steps=3, **settings))
    run(tiny_config(tiny_weights, tiny_embeddings, tmp_path / "resumed", max_train_steps=2, **settings))
    resumed = run(
        tiny_config(tiny_weights, tiny_embeddings, tmp_path / "resumed", max_train_steps=3, **settings),
        resume="latest",
    )

    assert straight[0]["first_abs_log_ratio"] < 1e-5  # the PPO ratio is 1 before the first update
    # rollout and update graphs, per block kind, compiled in the first iteration; none after (no recompile storm)
    assert straight[0]["compiles"] >= 4 and straight[0]["compile_seconds"] > 0
    assert [record["compiles"] for record in straight[1:]] == [0, 0]
    assert [r["reward_mean"] for r in straight] == [r["reward_mean"] for r in resumed]
    for folder in ("transformer", "transformer_ema"):
        a = exported_weights(tmp_path / "straight" / "checkpoint-3", folder)
        b = exported_weights(tmp_path / "resumed" / "checkpoint-3", folder)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[name], b[name]) for name in a), f"{folder} differs after a compiled resume"


def test_compiled_lora_with_its_reference_and_evaluation_without_checkpointing(
    tiny_weights, tiny_embeddings, tmp_path, captured_graphs
):
    """LoRA, the KL reference (adapters off) and the held-out evaluation's sampling share the compiled blocks."""
    prompts = tmp_path / "eval_prompts.txt"
    prompts.write_text("a red fox\na lighthouse\n")
    cfg = tiny_config(
        tiny_weights,
        tiny_embeddings,
        tmp_path / "lora",
        compile=True,
        gradient_checkpointing=False,
        lora_rank=4,
        kl_beta=0.01,
        max_train_steps=2,
        eval_every=2,
        eval_steps=2,
        eval_prompts=str(prompts),
    )
    records = run(cfg)
    trained = [record for record in records if "reward_mean" in record]
    assert [record["iteration"] for record in records if "eval_seconds" in record] == [0, 2]
    assert trained[0]["first_abs_log_ratio"] < 1e-5
    # the evaluation before iteration 1 and iteration 1 compiled every graph the run needs (the evaluation's
    # sampling with the rollout's; the reference's, with adapters off, its own)
    assert trained[0]["compiles"] >= 4 and trained[1]["compiles"] == 0


def test_compile_off_leaves_the_model_and_the_records_as_they_were(tiny_weights, tiny_embeddings, tmp_path):
    from fluxgrpo.runtime.dist import DistContext
    from fluxgrpo.training.parts import build_transformer

    cfg = tiny_config(tiny_weights, tiny_embeddings, tmp_path / "out")
    assert cfg.compile is False
    single = DistContext(
        rank=0, local_rank=0, world_size=1, device_type="cpu", device=torch.device("cpu"), backend="gloo"
    )
    transformer = build_transformer(cfg, single)
    assert repeated_blocks(transformer) and not is_compiled(transformer)
    assert all("forward" not in vars(block) for block in repeated_blocks(transformer))


def test_compile_is_refused_on_ascend_in_one_line_before_anything_starts():
    with pytest.raises(UsageError) as refused:
        compile_backend("npu")
    assert str(refused.value) == NPU_COMPILE_REFUSAL and "\n" not in NPU_COMPILE_REFUSAL
    assert "--compile" in NPU_COMPILE_REFUSAL
    assert compile_backend("cpu") == compile_backend("cuda") == "inductor"


# The whole-model mode traces diffusers' gradient-checkpointing helper, which calls an lru_cache'd version check.
@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_bench_compile_reports_compile_cost_speedup_and_break_even(captured_graphs):
    result = runner.invoke(
        app,
        [
            "bench",
            "--model",
            "tiny",
            "--steps",
            "2",
            "--rollout-batch-sizes",
            "2",
            "--micro-batch-sizes",
            "2",
            "--activation-checkpointing",
            "on",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--compile",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    modes = {record["mode"]: record for record in records if record["record"] == "compile"}
    assert list(modes) == ["eager", "regional", "whole-model"]
    eager = modes["eager"]
    assert eager["speedup"] is None and eager["compiles"] == 0 and eager["max_relative_x0_difference"] == 0.0
    for mode in ("regional", "whole-model"):
        row = modes[mode]
        assert row["compiles"] > 0 and row["compile_seconds"] > 0 and len(row["iteration_seconds_runs"]) == 1
        assert row["speedup"] == pytest.approx(eager["iteration_seconds"] / row["iteration_seconds"])
        saved = eager["iteration_seconds"] - row["iteration_seconds"]
        expected = row["compile_seconds"] / saved if saved > 0 else None
        assert row["break_even_iterations"] == (pytest.approx(expected) if expected else None)
        assert row["max_relative_x0_difference"] < 1e-5 and row["max_abs_log_ratio"] < 1e-5
    summary = next(record for record in records if record["record"] == "compile_summary")
    assert summary["recompiles_in_timed_rounds"] == 0
    assert summary["regional_over_whole_model_compile_seconds"] == pytest.approx(
        modes["regional"]["compile_seconds"] / modes["whole-model"]["compile_seconds"]
    )
    assert any(record["record"] == "figure" and record["phase"] == "update" for record in records)  # phases follow


def test_sample_compile_flag_reaches_the_pipeline(tiny_weights, tmp_path, captured_graphs):
    common = ["sample", "--model", str(tiny_weights.flux_dir), "--prompt", "a red fox", "--images-per-prompt", "2"]
    sizes = ["--height", "32", "--width", "32", "--steps", "2", "--batch-size", "2", "--json"]
    for flags, folder in (([], "eager"), (["--compile"], "compiled")):
        result = runner.invoke(app, [*common, *sizes, *flags, "--out", str(tmp_path / folder)])
        assert result.exit_code == 0, result.output
    index = json.loads(Path(tmp_path / "compiled" / "index.json").read_text())
    assert index["settings"]["compile"] is True
    for name in ("0000_00.png", "0000_01.png"):
        eager, compiled = (
            np.asarray(Image.open(tmp_path / folder / name), dtype=np.int16) for folder in ("eager", "compiled")
        )
        assert np.abs(eager - compiled).max() <= 1  # the same images, to 8-bit rounding
