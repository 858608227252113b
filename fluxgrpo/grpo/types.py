"""Dataclasses that carry tensors between the GRPO stages (rollout → reward → advantages → update).

Shape letters used throughout ``fluxgrpo.grpo``:
    B  trajectories on this rank (prompts × num_generations, groups contiguous)
    N  sampling steps (the σ table has N+1 points)
    T  trained timesteps per trajectory, T_train = int((N−1)·timestep_fraction)
    L  image tokens, (height/16)·(width/16)
    C  packed latent channels, 64 for FLUX (16 VAE channels × 2×2)
    S  text tokens (512 for FLUX.1-dev's T5)
    D  T5 hidden size (4096), P pooled CLIP size (768)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from fluxgrpo.grpo.objectives.base import Metric
    from fluxgrpo.grpo.retain import RetainedGraphs
    from fluxgrpo.grpo.samplers import Sampler


@dataclass(frozen=True)
class Conditioning:
    """Text conditioning, one row per trajectory (already repeated G times per prompt for grouping).

    The computation device of rollout and update is ``prompt_embeds.device``.
    """

    prompt_embeds: torch.Tensor  # [B, S, D] (bf16 as preprocessed), T5 last hidden state
    pooled: torch.Tensor  # [B, P] CLIP pooled output
    text_ids: torch.Tensor  # [S, 3] text position ids (zeros for FLUX), shared by all rows
    captions: tuple[str, ...] | None = None  # [B] the prompt text of each row, for logging and rewards

    def __post_init__(self) -> None:
        rows = self.prompt_embeds.shape[0]
        if self.pooled.shape[0] != rows:
            raise ValueError(f"pooled has {self.pooled.shape[0]} rows but prompt_embeds has {rows}")
        if self.text_ids.ndim != 2 or self.text_ids.shape[0] != self.prompt_embeds.shape[1]:
            raise ValueError(
                f"text_ids must be [S, 3] with S = {self.prompt_embeds.shape[1]} text tokens, got "
                f"{tuple(self.text_ids.shape)}"
            )
        if self.captions is not None and len(self.captions) != rows:
            raise ValueError(f"{len(self.captions)} captions for {rows} rows")

    @property
    def num_rows(self) -> int:
        return int(self.prompt_embeds.shape[0])

    def rows(self, start: int, stop: int) -> Conditioning:
        """Rows ``start:stop`` as views (no copy)."""
        return Conditioning(
            prompt_embeds=self.prompt_embeds[start:stop],
            pooled=self.pooled[start:stop],
            text_ids=self.text_ids,
            captions=None if self.captions is None else self.captions[start:stop],
        )

    def repeat_interleave(self, group_size: int) -> Conditioning:
        """Each row repeated ``group_size`` times in place: [p0×G, p1×G, …], DanceGRPO's contiguous groups."""
        captions = None
        if self.captions is not None:
            captions = tuple(caption for caption in self.captions for _ in range(group_size))
        return Conditioning(
            prompt_embeds=self.prompt_embeds.repeat_interleave(group_size, dim=0),
            pooled=self.pooled.repeat_interleave(group_size, dim=0),
            text_ids=self.text_ids,
            captions=captions,
        )


@dataclass(frozen=True)
class Rollout:
    """What sampling keeps for the update: the whole SDE trajectory, its log-probs and the decoded-from x̂0.

    Everything a recomputation needs (σ table, η, guidance, image ids) is stored here, so the update uses
    exactly the rollout's settings. The latents stay on the computation device in fp32: at the 8-die recipe's
    size (B=24, N=16, 720²) they are about 210 MB, small beside a sharded 12 B-parameter model.
    """

    latents: torch.Tensor  # [B, K, L, C] fp32, z_0 (initial noise) … z_{K−1}: K = N+1, or sde_stop+1 with a window
    log_probs: torch.Tensor  # [B, N] fp32, log p(z_{i+1} | z_i) as a per-element mean; NaN for ODE steps
    final_x0: torch.Tensor  # [B, L, C] fp32, x̂0 predicted at step N−1: what the VAE decodes (``--decode-sample x0``)
    sigmas: torch.Tensor  # [N+1] fp32, the exact σ table (1 → 0)
    img_ids: torch.Tensor  # [L, 3] image position ids used for every forward
    guidance: float  # FLUX distilled-guidance value (3.5 for FLUX.1-dev)
    sampler: Sampler  # the SDE step that made it, with its parameters; the update scores with it
    captions: tuple[str, ...] | None = None  # [B], copied from the conditioning
    sde_steps: tuple[int, int] | None = None  # [start, stop): the SDE (trainable) transitions; None: 0…N−2
    means: torch.Tensor | None = None  # [B, K−1, L, C] fp32, μ of each SDE step (GRPO-Guard), else None
    final_latent: torch.Tensor | None = None  # [B, L, C] fp32, z_N, the last step's result (``--decode-sample final``)
    retained: RetainedGraphs | None = None  # the trained steps' kept forwards (``--retain-rollout-graphs``)

    @property
    def num_trajectories(self) -> int:
        return int(self.latents.shape[0])

    @property
    def num_steps(self) -> int:
        return int(self.sigmas.shape[0]) - 1

    @property
    def trainable(self) -> range:
        """The transitions the update may train on: the SDE window, or DanceGRPO's 0…N−2."""
        start, stop = self.sde_steps if self.sde_steps is not None else (0, self.num_steps - 1)
        return range(start, stop)


