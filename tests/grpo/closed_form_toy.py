"""A toy flow whose RL optimum is known in closed form, trained through the loop's own stages.

The world: latents [B, L = 1 token, C = 2], data p = a two-component Gaussian mixture in the plane (equal weights,
means (−2, 0) and (+2, 0), std 0.5 per coordinate). The "transformer" (``MixtureFlow``) has FluxTransformer2DModel's
forward signature and returns the *exact* rectified-flow velocity of a mixture with its own parameters (FLUX's
convention x_σ = (1−σ)·x0 + σ·ε, v = ε − x0):

    v(x, σ) = (x − E[x0 | x_σ = x]) / σ,
    E[x0 | x_σ] = Σ_k γ_k(x) · (m_k + a_k·(x − (1−σ)·m_k)),   a_k = (1−σ)·s_k² / ((1−σ)²·s_k² + σ²)   (per coordinate)
    γ_k(x) ∝ π_k · N(x; (1−σ)·m_k, (1−σ)²·s_k² + σ²)                                  (the component responsibilities)

Its trainable parameters are the mixture's logits, means and log-stds, so every mixture, the tilt below included, is
representable: the toy is never "stiff".

The reward is r(x̂0) = 1[x̂0₀ > 0] on the rollout's decoded sample (the first coordinate). The KL-regularised optimum
is the tilt p·e^{r/β}/Z: both components keep their shapes (a component's mass beyond 0 is Φ(−4) ≈ 3·10⁻⁵, so the
cut changes nothing measurable) and the right one's weight becomes e^{1/β}/(1 + e^{1/β}). None of the shipped
objectives has a sequence-level KL unless ``--kl-beta`` > 0 (and none here sets it), so their optimum is the β → 0
limit: all the mass on the right component, its mean (2, 0) and std 0.5 unchanged.

``train_toy`` mirrors the middle of ``training/loop.py`` (rollout → reward → advantages → update) with the product's
own functions: ``iteration_randomness``, ``plan_for_iteration``, ``rollout_stage``, ``aggregate_rewards``,
``update_stage`` (so ``run_update`` and the objective's ``finish``), the objective from ``build_objective`` over policy
copies built as ``training.parts`` builds them, ``rollout_settings``, ``update_plumbing``, ``sigma_schedule``. The
toy's own parts: the prompts (one dummy token), the initial noise (drawn in the toy's shape with the loop's
generator, as ``stages.initial_noise`` draws it), the reward (a threshold on the decoded latent, not a VAE and a
scorer) and the optimizer: plain SGD by default (``test_closed_form_optimum``'s docstring says why), the run's AdamW
with ``optimizer="adamw"``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fluxgrpo.config import TrainConfig
from fluxgrpo.grpo.advantages import aggregate_rewards
from fluxgrpo.grpo.latents import image_ids
from fluxgrpo.grpo.objectives.neighbor.loss import neighborhood_noise
from fluxgrpo.grpo.rollout import sample_final_latents
from fluxgrpo.grpo.schedule import plan_for_iteration, sigma_schedule
from fluxgrpo.grpo.types import Conditioning
from fluxgrpo.grpo.weight_copies import FrozenReference, PolicyCopy
from fluxgrpo.training.loop import iteration_randomness
from fluxgrpo.training.settings import (
    build_objective,
    plan_settings,
    policy_copy_names,
    rollout_settings,
    update_plumbing,
)
from fluxgrpo.training.stages import RolloutDraws, rollout_stage, update_stage

MEANS = ((-2.0, 0.0), (2.0, 0.0))  # component 1 (x₀ > 0) is the rewarded one
STD = 0.5
CHANNELS = 2
RIGHT = 1


class MixtureFlow(nn.Module):
    """The exact rectified-flow velocity of a Gaussian mixture, behind FluxTransformer2DModel's forward."""

    def __init__(self, means=MEANS, std: float = STD) -> None:
        super().__init__()
        means_t = torch.tensor(means, dtype=torch.float32)  # [K, C]
        self.logits = nn.Parameter(torch.zeros(means_t.shape[0]))
        self.means = nn.Parameter(means_t.clone())
        self.log_stds = nn.Parameter(torch.full_like(means_t, math.log(std)))

    def weights(self) -> torch.Tensor:
        return torch.softmax(self.logits.detach(), dim=0)

    def posterior_mean(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """E[x0 | x_σ = x] for x [b, L, C] and σ [b]."""
        sigma = sigma.to(x.dtype).reshape(-1, 1, 1, 1)  # [b, 1, 1, 1] against [b, L, K, C]
        alpha = 1 - sigma
        means, variances = self.means, torch.exp(2 * self.log_stds)  # [K, C]
        marginal = alpha**2 * variances + sigma**2  # Var[x_σ | k], [b, 1, K, C]
        centred = x.unsqueeze(2) - alpha * means  # [b, L, K, C]
        log_density = -0.5 * (centred**2 / marginal + torch.log(2 * math.pi * marginal)).sum(dim=-1)  # [b, L, K]
        responsibilities = torch.softmax(torch.log_softmax(self.logits, dim=0) + log_density, dim=-1)
        per_component = means + alpha * variances / marginal * centred  # [b, L, K, C]
        return (responsibilities.unsqueeze(-1) * per_component).sum(dim=2)

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        pooled_projections: torch.Tensor,
        timestep: torch.Tensor,
        img_ids: torch.Tensor,
        txt_ids: torch.Tensor,
        guidance: torch.Tensor | None = None,
        return_dict: bool = True,
    ) -> tuple[torch.Tensor]:
        assert not return_dict  # the product always asks for the tuple
        assert hidden_states.shape[0] == encoder_hidden_states.shape[0] == timestep.shape[0]
        x = hidden_states.to(torch.float32)
        sigma = timestep.to(torch.float32)  # σ-valued (FLUX multiplies by 1000 inside; the toy needs σ itself)
        velocity = (x - self.posterior_mean(x, sigma)) / sigma.reshape(-1, 1, 1)
        return (velocity,)


