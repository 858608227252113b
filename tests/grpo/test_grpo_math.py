"""The pure GRPO math against values worked by hand: σ table, latent packing, SDE step, advantages, loss."""

from __future__ import annotations

import math

import pytest
import torch

from fluxgrpo.config import TrainConfig
from fluxgrpo.grpo.advantages import group_advantages
from fluxgrpo.grpo.latents import image_ids, latent_shape, pack_latents, unpack_latents
from fluxgrpo.grpo.objectives.grpo.loss import clipped_policy_loss
from fluxgrpo.grpo.samplers import dance_step
from fluxgrpo.grpo.schedule import model_timesteps, sigma_schedule

HALF_LOG_TWO_PI = 0.5 * math.log(2 * math.pi)  # 0.9189385…


# ---------------------------------------------------------------------------------------------- schedule


# dancegrpo-spec §3.4, N = 16, s = 3: σ_i = 3t/(1+2t), t = 1 − i/16. E.g. i = 8: t = ½ → 1.5/2 = 0.75;
# i = 15: t = 1/16 → (3/16)/(18/16) = 1/6 = 0.1667, floor(166.67) = 166.
SPEC_SIGMAS = [1.0000, 0.9783, 0.9545, 0.9286, 0.9000, 0.8684, 0.8333, 0.7941, 0.7500, 0.7000,
               0.6429, 0.5769, 0.5000, 0.4091, 0.3000, 0.1667, 0.0]  # fmt: skip
SPEC_TIMESTEPS = [1000, 978, 954, 928, 900, 868, 833, 794, 750, 700, 642, 576, 500, 409, 300, 166, 0]
SPEC_STD = [0.0442, 0.0462, 0.0483, 0.0507, 0.0533, 0.0562, 0.0594, 0.0630, 0.0671, 0.0717,
            0.0770, 0.0832, 0.0905, 0.0991, 0.1095, 0.1225]  # fmt: skip


def test_sigma_table_matches_spec():
    sigmas = sigma_schedule(16, 3.0)
    assert sigmas.dtype == torch.float32 and sigmas.shape == (17,)
    assert torch.allclose(sigmas, torch.tensor(SPEC_SIGMAS), atol=5e-5)
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0
    assert sigmas[8] == 0.75 and sigmas[12] == 0.5  # exact in binary
    std = 0.3 * (sigmas[:-1] - sigmas[1:]).sqrt()  # η = 0.3
    assert torch.allclose(std, torch.tensor(SPEC_STD), atol=5e-5)


def test_model_timesteps_are_floored_thousandths():
    timesteps = model_timesteps(sigma_schedule(16, 3.0))
    assert timesteps.dtype == torch.float32
    assert torch.round(timesteps * 1000).to(torch.int64).tolist() == SPEC_TIMESTEPS
    assert torch.equal(timesteps, torch.tensor(SPEC_TIMESTEPS, dtype=torch.float32) / 1000)


def test_shift_one_is_linear():
    assert torch.allclose(sigma_schedule(4, 1.0), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))


def test_train_timesteps():
    def count(steps: int, fraction: float) -> int:
        return TrainConfig(sampling_steps=steps, timestep_fraction=fraction).train_timesteps

    assert count(16, 0.6) == 9  # int(15·0.6) = 9, the 8-die recipe
    assert count(12, 0.6) == 6  # int(11·0.6) = int(6.6), the LoRA script
    assert count(16, 1.0) == 15  # the last transition is never trained
    problems = TrainConfig(sampling_steps=2, timestep_fraction=0.5).problems()  # int(1·0.5) = 0
    assert any("--timestep-fraction" in problem for problem in problems)


# ---------------------------------------------------------------------------------------------- latents


@pytest.mark.parametrize(("height", "width", "tokens"), [(720, 720, 2025), (1024, 1024, 4096), (64, 128, 32)])
def test_pack_unpack_identity(height, width, tokens):
    shape = latent_shape(height, width)
    assert shape.packed == (tokens, 64)
    latents = torch.randn(1, *shape.unpacked)
    packed = pack_latents(latents)
    assert packed.shape == (1, tokens, 64)
    assert torch.equal(unpack_latents(packed, height, width), latents)


