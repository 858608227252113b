"""The objective seam and the two final-sample objectives (reference/algorithms.md §6), on a tiny random
FluxTransformer2DModel (CPU, fp32, 16 tokens): DiffusionNFT's and AWM's tests, the policy copies, the ODE rollout."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn
from training_helpers import POOLED_DIM, TEXT_DIM, make_batch

from fluxgrpo.grpo.latents import image_ids
from fluxgrpo.grpo.objectives.awm.loss import (
    AwmObjective,
    AwmSettings,
    ema_policy_decay,
    stratified_indices,
    trainable_range,
    weighted_log_prob,
)
from fluxgrpo.grpo.objectives.base import Metric, MetricTally, StepResult
from fluxgrpo.grpo.objectives.nft.loss import NftObjective, NftSettings, nft_policy_loss, old_policy_decay
from fluxgrpo.grpo.rollout import sample_final_latents
from fluxgrpo.grpo.samplers import euler_step
from fluxgrpo.grpo.schedule import sigma_schedule
from fluxgrpo.grpo.update import UpdatePass, UpdatePlumbing
from fluxgrpo.grpo.weight_copies import PolicyCopy

NUM_STEPS, GUIDANCE = 8, 3.5


@pytest.fixture(scope="module")
def base_transformer() -> nn.Module:
    from diffusers import FluxTransformer2DModel

    from fluxgrpo.models.tiny import TINY_TRANSFORMER_CONFIG

    torch.manual_seed(0)
    config = {**TINY_TRANSFORMER_CONFIG, "num_layers": 1, "num_single_layers": 1}
    return FluxTransformer2DModel(**{**config, "joint_attention_dim": TEXT_DIM, "pooled_projection_dim": POOLED_DIM})


def final_samples(transformer: nn.Module, cond, noise):
    return sample_final_latents(
        transformer, cond, noise, sigma_schedule(NUM_STEPS, 3.0), guidance=GUIDANCE, rollout_batch_size=2,
        img_ids=image_ids(64, 64), device_type="cpu",
    )  # fmt: skip


def nudged(module: nn.Module, seed: int, scale: float = 0.02) -> nn.Module:
    """A copy with every weight moved a little (a policy that has trained)."""
    moved = copy.deepcopy(module)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in moved.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
    return moved


def weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: parameter.detach().clone() for name, parameter in module.named_parameters()}


def _plumbing(overrides: dict) -> UpdatePlumbing:
    return UpdatePlumbing(overrides.pop("micro_batch_size", 2), overrides.pop("grad_accum_steps", 2), 1.0)


def nft(transformer, old: PolicyCopy, **overrides) -> tuple[NftObjective, UpdatePlumbing]:
    plumbing = _plumbing(overrides)
    return NftObjective(NftSettings(**{"num_train_timesteps": 3, **overrides}), old), plumbing


def awm(ema: PolicyCopy | None = None, **overrides) -> tuple[AwmObjective, UpdatePlumbing]:
    plumbing = _plumbing(overrides)
    return AwmObjective(AwmSettings(**{"num_train_timesteps": 3, "ema_beta": 0.0, **overrides}), ema), plumbing


def prepare(objective_and_plumbing, transformer, samples, cond, advantages, seed=5) -> UpdatePass:
    """The update driver's pass over the rollout: ``step(m, k)`` is one scaled loss step, as the update takes it."""
    objective, plumbing = objective_and_plumbing
    return UpdatePass(
        transformer, objective, samples, cond, advantages, plumbing, device_type="cpu",
        generator_cpu=torch.Generator().manual_seed(seed),
    )  # fmt: skip


def velocity_at(update: UpdatePass, module: nn.Module, start: int, stop: int, slot: int) -> torch.Tensor:
    """``module``'s velocity at the update's input for samples start…stop−1 at their slot-th timestep (fp32)."""
    model_input = update.work.model_input(start, stop, slot)
    with torch.no_grad():
        return update.forwards.velocity(model_input, start, stop, module).to(torch.float32)


# --------------------------------------------------------------------------------------------- the seam


