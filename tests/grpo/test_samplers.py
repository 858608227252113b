"""The samplers (``--sampler``) against the authors' steps on recorded cases, and the ODE solvers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fluxgrpo.grpo.samplers import SdeStep, cps_step, dpm_solver_2m_step, euler_step, make_sampler
from fluxgrpo.grpo.schedule import sigma_schedule

# Written by tests/fixtures/make_sampler_cases.py from Flow-GRPO's sde_step_with_logprob and DanceGRPO's flux_step.
CASES = torch.load(Path(__file__).parents[1] / "fixtures" / "sampler_cases.pt", weights_only=True)


def sampler_step(name, x, velocity, sigma, sigma_next, noise_level, sigma_max, **given) -> SdeStep:
    """One step of the sampler ``name`` as the rollout and the update take it (``make_sampler(...).step``)."""
    return make_sampler(name, noise_level, sigma_max).step(x, velocity, sigma, sigma_next, **given)


@pytest.mark.parametrize("case", CASES, ids=[f"{c['sampler']}-{c['sigmas'].shape[0] - 1}" for c in CASES])
def test_each_sampler_equals_the_authors_step(case):
    sigmas, index = case["sigmas"], case["step_index"]
    args = (case["sampler"], case["x"], case["velocity"], sigmas[index], sigmas[index + 1], case["noise_level"])
    sampled = sampler_step(*args, sigma_max=float(sigmas[1]), noise=case["noise"])
    assert torch.allclose(sampled.prev_sample, case["prev_sample"], atol=1e-6, rtol=1e-6)
    assert torch.allclose(sampled.mean, case["mean"], atol=1e-6, rtol=1e-6)
    assert torch.allclose(sampled.log_prob, case["log_prob"], atol=1e-5, rtol=1e-6)
    # The authors' std_dev_t: Flow-GRPO's is the one its KL divides by; DanceGRPO's flux_step returns the step's std.
    returned = sampled.std if case["sampler"] == "dance" else sampled.kl_scale
    assert torch.allclose(returned.expand_as(case["std_dev_t"]), case["std_dev_t"], atol=1e-7, rtol=1e-6)
    scored = sampler_step(*args, sigma_max=float(sigmas[1]), prev_sample=case["given"])
    assert torch.allclose(scored.log_prob, case["given_log_prob"], atol=1e-5, rtol=1e-6)
    # The rollout's own sample, scored again, gives exactly its log-prob: the ratio is 1 before any update.
    rescored = sampler_step(*args, sigma_max=float(sigmas[1]), prev_sample=sampled.prev_sample)
    assert torch.equal(rescored.log_prob, sampled.log_prob)


@pytest.mark.parametrize("sampler", ["flow-grpo", "cps"])
def test_noise_level_zero_is_the_euler_step(sampler):
    generator = torch.Generator().manual_seed(0)
    x, velocity = torch.randn(3, 5, 4, generator=generator), torch.randn(3, 5, 4, generator=generator)
    sigma, sigma_next = torch.tensor([0.9, 0.6, 0.3]), torch.tensor([0.8, 0.4, 0.0])
    step = sampler_step(sampler, x, velocity, sigma, sigma_next, 0.0, sigma_max=0.95, noise=torch.zeros_like(x))
    expected = euler_step(x, velocity, sigma[:, None, None], sigma_next[:, None, None])
    assert torch.allclose(step.prev_sample, expected, atol=1e-6)


def test_cps_preserves_the_marginal():
    # x_σ = (1−σ)·x0 + σ·ε with the oracle velocity v = ε − x0: x' − (1−σ')·x0 must have std σ' (fresh noise
    # and the kept noise combine to exactly σ'). Flow-GRPO's "sde" step does not keep it (0.768 for 0.6).
    generator = torch.Generator().manual_seed(1)
    x0, eps = torch.randn(100_000, 1, 1, generator=generator) * 2 + 1, torch.randn(100_000, 1, 1, generator=generator)
    sigma, sigma_next = 0.8, 0.6
    x = (1 - sigma) * x0 + sigma * eps
    noise = torch.randn(x.shape, generator=generator)
    step = cps_step(x, eps - x0, sigma, sigma_next, 0.7, noise=noise)
    spread = (step.prev_sample - (1 - sigma_next) * x0).std().item()
    assert abs(spread - sigma_next) < 0.01 * sigma_next, spread
    sde = sampler_step("flow-grpo", x, eps - x0, sigma, sigma_next, 0.7, sigma_max=0.9, noise=noise)
    assert abs((sde.prev_sample - (1 - sigma_next) * x0).std().item() - sigma_next) > 0.05


def test_dpm_solver_with_a_constant_prediction_is_euler():
    # D1 = 0 when x̂0 does not change, and the first-order DPM-Solver++ step equals Euler on any σ grid.
    generator = torch.Generator().manual_seed(2)
    x0 = torch.randn(2, 4, 3, generator=generator)
    sigmas = sigma_schedule(7, 3.0)
    x = (1 - sigmas[2]) * x0 + sigmas[2] * torch.randn(2, 4, 3, generator=generator)
    velocity = (x - x0) / sigmas[2]
    dpm = dpm_solver_2m_step(x, x0, x0, sigmas[1], sigmas[2], sigmas[3])
    assert torch.allclose(dpm, euler_step(x, velocity, sigmas[2], sigmas[3]), atol=1e-6)


def test_dpm_solver_second_order_beats_euler_on_a_curved_path():
    # x̂0 changing linearly in λ = log((1−σ)/σ): the 2M step's correction cuts Euler's error about eightfold.
    sigmas = torch.tensor([0.8, 0.6, 0.4])

    def log_snr(value):
        return torch.log((1 - value) / value)

    def x0_at(sigma):  # data prediction linear in λ
        return torch.tensor([[1.0]]) + 0.5 * log_snr(sigma)

    # exact ODE solution of dx/dλ in data-prediction form: x_t = σ_t/σ_s·x_s + σ_t ∫ e^{λ} x̂0(λ) dλ
    def exact(x_s, s, t):
        grid = torch.linspace(float(log_snr(s)), float(log_snr(t)), 20_001, dtype=torch.float64)
        integrand = torch.exp(grid) * (1.0 + 0.5 * grid)
        integral = torch.trapezoid(integrand, grid)
        return (t / s).double() * x_s.double() + t.double() * integral

    x_s = torch.tensor([[0.3]])
    truth = exact(x_s, sigmas[1], sigmas[2])
    dpm = dpm_solver_2m_step(x_s, x0_at(sigmas[1]), x0_at(sigmas[0]), sigmas[0], sigmas[1], sigmas[2])
    euler = euler_step(x_s, (x_s - x0_at(sigmas[1])) / sigmas[1], sigmas[1], sigmas[2])
    assert abs(dpm.item() - truth.item()) < 0.01  # 0.5333 vs 0.5424; Euler gives 0.4658
    assert abs(euler.item() - truth.item()) > 5 * abs(dpm.item() - truth.item())
