"""``--objective neighbor``'s settings (--neighbor-…, torch-free) and catalogue entry. Its rollout differs from the
other ODE objectives' in two ways it declares here: the initial noises of a group are a neighbourhood of one base
noise (``initial_noise``: ``loss.neighborhood_initial_noise``), and the rollout keeps every candidate's latents on
the σ grid (its objective's ``keeps_ode_path``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fluxgrpo.grpo.objectives.entry import ObjectiveEntry
from fluxgrpo.grpo.objectives.options import Options, option

if TYPE_CHECKING:
    from fluxgrpo.config import TrainConfig

TEMPERATURE_MAX = 1e4  # τ of softmax(−d²/τ): the README measured 10-1000


@dataclass(frozen=True)
class NeighborOptions(Options):
    prefix = "neighbor"
    sigma: float = option(
        0.3, "Neighbor GRPO's perturbation σ: ε_i = √(1−σ²)·ε* + σ·δ_i within a group.", exclusive=True
    )
    anchors: int = option(
        4, "Neighbor GRPO's anchors B per group trained each iteration (of the G candidates).", exclusive=True
    )
    quasi_norm_p: float = option(
        0.8, "Neighbor GRPO's group advantage reweighting A_i/(Σ|A_k|^p)^(1/p), p in (0, 2].", exclusive=True
    )
    temperature: float = option(
        1.0,
        "Temperature τ of Neighbor GRPO's leaping policy softmax(−‖x_i − x_θ‖²/τ) (the paper: 1).",
        exclusive=True,
    )

    def problems(self) -> list[str]:
        out = []
        if not 0 < self.sigma <= 1:
            out.append(f"--neighbor-sigma {self.sigma} must be in (0, 1] (the authors: 0.3)")
        if not 0 < self.quasi_norm_p <= 2:
            out.append(f"--neighbor-quasi-norm-p {self.quasi_norm_p} must be in (0, 2] (the authors: 0.8)")
        if not 0 < self.temperature <= TEMPERATURE_MAX:
            out.append(
                f"--neighbor-temperature {self.temperature} must be in (0, {TEMPERATURE_MAX:g}] (the authors: 1)"
            )
        if self.anchors < 1:
            out.append(f"--neighbor-anchors {self.anchors} must be at least 1 (the authors: 4 of 12)")
        return out


def _anchors_per_rank(cfg: TrainConfig) -> int:
    """The anchors one rank's update trains: B of each group's G candidates."""
    return cfg.train_batch_size * min(cfg.settings_of(NeighborOptions).anchors, cfg.num_generations)


def _neighbor_run_problems(cfg: TrainConfig) -> list[str]:
    anchors_per_group = cfg.settings_of(NeighborOptions).anchors
    if anchors_per_group > cfg.num_generations >= 1:
        return [
            f"--neighbor-anchors {anchors_per_group} must be at most --num-generations {cfg.num_generations} "
            "(the anchors are candidates of the group; the authors: 4 of 12)"
        ]
    anchors = _anchors_per_rank(cfg)
    if cfg.train_micro_batch_size >= 1 and anchors % cfg.train_micro_batch_size:
        return [
            f"--train-micro-batch-size {cfg.train_micro_batch_size} does not divide the {anchors} anchors per rank "
            f"(--train-batch-size {cfg.train_batch_size} × --neighbor-anchors {anchors_per_group}), which the "
            "neighbor update trains on"
        ]
    return []


# Neighbor GRPO: no log-probs (an ODE rollout, its paths kept for the candidates); B anchors per group each train K
# of the N−1 transitions. Its paths are the rollout's trajectory latents: no update latents.
ENTRY = ObjectiveEntry(
    "neighbor",
    "fluxgrpo.grpo.objectives.neighbor.loss:NeighborObjective",
    keeps_trajectory=False,
    trainable_timesteps=lambda cfg: cfg.sampling_steps - 1,
    run_problems=_neighbor_run_problems,
    settings=NeighborOptions,
    trained_samples=_anchors_per_rank,
    kept_latents=lambda cfg: 0,
    initial_noise="fluxgrpo.grpo.objectives.neighbor.loss:neighborhood_initial_noise",
    summary="Neighbor GRPO: PPO-clip on a softmax-distance policy over ODE neighbours",
)