def test_metrics_are_reduced_as_each_declares():
    specs = {
        "total": Metric("loss", "sum"),
        "average": Metric("average", "mean"),
        "top": Metric("top", "max"),
        "bottom": Metric("bottom", "min"),
        "per_step": Metric("per_step_mean", "per_step", count_name="per_step_count"),
        "never": Metric("never", "mean"),
    }
    tally = MetricTally(specs, torch.device("cpu"), num_steps=3)
    for values, steps in (([1.0, 3.0], [0, 2]), ([5.0], [2])):
        value = torch.tensor(values)
        metrics = {"total": value.sum(), "average": value.sum(), "top": value.max(), "bottom": value.min()}
        metrics["per_step"] = (torch.tensor(steps), value)
        tally.add(StepResult(loss=torch.tensor(0.0), metrics=metrics, num_samples=len(values)))
    out = tally.result()
    assert out["total"].item() == 9.0 and out["average"].item() == 3.0
    assert out["top"].item() == 5.0 and out["bottom"].item() == 1.0
    assert out["per_step"].tolist() == [1.0, 0.0, 8.0] and out["per_step_count"].tolist() == [1.0, 0.0, 2.0]
    assert torch.isnan(out["never"])  # nothing was measured


def test_the_ode_rollout_is_dpm_solver_and_does_not_depend_on_the_batch(base_transformer):
    cond, noise = make_batch(4)
    samples = final_samples(base_transformer, cond, noise)
    assert samples.final_x0.shape == noise.shape and samples.num_steps == NUM_STEPS
    again = sample_final_latents(
        base_transformer, cond, noise, sigma_schedule(NUM_STEPS, 3.0), guidance=GUIDANCE, rollout_batch_size=4,
        img_ids=image_ids(64, 64), device_type="cpu",
    )  # fmt: skip
    assert torch.allclose(again.final_x0, samples.final_x0, atol=1e-5)

    class ConstantX0(nn.Module):  # v = (x − x0)/σ for a fixed x0: x̂0 is constant, so DPM-Solver++ is Euler
        def forward(self, hidden_states, timestep, **_):
            return ((hidden_states - target) / timestep.reshape(-1, 1, 1),)

    target = torch.randn_like(noise)
    constant = sample_final_latents(
        ConstantX0(), cond, noise, sigma_schedule(NUM_STEPS, 3.0), guidance=GUIDANCE, rollout_batch_size=4,
        img_ids=image_ids(64, 64), device_type="cpu",
    )  # fmt: skip
    euler = noise.clone()
    sigmas = sigma_schedule(NUM_STEPS, 3.0)
    for j in range(NUM_STEPS):  # the model is fed floor(1000σ)/1000, so feed Euler the same velocity
        fed = torch.floor(sigmas[j] * 1000) / 1000
        euler = euler_step(euler, (euler - target) / fed, sigmas[j], sigmas[j + 1])
    assert torch.allclose(constant.final_x0, euler, atol=1e-5)


# --------------------------------------------------------------------------------------------- policy copies


def test_a_policy_copy_swaps_in_exactly_and_blends(base_transformer):
    policy = nudged(base_transformer, seed=1)
    copy_ = PolicyCopy(policy)
    start = weights(policy)
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(1.0)
    trained = weights(policy)
    with copy_.swapped_in(policy):
        assert all(torch.equal(parameter, start[name]) for name, parameter in policy.named_parameters())
    assert all(torch.equal(parameter, trained[name]) for name, parameter in policy.named_parameters())
    copy_.blend(policy, 0.25)
    with copy_.swapped_in(policy):
        blended = weights(policy)
    assert all(torch.allclose(blended[name], 0.25 * start[name] + 0.75 * trained[name]) for name in start)
    copy_.blend(policy, 0.0)
    with copy_.swapped_in(policy):
        assert all(torch.equal(parameter, trained[name]) for name, parameter in policy.named_parameters())


# --------------------------------------------------------------------------------------------- DiffusionNFT


