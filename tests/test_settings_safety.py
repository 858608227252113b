"""Issue #23.7-8: nonsense settings are refused before a run starts, a run that cannot learn stops, and `score`
never pairs an image with another image's prompt."""

from __future__ import annotations

import math

import pytest
import torch
from training_helpers import run, tiny_config

from fluxgrpo.config import build_config
from fluxgrpo.errors import FluxgrpoError, UsageError
from fluxgrpo.training.health import SkippedUpdateWatch


@pytest.mark.parametrize(
    "name, value, says",
    [
        ("learning_rate", math.inf, "--learning-rate must be a finite number"),
        ("weight_decay", math.inf, "--weight-decay must be a finite number"),
        ("eta", math.inf, "--eta must be a finite number"),
        ("eta", 1e9, "--eta 1000000000.0 is out of range"),
        ("kl_beta", math.inf, "--kl-beta must be a finite number"),
        ("shift", math.nan, "--shift must be a finite number"),
        ("guidance", math.nan, "--guidance must be a finite number"),
        ("guidance", -1.0, "--guidance and --kl-beta cannot be negative"),
        ("clip_range", math.nan, "--clip-range must be a finite number"),
    ],
)
def test_non_finite_and_out_of_range_settings_are_refused(name, value, says):
    with pytest.raises(UsageError) as caught:
        build_config("tiny-cpu", {name: value})
    assert says in str(caught.value)


def test_the_watch_stops_at_the_kth_iteration_in_a_row_without_a_step():
    watch = SkippedUpdateWatch(limit=3)
    stepped = {"iteration": 1, "optimizer_steps": 2, "update_skipped": False, "loss": 0.1}
    skipped = {"optimizer_steps": 0, "update_skipped": False, "loss": math.nan}
    watch.observe(stepped)
    watch.observe({**skipped, "iteration": 2})
    watch.observe({**skipped, "iteration": 3})
    watch.observe({**stepped, "iteration": 4})  # a step in between starts the count over
    watch.observe({**skipped, "iteration": 5})
    watch.observe({**skipped, "iteration": 6})
    with pytest.raises(FluxgrpoError, match=r"iterations 5-7 all skipped their update because the loss \(nan\)"):
        watch.observe({**skipped, "iteration": 7})


def test_a_run_whose_updates_are_all_skipped_stops_naming_the_reward(
    tiny_weights, tiny_embeddings, tmp_path, monkeypatch
):
    import fluxgrpo.rewards as reward_module

    def load_failing(*args, **kwargs):
        return lambda images, prompts: torch.full((images.shape[0],), float("nan"))

    monkeypatch.setattr(reward_module, "load_reward", load_failing)
    cfg = tiny_config(
        tiny_weights, tiny_embeddings, tmp_path / "out", max_train_steps=5, checkpointing_steps=5, sampling_steps=4
    )
    with pytest.raises(FluxgrpoError) as caught:
        run(cfg)
    message = str(caught.value)
    assert "iterations 1-3 all skipped their update because the reward" in message, message
    assert not list((tmp_path / "out").glob("checkpoint-*"))
