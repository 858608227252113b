"""--objective nft, awm, vgrpo and neighbor in the real loop on the tiny weights: exact resume including the policy
copies, LoRA and full fine-tuning, the toy reward, and the dry run's memory estimate counting the copies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from training_helpers import TOY_REWARD_RUN, run, tiny_config, tiny_train_argv
from typer.testing import CliRunner

from fluxgrpo.cli.app import app
from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.metrics import read_metrics, reward_trend

LORA = {"lora_rank": 4, "lora_alpha": 8.0, "learning_rate": 0.03}
RUNS = {
    # the authors' setting: LoRA, the old policy as a second set of adapters, the KL's reference = adapters off
    "nft-lora": {"objective": "nft", "kl_beta": 0.01, **LORA},
    # full fine-tuning: the old policy is a second copy of the weights; the reference a frozen base
    "nft-full": {"objective": "nft", "nft_beta": 0.1},
    "awm-full": {"objective": "awm", "awm_ema_beta": 1.0, "kl_beta": 0.01, "clip_range": 1.0},
    "awm-lora": {"objective": "awm", "awm_weighting": "t", **LORA},
    # GA 1: two optimizer steps per iteration, so the second micro-batch's ratio is off-policy (measured, clipped)
    "vgrpo-lora": {"objective": "vgrpo", "clip_range": 0.01, "kl_beta": 0.01, "gradient_accumulation_steps": 1, **LORA},
    "vgrpo-full": {"objective": "vgrpo", "clip_range": 0.01, "vgrpo_mc_samples": 2, "fm_draws": "sample"},
    "neighbor-full": {
        "objective": "neighbor",
        "kl_beta": 0.01,
        "neighbor_anchors": 2,
        "train_micro_batch_size": 1,
        "gradient_accumulation_steps": 1,
    },
    "neighbor-lora": {"objective": "neighbor", "neighbor_anchors": 4, **LORA},
}
# A metric each objective reports that depends on the policy copies or the off-policy ratio.
TELLTALE = {"nft": "old_deviation", "awm": "ema_deviation", "vgrpo": "ratio_max", "neighbor": "ratio_max"}


def exported(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.rglob("*.safetensors")):
        out.update({f"{path.parent.name}/{key}": value for key, value in load_file(path).items()})
    return out


@pytest.mark.parametrize("name", ["nft-lora", "awm-full", "vgrpo-lora", "neighbor-full"])
def test_exact_resume_restores_the_policy_copies(tiny_weights, tiny_embeddings, tmp_path, name):
    options = RUNS[name]
    straight = run(tiny_config(tiny_weights, tiny_embeddings, tmp_path / "straight", **options))
    run(tiny_config(tiny_weights, tiny_embeddings, tmp_path / "resumed", **options, max_train_steps=2))
    run(tiny_config(tiny_weights, tiny_embeddings, tmp_path / "resumed", **options), resume="latest")
    a, b = exported(tmp_path / "straight" / "checkpoint-4"), exported(tmp_path / "resumed" / "checkpoint-4")
    assert a and a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)
    # the old / EMA policy's pull shows in the losses of the resumed iterations: equal only if it was restored
    keys = ("reward_mean", "loss", "kl", TELLTALE[options["objective"]])
    resumed = read_metrics(tmp_path / "resumed")
    assert [[r.get(k) for k in keys] for r in read_metrics(tmp_path / "straight")] == [
        [r.get(k) for k in keys] for r in resumed
    ]
    if options.get("gradient_accumulation_steps") == 1:  # the second step of iteration 1 has moved already
        assert straight[0]["kl"] > 0 and straight[-1]["kl"] > 0
    else:
        assert straight[0]["kl"] == 0.0 and straight[-1]["kl"] > 0  # starts at the reference, then moves away
    if name.startswith("nft"):
        assert straight[0]["old_deviation"] == 0.0 and straight[-1]["old_deviation"] > 0
    if options["objective"] in ("vgrpo", "neighbor"):  # the second optimizer step's ratio moved off 1
        assert all(r["ratio_max"] != 1.0 or r["ratio_min"] != 1.0 for r in straight)
    other = "grpo" if name.startswith("nft") else "nft"
    with pytest.raises(FluxgrpoError, match="--objective"):
        run(
            tiny_config(tiny_weights, tiny_embeddings, tmp_path / "straight", **{**options, "objective": other}),
            resume="latest",
        )


@pytest.mark.slow
@pytest.mark.parametrize("name", ["nft-full", "awm-lora", "vgrpo-full", "neighbor-lora"])
def test_each_objective_raises_the_toy_reward(tiny_weights, tiny_embeddings, tmp_path, name):
    options = {key: value for key, value in RUNS[name].items() if key != "kl_beta"}
    short = {**TOY_REWARD_RUN, "max_train_steps": 10, "checkpointing_steps": 10}  # both rise steadily from the start
    cfg = tiny_config(tiny_weights, tiny_embeddings, tmp_path / "out", **short, **options)
    trend = reward_trend(run(cfg), window=3)
    assert trend is not None and trend["last"] > trend["first"] + 0.002, trend


def test_dry_run_counts_the_policy_copies(tiny_weights, tiny_embeddings, tmp_path):
    from fluxgrpo.bench.models import FLUX_DEV_TRANSFORMER_CONFIG
    from fluxgrpo.config import build_config
    from fluxgrpo.training.memory import RunShape, VaeShape, estimate, lora_adapter_shapes, transformer_shape
    from fluxgrpo.training.settings import lora_spec

    model = transformer_shape(FLUX_DEV_TRANSFORMER_CONFIG)

    def persistent(**options) -> dict[str, int]:
        cfg = build_config("a3-16die", options)
        lora = lora_spec(cfg)
        adapters = lora_adapter_shapes(FLUX_DEV_TRANSFORMER_CONFIG, lora.targets, lora.rank) if lora else ()
        return estimate(model, VaeShape(0, 0), RunShape.from_config(cfg, 16, adapter_shapes=adapters)).persistent

    grpo, nft = persistent(), persistent(objective="nft")
    assert grpo["policy copies"] == 0 and nft["policy copies"] == grpo["weights"]  # a second fp32 copy of the shards
    lora = persistent(objective="nft", lora_rank=32)
    assert 0 < lora["policy copies"] < grpo["weights"] / 100  # the adapters only
    assert persistent(objective="awm", awm_ema_beta=0.0)["policy copies"] == 0
    assert persistent(objective="awm")["policy copies"] == grpo["weights"]
    result = CliRunner().invoke(
        app,
        [*tiny_train_argv(tiny_weights, tiny_embeddings, "--dry-run", "--json", "--objective", "nft"),
         "--output-dir", str(tmp_path / "out")],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    memory = json.loads(result.stdout)["memory_per_die"]
    assert "policy copies" in memory["persistent_gib"] and "objective latents" in memory["phases_gib"]["update"]


def test_grpo_only_options_are_refused_for_the_other_objectives(tiny_weights, tiny_embeddings, tmp_path):
    from fluxgrpo.errors import UsageError

    with pytest.raises(UsageError, match="--sde-window"):
        tiny_config(tiny_weights, tiny_embeddings, tmp_path, objective="nft", sde_window=2)
    with pytest.raises(UsageError, match="--awm-weighting"):
        tiny_config(tiny_weights, tiny_embeddings, tmp_path, objective="awm", awm_weighting="cubic")