def test_nft_decay_schedules_are_the_authors():
    assert [old_policy_decay(step, 1) for step in (0, 1, 100, 500, 501, 10_000)] == [0.0, 0.001, 0.1, 0.5, 0.5, 0.5]
    assert [old_policy_decay(step, 2) for step in (0, 74, 75, 76, 175)] == [0.0, 0.0, 0.0, 0.0075, 0.75]
    assert old_policy_decay(10_000, 2) == 0.999
    assert old_policy_decay(10_000, 0) == 0.0


def test_nft_gradient_is_zero_at_the_old_policy_without_advantage(base_transformer):
    policy = nudged(base_transformer, seed=2)
    cond, noise = make_batch(4)
    samples = final_samples(policy, cond, noise)
    work = prepare(nft(policy, PolicyCopy(policy)), policy, samples, cond, torch.zeros(4))
    for micro_index in range(work.layout.num_micro_batches):
        for slot in range(work.work.slots):
            work.step(micro_index, slot).loss.backward()
    gradients = [parameter.grad for parameter in policy.parameters() if parameter.grad is not None]
    assert gradients and all(torch.count_nonzero(gradient) == 0 for gradient in gradients)


def test_nft_gradient_at_the_old_policy_is_the_authors_closed_form():
    # ∂loss/∂v = 2c·t·(1−2r)·(x̂0 − x0)/(w·D·B) per element (β cancels at v = v_old; §6.3's 10 = 2c), B = 2, D = 12
    generator = torch.Generator().manual_seed(0)
    x0, x_t, old = (torch.randn(2, 4, 3, generator=generator) for _ in range(3))
    t, r = torch.tensor([0.3, 0.8]), torch.tensor([0.9, 0.2])
    velocity = old.clone().requires_grad_(True)
    nft_policy_loss(velocity, old, x_t, x0, t, r, beta=0.1, adv_clip_max=5.0).mean().backward()
    error = x_t - t.reshape(-1, 1, 1) * old - x0
    weight = error.abs().mean(dim=(1, 2), keepdim=True)
    expected = 10 * t.reshape(-1, 1, 1) * (1 - 2 * r.reshape(-1, 1, 1)) * error / (weight * 12 * 2)
    assert torch.allclose(velocity.grad, expected, atol=1e-6)


def test_nft_with_positive_advantage_moves_the_prediction_towards_the_sample(base_transformer):
    policy = nudged(base_transformer, seed=3)
    cond, noise = make_batch(2)
    samples = final_samples(policy, cond, noise)
    work = prepare(nft(policy, PolicyCopy(policy), micro_batch_size=2, grad_accum_steps=1), policy, samples, cond,
                   torch.full((2,), 5.0))  # fmt: skip

    def x0_error() -> float:
        x_t, t, _ = work.work.batch.noised(0, 2, 0)
        velocity = velocity_at(work, policy, 0, 2, 0)
        return float(((x_t - t.reshape(-1, 1, 1) * velocity - work.work.batch.x0) ** 2).mean())

    before = x0_error()
    optimizer = torch.optim.SGD(policy.parameters(), lr=1e-2)
    work.step(0, 0).loss.backward()
    optimizer.step()
    assert x0_error() < before


def test_nft_rolls_out_with_the_old_policy(base_transformer):
    from fluxgrpo.grpo.rollout import RolloutSettings
    from fluxgrpo.grpo.samplers import make_sampler
    from fluxgrpo.training.stages import RolloutDraws, rollout_stage

    old_weights = nudged(base_transformer, seed=4)
    policy = copy.deepcopy(old_weights)
    objective, _ = nft(policy, PolicyCopy(policy))
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(0.05)
    cond, noise = make_batch(2)
    settings = RolloutSettings(make_sampler("dance", 0.3, 0.0), GUIDANCE, 2)  # the ODE reads guidance and batch size
    sigmas = sigma_schedule(NUM_STEPS, 3.0)
    rolled = rollout_stage(
        policy, objective, settings, cond, noise, sigmas, image_ids(64, 64), device_type="cpu", draws=RolloutDraws(None)
    )
    assert torch.equal(rolled.final_x0, final_samples(old_weights, cond, noise).final_x0)
    assert not torch.allclose(rolled.final_x0, final_samples(policy, cond, noise).final_x0, atol=1e-4)


