"""``--retain-rollout-graphs`` (``grpo/retain.py``): the update back-propagates through the rollout's kept forwards and
gets today's gradients and weights: bit for bit with one trajectory per forward (the same arithmetic), within fp32
rounding with batched forwards (other row groupings in the matmuls' reductions); with every sampler, a window, GRPO-
Guard, gradient checkpointing and LoRA. The loop-level proofs (exact resume, the flag's neutral setting, the config's
refusals) are in tests/training/test_retain_training.py."""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from training_helpers import POOLED_DIM, TEXT_DIM, make_batch

from fluxgrpo.grpo.latents import image_ids
from fluxgrpo.grpo.objectives.grpo.loss import GrpoObjective, GrpoSettings
from fluxgrpo.grpo.retain import RetainedGraphs
from fluxgrpo.grpo.rollout import RolloutSettings, sample_trajectories
from fluxgrpo.grpo.samplers import make_sampler
from fluxgrpo.grpo.schedule import StepPlan, sigma_schedule
from fluxgrpo.grpo.types import Rollout
from fluxgrpo.grpo.update import UpdatePlumbing, run_update

NUM_STEPS, NUM_TRAIN, NUM_TRAJECTORIES = 6, 3, 4
ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, -0.5])


@pytest.fixture(scope="module")
def base_transformer() -> nn.Module:
    from diffusers import FluxTransformer2DModel

    from fluxgrpo.models.tiny import TINY_TRANSFORMER_CONFIG

    torch.manual_seed(0)
    return FluxTransformer2DModel(
        **{
            **TINY_TRANSFORMER_CONFIG,
            "num_layers": 1,
            "num_single_layers": 1,
            "joint_attention_dim": TEXT_DIM,
            "pooled_projection_dim": POOLED_DIM,
        }
    )


@dataclasses.dataclass
class Updated:
    """One update's outcome: the rollout it trained on, the gradients at its optimizer step, the weights after it."""

    rollout: Rollout
    grads: dict[str, torch.Tensor]
    weights: dict[str, torch.Tensor]
    metrics: dict[str, float]


class Recording:
    """An optimizer (AdamW, or plain SGD) that keeps a copy of the gradients it steps with (one step per update)."""

    def __init__(self, module: nn.Module, sgd: bool) -> None:
        self.named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        parameters = [p for _, p in self.named]
        self.inner = torch.optim.SGD(parameters, lr=1e-3) if sgd else torch.optim.AdamW(parameters, lr=1e-3)
        self.grads: dict[str, torch.Tensor] = {}

    def step(self) -> None:
        self.grads = {name: p.grad.clone() for name, p in self.named if p.grad is not None}
        self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)


def roll_out(transformer, *, retain, rollout_batch_size, sampler="dance", plan=None, keep_means=False, seed=2):
    """A rollout on 4 trajectories; with ``retain`` the steps the update will draw (generator ``seed``) are kept."""
    cond, noise = make_batch(NUM_TRAJECTORIES)
    sigmas = sigma_schedule(NUM_STEPS, 3.0)
    objective = GrpoObjective(GrpoSettings(NUM_TRAIN, 1e-4))
    eta = 0.7 if sampler != "dance" else 0.3
    settings = RolloutSettings(
        make_sampler(sampler, eta, float(sigmas[1])), 3.5, rollout_batch_size, keep_means=keep_means,
        retain_graphs=retain,
    )  # fmt: skip
    trainable = (plan or StepPlan.every_step(NUM_STEPS)).trainable
    indices = objective.planned_train_indices(NUM_TRAJECTORIES, trainable, torch.Generator().manual_seed(seed))
    rollout = sample_trajectories(
        transformer, cond, noise, sigmas, settings, img_ids=image_ids(64, 64), device_type="cpu",
        generator=torch.Generator().manual_seed(1), plan=plan, train_indices=indices if retain else None,
    )  # fmt: skip
    return rollout, cond