def test_pack_channel_order():
    # Channel c of the 2×2 patch at (dy, dx) lands at index c·4 + dy·2 + dx of its token.
    latents = torch.zeros(1, 16, 4, 4)
    latents[0, 5, 2 + 1, 0 + 0] = 1.0  # c=5, token row 1 (dy=1), token col 0 (dx=0)
    packed = pack_latents(latents)
    token = 1 * 2 + 0  # row-major over the 2×2 token grid
    assert packed[0, token, 5 * 4 + 1 * 2 + 0] == 1.0
    assert packed.sum() == 1.0


def test_image_id_grid():
    ids = image_ids(64, 48)  # 4×3 token grid
    assert ids.shape == (12, 3)
    expected = [[0, r, c] for r in range(4) for c in range(3)]
    assert ids.tolist() == expected


def test_image_size_must_be_multiple_of_16():
    from fluxgrpo.grpo.latents import image_size_problem

    assert image_size_problem(720, 1024) is None and image_size_problem(16, 16) is None
    for height, width in ((720, 712), (0, 720), (-16, 720), (720, 8)):
        problem = image_size_problem(height, width)
        assert problem is not None and f"image size {height}×{width} is not a positive multiple of 16" in problem
        assert "--" not in problem  # a library message: each command names its own flags
    with pytest.raises(ValueError, match=r"image size 720×712 is not a positive multiple of 16"):
        latent_shape(720, 712)


# ---------------------------------------------------------------------------------------------- sde


def test_sde_step_closed_form():
    # x = [1, 2], v = [0.5, −1], σ = 0.5, σ' = 0.25, η = 0.5, ξ = [1, −2]; every number is exact in binary.
    # x̂0 = x − 0.5·v = [0.75, 2.5]
    # score = −(x − 0.5·x̂0)/0.25 = −[0.625, 0.75]/0.25 = [−2.5, −3]
    # μ = x + (−0.25)·v + (−0.25)·(−½·0.25·score) = x − 0.25v + 0.03125·score
    #   = [1 − 0.125 − 0.078125, 2 + 0.25 − 0.09375] = [0.796875, 2.15625]
    # std = 0.5·√0.25 = 0.25; x' = μ + 0.25·ξ = [1.046875, 1.65625]
    # log p = mean(−ξ²/2) − log 0.25 − ½log 2π = −1.25 + 1.3862944 − 0.9189385 = −0.7826441
    x = torch.tensor([[1.0, 2.0]])
    v = torch.tensor([[0.5, -1.0]])
    result = dance_step(x, v, 0.5, 0.25, 0.5, noise=torch.tensor([[1.0, -2.0]]))
    assert torch.equal(result.x0_pred, torch.tensor([[0.75, 2.5]]))
    assert torch.equal(result.prev_sample, torch.tensor([[1.046875, 1.65625]]))
    assert result.log_prob.shape == (1,)
    assert result.log_prob.item() == pytest.approx(-1.25 - math.log(0.25) - HALF_LOG_TWO_PI, abs=1e-6)
    assert result.log_prob.item() == pytest.approx(-0.7826441, abs=1e-6)


def test_sde_step_scoring_a_given_sample():
    # Same step, scoring x' = μ (ξ = 0): log p = −log 0.25 − ½log 2π = 0.4673559.
    x, v = torch.tensor([[1.0, 2.0]]), torch.tensor([[0.5, -1.0]])
    result = dance_step(x, v, 0.5, 0.25, 0.5, prev_sample=torch.tensor([[0.796875, 2.15625]]))
    assert result.log_prob.item() == pytest.approx(0.4673559, abs=1e-6)