# --------------------------------------------------------------------------------------------- AWM


def test_awm_log_prob_weightings():
    mse = torch.linspace(0.01, 4.0, 50, dtype=torch.float64)
    t = torch.full_like(mse, 0.7)
    for weighting in ("uniform", "t", "t2", "ghuber", "huber"):
        lp = weighted_log_prob(mse, t, weighting, 0.25)
        assert bool((lp[1:] < lp[:-1]).all()), weighting  # a larger error is always less likely
    assert torch.allclose(weighted_log_prob(mse, t, "ghuber", 1.0), -t * mse, atol=1e-9)
    assert torch.equal(weighted_log_prob(mse, t, "t2", 0.25), -mse * t**2)


def test_awm_stratified_indices_cover_the_authors_range():
    generator = torch.Generator().manual_seed(0)
    assert trainable_range(14) == range(1, 12)  # int(14·0.9) = 12: indices 12 and 13 never train
    draws = torch.stack([stratified_indices(14, 6, generator) for _ in range(200)])
    bounds = torch.linspace(1, 12, 7).long()
    assert bool(((draws >= bounds[:-1]) & (draws < bounds[1:])).all())
    assert set(draws.flatten().tolist()) == set(range(1, 12))


def test_awm_at_unit_advantage_is_plain_flow_matching(base_transformer):
    policy = nudged(base_transformer, seed=5)
    twin = copy.deepcopy(policy)
    cond, noise = make_batch(2)
    samples = final_samples(policy, cond, noise)
    objective = awm(weighting="uniform", micro_batch_size=2, grad_accum_steps=1)
    work = prepare(objective, policy, samples, cond, torch.full((2,), 5.0))  # A' = clamp(A, ±5)/5 = 1
    for slot in range(work.work.slots):
        work.step(0, slot).loss.backward()
    for slot in range(work.work.slots):  # Σ_slots mean_b mse / T, on the same noise and timesteps
        _, _, eps = work.work.batch.noised(0, 2, slot)
        velocity = work.forwards.velocity(work.work.model_input(0, 2, slot), 0, 2, twin).to(torch.float32)
        ((velocity - (eps - work.work.batch.x0)) ** 2).mean(dim=(1, 2)).mean().div(work.work.slots).backward()
    for (name, parameter), expected in zip(policy.named_parameters(), twin.parameters(), strict=True):
        if expected.grad is not None:
            assert torch.allclose(parameter.grad, expected.grad, rtol=1e-4, atol=1e-7), name


def test_awm_ratio_is_one_on_policy_then_measures_the_step(base_transformer):
    policy = nudged(base_transformer, seed=6)
    cond, noise = make_batch(4)
    samples = final_samples(policy, cond, noise)
    work = prepare(awm(micro_batch_size=1, grad_accum_steps=2), policy, samples, cond, torch.tensor([5.0, -5, 2, -2]))
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.05)
    for micro_index in range(2):
        step = work.step(micro_index, 0)
        assert step.metrics["ratio_min"].item() == 1.0 and step.metrics["ratio_max"].item() == 1.0
        step.loss.backward()
    optimizer.step()
    after = work.step(2, 0)  # off-policy: lp_old from the weights before the step
    assert after.metrics["ratio_max"].item() != 1.0


def test_awm_pulls_towards_its_ema_policy(base_transformer):
    policy = nudged(base_transformer, seed=7)
    ema = PolicyCopy(policy)
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(0.01)
    cond, noise = make_batch(2)
    samples = final_samples(policy, cond, noise)
    work = prepare(awm(ema, ema_beta=1.0, micro_batch_size=2, grad_accum_steps=1), policy, samples, cond,
                   torch.zeros(2))  # fmt: skip
    step = work.step(0, 0)
    assert step.metrics["ema_deviation"].item() > 0
    assert ema_policy_decay(0) == 0.0 and ema_policy_decay(100) == 0.1 and ema_policy_decay(10_000) == 0.3