def reward(decoded: torch.Tensor) -> torch.Tensor:
    """scores [B, 1]: 1 where the decoded sample's first coordinate is positive (the binary reward)."""
    return (decoded[:, 0, 0] > 0).to(torch.float32).unsqueeze(1)


def toy_conditioning(num_prompts: int, group_size: int) -> Conditioning:
    """One dummy text token per prompt, each row repeated G times (the loop's ``draw_prompts`` layout)."""
    cond = Conditioning(
        prompt_embeds=torch.zeros(num_prompts, 1, 1),
        pooled=torch.zeros(num_prompts, 1),
        text_ids=torch.zeros(1, 3),
        captions=tuple(f"toy {i}" for i in range(num_prompts)),
    )
    return cond.repeat_interleave(group_size)


def toy_noise(cfg: TrainConfig, num_prompts: int, generator: torch.Generator) -> torch.Tensor:
    """[B, 1, C] initial noise as ``training.stages.initial_noise`` draws it, in the toy's shape: Neighbor GRPO's
    neighbourhoods (``neighborhood_noise``), a group-shared draw with ``shares_group_noise``, else one per row.
    Not through the entry's ``initial_noise`` hook: it packs 2×2 latent patches (4c channels a token), and the toy's
    one token of 2 channels is no packed latent."""
    group, shape = cfg.num_generations, (1, CHANNELS)
    if cfg.objective == "neighbor":
        base = torch.randn((num_prompts, *shape), generator=generator)
        deltas = torch.randn((num_prompts * group, *shape), generator=generator)
        return neighborhood_noise(base, deltas, cfg.neighbor_sigma)
    draws = num_prompts if cfg.shares_group_noise else num_prompts * group
    noise = torch.randn((draws, *shape), generator=generator)
    return noise.repeat_interleave(group, dim=0) if cfg.shares_group_noise else noise


@dataclass
class ToyModel:
    """What ``update_stage`` trains (``stages.TrainedModel``): scheduler, policy copies and KL reference built as
    ``training.parts`` builds them; the optimizer SGD or the run's AdamW."""

    transformer: nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    reference: Any = None
    ema: Any = None
    policy_copies: dict[str, PolicyCopy] = field(default_factory=dict)


def build_toy(cfg: TrainConfig, optimizer_name: str = "sgd") -> ToyModel:
    from diffusers.optimization import get_scheduler

    torch.manual_seed(cfg.seed)
    transformer = MixtureFlow()
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer: torch.optim.Optimizer
    if optimizer_name == "adamw":  # the run's (``training.parts.build_parts``)
        optimizer = torch.optim.AdamW(
            params, lr=cfg.learning_rate, betas=(0.9, 0.999), eps=1e-8, weight_decay=cfg.weight_decay
        )
    else:
        optimizer = torch.optim.SGD(params, lr=cfg.learning_rate)
    total_steps = cfg.derived(1)["total_optimizer_steps"]
    scheduler = get_scheduler(
        cfg.lr_scheduler, optimizer, num_warmup_steps=cfg.lr_warmup_steps, num_training_steps=max(total_steps, 1)
    )
    copies = {name: PolicyCopy(transformer) for name in policy_copy_names(cfg)}
    # the KL's reference with --kl-beta: the base weights again, frozen (``parts.build_reference``, full fine-tuning)
    reference = FrozenReference(MixtureFlow().requires_grad_(False)) if cfg.kl_beta > 0 else None
    return ToyModel(transformer, optimizer, scheduler, reference=reference, policy_copies=copies)