def test_sampled_log_prob_matches_its_noise():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, 64, generator=generator)
    v = torch.randn(3, 16, 64, generator=generator)
    noise = torch.randn(3, 16, 64, generator=generator)
    sigma, sigma_next, eta = 0.9, 0.8684, 0.3
    result = dance_step(x, v, sigma, sigma_next, eta, noise=noise)
    std = eta * math.sqrt(sigma - sigma_next)
    expected = (-(noise**2) / 2).mean(dim=(1, 2)) - math.log(std) - HALF_LOG_TWO_PI
    assert torch.allclose(result.log_prob, expected, atol=1e-4)


def test_recomputed_log_prob_gives_ratio_exactly_one():
    generator = torch.Generator().manual_seed(1)
    x, v, noise = (torch.randn(2, 8, 64, generator=generator) for _ in range(3))
    sampled = dance_step(x, v, 0.5, 0.4091, 0.3, noise=noise)
    rescored = dance_step(x, v.clone(), 0.5, 0.4091, 0.3, prev_sample=sampled.prev_sample)
    assert torch.equal(torch.exp(rescored.log_prob - sampled.log_prob), torch.ones(2))


def test_per_sample_sigmas_equal_separate_calls():
    generator = torch.Generator().manual_seed(2)
    x, v, noise = (torch.randn(2, 4, 8, generator=generator) for _ in range(3))
    sigmas, sigmas_next = torch.tensor([0.9, 0.3]), torch.tensor([0.8684, 0.1667])
    batched = dance_step(x, v, sigmas, sigmas_next, 0.3, noise=noise)
    for row in range(2):
        single = dance_step(x[row : row + 1], v[row : row + 1], float(sigmas[row]), float(sigmas_next[row]), 0.3,
                          noise=noise[row : row + 1])  # fmt: skip
        assert torch.allclose(batched.prev_sample[row], single.prev_sample[0], atol=1e-6)
        assert torch.allclose(batched.log_prob[row], single.log_prob[0], atol=1e-6)


def test_sde_step_gradient_flows_through_mean_only():
    x = torch.tensor([[1.0, 2.0]])
    v = torch.tensor([[0.5, -1.0]], requires_grad=True)
    target = torch.tensor([[1.046875, 1.65625]], requires_grad=True)
    result = dance_step(x, v, 0.5, 0.25, 0.5, prev_sample=target)
    result.log_prob.sum().backward()
    assert target.grad is None
    # Scoring x' = μ + 0.25·ξ with ξ = [1, −2] (the closed-form case above), D = 2 elements:
    # d log p/dμ = (x' − μ)/std²/D = 0.25ξ/0.0625/2 = 2ξ.
    # score = −(x − (1−σ)(x − σv))/σ² = −(σx + (1−σ)σv)/σ², so dscore/dv = −(1−σ)/σ = −1 at σ = ½;
    # dμ/dv = Δσ + Δσ·(−½η²)·dscore/dv = −0.25 − 0.03125 = −0.28125;
    # d log p/dv = 2ξ·(−0.28125) = [−0.5625, 1.125].
    assert torch.allclose(v.grad, torch.tensor([[-0.5625, 1.125]]))


# ---------------------------------------------------------------------------------------------- advantages


def test_group_advantages_hand_worked():
    # Group [1, 2]: mean 1.5, unbiased std = √((0.25+0.25)/1) = 0.70710678; (±0.5)/0.70710678 = ±0.70710678.
    result = group_advantages(torch.tensor([1.0, 2.0, 3.0, 4.0]), group_size=2, adv_clip_max=5.0)
    expected = torch.tensor([-1, 1, -1, 1]) * 0.70710678
    assert torch.allclose(result.advantages, expected, atol=1e-6)
    assert result.num_nonfinite == 0


