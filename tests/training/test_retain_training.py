"""``--retain-rollout-graphs`` in the real loop on the tiny weights: off (its default) the run is today's; on, with one
trajectory per forward, it trains the same weights bit for bit (every option at once; LoRA with gradient
checkpointing; --compile; 2 FSDP2 ranks); on, with batched forwards, a run resumed from a checkpoint ends exactly where
an uninterrupted one does; what it cannot serve is refused in one line naming the flag; the memory estimate sizes it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from training_helpers import run, tiny_config, tiny_train_argv
from typer.testing import CliRunner

from fluxgrpo.cli.app import app
from fluxgrpo.config import TrainConfig
from fluxgrpo.metrics import read_metrics

# Exactly the numbers that must not move, per iteration record.
COMPARED = ("reward_mean", "advantage_abs_mean", "loss", "ratio_mean", "ratio_min", "ratio_max", "grad_norm_mean")
# One trajectory per rollout forward and per micro-batch, all 4 micro-batches in one optimizer step: on-policy and
# the same arithmetic as the recomputing update.
ONE_PER_FORWARD = {"rollout_batch_size": 1, "train_micro_batch_size": 1, "gradient_accumulation_steps": 4}
EVERYTHING = {  # Flow-GRPO's step, a moving window with DPM-Solver++ after it, the KL and GRPO-Guard
    "sampler": "flow-grpo",
    "eta": 0.7,
    "sde_window": 2,
    "sde_window_shift_every": 1,
    "ode_solver": "dpm2",
    "ode_compress_ratio": 0.6,
    "timestep_fraction": 1.0,
    "kl_beta": 0.05,
    "ratio_normalization": "grpo-guard",
}
# LoRA with its reference (the adapters turned off between the kept forward and its backward) and checkpointing
LORA_CHECKPOINTED = {"lora_rank": 4, "lora_alpha": 8.0, "kl_beta": 0.05, "gradient_checkpointing": True}


def weights_in(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def trained(tiny_weights, tiny_embeddings, folder: Path, **overrides) -> tuple[list[dict], dict[str, torch.Tensor]]:
    cfg = tiny_config(tiny_weights, tiny_embeddings, folder, max_train_steps=2, **overrides)
    records = run(cfg)
    last = folder / "checkpoint-2"
    weights = weights_in(last / "transformer") if (last / "transformer").exists() else {}
    lora = sorted(last.glob("**/*lora*.safetensors"))
    for path in lora:
        weights.update({f"{path.name}/{k}": v for k, v in load_file(path).items()})
    return records, weights


@pytest.mark.parametrize("options", [{}, EVERYTHING, LORA_CHECKPOINTED], ids=["dance", "everything", "lora"])
def test_on_is_todays_run_bit_for_bit_with_one_trajectory_per_forward(tiny_weights, tiny_embeddings, tmp_path, options):
    today, today_weights = trained(tiny_weights, tiny_embeddings, tmp_path / "today", **ONE_PER_FORWARD, **options)
    off, off_weights = trained(
        tiny_weights, tiny_embeddings, tmp_path / "off", **ONE_PER_FORWARD, **options, retain_rollout_graphs=False
    )
    kept, kept_weights = trained(
        tiny_weights, tiny_embeddings, tmp_path / "kept", **ONE_PER_FORWARD, **options, retain_rollout_graphs=True
    )
    assert today_weights and today_weights.keys() == off_weights.keys() == kept_weights.keys()
    for name in today_weights:
        assert torch.equal(today_weights[name], off_weights[name]), f"{name}: the neutral setting moved it"
        assert torch.equal(today_weights[name], kept_weights[name]), f"{name} differs with the kept graphs"
    for key in COMPARED:
        assert [r[key] for r in today] == [r[key] for r in off] == [r[key] for r in kept], key
    assert all(r["optimizer_steps"] == 1 for r in kept)


def test_exact_resume_with_the_kept_graphs(tiny_weights, tiny_embeddings, tmp_path):
    # tiny's own batching (4 trajectories per rollout forward, micro-batches of 2, 2 of them per optimizer step):
    # chunks whose rows train a step only partly run as two forwards
    straight = run(tiny_config(tiny_weights, tiny_embeddings, tmp_path / "straight", retain_rollout_graphs=True))
    run(tiny_config(tiny_weights, tiny_embeddings, tmp_path / "resumed", retain_rollout_graphs=True, max_train_steps=2))
    resumed = run(
        tiny_config(tiny_weights, tiny_embeddings, tmp_path / "resumed", retain_rollout_graphs=True), resume="latest"
    )
    assert [r["iteration"] for r in resumed] == [1, 2, 3, 4]  # metrics.jsonl reads as one run
    a = weights_in(tmp_path / "straight" / "checkpoint-4" / "transformer")
    b = weights_in(tmp_path / "resumed" / "checkpoint-4" / "transformer")
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    for key in COMPARED:
        assert [r[key] for r in straight] == [r[key] for r in read_metrics(tmp_path / "resumed")], key
    assert straight[0]["first_abs_log_ratio"] < 1e-5  # on-policy: the kept forward is the rollout's own


REFUSED = {
    "more than one optimizer step": (
        {"gradient_accumulation_steps": 1},
        "--retain-rollout-graphs needs one optimizer step per rollout",
    ),
    "an ODE objective": ({"objective": "nft"}, "--retain-rollout-graphs keeps the SDE rollout's forwards"),
    "LoRA dropout": ({"lora_rank": 4, "lora_dropout": 0.1}, "--retain-rollout-graphs with --lora-dropout 0.1"),
    "CPU offload": ({"cpu_offload": True, "dies": 2}, "--retain-rollout-graphs with --cpu-offload"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_it_cannot_serve_is_refused_in_one_line_naming_the_flag(case):
    overrides, message = REFUSED[case]
    base = {"num_generations": 4, "train_micro_batch_size": 2, "gradient_accumulation_steps": 2}
    problems = TrainConfig(**{**base, **overrides, "retain_rollout_graphs": True}).problems()
    matching = [problem for problem in problems if "--retain-rollout-graphs" in problem]
    assert len(matching) == 1 and matching[0].startswith(message) and "\n" not in matching[0], problems
    assert not [p for p in TrainConfig(**{**base, **overrides}).problems() if "retain" in p]  # off: nothing to say


def test_the_cli_refuses_an_off_policy_run_with_exit_2(tiny_weights, tiny_embeddings, tmp_path):
    argv = tiny_train_argv(tiny_weights, tiny_embeddings, "--output-dir", str(tmp_path / "out"))
    result = CliRunner().invoke(app, [*argv, "--gradient-accumulation-steps", "1", "--retain-rollout-graphs"])
    assert result.exit_code == 2
    assert "--retain-rollout-graphs needs one optimizer step per rollout" in result.output
    assert not (tmp_path / "out" / "checkpoint-1").exists()


def test_the_estimate_sizes_the_kept_forwards_per_die():
    from fluxgrpo.config import build_config
    from fluxgrpo.training.memory import GiB, estimate_for_config

    cfg = build_config("gpu-1x-lora", {})
    today = estimate_for_config(cfg, 1, "cuda", from_family=True)
    kept = estimate_for_config(dataclasses.replace(cfg, retain_rollout_graphs=True), 1, "cuda", from_family=True)
    # FLUX.1-dev at 720², checkpointing: every kept row holds the input of each of its 57 blocks in bf16
    tokens = 45 * 45 + 512
    per_row = tokens * 3072 * 57 * 2
    rows = cfg.trajectories_per_rank * cfg.train_timesteps  # 12 trajectories × 9 steps
    for phase in ("rollout", "decode", "update"):
        assert kept.phases[phase]["retained graphs"] == rows * per_row
        assert today.phases[phase].get("retained graphs", 0) == 0
    assert kept.peak == today.peak + rows * per_row  # live in every phase: the peak phase carries it too
    assert 85 < rows * per_row / GiB < 95  # ≈ 89 GiB: more than one 80 GB GPU holds at G 12, T 9


@pytest.mark.slow
def test_two_fsdp2_ranks_keep_it_bit_for_bit(tiny_weights, tiny_embeddings, tmp_path):
    # the kept forwards of sharded blocks: FSDP2 re-gathers their weights for the later backward (2 gloo ranks, fp32)
    settings = {**ONE_PER_FORWARD, "gradient_checkpointing": True, "max_train_steps": 2}
    today = run(tiny_config(tiny_weights, tiny_embeddings, tmp_path / "today", **settings), dies=2)
    kept = run(tiny_config(tiny_weights, tiny_embeddings, tmp_path / "kept", **settings, retain_rollout_graphs=True), 2)
    a = weights_in(tmp_path / "today" / "checkpoint-2" / "transformer")
    b = weights_in(tmp_path / "kept" / "checkpoint-2" / "transformer")
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    for key in COMPARED:
        assert [r[key] for r in today] == [r[key] for r in kept], key


@pytest.fixture
def captured_graphs(tmp_path, monkeypatch):
    """--compile with TorchDynamo's graphs run as captured (as tests/models/test_compile.py), caches emptied."""
    from fluxgrpo.runtime.adapt import COMPILE_BACKEND_ENV

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-cache"))
    monkeypatch.setenv(COMPILE_BACKEND_ENV, "eager")
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def test_compiled_blocks_keep_it_bit_for_bit_without_recompiles(
    tiny_weights, tiny_embeddings, tmp_path, captured_graphs
):
    compiled = {**ONE_PER_FORWARD, "compile": True, "gradient_checkpointing": True, "max_train_steps": 3}
    today = run(tiny_config(tiny_weights, tiny_embeddings, tmp_path / "today", **compiled))
    kept = run(tiny_config(tiny_weights, tiny_embeddings, tmp_path / "kept", **compiled, retain_rollout_graphs=True))
    a = weights_in(tmp_path / "today" / "checkpoint-3" / "transformer")
    b = weights_in(tmp_path / "kept" / "checkpoint-3" / "transformer")
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    for key in COMPARED:
        assert [r[key] for r in today] == [r[key] for r in kept], key
    # the kept forwards are compiled once (gradients on, eval mode), like the update's: no recompile after the first
    assert [record["compiles"] for record in kept[1:]] == [0, 0]