@dataclass(frozen=True)
class FinalSamples:
    """What an ODE rollout keeps for the objectives that train on final samples (NFT, AWM): x0 and the grid."""

    final_x0: torch.Tensor  # [B, L, C] fp32, the ODE's end point at σ = 0: what the VAE decodes and x0 of the loss
    sigmas: torch.Tensor  # [N+1] fp32, the sampler's σ grid (the training timesteps are drawn from it)
    img_ids: torch.Tensor  # [L, 3]
    guidance: float
    captions: tuple[str, ...] | None = None
    # [B, N+1, L, C] fp32, the latent at every grid point (index 0: the initial noise), for the objectives that train
    # on the ODE path (Neighbor GRPO); None when the rollout keeps the end point only.
    path: torch.Tensor | None = None

    @property
    def final_latent(self) -> torch.Tensor:
        """The ODE's last step lands on σ = 0: the final latent is x0."""
        return self.final_x0

    @property
    def num_trajectories(self) -> int:
        return int(self.final_x0.shape[0])

    @property
    def num_steps(self) -> int:
        return int(self.sigmas.shape[0]) - 1


@dataclass(frozen=True)
class UpdateStats:
    """What one update did, for this rank. Float tensors are fp32 on the computation device, built up without host
    syncs and reduced once at the end; ``as_floats`` turns them into numbers with one sync.

    ``metrics`` holds the objective's metrics by name (``grpo.objectives.base.Metric``), each reduced as its spec
    says; they read as attributes too (``stats.ratio_mean``). Nothing here is averaged over ranks; the training
    loop does that once per iteration.
    """

    metrics: dict[str, torch.Tensor]  # name → [] scalar, or [N] per-step sums and counts
    specs: Mapping[str, Metric]  # name → how it is reduced and logged
    grad_norms: torch.Tensor  # [boundaries] pre-clip global grad norm at each boundary; non-finite: skipped
    optimizer_steps: int  # optimizer steps taken
    skipped_steps: int  # boundaries whose grad norm was non-finite: gradients dropped, weights untouched
    num_microbatches: int
    train_timestep_indices: torch.Tensor  # [B, T] int64 cpu, σ-table index of each trained step, in training order
    update_skipped: bool = False  # True when the update did not run at all (no finite reward on any rank)

    def __getattr__(self, name: str) -> torch.Tensor:
        if name in ("metrics", "specs") or name.startswith("__"):  # not yet set (copy, pickle): no recursion
            raise AttributeError(name)
        try:
            return self.metrics[name]
        except KeyError:
            raise AttributeError(f"UpdateStats has no metric or field {name!r}") from None

    def scalar_reductions(self) -> dict[str, str]:
        """Record key → how it is reduced over ranks (mean, max or min) for every number ``as_floats`` gives."""
        out = {spec.key: spec.reduction for spec in self.specs.values() if spec.reduction != "per_step"}
        out = {key: "mean" if reduction == "sum" else reduction for key, reduction in out.items()}
        return {**out, "grad_norm_mean": "mean", "grad_norm_max": "max"}

    def as_floats(self) -> dict[str, float]:
        """Plain numbers for logging, by record key (one host sync for the lot)."""
        finite_norms = self.grad_norms[torch.isfinite(self.grad_norms)]
        scalars = [(spec.key, self.metrics[name]) for name, spec in self.specs.items() if spec.reduction != "per_step"]
        nan = torch.full((), float("nan"), device=self.grad_norms.device)
        norms = [
            finite_norms.mean() if finite_norms.numel() else nan,
            finite_norms.max() if finite_norms.numel() else nan,
        ]
        packed = torch.stack([value.to(nan.device) for _, value in scalars] + norms).tolist()
        names: Sequence[str] = [key for key, _ in scalars] + ["grad_norm_mean", "grad_norm_max"]
        out = dict(zip(names, packed, strict=True))
        out["optimizer_steps"] = float(self.optimizer_steps)
        out["skipped_steps"] = float(self.skipped_steps)
        out["update_skipped"] = float(self.update_skipped)
        return out

    def per_step(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Record key → ([N] sums, [N] counts) of each per-step metric."""
        return {
            spec.key: (self.metrics[name], self.metrics[spec.count_name])
            for name, spec in self.specs.items()
            if spec.reduction == "per_step"
        }
