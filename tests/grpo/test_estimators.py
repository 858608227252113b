"""V-GRPO, Neighbor GRPO and the (t, ε) draw options of nft/awm/vgrpo: hand-worked values, the authors' formulas,
bitwise neutrality of the defaults, and the options refused where an objective would ignore them."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from training_helpers import POOLED_DIM, TEXT_DIM, make_batch

from fluxgrpo.config import TrainConfig
from fluxgrpo.errors import UsageError
from fluxgrpo.grpo.latents import image_ids
from fluxgrpo.grpo.objectives.awm.loss import AwmObjective, AwmSettings, stratified_indices, trainable_range
from fluxgrpo.grpo.objectives.base import CURRENT_POLICY
from fluxgrpo.grpo.objectives.draws import group_bounds, indices_per_unit, linspace_strata, random_indices
from fluxgrpo.grpo.objectives.neighbor.loss import (
    NeighborObjective,
    NeighborSettings,
    leap_log_probs,
    neighbor_policy_loss,
    neighborhood_noise,
    quasi_norm_advantages,
)
from fluxgrpo.grpo.objectives.nft.loss import NftObjective, NftSettings
from fluxgrpo.grpo.objectives.vgrpo.loss import (
    VgrpoObjective,
    VgrpoSettings,
    self_normalized_surrogate,
    soft_clipped,
    tensor_split_strata,
    vgrpo_policy_loss,
)
from fluxgrpo.grpo.rollout import predict_velocity, sample_final_latents
from fluxgrpo.grpo.schedule import model_timesteps, sigma_schedule
from fluxgrpo.grpo.update import UpdatePass, UpdatePlumbing
from fluxgrpo.grpo.weight_copies import PolicyCopy

NUM_STEPS, GUIDANCE = 8, 3.5


@pytest.fixture(scope="module")
def transformer() -> nn.Module:
    from diffusers import FluxTransformer2DModel

    from fluxgrpo.models.tiny import TINY_TRANSFORMER_CONFIG

    torch.manual_seed(0)
    config = {**TINY_TRANSFORMER_CONFIG, "num_layers": 1, "num_single_layers": 1}
    return FluxTransformer2DModel(**{**config, "joint_attention_dim": TEXT_DIM, "pooled_projection_dim": POOLED_DIM})


def update_pass(objective, transformer, samples, cond, advantages, micro_batch_size, grad_accum_steps, seed):
    """The update driver's pass (``step(m, k)`` is one scaled loss step, as the update takes it)."""
    return UpdatePass(
        transformer, objective, samples, cond, advantages, UpdatePlumbing(micro_batch_size, grad_accum_steps, 1.0),
        device_type="cpu", generator_cpu=torch.Generator().manual_seed(seed),
    )  # fmt: skip


def rollout_of(transformer: nn.Module, rows: int, keep_path: bool = False, seed: int = 0):
    cond, noise = make_batch(rows, seed=seed)
    samples = sample_final_latents(
        transformer, cond, noise, sigma_schedule(NUM_STEPS, 3.0), guidance=GUIDANCE, rollout_batch_size=2,
        img_ids=image_ids(64, 64), device_type="cpu", keep_path=keep_path,
    )  # fmt: skip
    return cond, noise, samples


# --- the draws: the defaults are today's bitwise -----------------------------------------------------------------


def test_nft_and_awm_default_draws_are_the_previous_code_bitwise(transformer):
    cond, _, samples = rollout_of(transformer, 4)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    nft = NftObjective(NftSettings(num_train_timesteps=3), PolicyCopy(transformer))
    work = update_pass(nft, transformer, samples, cond, advantages, 2, 2, seed=5).work
    # The code before the options: a permutation per sample, then the noise, from one generator.
    generator = torch.Generator().manual_seed(5)
    indices = torch.stack([torch.randperm(NUM_STEPS, generator=generator)[:3] for _ in range(4)])
    noise = torch.randn((4, 3, 16, 64), generator=generator, dtype=torch.float32)
    assert torch.equal(work.train_timestep_indices, indices) and torch.equal(work.batch.noise, noise)

    awm = AwmObjective(AwmSettings(num_train_timesteps=3))
    work = update_pass(awm, transformer, samples, cond, advantages, 2, 2, seed=6).work
    generator = torch.Generator().manual_seed(6)
    grid = range(1, int(NUM_STEPS * 0.9))
    rows = []
    for _ in range(2):  # one stratified draw per micro-batch of 2
        bounds = torch.linspace(grid.start, grid.stop, 4).long()
        u = torch.rand(3, generator=generator)
        rows.append((bounds[:-1] + torch.floor(u * (bounds[1:] - bounds[:-1])).long()).expand(2, -1))
    noise = torch.randn((4, 3, 16, 64), generator=generator, dtype=torch.float32)
    assert torch.equal(work.train_timestep_indices, torch.cat(rows)) and torch.equal(work.batch.noise, noise)