def test_an_objectives_own_metrics_reach_the_report_without_naming_them_there(tmp_path):
    from fluxgrpo.report.figures import panels_for
    from fluxgrpo.report.run import RunData

    records = [{"iteration": i, "reward_mean": 0.5, "loss": 1.0, "policy_loss": 2.0 - i, "fm_mse": 0.3} for i in (1, 2)]
    keys = {line.key for panel in panels_for([RunData(tmp_path, "nft", records, [])]) for line in panel.lines}
    assert {"policy_loss", "fm_mse"} <= keys


def test_the_structure_toy_reward_needs_the_targets_layout():
    from fluxgrpo.rewards import load_reward
    from fluxgrpo.rewards.structure import SIZE

    reward = load_reward("structure", "unused")
    target = reward.target_image  # type: ignore[attr-defined]
    images = torch.stack([target, target.flip(-1), torch.full_like(target, 0.5), torch.full_like(target, 0.9)])
    scores = reward(images, ["a"] * 4)
    assert scores[0].item() == pytest.approx(1.0, abs=1e-6)  # the target itself
    assert scores[1] < 0.99 and scores[3] < 0.99  # mirrored layout, or a uniform brightness change, is not it
    assert scores[2].item() == 0.0  # flat grey has no features
    upscaled = torch.nn.functional.interpolate(target[None], size=(2 * SIZE, 2 * SIZE), mode="bilinear")
    assert reward(upscaled, ["a"]).item() > 0.99  # resolution-independent
    assert torch.equal(load_reward("structure", "unused")(images, ["a"] * 4), scores)  # fixed seed: deterministic


# --------------------------------------------------------------------------------------------- the authors' losses

CASES = torch.load(Path(__file__).parents[1] / "fixtures" / "objective_cases.pt", weights_only=True)
AUTHORS_WEIGHTINGS = {"Uniform": "uniform", "t": "t", "t**2": "t2", "huber": "huber", "ghuber": "ghuber"}


@pytest.mark.parametrize("case", [case for case in CASES if case["kind"] == "nft"], ids=lambda case: str(case["beta"]))
def test_nft_loss_and_gradient_match_the_authors_recorded_cases(case):
    from fluxgrpo.grpo.objectives.nft.loss import optimality_probability

    velocity = case["velocity"].clone().requires_grad_(True)
    r = optimality_probability(case["advantages"], case["adv_clip_max"])
    policy = nft_policy_loss(
        velocity, case["old_velocity"], case["x_t"], case["x0"], case["t"], r, case["beta"], case["adv_clip_max"]
    )
    kl = ((velocity - case["reference_velocity"]) ** 2).mean(dim=(1, 2))
    loss = policy.mean() + case["kl_beta"] * kl.mean()
    loss.backward()
    assert torch.allclose(loss.detach(), case["loss"], rtol=1e-6, atol=0)
    assert torch.allclose(velocity.grad, case["gradient"], rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("case", [case for case in CASES if case["kind"] == "awm"], ids=lambda case: case["weighting"])
def test_awm_loss_and_gradient_match_the_authors_recorded_cases(case):
    from fluxgrpo.grpo.objectives.awm.loss import awm_policy_loss, flow_matching_mse

    velocity = case["velocity"].clone().requires_grad_(True)
    mse = flow_matching_mse(velocity, case["noise"], case["x0"])
    log_prob = weighted_log_prob(mse, case["t"], AUTHORS_WEIGHTINGS[case["weighting"]], case["ghuber_power"])
    clipped = case["advantages"].clamp(-case["adv_clip_max"], case["adv_clip_max"]) / case["adv_clip_max"]
    policy, _ = awm_policy_loss(log_prob, case["old_log_prob"], clipped, case["clip_range"])
    loss = policy.mean()
    loss.backward()
    assert torch.equal(log_prob.detach(), case["log_prob"])  # the same float64 operations, bit for bit
    assert torch.allclose(loss.detach(), case["loss"], rtol=1e-12, atol=0)
    assert torch.allclose(velocity.grad, case["gradient"], rtol=1e-6, atol=1e-12)