def update(
    transformer, rollout, cond, *, micro_batch_size, grad_accum_steps=8, guard=False, seed=2, sgd=False
) -> Updated:
    settings = GrpoSettings(NUM_TRAIN, 1e-4, ratio_normalization="grpo-guard" if guard else "none")
    optimizer = Recording(transformer, sgd)
    trainee = SimpleNamespace(
        transformer=transformer, optimizer=optimizer, lr_scheduler=SimpleNamespace(step=lambda: None), reference=None
    )
    stats = run_update(
        trainee, GrpoObjective(settings), rollout, cond, ADVANTAGES, UpdatePlumbing(micro_batch_size, grad_accum_steps, 1.0),
        device_type="cpu", generator_cpu=torch.Generator().manual_seed(seed),
    )  # fmt: skip
    assert stats.optimizer_steps == 1
    weights = {name: p.detach().clone() for name, p in transformer.named_parameters()}
    return Updated(rollout, optimizer.grads, weights, stats.as_floats())


def retained_and_recomputed(
    base, *, rollout_batch_size, micro_batch_size, prepare=None, sgd=False, **options
) -> tuple[Updated, Updated]:
    """The same trajectory trained twice from the same weights: through its kept graphs, and by today's update
    (the rollout's forwards recomputed)."""
    guard = options.get("keep_means", False)
    kept_model, recomputing_model = copy.deepcopy(base), copy.deepcopy(base)
    if prepare is not None:
        prepare(kept_model), prepare(recomputing_model)
    rollout, cond = roll_out(kept_model, retain=True, rollout_batch_size=rollout_batch_size, **options)
    assert rollout.retained is not None and rollout.retained.kept_rows == NUM_TRAJECTORIES * NUM_TRAIN
    today = update(
        recomputing_model, dataclasses.replace(rollout, retained=None), cond, micro_batch_size=micro_batch_size,
        guard=guard, sgd=sgd,
    )  # fmt: skip
    retained = update(kept_model, rollout, cond, micro_batch_size=micro_batch_size, guard=guard, sgd=sgd)
    assert rollout.retained.pending == 0  # every kept graph was back-propagated, its activations freed
    return retained, today


def assert_bitwise(a: Updated, b: Updated) -> None:
    assert a.grads.keys() == b.grads.keys() and a.grads
    for name in a.grads:
        assert torch.equal(a.grads[name], b.grads[name]), f"gradient of {name} differs"
    for name in a.weights:
        assert torch.equal(a.weights[name], b.weights[name]), f"{name} differs after the step"
    for key in ("loss", "ratio_mean", "ratio_min", "ratio_max", "clip_fraction", "grad_norm_mean"):
        assert a.metrics[key] == b.metrics[key], key