def test_group_shared_draws_are_one_set_per_group(transformer):
    cond, _, samples = rollout_of(transformer, 4)
    settings = NftSettings(num_train_timesteps=3, sharing="group", timestep_rule="stratified", group_size=2)
    nft = NftObjective(settings, PolicyCopy(transformer))
    work = update_pass(nft, transformer, samples, cond, torch.ones(4), 1, 4, seed=1).work
    indices, noise = work.train_timestep_indices, work.batch.noise
    for first in (0, 2):  # within a group: the same (t, ε)
        assert torch.equal(indices[first], indices[first + 1]) and torch.equal(noise[first], noise[first + 1])
    assert not torch.equal(noise[0], noise[2])
    for row in indices:  # stratified over the N timesteps: one per stratum of linspace(0, 8, 4) = 0, 2, 5, 8
        assert 0 <= row[0] < 2 <= row[1] < 5 <= row[2] < 8


def test_stratified_and_random_rules_cover_their_grids():
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([linspace_strata(range(0, 10), 4, generator) for _ in range(300)])
    assert set(draws[:, 0].tolist()) == {0, 1} and set(draws[:, 3].tolist()) == {7, 8, 9}  # b = 0, 2, 5, 7, 10
    assert torch.equal(draws[:, 0], draws[:, 0].clamp(0, 1))
    picks = torch.stack([random_indices(range(3, 9), 4, generator) for _ in range(100)])
    assert all(len(set(row.tolist())) == 4 for row in picks) and picks.min() == 3 and picks.max() == 8
    units = group_bounds(6, 3)
    assert units == [(0, 3), (3, 6)]
    shared = indices_per_unit(units, random_indices, range(8), 2, generator)
    assert shared.shape == (6, 2) and torch.equal(shared[0], shared[2]) and torch.equal(shared[3], shared[5])


def test_awm_time_types_are_the_authors_ranges():
    assert trainable_range(14, "discrete_wo_init") == range(1, 12)
    assert trainable_range(14, "discrete") == range(0, 12)  # the PickScore config includes σ = 1
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([stratified_indices(14, 6, generator, "discrete") for _ in range(200)])
    assert draws.min() == 0 and draws.max() == 11  # linspace(0, 12, 7) = 0, 2, 4, …: stratum 0 is {0, 1}
    assert TrainConfig(objective="awm", sampling_steps=14, awm_time_type="discrete").trainable_timesteps == 12
    assert TrainConfig(objective="awm", sampling_steps=14).trainable_timesteps == 11


def test_fm_timesteps_sets_the_trained_count_and_zero_keeps_the_fraction():
    assert TrainConfig(objective="nft", sampling_steps=10, timestep_fraction=0.99).train_timesteps == 9
    assert TrainConfig(objective="nft", sampling_steps=10, fm_timesteps=2).train_timesteps == 2
    assert TrainConfig(objective="awm", sampling_steps=14, fm_timesteps=4).train_timesteps == 4
    assert TrainConfig(objective="vgrpo", sampling_steps=16).train_timesteps == 4  # N_MC
    assert TrainConfig(objective="nft").flow_matching_draws == ("sample", "random")
    assert TrainConfig(objective="awm").flow_matching_draws == ("sample", "stratified")
    assert TrainConfig(objective="vgrpo").flow_matching_draws == ("group", "stratified")


# --- V-GRPO -------------------------------------------------------------------------------------------------------


def test_vgrpo_surrogate_and_its_gradient_by_hand():
    x0 = torch.zeros(1, 3)
    prediction = torch.tensor([[1.0, -2.0, 3.0]], requires_grad=True)
    surrogate = self_normalized_surrogate(prediction, x0)
    # −mean(e²)/mean|e| = −(14/3)/2
    assert torch.allclose(surrogate, torch.tensor([-7.0 / 3.0]))
    surrogate.sum().backward()  # the weight is stop-gradient: d/de = −2e/(D·w) = −e/3
    assert prediction.grad is not None
    assert torch.allclose(prediction.grad, -torch.tensor([[1.0, -2.0, 3.0]]) / 3.0)


