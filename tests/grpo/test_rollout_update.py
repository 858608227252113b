"""Rollout and policy update on a tiny random FluxTransformer2DModel (CPU, fp32, 64×64 → 16 tokens)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from training_helpers import POOLED_DIM, TEXT_DIM, grpo_update, make_batch, sde_rollout

from fluxgrpo.grpo.advantages import group_advantages
from fluxgrpo.grpo.latents import image_ids
from fluxgrpo.grpo.rollout import predict_velocity
from fluxgrpo.grpo.samplers import dance_step
from fluxgrpo.grpo.schedule import model_timesteps, sigma_schedule

NUM_STEPS = 6  # N
NUM_TRAIN = 3  # T_train = int(5·0.6), DanceGRPO's fraction 0.6
ETA, GUIDANCE = 0.3, 3.5


@pytest.fixture(scope="module")
def base_transformer() -> nn.Module:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    from fluxgrpo.models.tiny import TINY_TRANSFORMER_CONFIG

    return FluxTransformer2DModel(
        **{
            **TINY_TRANSFORMER_CONFIG,
            "num_layers": 1,
            "num_single_layers": 1,
            "joint_attention_dim": TEXT_DIM,
            "pooled_projection_dim": POOLED_DIM,
        }
    )


def rollout_of(transformer, cond, noise, rollout_batch_size=2, seed=1):
    return sde_rollout(
        transformer,
        cond,
        noise,
        sigma_schedule(NUM_STEPS, 3.0),
        eta=ETA,
        guidance=GUIDANCE,
        img_ids=image_ids(64, 64),
        rollout_batch_size=rollout_batch_size,
        device_type="cpu",
        generator=torch.Generator().manual_seed(seed),
    )


class CountingScheduler:
    def __init__(self) -> None:
        self.steps = 0

    def step(self) -> None:
        self.steps += 1


def update_of(transformer, rollout, cond, advantages, *, micro_batch_size=1, grad_accum_steps=2, seed=2, **extra):
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=1e-3, weight_decay=0.0)
    scheduler = CountingScheduler()
    values = {"num_train_timesteps": NUM_TRAIN, "clip_range": 1e-4, "max_grad_norm": 1.0, **extra}
    stats = grpo_update(
        transformer,
        rollout,
        cond,
        advantages,
        optimizer,
        scheduler,
        micro_batch_size=micro_batch_size,
        grad_accum_steps=grad_accum_steps,
        **values,
        device_type="cpu",
        generator_cpu=torch.Generator().manual_seed(seed),
    )
    return stats, scheduler


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: parameter.detach().clone() for name, parameter in module.named_parameters()}


# ---------------------------------------------------------------------------------------------- rollout


def test_rollout_shapes_and_stored_values(base_transformer):
    transformer = copy.deepcopy(base_transformer)
    cond, noise = make_batch(3)
    rollout = rollout_of(transformer, cond, noise)
    assert rollout.latents.shape == (3, NUM_STEPS + 1, 16, 64) and rollout.latents.dtype == torch.float32
    assert rollout.log_probs.shape == (3, NUM_STEPS) and rollout.final_x0.shape == (3, 16, 64)
    assert torch.equal(rollout.latents[:, 0], noise)
    assert torch.isfinite(rollout.latents).all() and torch.isfinite(rollout.log_probs).all()

    # Step 0 redone by hand: z_1 = μ_0 + std_0·ξ_0, with ξ_0 the generator's first [B, L, C] draw, and
    # the stored log-prob is that step's; x̂0 of step N−1 is what the VAE will decode.
    sigmas, fed = rollout.sigmas, model_timesteps(rollout.sigmas)
    xi_0 = torch.randn(3, 16, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        v_0 = predict_velocity(transformer, noise, cond, fed[0].expand(3), torch.full((3,), GUIDANCE),
                               rollout.img_ids, "cpu")  # fmt: skip
        redone = dance_step(noise, v_0, sigmas[0], sigmas[1], ETA, noise=xi_0)
        last = NUM_STEPS - 1
        v_last = predict_velocity(transformer, rollout.latents[:, last], cond, fed[last].expand(3),
                                  torch.full((3,), GUIDANCE), rollout.img_ids, "cpu")  # fmt: skip
    assert torch.allclose(rollout.latents[:, 1], redone.prev_sample, atol=1e-5)
    assert torch.allclose(rollout.log_probs[:, 0], redone.log_prob, atol=1e-5)
    assert torch.allclose(rollout.final_x0, rollout.latents[:, last] - sigmas[last] * v_last, atol=1e-5)


def test_rollout_is_reproducible_and_independent_of_chunking(base_transformer):
    transformer = copy.deepcopy(base_transformer)
    cond, noise = make_batch(4)
    whole = rollout_of(transformer, cond, noise, rollout_batch_size=4)
    again = rollout_of(transformer, cond, noise, rollout_batch_size=4)
    singles = rollout_of(transformer, cond, noise, rollout_batch_size=1)
    other_seed = rollout_of(transformer, cond, noise, rollout_batch_size=4, seed=7)
    assert torch.equal(whole.latents, again.latents)
    assert torch.allclose(whole.latents, singles.latents, atol=1e-5)
    assert torch.allclose(whole.log_probs, singles.log_probs, atol=1e-5)
    assert not torch.allclose(whole.latents[:, 1:], other_seed.latents[:, 1:], atol=1e-3)
    assert transformer.training == base_transformer.training  # the module's mode is restored


# ---------------------------------------------------------------------------------------------- update


@pytest.mark.parametrize(("rollout_batch_size", "micro_batch_size"), [(4, 1), (4, 4), (1, 1), (2, 2)])
def test_ratio_is_one_before_the_first_optimizer_step(base_transformer, rollout_batch_size, micro_batch_size):
    transformer = copy.deepcopy(base_transformer)
    cond, noise = make_batch(4)
    rollout = rollout_of(transformer, cond, noise, rollout_batch_size=rollout_batch_size)
    stats, _ = update_of(transformer, rollout, cond, torch.tensor([1.0, -1.0, 0.5, -0.5]),
                         micro_batch_size=micro_batch_size, grad_accum_steps=8)  # fmt: skip
    assert stats.first_microbatch_max_abs_log_ratio.item() < 1e-5
    # GA = 8 covers every micro-batch, so all ratios are taken before the (single) optimizer step.
    assert stats.optimizer_steps == 1
    assert abs(stats.ratio_max.item() - 1) < 1e-5 and abs(stats.ratio_min.item() - 1) < 1e-5
    assert stats.clip_fraction.item() == 0.0


def test_every_trainable_parameter_changes(base_transformer):
    transformer = copy.deepcopy(base_transformer)
    cond, noise = make_batch(4)
    rollout = rollout_of(transformer, cond, noise)
    before = snapshot(transformer)
    stats, scheduler = update_of(transformer, rollout, cond, torch.tensor([1.0, -1.0, 0.5, -0.5]))
    unchanged = [name for name, parameter in transformer.named_parameters() if torch.equal(parameter, before[name])]
    assert unchanged == []
    assert stats.optimizer_steps == 2 and scheduler.steps == 2 and stats.skipped_steps == 0
    assert torch.isfinite(stats.grad_norms).all() and (stats.grad_norms > 0).all()
    assert all(parameter.grad is None for parameter in transformer.parameters())


def test_leftover_gradients_are_stepped(base_transformer):
    # B = 5 micro-batches of 1, GA = 2: boundaries after micro-batches 2 and 4, then the leftover 5th.
    transformer = copy.deepcopy(base_transformer)
    cond, noise = make_batch(5)
    rollout = rollout_of(transformer, cond, noise)
    stats, scheduler = update_of(transformer, rollout, cond, torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0]))
    assert stats.optimizer_steps == 3 and scheduler.steps == 3 and stats.num_microbatches == 5
    assert stats.grad_norms.shape == (3,) and torch.isfinite(stats.grad_norms).all()


def test_fewer_trajectories_than_accumulation_steps_still_steps(base_transformer):
    transformer = copy.deepcopy(base_transformer)
    cond, noise = make_batch(1)
    rollout = rollout_of(transformer, cond, noise)
    before = snapshot(transformer)
    stats, _ = update_of(transformer, rollout, cond, torch.tensor([1.5]), grad_accum_steps=4)
    assert stats.optimizer_steps == 1
    assert any(not torch.equal(parameter, before[name]) for name, parameter in transformer.named_parameters())


def test_non_finite_loss_skips_the_step_and_keeps_weights(base_transformer):
    transformer = copy.deepcopy(base_transformer)
    cond, noise = make_batch(2)
    rollout = rollout_of(transformer, cond, noise)
    before = snapshot(transformer)
    stats, scheduler = update_of(transformer, rollout, cond, torch.tensor([float("nan"), 1.0]))
    assert stats.skipped_steps == 1 and stats.optimizer_steps == 0
    assert scheduler.steps == 0
    assert not torch.isfinite(stats.grad_norms).any()
    for name, parameter in transformer.named_parameters():
        assert torch.equal(parameter, before[name]), name
    assert all(parameter.grad is None for parameter in transformer.parameters())


def test_only_the_poisoned_window_is_skipped(base_transformer):
    transformer = copy.deepcopy(base_transformer)
    cond, noise = make_batch(4)
    rollout = rollout_of(transformer, cond, noise)
    before = snapshot(transformer)
    stats, scheduler = update_of(transformer, rollout, cond, torch.tensor([1.0, float("nan"), -1.0, 0.5]))
    assert (~torch.isfinite(stats.grad_norms)).tolist() == [True, False]  # the first boundary was skipped
    assert stats.optimizer_steps == 1 and stats.skipped_steps == 1 and scheduler.steps == 1
    assert all(torch.isfinite(parameter).all() for parameter in transformer.parameters())
    assert any(not torch.equal(parameter, before[name]) for name, parameter in transformer.named_parameters())


def test_non_finite_reward_trains_with_zero_advantage(base_transformer):
    transformer = copy.deepcopy(base_transformer)
    cond, noise = make_batch(4)
    rollout = rollout_of(transformer, cond, noise)
    rewards = torch.tensor([0.3, float("nan"), 0.2, 0.4])
    advantages = group_advantages(rewards, group_size=2, adv_clip_max=5.0)
    assert advantages.num_nonfinite == 1 and torch.isfinite(advantages.advantages).all()
    stats, _ = update_of(transformer, rollout, cond, advantages.advantages)
    assert stats.skipped_steps == 0 and stats.optimizer_steps == 2
    assert all(torch.isfinite(parameter).all() for parameter in transformer.parameters())


class TimestepSpy(nn.Module):
    """Delegates to a transformer and records the timesteps each forward was fed."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.fed: list[torch.Tensor] = []

    def forward(self, **kwargs):
        self.fed.append(kwargs["timestep"].detach().clone())
        return self.inner(**kwargs)


