"""The algorithm options on a tiny random FluxTransformer2DModel (CPU, fp32): samplers, the SDE window and its
ODE solvers, the KL to a reference, GRPO-Guard. Each reduces to DanceGRPO when off, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from training_helpers import POOLED_DIM, TEXT_DIM, grpo_update, make_batch, sde_rollout

from fluxgrpo.config import build_config
from fluxgrpo.errors import UsageError
from fluxgrpo.grpo.latents import image_ids
from fluxgrpo.grpo.objectives.grpo.loss import guard_log_ratio
from fluxgrpo.grpo.samplers import make_sampler
from fluxgrpo.grpo.schedule import (
    PlanSettings,
    StepPlan,
    plan_for_iteration,
    sigma_schedule,
    tail_schedule,
    window_start,
)
from fluxgrpo.grpo.weight_copies import FrozenReference

NUM_STEPS, ETA, GUIDANCE = 6, 0.3, 3.5


@pytest.fixture(scope="module")
def base_transformer() -> nn.Module:
    from diffusers import FluxTransformer2DModel

    from fluxgrpo.models.tiny import TINY_TRANSFORMER_CONFIG

    torch.manual_seed(0)
    config = {"num_layers": 1, "num_single_layers": 1, "joint_attention_dim": TEXT_DIM}
    return FluxTransformer2DModel(**{**TINY_TRANSFORMER_CONFIG, **config, "pooled_projection_dim": POOLED_DIM})


class CallCounter(nn.Module):
    """Delegates to a transformer and counts its forwards (and the rows each fed)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, **kwargs):
        self.calls += 1
        return self.inner(**kwargs)


def rollout_of(transformer, cond, noise, seed=1, eta=ETA, **options):
    return sde_rollout(
        transformer,
        cond,
        noise,
        sigma_schedule(NUM_STEPS, 3.0),
        eta=eta,
        guidance=GUIDANCE,
        img_ids=image_ids(64, 64),
        rollout_batch_size=2,
        device_type="cpu",
        generator=torch.Generator().manual_seed(seed),
        **options,
    )


def update_of(transformer, rollout, cond, advantages, *, lr=1e-3, num_train=3, grad_accum_steps=8, **options):
    optimizer = torch.optim.SGD(transformer.parameters(), lr=lr)
    reference = options.pop("reference", None)
    return grpo_update(
        transformer, rollout, cond, advantages, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
        num_train_timesteps=num_train, clip_range=1e-2, micro_batch_size=2, grad_accum_steps=grad_accum_steps,
        max_grad_norm=1.0, **options, device_type="cpu", generator_cpu=torch.Generator().manual_seed(2),
        reference=reference,
    )  # fmt: skip


def weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: parameter.detach().clone() for name, parameter in module.named_parameters()}


ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, -0.5])


# ------------------------------------------------------------------------------------------- reductions


def test_a_window_over_every_trainable_step_is_dancegrpo_bit_for_bit(base_transformer):
    cond, noise = make_batch(4)
    dance, window = copy.deepcopy(base_transformer), copy.deepcopy(base_transformer)
    plan = StepPlan(sde_start=0, sde_stop=NUM_STEPS - 1)  # --sde-window N−1: only the untrained last step is Euler
    reference_rollout = rollout_of(dance, cond, noise)
    window_rollout = rollout_of(window, cond, noise, plan=plan)
    assert torch.equal(window_rollout.final_x0, reference_rollout.final_x0)  # the decoded image
    assert torch.equal(window_rollout.log_probs[:, :-1], reference_rollout.log_probs[:, :-1])
    assert torch.equal(window_rollout.latents, reference_rollout.latents[:, :-1])
    assert torch.isnan(window_rollout.log_probs[:, -1]).all()  # the ODE step has no log-prob
    a = update_of(dance, reference_rollout, cond, ADVANTAGES, grad_accum_steps=1)
    b = update_of(window, window_rollout, cond, ADVANTAGES, grad_accum_steps=1)
    assert torch.equal(a.train_timestep_indices, b.train_timestep_indices)
    assert torch.equal(a.loss_sum, b.loss_sum)
    after_a, after_b = weights(dance), weights(window)
    assert all(torch.equal(after_a[name], after_b[name]) for name in after_a)