def test_vgrpo_policy_loss_clips_the_ratio_of_the_mean_surrogate():
    log_prob, old = torch.tensor([-1.0, -2.0]), torch.tensor([-1.1, -1.9])
    advantages = torch.tensor([1.0, -1.0])
    loss, ratio = vgrpo_policy_loss(log_prob, old, advantages, clip_range=0.05)
    assert torch.allclose(ratio, torch.tensor([math.exp(0.1), math.exp(-0.1)]))
    # A > 0, ρ = 1.105 > 1.05: the clipped −1.05; A < 0, ρ = 0.905 < 0.95: max(0.905, 0.95) = 0.95
    assert torch.allclose(loss, torch.tensor([-1.05, 0.95]))
    assert torch.allclose(soft_clipped(torch.tensor([3.0, -30.0, 0.1]), 3.0),
                          torch.tensor([3 * math.tanh(1.0), -3 * math.tanh(10.0), 3 * math.tanh(0.1 / 3)]))  # fmt: skip
    assert torch.equal(soft_clipped(torch.tensor([7.0]), 0.0), torch.tensor([7.0]))


def test_vgrpo_strata_are_the_authors_tensor_split():
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([tensor_split_strata(range(0, 10), 4, generator) for _ in range(300)])
    # tensor_split(0…9, 4) = [0,1,2], [3,4,5], [6,7], [8,9]
    for column, allowed in enumerate(({0, 1, 2}, {3, 4, 5}, {6, 7}, {8, 9})):
        assert set(draws[:, column].tolist()) == allowed


def authors_vgrpo_loss(transformer, samples, cond, indices, noise, advantages, old_surrogates, clip):
    """V-GRPO's loss as the authors' FastVideo code computes it (``calc_surrogate`` with self_normalize on the
    sample repeated N_MC times, the ratio of the means over the pairs, PPO clip), read from its published listing."""
    count = indices.shape[1]
    sigmas = samples.sigmas[indices].flatten(0, 1)
    latents = samples.final_x0.repeat_interleave(count, dim=0)
    flat_noise = noise.flatten(0, 1)
    s = sigmas.reshape(-1, 1, 1)
    noisy = (1.0 - s) * latents + s * flat_noise
    rows = cond.num_rows
    model_pred = predict_velocity(
        transformer, noisy, cond.repeat_interleave(count), model_timesteps(sigmas),
        torch.full((rows * count,), GUIDANCE), samples.img_ids, "cpu",
    )  # fmt: skip
    x0_pred = noisy - s * model_pred
    surrogate = -torch.mean(((x0_pred.float() - latents.float()) ** 2).reshape(rows * count, -1), dim=1)
    surrogate = surrogate / torch.mean(
        torch.abs((x0_pred.detach().float() - latents.float()).reshape(rows * count, -1)), dim=1
    )
    new = surrogate.view(rows, count)
    ratio = torch.exp(new.mean(dim=1) - old_surrogates.mean(dim=1))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip, 1 + clip)
    return torch.mean(torch.maximum(unclipped, clipped)), new


def test_vgrpo_loss_is_the_authors_on_and_off_policy(transformer):
    cond, _, samples = rollout_of(transformer, 4)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    objective = VgrpoObjective(VgrpoSettings(num_mc=3, group_size=2, clip_range=0.01))
    update = update_pass(objective, transformer, samples, cond, advantages, 4, 1, seed=2)
    work = update.work
    indices, noise = work.train_timestep_indices, work.batch.noise
    assert torch.equal(indices[0], indices[1]) and torch.equal(noise[2], noise[3])  # group-shared by default
    for column in range(3):  # tensor_split(0…7, 3) = [0,1,2], [3,4,5], [6,7]
        assert indices[:, column].min() >= (0, 3, 6)[column] and indices[:, column].max() <= (2, 5, 7)[column]
    step = update.step(0, 0)  # one micro-batch, GA 1: the loss scale 1/(GA·slots) is 1
    with torch.no_grad():
        _, on_policy = authors_vgrpo_loss(transformer, samples, cond, indices, noise, advantages,
                                          torch.zeros(4, 3), 0.01)  # fmt: skip
    expected, _ = authors_vgrpo_loss(transformer, samples, cond, indices, noise, advantages, on_policy, 0.01)
    assert torch.allclose(step.loss, expected, atol=1e-6) and torch.allclose(step.loss, -advantages.mean())
    # Off-policy (two micro-batches, GA 1: the second comes after an optimizer step): the old surrogates are the
    # pre-update weights' (the driver's precomputed forward), the current ones a moved policy's.
    policy = copy.deepcopy(transformer)
    off = update_pass(objective, policy, samples, cond, advantages, 2, 1, seed=2)
    assert CURRENT_POLICY in off.precomputed
    moved = nudge_in_place(policy)
    got = off.step(1, 0)
    rows = slice(2, 4)
    part, part_cond = rows_of(samples, rows), cond.rows(2, 4)
    part_indices, part_noise = off.work.train_timestep_indices[rows], off.work.batch.noise[rows]
    with torch.no_grad():
        _, old = authors_vgrpo_loss(transformer, part, part_cond, part_indices, part_noise, advantages[rows],
                                    torch.zeros(2, 3), 0.01)  # fmt: skip
    expected, _ = authors_vgrpo_loss(moved, part, part_cond, part_indices, part_noise, advantages[rows], old, 0.01)
    assert torch.allclose(got.loss, expected, atol=1e-6) and got.metrics["ratio_max"] != 1.0