@dataclass(frozen=True)
class SampleStats:
    """What fresh ODE samples of a policy show: the rewarded fraction, and the rewarded component's shape."""

    right_fraction: float
    right_mean: tuple[float, float]  # mean of the samples with x₀ > 0
    right_std: tuple[float, float]  # their per-coordinate std
    left_mean: tuple[float, float]

    def __str__(self) -> str:
        m, s = self.right_mean, self.right_std
        return f"right {self.right_fraction:.3f} · mean ({m[0]:.3f}, {m[1]:.3f}) · std ({s[0]:.3f}, {s[1]:.3f})"


def fresh_samples(transformer: nn.Module, sigmas: torch.Tensor, count: int = 2048, seed: int = 1234) -> torch.Tensor:
    """[count, 2] the deterministic ODE's samples (the product's ``sample_final_latents``) from fixed noise."""
    noise = torch.randn((count, 1, CHANNELS), generator=torch.Generator().manual_seed(seed))
    cond = toy_conditioning(count, 1)
    samples = sample_final_latents(
        transformer, cond, noise, sigmas, guidance=3.5, rollout_batch_size=count, img_ids=torch.zeros(1, 3),
        device_type="cpu",
    )  # fmt: skip
    return samples.final_x0[:, 0]


def sample_stats(samples: torch.Tensor) -> SampleStats:
    right, left = samples[samples[:, 0] > 0], samples[samples[:, 0] <= 0]

    def pair(values: torch.Tensor) -> tuple[float, float]:
        return (float(values[0]), float(values[1])) if values.numel() else (math.nan, math.nan)

    return SampleStats(
        right_fraction=right.shape[0] / samples.shape[0],
        right_mean=pair(right.mean(dim=0)) if len(right) else (math.nan, math.nan),
        right_std=pair(right.std(dim=0)) if len(right) > 1 else (math.nan, math.nan),
        left_mean=pair(left.mean(dim=0)) if len(left) else (math.nan, math.nan),
    )


@dataclass
class ToyRun:
    before: SampleStats
    after: SampleStats
    weights: tuple[float, float]  # the trained mixture's weights (left, right)
    reward_means: list[float]  # the rollouts' mean reward, per iteration
    model: ToyModel


def train_toy(cfg: TrainConfig, *, flip_advantages: bool = False, optimizer: str = "sgd") -> ToyRun:
    """``cfg.max_train_steps`` iterations of the loop's middle on the toy; ``flip_advantages`` negates the
    advantages before the update (the negative control: it must move the samples the wrong way)."""
    cfg.validate()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the toy's tensors are tiny: a second thread only contends (8 s → 50 s on 2 shared cores)
    try:
        return _train(cfg, flip_advantages, optimizer)
    finally:
        torch.set_num_threads(threads)


def _train(cfg: TrainConfig, flip_advantages: bool, optimizer: str) -> ToyRun:
    ctx = _CpuContext()
    model = build_toy(cfg, optimizer)
    sigmas = sigma_schedule(cfg.sampling_steps, cfg.shift)  # [N+1]
    img_ids = image_ids(16, 16)  # [1, 3]: one token, as the toy's latents
    objective = build_objective(cfg, model.policy_copies)
    step_plan_settings, plumbing = plan_settings(cfg), update_plumbing(cfg)
    rollout_setup = rollout_settings(cfg, sigmas, objective)
    before = sample_stats(fresh_samples(model.transformer, sigmas))
    reward_means = []
    for iteration in range(1, cfg.max_train_steps + 1):
        rng = iteration_randomness(cfg, ctx, iteration)  # type: ignore[arg-type]  # device and rank are all it reads
        plan = plan_for_iteration(step_plan_settings, sigmas, iteration, rng.window)
        cond = toy_conditioning(cfg.train_batch_size, cfg.num_generations)
        noise = toy_noise(cfg, cfg.train_batch_size, rng.noise)
        rollout = rollout_stage(
            model.transformer, objective, rollout_setup, cond, noise, sigmas, img_ids,
            device_type="cpu", draws=RolloutDraws(rng.noise, rng.timestep), plan=plan,
        )  # fmt: skip
        decoded = rollout.final_x0 if cfg.decode_sample == "x0" else rollout.final_latent
        assert decoded is not None
        scores = reward(decoded)  # [B, 1]
        rewards, adv = aggregate_rewards(
            scores, torch.ones(1), cfg.advantage_aggregation, cfg.num_generations, cfg.adv_clip_max
        ).as_tuple()
        advantages = -adv.advantages if flip_advantages else adv.advantages
        update_stage(
            model, objective, rollout, cond, advantages, plumbing, device_type="cpu",
            generator_cpu=rng.timestep, learnable=bool(torch.isfinite(rewards).any()),
        )  # fmt: skip
        reward_means.append(float(rewards.mean()))
    after = sample_stats(fresh_samples(model.transformer, sigmas))
    weights = model.transformer.weights()
    return ToyRun(before, after, (float(weights[0]), float(weights[1])), reward_means, model)


class _CpuContext:
    """The two fields of ``DistContext`` that ``iteration_randomness`` reads."""

    device = torch.device("cpu")
    rank = 0