OPTIONS = {
    "dance": {},
    "flow-grpo": {"sampler": "flow-grpo"},
    "cps": {"sampler": "cps"},
    "window": {"plan": StepPlan(sde_start=1, sde_stop=4)},
    "grpo-guard": {"keep_means": True},
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_one_trajectory_per_forward_gives_todays_gradients_and_weights_bit_for_bit(base_transformer, option):
    retained, today = retained_and_recomputed(
        base_transformer, rollout_batch_size=1, micro_batch_size=1, **OPTIONS[option]
    )
    assert_bitwise(retained, today)


def test_gradient_checkpointing_and_lora_keep_it_bit_for_bit(base_transformer):
    from fluxgrpo.lora import LoraSpec, add_lora, init_adapters

    def checkpointed_lora(model: nn.Module) -> None:
        add_lora(model, LoraSpec(4, 8.0, ("attn.to_q", "attn.to_k", "attn.to_v"), 0.0), torch.float32)
        init_adapters(model, seed=3)
        model.enable_gradient_checkpointing()

    retained, today = retained_and_recomputed(
        base_transformer, rollout_batch_size=1, micro_batch_size=1, prepare=checkpointed_lora
    )
    assert retained.grads and all("lora" in name for name in retained.grads)
    assert_bitwise(retained, today)


@pytest.mark.parametrize(("rollout_batch_size", "micro_batch_size"), [(4, 2), (2, 1), (4, 4)])
def test_batched_forwards_agree_within_fp32_rounding(base_transformer, rollout_batch_size, micro_batch_size):
    # A kept graph holds a rollout chunk's trained rows at one step; the update's micro-batch stacks rows at their own
    # steps. The matmuls reduce over other groupings of rows, so the sums round differently: 1e-5 of each gradient's
    # norm is ~100 float32 ulps of headroom over the ~1e-7 relative differences measured. The step is SGD's here:
    # Adam's first step is lr·sign(g) wherever |g| ≫ its ε, so a gradient that is zero up to rounding can flip.
    retained, today = retained_and_recomputed(
        base_transformer, rollout_batch_size=rollout_batch_size, micro_batch_size=micro_batch_size, sgd=True
    )
    for name, grad in today.grads.items():
        difference = (retained.grads[name] - grad).norm()
        assert difference <= 1e-5 * grad.norm() + 1e-12, f"{name}: {difference} of {grad.norm()}"
    for name, weight in today.weights.items():
        assert torch.allclose(retained.weights[name], weight, rtol=0, atol=1e-9), name
    # on-policy the surrogate is −mean(A·ρ) with ρ = 1: the advantages' mean, 0 up to rounding; ρ itself is 1 to 1e-6
    assert abs(retained.metrics["loss"] - today.metrics["loss"]) <= 1e-6
    assert abs(retained.metrics["ratio_max"] - 1) <= 1e-6 and abs(retained.metrics["ratio_min"] - 1) <= 1e-6


def test_the_kept_rollout_samples_what_todays_rollout_samples(base_transformer):
    # Whole chunks (one trajectory per chunk, or every row training the step) run as today's forwards; a chunk
    # whose rows only partly train a step runs as two forwards, the same math at another batch size.
    today, _ = roll_out(copy.deepcopy(base_transformer), retain=False, rollout_batch_size=1)
    kept, _ = roll_out(copy.deepcopy(base_transformer), retain=True, rollout_batch_size=1)
    assert torch.equal(today.latents, kept.latents) and torch.equal(
        today.log_probs,
        kept.log_probs,
    )
    assert torch.equal(today.final_x0, kept.final_x0)
    split_today, _ = roll_out(copy.deepcopy(base_transformer), retain=False, rollout_batch_size=4)
    split_kept, _ = roll_out(copy.deepcopy(base_transformer), retain=True, rollout_batch_size=4)
    assert torch.allclose(split_today.latents, split_kept.latents, rtol=0, atol=1e-5)
    assert today.retained is None and split_today.retained is None


def test_off_policy_layouts_and_other_draws_are_refused(base_transformer):
    model = copy.deepcopy(base_transformer)
    rollout, cond = roll_out(model, retain=True, rollout_batch_size=2)
    with pytest.raises(ValueError, match="--retain-rollout-graphs needs one optimizer step per rollout"):
        update(model, rollout, cond, micro_batch_size=1, grad_accum_steps=2)  # 4 micro-batches, 2 steps
    with pytest.raises(RuntimeError, match="other steps than the rollout kept"):
        update(model, rollout, cond, micro_batch_size=1, seed=5)


def test_release_frees_every_kept_graph():
    graphs = RetainedGraphs(torch.tensor([[0, 1], [1, 2]]), num_steps=4)
    weight = nn.Parameter(torch.ones(3))
    for step in range(3):
        graphs.velocity(lambda rows, x: x * weight, torch.ones(2, 3), 0, 2, step)
    assert graphs.kept_rows == 4 and graphs.pending == 3
    assert graphs.trains.tolist() == [[True, True, False, False], [False, True, True, False]]
    graphs.release()
    assert graphs.pending == 0
