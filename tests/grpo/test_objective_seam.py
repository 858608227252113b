"""The objective seam's proof: an objective defined here, in this one file (its class and its catalogue entry), is
validated, trained, resumed bit for bit, sized by the memory model and guarded, with no edit anywhere else."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from training_helpers import run, tiny_config

from fluxgrpo.errors import UsageError
from fluxgrpo.grpo.objectives.base import Metric, ModelInput, ObjectiveBase, StepLoss, UpdateLayout, UpdateStep
from fluxgrpo.grpo.objectives.catalogue import CATALOGUE, ObjectiveEntry
from fluxgrpo.grpo.objectives.nft.loss import FlowMatchingBatch
from fluxgrpo.grpo.types import FinalSamples
from fluxgrpo.grpo.weight_copies import PolicyCopy

ANCHOR = "toy_anchor"  # a policy copy the toy keeps: θ_anchor ← ½·θ_anchor + ½·θ after every update


# --- the toy objective: advantage-weighted flow matching on the ODE's final samples, pulled towards an anchor copy
class ToyWork:
    wants_reference = False
    precomputed_forwards = (ANCHOR,)

    def __init__(self, rollout: FinalSamples, advantages: torch.Tensor, generator_cpu: torch.Generator) -> None:
        self.slots = 2
        self.train_timestep_indices = torch.stack(
            [torch.randperm(rollout.num_steps, generator=generator_cpu)[: self.slots] for _ in advantages]
        )
        self.batch = FlowMatchingBatch(rollout, self.train_timestep_indices, generator_cpu, advantages.device)
        self.advantages = advantages

    def model_input(self, start: int, stop: int, slot: int) -> ModelInput:
        return self.batch.model_input(start, stop, slot)

    def loss(self, step: UpdateStep) -> StepLoss:
        _, _, noise = self.batch.noised(step.start, step.stop, step.slot)
        velocity = step.velocity.float()
        matching = ((velocity - (noise - self.batch.x0[step.start : step.stop])) ** 2).mean(dim=(1, 2))
        gap = ((velocity - step.precomputed[ANCHOR]) ** 2).mean(dim=(1, 2))
        weighted = (1 - self.advantages[step.start : step.stop]) * matching
        metrics = {"toy_matching": matching.detach().sum(), "toy_anchor_gap": gap.detach().sum()}
        return StepLoss((weighted.mean(), 0.1 * gap.mean()), metrics)


TOY_METRICS = {"toy_matching": Metric("toy_matching", "mean"), "toy_anchor_gap": Metric("toy_anchor_gap", "mean")}


class ToyObjective(ObjectiveBase):
    name = "toy"
    keeps_trajectory = False
    keeps_step_means = False
    metrics = TOY_METRICS
    progress = "matching {toy_matching:.4g}"

    def __init__(self, anchor: PolicyCopy) -> None:
        self.anchor = anchor
        self.policy_copies = {ANCHOR: anchor}

    @classmethod
    def from_config(cls, cfg: Any, policy_copies: dict[str, PolicyCopy]) -> ToyObjective:
        return cls(policy_copies[ANCHOR])

    def prepare(
        self, rollout: FinalSamples, advantages: torch.Tensor, layout: UpdateLayout, generator_cpu: torch.Generator
    ) -> ToyWork:
        return ToyWork(rollout, advantages, generator_cpu)

    def rollout_policy(self) -> None:
        return None

    def finish(self, transformer: torch.nn.Module, optimizer_steps: int) -> None:
        self.anchor.blend(transformer, 0.5)


TOY = ObjectiveEntry(
    "toy",
    ToyObjective,
    keeps_trajectory=False,
    trainable_timesteps=lambda cfg: cfg.sampling_steps,
    policy_copies=lambda cfg: (ANCHOR,),
    run_problems=lambda cfg: [] if cfg.sampling_steps >= 2 else ["--objective toy trains 2 timesteps: N ≥ 2"],
)


# --- the proof
@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(CATALOGUE, "toy", TOY)


def exported(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.rglob("*.safetensors")):
        out.update({f"{path.parent.name}/{key}": value for key, value in load_file(path).items()})
    return out


def test_a_toy_objective_trains_and_resumes_bit_for_bit(toy, tiny_weights, tiny_embeddings, tmp_path):
    straight = run(tiny_config(tiny_weights, tiny_embeddings, tmp_path / "straight", objective="toy"))
    run(tiny_config(tiny_weights, tiny_embeddings, tmp_path / "resumed", objective="toy", max_train_steps=2))
    resumed = run(tiny_config(tiny_weights, tiny_embeddings, tmp_path / "resumed", objective="toy"), resume="latest")
    assert [record["iteration"] for record in straight] == [record["iteration"] for record in resumed] == [1, 2, 3, 4]
    # its own metrics reach the records; the anchor starts at the weights and the policy moves away from it
    assert straight[0]["toy_anchor_gap"] == 0.0 and straight[-1]["toy_anchor_gap"] > 0
    assert all(record["optimizer_steps"] > 0 and record["toy_matching"] > 0 for record in straight)
    # the anchor's pull shows in the resumed iterations' numbers: equal only if the checkpoint restored it
    keys = ("reward_mean", "loss", "toy_matching", "toy_anchor_gap", "grad_norm_mean")
    assert [[r[k] for k in keys] for r in straight] == [[r[k] for k in keys] for r in resumed]
    a, b = exported(tmp_path / "straight" / "checkpoint-4"), exported(tmp_path / "resumed" / "checkpoint-4")
    assert a and a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


def test_a_toy_objective_is_validated_sized_and_guarded(toy, tiny_weights, tiny_embeddings, tmp_path):
    from fluxgrpo.bench.models import FLUX_DEV_TRANSFORMER_CONFIG
    from fluxgrpo.config import TrainConfig, build_config
    from fluxgrpo.config.guard_rules import guard_problems
    from fluxgrpo.training.memory import RunShape, VaeShape, estimate, transformer_shape

    model = transformer_shape(FLUX_DEV_TRANSFORMER_CONFIG)
    toy_run = build_config("a3-16die", {"objective": "toy"})
    grpo, toy_estimate = (
        estimate(model, VaeShape(0, 0), RunShape.from_config(cfg, 16))
        for cfg in (build_config("a3-16die", {}), toy_run)
    )
    assert (
        grpo.persistent["policy copies"] == 0 and toy_estimate.persistent["policy copies"] == grpo.persistent["weights"]
    )
    assert toy_estimate.phases["update"]["objective latents"] > 0 == grpo.phases["update"]["objective latents"]
    assert toy_run.trainable_timesteps == toy_run.sampling_steps and not toy_run.shares_group_noise
    with pytest.raises(UsageError, match="--objective toy trains 2 timesteps"):
        tiny_config(tiny_weights, tiny_embeddings, tmp_path, objective="toy", sampling_steps=1)
    with pytest.raises(UsageError, match="only --objective grpo has per-step log-probs"):
        tiny_config(tiny_weights, tiny_embeddings, tmp_path, objective="toy", sde_window=2)
    # velocity_norm_ratio probes the SDE trajectory, which the toy does not keep: refused for it, not for grpo
    guarded = {"eval_every": 1, "guard": "velocity_norm_ratio:max=2"}
    assert any("velocity_norm_ratio" in problem for problem in guard_problems(TrainConfig(objective="toy", **guarded)))
    assert not guard_problems(TrainConfig(**guarded))