def test_each_trajectory_trains_on_its_own_random_timesteps(base_transformer):
    cond, noise = make_batch(6)
    spy = TimestepSpy(copy.deepcopy(base_transformer))
    rollout = rollout_of(spy, cond, noise)
    spy.fed.clear()
    stats, _ = update_of(spy, rollout, cond, torch.linspace(-1, 1, 6), micro_batch_size=2, grad_accum_steps=1)

    indices = stats.train_timestep_indices
    num_train = 3  # int((6−1)·0.6)
    assert indices.shape == (6, num_train)
    generator = torch.Generator().manual_seed(2)
    expected = torch.stack([torch.randperm(NUM_STEPS - 1, generator=generator)[:num_train] for _ in range(6)])
    assert torch.equal(indices, expected)  # drawn per trajectory, in order, from generator_cpu
    for row in indices:
        assert len(set(row.tolist())) == num_train and row.min() >= 0 and row.max() <= NUM_STEPS - 2
    assert len({tuple(row.tolist()) for row in indices}) > 1

    # Micro-batch of trajectories (0, 1), step k feeds [t(idx[0, k]), t(idx[1, k])]: per-sample timesteps.
    fed_table = model_timesteps(rollout.sigmas)
    assert len(spy.fed) == 3 * num_train
    for micro, start in enumerate(range(0, 6, 2)):
        for k in range(num_train):
            assert torch.equal(spy.fed[micro * num_train + k], fed_table[indices[start : start + 2, k]])


def test_impossible_sizes_are_programming_errors(base_transformer):
    # The user-facing checks (naming the flag) are TrainConfig's; the stages only refuse what cannot run.
    cond, noise = make_batch(2)
    with pytest.raises(ValueError, match="rollout_batch_size"):
        rollout_of(base_transformer, cond, noise, rollout_batch_size=0)
    rollout = rollout_of(copy.deepcopy(base_transformer), cond, noise)
    with pytest.raises(ValueError, match="cannot train 6 timesteps"):
        update_of(copy.deepcopy(base_transformer), rollout, cond, torch.zeros(2), num_train_timesteps=6)