def test_group_advantages_are_standardised_and_clipped():
    # Group [0, 0, 0, 10]: mean 2.5, unbiased std = √((3·6.25 + 56.25)/3) = 5; A = [−0.5, −0.5, −0.5, 1.5].
    result = group_advantages(torch.tensor([0.0, 0.0, 0.0, 10.0]), group_size=4, adv_clip_max=1.0)
    assert torch.allclose(result.advantages, torch.tensor([-0.5, -0.5, -0.5, 1.0]), atol=1e-6)  # 1.5 → 1
    unclipped = group_advantages(torch.tensor([0.0, 0.0, 0.0, 10.0]), group_size=4, adv_clip_max=5.0)
    assert torch.allclose(unclipped.advantages, torch.tensor([-0.5, -0.5, -0.5, 1.5]), atol=1e-6)


def test_identical_rewards_give_zero_advantage():
    result = group_advantages(torch.tensor([0.3, 0.3, 0.3]), group_size=3, adv_clip_max=5.0)
    assert torch.equal(result.advantages, torch.zeros(3))


def test_equal_rewards_get_exactly_zero_not_their_rounding_blown_up():
    # DanceGRPO's bug: 12 × 0.3 has an fp32 mean ≠ 0.3, std ≈ 3e-8, and (r − mean)/(std + 1e-8) ≈ +0.72 for all.
    twelve = torch.full((12,), 0.3)
    assert torch.equal(group_advantages(twelve, 12, 5.0).advantages, torch.zeros(12))
    # Rounding-level spread (1 ulp) is flat too; a group beside it with a real spread is untouched.
    nearly = torch.tensor([0.3, 0.3, torch.nextafter(torch.tensor(0.3), torch.tensor(1.0)).item(), 0.3])
    result = group_advantages(torch.cat([nearly, torch.tensor([1.0, 2.0, 3.0, 4.0])]), 4, 5.0).advantages
    assert torch.equal(result[:4], torch.zeros(4))
    assert torch.allclose(result[4:], torch.tensor([-1.5, -0.5, 0.5, 1.5]) / 1.2909944, atol=1e-6)


def test_non_finite_rewards_are_excluded_from_their_group():
    rewards = torch.tensor([1.0, float("nan"), 3.0, 5.0, float("inf"), 7.0, float("nan"), 8.0])
    result = group_advantages(rewards, group_size=4, adv_clip_max=5.0)
    # Group 0: finite [1, 3, 5], mean 3, unbiased std = √((4+0+4)/2) = 2 → [−1, 0, 0, 1].
    # Group 1: [inf, 7, nan, 8] → finite [7, 8], mean 7.5, unbiased std = √0.5 = 0.70710678
    # → [0, −0.70710678, 0, 0.70710678].
    expected = torch.tensor([-1.0, 0.0, 0.0, 1.0, 0.0, -0.70710678, 0.0, 0.70710678])
    assert torch.allclose(result.advantages, expected, atol=1e-6)
    assert result.num_nonfinite == 3


def test_group_with_one_finite_reward_is_all_zero():
    result = group_advantages(torch.tensor([float("nan"), 2.0, 1.0, 3.0]), group_size=2, adv_clip_max=5.0)
    assert torch.allclose(result.advantages, torch.tensor([0.0, 0.0, -0.70710678, 0.70710678]), atol=1e-6)
    assert result.num_nonfinite == 1


# ---------------------------------------------------------------------------------------------- loss


def test_loss_unclipped_branch_at_ratio_one():
    # ρ = 1 everywhere: loss = mean(−A) = −(2 − 1)/2 = −0.5.
    zeros = torch.zeros(2)
    loss, stats = clipped_policy_loss(zeros, torch.tensor([2.0, -1.0]), 0.1)
    assert loss.item() == pytest.approx(-0.5)
    assert stats.ratio_mean.item() == 1.0 and stats.clip_fraction.item() == 0.0