def nudge_in_place(module: nn.Module, scale: float = 0.05) -> nn.Module:
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
    return module


def rows_of(samples, rows: slice):
    import dataclasses

    return dataclasses.replace(samples, final_x0=samples.final_x0[rows])


# --- Neighbor GRPO ------------------------------------------------------------------------------------------------


def test_neighborhood_noise_and_quasi_norm_by_hand():
    base, deltas = torch.tensor([[1.0]]), torch.tensor([[0.0], [2.0]])
    assert torch.allclose(neighborhood_noise(base, deltas, 0.6), torch.tensor([[0.8], [2.0]]))  # √0.64 = 0.8
    advantages = torch.tensor([1.0, -1.0, 2.0, -2.0, 0.0, 0.0, 0.0, 0.0])
    assert torch.allclose(quasi_norm_advantages(advantages, 4, 1.0)[:4], advantages[:4] / 6.0)
    assert torch.allclose(quasi_norm_advantages(advantages, 4, 2.0)[:4], advantages[:4] / math.sqrt(10.0))
    p = 0.8  # (Σ|A|^p)^(1/p) = (2 + 2·2^0.8)^(1.25)
    assert torch.allclose(quasi_norm_advantages(advantages, 4, p)[:4], advantages[:4] / (2 + 2 * 2**p) ** (1 / p))
    assert torch.equal(quasi_norm_advantages(advantages, 4, p)[4:], torch.zeros(4))  # a flat group: no signal


def test_leaping_policy_and_its_gradient_pull_towards_the_good_candidates():
    candidates = torch.tensor([[[0.0], [1.0], [3.0]]])  # [m=1, G=3, 1]
    prediction = torch.tensor([[1.0]], requires_grad=True)
    log_probs = leap_log_probs(candidates, prediction, temperature=2.0)
    logits = torch.tensor([-1.0, 0.0, -4.0]) / 2.0  # −‖x_i − x_θ‖²/τ
    assert torch.allclose(log_probs[0], torch.log_softmax(logits, dim=0))
    advantages = torch.tensor([[-1.0, 0.0, 1.0]])
    (advantages * log_probs).sum().backward()
    # ∇ Σ_i A_i log π_i = (2/τ)·Σ_i A_i (x_i − E_π[x]) = Σ_i A_i x_i (τ = 2, Σ A = 0): +3, towards candidate 2
    assert prediction.grad is not None and torch.allclose(prediction.grad, torch.tensor([[3.0]]))
    loss, ratio = neighbor_policy_loss(log_probs.detach(), log_probs.detach() - 0.1, advantages, clip_range=0.05)
    assert torch.allclose(ratio, torch.full((1, 3), math.exp(0.1)))  # A·clip: −1.05 for A = 1, ρ for A = −1
    assert torch.allclose(loss, torch.tensor([(math.exp(0.1) + 0 - 1.05) / 3]))


def test_neighbor_path_rollout_keeps_the_grid_and_changes_nothing_else(transformer):
    _, noise, plain = rollout_of(transformer, 4)
    _, _, kept = rollout_of(transformer, 4, keep_path=True)
    assert plain.path is None and kept.path is not None and kept.path.shape == (4, NUM_STEPS + 1, 16, 64)
    assert torch.equal(kept.final_x0, plain.final_x0) and torch.equal(kept.path[:, -1], kept.final_x0)
    assert torch.equal(kept.path[:, 0], noise)


