"""The algorithm options in the real loop on the tiny weights: exact resume with a moving window, and each option
still learns the toy (brightness) reward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from training_helpers import TOY_REWARD_RUN, run, tiny_config

from fluxgrpo.metrics import read_metrics, reward_trend


def weights_in(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(path))
    return out


# Every option at once: Flow-GRPO's step, a window of 2 moving every iteration (and wrapping), DPM-Solver++ after
# it, the KL to the base weights and GRPO-Guard's ratio.
EVERYTHING = {
    "sampler": "flow-grpo",
    "eta": 0.7,
    "sde_window": 2,
    "sde_window_shift_every": 1,
    "sde_window_wrap": True,
    "ode_solver": "dpm2",
    "ode_compress_ratio": 0.6,
    "timestep_fraction": 1.0,
    "kl_beta": 0.05,
    "ratio_normalization": "grpo-guard",
}


def test_exact_resume_with_a_moving_window_and_every_option(tiny_weights, tiny_embeddings, tmp_path):
    straight = run(tiny_config(tiny_weights, tiny_embeddings, tmp_path / "straight", **EVERYTHING))
    assert [r["sde_window_start"] for r in straight] == [0, 1, 2, 3]
    first = straight[0]
    assert first["first_abs_log_ratio"] < 1e-5 and first["kl"] == 0.0  # on-policy, policy == reference
    assert straight[-1]["kl"] > 0
    trained = [i for i, mean in enumerate(first["ratio_mean_per_step"]) if mean is not None]
    assert trained == [0, 1]  # the window's steps only
    run(tiny_config(tiny_weights, tiny_embeddings, tmp_path / "resumed", **EVERYTHING, max_train_steps=2))
    resumed = run(tiny_config(tiny_weights, tiny_embeddings, tmp_path / "resumed", **EVERYTHING), resume="latest")
    assert [r["sde_window_start"] for r in resumed] == [0, 1, 2, 3]  # metrics.jsonl reads as one run
    a = weights_in(tmp_path / "straight" / "checkpoint-4" / "transformer")
    b = weights_in(tmp_path / "resumed" / "checkpoint-4" / "transformer")
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    assert [r["reward_mean"] for r in read_metrics(tmp_path / "straight")] == [
        r["reward_mean"] for r in read_metrics(tmp_path / "resumed")
    ]


OPTIONS = {
    "flow-grpo": {"sampler": "flow-grpo", "eta": 0.7},
    "cps": {"sampler": "cps", "eta": 0.7},
    "mixgrpo-flash": {"sde_window": 3, "sde_window_shift_every": 4, "ode_solver": "dpm2", "timestep_fraction": 1.0},
    "random-window": {"sde_window": 2, "sde_window_policy": "random", "timestep_fraction": 1.0},
    "kl": {"kl_beta": 0.01},
    "grpo-guard": {"ratio_normalization": "grpo-guard"},
}


@pytest.mark.slow
@pytest.mark.parametrize("option", list(OPTIONS))
def test_each_option_raises_the_toy_reward(tiny_weights, tiny_embeddings, tmp_path, option):
    # The shipped tiny-cpu settings (brightness reward, lr 3e-3, clip 1e-2) as test_train's DanceGRPO check.
    cfg = tiny_config(
        tiny_weights,
        tiny_embeddings,
        tmp_path / "out",
        **TOY_REWARD_RUN,
        **OPTIONS[option],
    )
    trend = reward_trend(run(cfg), window=4)
    assert trend["last"] > trend["first"], trend