def test_loss_clipped_branches():
    # ε = 0.1, ratios ρ = e^{±0.5} = 1.6487 / 0.6065, advantages ±1:
    # A=+1, ρ=1.6487: max(−1.6487, −1.1) = −1.1 (clipped: no credit beyond 1+ε)
    # A=−1, ρ=1.6487: max(1.6487, 1.1) = 1.6487 (unclipped: the pessimistic branch)
    # A=+1, ρ=0.6065: max(−0.6065, −0.9) = −0.6065 (unclipped)
    # A=−1, ρ=0.6065: max(0.6065, 0.9) = 0.9 (clipped)
    # mean = (−1.1 + 1.6487213 − 0.6065307 + 0.9)/4 = 0.2105477; all four ratios are outside [0.9, 1.1].
    new = torch.tensor([0.5, 0.5, -0.5, -0.5])
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, stats = clipped_policy_loss(new, advantages, 0.1)
    assert loss.item() == pytest.approx(0.2105477, abs=1e-6)
    assert stats.clip_fraction.item() == 1.0
    assert stats.ratio_max.item() == pytest.approx(math.exp(0.5))
    assert stats.ratio_min.item() == pytest.approx(math.exp(-0.5))
    assert stats.max_abs_log_ratio.item() == pytest.approx(0.5)


def test_loss_gradient_only_through_unclipped_samples():
    # At ρ = e^{0.5} with A = +1 the clipped branch wins: no gradient; with A = −1 the unclipped one does:
    # d/dnew of −A·e^{new−old} = −A·ρ = e^{0.5}, divided by M = 2.
    new = torch.tensor([0.5, 0.5], requires_grad=True)
    loss, _ = clipped_policy_loss(new, torch.tensor([1.0, -1.0]), 0.1)
    loss.backward()
    assert torch.allclose(new.grad, torch.tensor([0.0, math.exp(0.5) / 2]))


def test_summed_scaled_gradients_equal_gradient_of_mean_surrogate():
    # GA = 3 micro-batches × T_train = 4 steps, one backward each with scale 1/(GA·T_train), must accumulate
    # the gradient of the mean surrogate over all 12 (micro-batch, step) pairs.
    ga, t_train, batch = 3, 4, 2
    generator = torch.Generator().manual_seed(3)
    features = torch.randn(ga, t_train, batch, 5, generator=generator)
    old = torch.randn(ga, t_train, batch, generator=generator) * 0.01
    advantages = torch.randn(ga, batch, generator=generator)
    weights = torch.randn(5, generator=generator) * 0.01

    accumulated = weights.clone().requires_grad_(True)
    for g in range(ga):
        for k in range(t_train):
            log_ratio = features[g, k] @ accumulated - old[g, k]
            loss, _ = clipped_policy_loss(log_ratio, advantages[g], 1e-4)
            (loss * (1.0 / (ga * t_train))).backward()  # the update driver's scale

    direct = weights.clone().requires_grad_(True)
    surrogates = [
        clipped_policy_loss(features[g, k] @ direct - old[g, k], advantages[g], 1e-4)[0]
        for g in range(ga)
        for k in range(t_train)
    ]
    torch.stack(surrogates).mean().backward()
    assert torch.allclose(accumulated.grad, direct.grad, atol=1e-6)
    assert accumulated.grad.abs().sum() > 0


def test_finite_mean_std_leaves_non_finite_values_out_by_hand():
    from fluxgrpo.grpo.advantages import finite_mean_std

    values = torch.tensor([[1.0, 2.0, float("nan"), 4.0], [float("inf"), 3.0, float("nan"), float("-inf")]])
    stats = finite_mean_std(values, dim=1)
    # row 0: 1, 2, 4 → mean 7/3, unbiased variance ((4/3)² + (1/3)² + (5/3)²) / 2 = 7/3; row 1: one value, std 0
    assert stats.num_finite.tolist() == [3.0, 1.0]
    assert stats.mean.tolist() == pytest.approx([7 / 3, 3.0], abs=1e-6)
    assert stats.std.tolist() == pytest.approx([(7 / 3) ** 0.5, 0.0], abs=1e-6)
    assert finite_mean_std(values, dim=1, keepdim=True).mean.shape == (2, 1)