def test_neighbor_work_trains_anchors_against_their_group(transformer):
    cond, _, samples = rollout_of(transformer, 4, keep_path=True)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    settings = NeighborSettings(num_train_timesteps=2, num_anchors=1, group_size=2, clip_range=0.01)
    update = update_pass(NeighborObjective(settings), transformer, samples, cond, advantages, 1, 1, seed=4)
    work = update.work
    assert update.layout.num_micro_batches == 2  # the micro-batches cut the 2 anchors, not the 4 trajectories
    assert work.anchor_rows.tolist()[0] in (0, 1) and work.anchor_rows.tolist()[1] in (2, 3)
    assert CURRENT_POLICY in update.precomputed  # GA 1: the second anchor's step is off-policy
    first = update.step(0, 0)  # on-policy: ρ = 1
    assert first.metrics["ratio_min"] == 1.0 and first.metrics["ratio_max"] == 1.0
    # By hand for anchor k at transition j: one Euler step of the module, softmax over the group's next latents.
    k, j = int(work.anchor_rows[0]), int(work.train_timestep_indices[0, 0])
    sigmas = samples.sigmas
    x = samples.path[k, j].unsqueeze(0)
    with torch.no_grad():
        v = predict_velocity(transformer, x, cond.rows(k, k + 1), model_timesteps(sigmas[j : j + 1]),
                             torch.full((1,), GUIDANCE), samples.img_ids, "cpu")  # fmt: skip
    x_theta = x + (sigmas[j + 1] - sigmas[j]) * v
    distances = ((samples.path[0:2, j + 1] - x_theta) ** 2).sum(dim=(1, 2))
    old = work._log_probs(update.precomputed[CURRENT_POLICY][0][0], 0, 1, 0)
    assert torch.allclose(old[0], torch.log_softmax(-distances, dim=0), atol=1e-5)


# --- options refused where an objective ignores them ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "flag"),
    [
        ({"objective": "grpo", "fm_draws": "group"}, "--fm-draws"),
        ({"objective": "neighbor", "fm_timestep_rule": "stratified"}, "--fm-timestep-rule"),
        ({"objective": "vgrpo", "fm_timesteps": 2}, "--fm-timesteps"),
        ({"objective": "nft", "awm_time_type": "discrete"}, "--awm-time-type"),
        ({"objective": "awm", "vgrpo_mc_samples": 2}, "--vgrpo-mc-samples"),
        ({"objective": "vgrpo", "vgrpo_mc_samples": 0}, "--vgrpo-mc-samples"),
        ({"objective": "vgrpo", "clip_range": 0.0}, "--clip-range"),
        ({"objective": "neighbor", "clip_range": -1e-3}, "--clip-range"),
        ({"objective": "grpo", "neighbor_sigma": 0.5}, "--neighbor-sigma"),
        ({"objective": "neighbor", "neighbor_anchors": 13}, "--neighbor-anchors"),
        ({"objective": "neighbor", "neighbor_quasi_norm_p": 3.0}, "--neighbor-quasi-norm-p"),
        ({"objective": "nft", "fm_timesteps": 20, "sampling_steps": 10}, "--fm-timesteps"),
        ({"objective": "awm", "fm_draws": "per-batch"}, "--fm-draws"),
        ({"objective": "neighbor", "neighbor_anchors": 3, "train_micro_batch_size": 2}, "--train-micro-batch-size"),
    ],
)
def test_bad_combinations_are_refused_naming_the_flag(options, flag):
    problems = TrainConfig(**options).problems()
    assert any(problem.startswith(flag) for problem in problems), problems
    assert all("\n" not in problem for problem in problems)
    with pytest.raises(UsageError, match=flag):
        TrainConfig(**options).validate()


def test_the_new_objectives_defaults_validate():
    for objective in ("vgrpo", "neighbor"):
        assert TrainConfig(objective=objective).problems() == []


def test_memory_counts_vgrpo_batched_pairs_and_neighbor_paths():
    from fluxgrpo.bench.models import FLUX_DEV_TRANSFORMER_CONFIG
    from fluxgrpo.config import build_config
    from fluxgrpo.training.memory import RunShape, VaeShape, estimate, transformer_shape

    model = transformer_shape(FLUX_DEV_TRANSFORMER_CONFIG)

    def update_phase(**options) -> dict[str, int]:
        cfg = build_config("a3-16die", options)
        return estimate(model, VaeShape(0, 0), RunShape.from_config(cfg, 16)).phases["update"]

    one, four = update_phase(objective="vgrpo", vgrpo_mc_samples=1), update_phase(objective="vgrpo")
    assert four["activations"] == 4 * one["activations"] > 0  # the N_MC pairs are one batched forward
    assert four["objective latents"] == 4 * one["objective latents"] > 0  # a noise per pair
    assert update_phase(objective="neighbor")["objective latents"] == 0  # its paths are the rollout's latents
    cfg = build_config("a3-16die", {"objective": "neighbor"})
    derived = cfg.derived(16)  # 1 prompt × 4 of its 12 candidates as anchors, K = int(15·0.6) = 9 transitions each
    assert derived["train_forward_backward_per_rank"] == 4 * 9 and derived["micro_batches_per_iteration"] == 4
