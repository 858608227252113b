"""The training loop's numerics on the tiny weights: skipped iterations, the EMA's unit (issue #11.6)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from training_helpers import run
from training_helpers import tiny_config as training_config

from fluxgrpo.errors import FluxgrpoError


def tiny_config(tiny_weights, tiny_embeddings, output_dir: Path, **overrides):
    """One short iteration per checkpoint: these tests read the weights after each."""
    values = {"max_train_steps": 1, "checkpointing_steps": 1, "sampling_steps": 4, **overrides}
    return training_config(tiny_weights, tiny_embeddings, output_dir, **values)


def weights_in(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def test_an_iteration_without_any_finite_reward_does_not_step(tiny_weights, tiny_embeddings, tmp_path, monkeypatch):
    import fluxgrpo.rewards as reward_module

    def load_failing(*args, **kwargs):
        return lambda images, prompts: torch.full((images.shape[0],), float("nan"))

    monkeypatch.setattr(reward_module, "load_reward", load_failing)
    # Weight decay would move every weight even with zero advantages, and a warm-up would show a scheduler step.
    cfg = tiny_config(
        tiny_weights, tiny_embeddings, tmp_path / "out", weight_decay=0.1, lr_warmup_steps=10, max_train_steps=4
    )
    # a run none of whose updates could step fails (three in a row); checkpoint-2 was written before that
    with pytest.raises(FluxgrpoError, match="skipped their update"):
        run(cfg)
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if "update_skipped" in r]
    assert [r["update_skipped"] for r in records] == [1.0, 1.0, 1.0]
    assert [r["lr"] for r in records] == [0.0, 0.0, 0.0]  # warm-up step 0: the schedule never advanced
    assert all(r["optimizer_steps"] == 0 and r["skipped_steps"] == 1 for r in records)
    before = weights_in(tiny_weights.flux_dir / "transformer")
    after = weights_in(tmp_path / "out" / "checkpoint-2" / "transformer")
    for name, value in before.items():
        assert torch.equal(after[name], value), name


def test_the_ema_moves_once_per_iteration(tiny_weights, tiny_embeddings, tmp_path):
    # GA 1 with 2 micro-batches: two optimizer steps in the iteration, but one EMA update (DanceGRPO's unit).
    cfg = tiny_config(
        tiny_weights, tiny_embeddings, tmp_path / "out", use_ema=True, ema_decay=0.9, gradient_accumulation_steps=1
    )
    records = run(cfg)
    assert records[0]["optimizer_steps"] == 2
    initial = weights_in(tiny_weights.flux_dir / "transformer")
    trained = weights_in(tmp_path / "out" / "checkpoint-1" / "transformer")
    ema = weights_in(tmp_path / "out" / "checkpoint-1" / "transformer_ema")
    moved = 0
    for name, value in ema.items():
        expected = 0.9 * initial[name].float() + 0.1 * trained[name].float()
        assert torch.allclose(value.float(), expected, atol=1e-6), name
        moved += not torch.equal(trained[name], initial[name])
    assert moved > 0