def test_kl_beta_zero_and_ratio_normalization_none_change_nothing(base_transformer):
    cond, noise = make_batch(4)
    plain, optioned = copy.deepcopy(base_transformer), copy.deepcopy(base_transformer)
    rollout = rollout_of(plain, cond, noise, keep_means=True)
    a = update_of(plain, rollout, cond, ADVANTAGES, grad_accum_steps=1)
    reference = FrozenReference(copy.deepcopy(base_transformer))
    b = update_of(optioned, rollout, cond, ADVANTAGES, grad_accum_steps=1, kl_beta=0.0, ratio_normalization="none",
                  reference=reference)  # fmt: skip
    assert torch.equal(a.loss_sum, b.loss_sum) and torch.isnan(b.kl_mean)
    after_a, after_b = weights(plain), weights(optioned)
    assert all(torch.equal(after_a[name], after_b[name]) for name in after_a)


# ------------------------------------------------------------------------------------------- ratio is 1


OPTIONS = {
    "dance": {},
    "flow-grpo": {"sampler": "flow-grpo"},
    "cps": {"sampler": "cps"},
    "window": {"plan": StepPlan(sde_start=1, sde_stop=4)},
    "window-dpm2": {"plan": StepPlan(sde_start=0, sde_stop=3, tail_sigmas=torch.tensor([0.75, 0.4, 0.0]))},
    "kl": {"kl_beta": 0.1},
    "grpo-guard": {"ratio_normalization": "grpo-guard"},
    "flow-grpo-guard": {"sampler": "flow-grpo", "ratio_normalization": "grpo-guard"},
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_ratio_is_one_before_the_first_optimizer_step(base_transformer, option):
    transformer = copy.deepcopy(base_transformer)
    cond, noise = make_batch(4)
    values = dict(OPTIONS[option])
    rollout_options = {key: values.pop(key) for key in ("sampler", "plan") if key in values}
    if option == "window-dpm2":
        rollout_options["plan"] = StepPlan(0, 3, tail_sigmas=tail_schedule(sigma_schedule(NUM_STEPS, 3.0), 3, 3.0, 0.6))
    guard = values.get("ratio_normalization") == "grpo-guard"
    eta = 0.7 if rollout_options.get("sampler") in ("flow-grpo", "cps") else ETA
    rollout = rollout_of(transformer, cond, noise, eta=eta, keep_means=guard, **rollout_options)
    if values.get("kl_beta"):
        values["reference"] = FrozenReference(copy.deepcopy(transformer))
    stats = update_of(transformer, rollout, cond, ADVANTAGES, **values)
    assert stats.optimizer_steps == 1  # GA 8 covers both micro-batches: every ratio is taken before the step
    assert abs(stats.ratio_max.item() - 1) < 1e-5 and abs(stats.ratio_min.item() - 1) < 1e-5
    assert set(stats.train_timestep_indices.unique().tolist()) <= set(rollout.trainable)
    trained = stats.count_per_step > 0
    assert torch.allclose(stats.ratio_sum_per_step[trained] / stats.count_per_step[trained], torch.ones(1), atol=1e-5)
    if values.get("kl_beta"):
        assert stats.kl_mean.item() == 0.0  # the reference is the policy itself before any step


# ------------------------------------------------------------------------------------------- window


def test_window_schedule_as_mixgrpo():
    # MixGRPO: N = 25, window 4, shift every 25 iterations by 1: 300 iterations visit starts 0…11.
    generator = torch.Generator()
    starts = [window_start(k, 25, 4, "sliding", 25, 1, False, generator) for k in range(1, 301)]
    assert starts[0] == 0 and starts[24] == 0 and starts[25] == 1 and sorted(set(starts)) == list(range(12))
    # Past the last position (N−1−W = 20 here) it holds, or starts over with wrap; stride 0 freezes it (Flash*).
    assert window_start(10_000, 25, 4, "sliding", 25, 1, False, generator) == 20
    assert [window_start(k, 8, 3, "sliding", 1, 2, True, generator) for k in range(1, 8)] == [0, 2, 4, 0, 2, 4, 0]
    assert window_start(500, 25, 4, "sliding", 20, 0, False, generator) == 0
    draws = [window_start(1, 16, 2, "random", 0, 1, False, torch.Generator().manual_seed(s)) for s in range(200)]
    assert min(draws) == 0 and max(draws) == 13  # every window [start, start+2) inside 0…14


def test_random_window_is_a_function_of_the_iteration_seed():
    settings = PlanSettings(2, "random", 0, 1, False, "euler", 0.4, 3.0)
    sigmas = sigma_schedule(16, 3.0)
    first = plan_for_iteration(settings, sigmas, 7, torch.Generator().manual_seed(123))
    again = plan_for_iteration(settings, sigmas, 7, torch.Generator().manual_seed(123))
    assert (first.sde_start, first.sde_stop) == (again.sde_start, again.sde_stop)


def test_steps_before_the_window_are_the_ode_and_do_not_depend_on_the_noise(base_transformer):
    cond, noise = make_batch(2)
    transformer = copy.deepcopy(base_transformer)
    plan = StepPlan(sde_start=2, sde_stop=4)
    a = rollout_of(transformer, cond, noise, seed=1, plan=plan)
    b = rollout_of(transformer, cond, noise, seed=9, plan=plan)
    assert torch.equal(a.latents[:, :3], b.latents[:, :3])  # z_0 … z_2: Euler from the same z_0
    assert not torch.equal(a.latents[:, 3], b.latents[:, 3])  # the first SDE step adds its noise
    assert torch.isnan(a.log_probs[:, :2]).all() and torch.isfinite(a.log_probs[:, 2:4]).all()
    everything_ode = StepPlan(sde_start=0, sde_stop=0)
    c = rollout_of(transformer, cond, noise, seed=1, plan=everything_ode)
    d = rollout_of(transformer, cond, noise, seed=9, plan=everything_ode)
    assert torch.equal(c.final_x0, d.final_x0)  # no SDE step at all: the image is deterministic


def test_dpm2_tail_saves_model_calls_and_lands_near_the_euler_image(base_transformer):
    cond, noise = make_batch(2)
    counter = CallCounter(copy.deepcopy(base_transformer))
    sigmas = sigma_schedule(16, 3.0)
    tail = tail_schedule(sigmas, 4, 3.0, 0.4)  # n = int((16 − 3)·0.4) = 5 points: 4 steps instead of 12
    assert tail.shape == (5,) and tail[0] == sigmas[4] and tail[-1] == 0
    run = dict(sigmas=sigmas, eta=ETA, guidance=GUIDANCE, img_ids=image_ids(64, 64), rollout_batch_size=2,
               device_type="cpu")  # fmt: skip
    dpm = sde_rollout(counter, cond, noise, **run, generator=torch.Generator().manual_seed(1),
                           plan=StepPlan(0, 4, tail_sigmas=tail))  # fmt: skip
    assert counter.calls == 4 + 4 and dpm.latents.shape[1] == 5
    counter.calls = 0
    euler = sde_rollout(counter, cond, noise, **run, generator=torch.Generator().manual_seed(1),
                             plan=StepPlan(0, 4))  # fmt: skip
    assert counter.calls == 16
    assert torch.equal(dpm.latents, euler.latents[:, :5]) and torch.equal(dpm.log_probs[:, :4], euler.log_probs[:, :4])
    error = (dpm.final_x0 - euler.final_x0).norm() / euler.final_x0.norm()
    assert error < 0.2, error  # a different ODE discretisation of the same path, not a different image


# ------------------------------------------------------------------------------------------- KL


def test_kl_grows_as_the_policy_moves_and_its_gradient_pulls_back(base_transformer):
    cond, noise = make_batch(4)
    policy = copy.deepcopy(base_transformer)
    reference = FrozenReference(copy.deepcopy(base_transformer))
    rollout = rollout_of(policy, cond, noise)

    def kl_now() -> float:  # measured with a zero learning rate: nothing moves
        return update_of(policy, rollout, cond, ADVANTAGES, lr=0.0, kl_beta=1.0, reference=reference).kl_mean.item()

    assert kl_now() == 0.0
    update_of(policy, rollout, cond, ADVANTAGES, lr=1e-2, grad_accum_steps=1)  # the policy loss alone moves it
    moved = kl_now()
    assert moved > 0
    # With zero advantages only the KL has a gradient: a step along it brings the policy back towards the base.
    stats = update_of(policy, rollout, cond, torch.zeros(4), lr=1e-2, kl_beta=1.0, reference=reference)
    assert stats.kl_mean.item() == pytest.approx(moved)
    assert kl_now() < moved


# ------------------------------------------------------------------------------------------- GRPO-Guard


def test_guard_log_ratio_is_the_noise_projection_with_zero_mean():
    # (lp_θ − lp_old + b)·s = mean(ξ ⊙ (μθ − μ_old)) with ξ = (x' − μ_old)/s: zero mean over ξ, unlike the raw
    # log-ratio, whose mean is −mean(δ²)/(2s²).
    generator = torch.Generator().manual_seed(5)
    x, velocity = torch.randn(1, 8, 4, generator=generator), torch.randn(1, 8, 4, generator=generator)
    shifted = velocity + 0.05 * torch.randn(1, 8, 4, generator=generator)
    sigma, sigma_next = torch.tensor([0.7]), torch.tensor([0.6])
    dance = make_sampler("dance", ETA, 0.9)
    old = dance.step(x, velocity, sigma, sigma_next, noise=torch.zeros_like(x))
    normalised, raw = [], []
    for _ in range(2000):
        xi = torch.randn(1, 8, 4, generator=generator)
        x_next = old.mean + old.std * xi
        old_lp = dance.step(x, velocity, sigma, sigma_next, prev_sample=x_next).log_prob
        new = dance.step(x, shifted, sigma, sigma_next, prev_sample=x_next)
        guard = guard_log_ratio(new, old_lp, old.mean)
        assert torch.allclose(guard, (xi * (new.mean - old.mean)).mean(dim=(1, 2)), atol=1e-6)
        normalised.append(guard.item())
        raw.append((new.log_prob - old_lp).item())
    delta = (new.mean - old.mean).pow(2).mean().item()
    bias = delta / (2 * old.std.item() ** 2)
    assert abs(sum(raw) / len(raw) + bias) < 0.1 * bias
    assert abs(sum(normalised) / len(normalised)) < 0.1 * bias * old.std.item()


def test_a_lora_runs_reference_is_the_policy_with_its_adapters_off(base_transformer):
    from fluxgrpo.grpo.rollout import predict_velocity
    from fluxgrpo.grpo.weight_copies import AdapterDisabledReference
    from fluxgrpo.lora import LoraSpec, add_lora, init_adapters

    base = copy.deepcopy(base_transformer)
    policy = copy.deepcopy(base_transformer)
    add_lora(policy, LoraSpec(rank=4, alpha=8.0, targets=("attn.to_q", "attn.to_v"), dropout=0.0), torch.float32)
    init_adapters(policy, seed=0)
    with torch.no_grad():  # move the adapters away from B = 0, so the policy differs from the base
        for name, parameter in policy.named_parameters():
            if ".lora_B." in name:
                parameter.normal_(0, 0.1, generator=torch.Generator().manual_seed(3))
    cond, noise = make_batch(2)
    args = (cond, torch.full((2,), 0.7), torch.full((2,), GUIDANCE), image_ids(64, 64), "cpu")
    with torch.no_grad():
        expected = predict_velocity(base, noise, *args)
        policy_before = predict_velocity(policy, noise, *args)
    reference = AdapterDisabledReference(policy).reference_prediction(noise, *args)
    assert torch.allclose(reference, expected, atol=1e-6)
    assert not torch.allclose(policy_before, expected, atol=1e-3)
    with torch.no_grad():
        assert torch.equal(predict_velocity(policy, noise, *args), policy_before)  # adapters are back on


def test_random_early_windows_start_in_the_first_half_as_flow_grpo_fast():
    generator = torch.Generator().manual_seed(0)
    starts = {window_start(1, 16, 3, "random-early", 0, 1, False, generator) for _ in range(300)}
    assert starts == set(range(0, 16 // 2 - 3 + 1))  # 0 … N/2 − W, each reached
    with pytest.raises(UsageError, match="random-early"):
        build_config("tiny-cpu", {"sde_window": 5, "sde_window_policy": "random-early"})


def test_the_final_latent_is_kept_for_decoding_as_flow_grpo(base_transformer):
    cond, noise = make_batch(2)
    every = rollout_of(base_transformer, cond, noise)
    assert torch.equal(every.final_latent, every.latents[:, -1])  # z_N, with the last SDE step's noise
    assert not torch.allclose(every.final_latent, every.final_x0, atol=1e-3)
    window = rollout_of(base_transformer, cond, noise, plan=StepPlan(sde_start=1, sde_stop=3))
    assert window.latents.shape[1] == 4 and torch.allclose(window.final_latent, window.final_x0, atol=1e-5)
