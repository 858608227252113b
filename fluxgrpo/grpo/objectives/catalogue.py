"""The catalogue of training objectives (``--objective``): everything the run's config, settings, memory model and
guards know of an objective, without importing torch (validation runs before any worker starts).

Adding an objective is two files: its module (``grpo/objectives/<name>.py``: a class with ``from_config`` whose
work computes a loss from the tensors the update driver hands it, ``base.py``) and its entry here
(``register_objective``). Flags of its own are fields of ``TrainConfig`` (named ``<name>_…``) checked by its
``option_problems``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

OLD_POLICY, EMA_POLICY = "old_policy", "ema_policy"  # the names policy copies are saved under
NFT_DECAY_TYPES = (0, 1, 2)
AWM_WEIGHTINGS = ("uniform", "t", "t2", "ghuber", "huber")
AWM_TIME_FRACTION = 0.9  # AWM trains at the sampler-grid indices 1 … int(0.9·N)−1
# Guard rules measured on the SDE trajectory's trained steps: an objective that keeps no trajectory cannot have them.
TRAJECTORY_GUARDS = ("velocity_norm_ratio",)


def _no_problems(cfg: Any) -> list[str]:
    return []


def _no_copies(cfg: Any) -> tuple[str, ...]:
    return ()


@dataclass(frozen=True)
class ObjectiveEntry:
    """One objective as the run's plumbing sees it. ``cfg`` below is a ``TrainConfig`` (duck-typed: no import)."""

    name: str
    # The class to train with: "module:Class" (imported when a run builds it) or the class itself; its
    # ``from_config(cfg, policy_copies)`` returns a ``base.Objective``.
    builder: str | Callable[..., Any]
    # True: the rollout is the SDE with per-step log-probs (``Rollout``); False: the ODE's final samples only.
    keeps_trajectory: bool
    # (sampling_steps N, sde_window W) → the timesteps a sample may train on (T_train = int(this·fraction)).
    trainable_timesteps: Callable[[int, int], int]
    # The copies of the trainable weights it keeps (saved with checkpoints, counted by the memory model).
    policy_copies: Callable[[Any], tuple[str, ...]] = _no_copies
    # Its own flags' problems, checked whichever objective is chosen (a wrong value is wrong anyway).
    option_problems: Callable[[Any], list[str]] = _no_problems
    # Problems of a run with this objective (settings it cannot train with).
    run_problems: Callable[[Any], list[str]] = _no_problems

    @property
    def refused_guards(self) -> tuple[str, ...]:
        """The guard rules it cannot be checked by (their probe would only report NaN)."""
        return () if self.keeps_trajectory else TRAJECTORY_GUARDS

    def update_latents(self, cfg: Any) -> int:
        """[trajectories × T_train] latents its update keeps besides the rollout's: the fresh noise and each policy
        copy's velocity per trained slot (the final-sample objectives); none for the trajectory objectives."""
        if self.keeps_trajectory:
            return 0
        return cfg.trajectories_per_rank * cfg.train_timesteps * (1 + len(self.policy_copies(cfg)))


def _nft_option_problems(cfg: Any) -> list[str]:
    out = []
    if not cfg.nft_beta > 0:
        out.append(f"--nft-beta {cfg.nft_beta} must be positive")
    if cfg.nft_decay_type not in NFT_DECAY_TYPES:
        out.append(f"--nft-decay-type {cfg.nft_decay_type}: use one of {', '.join(map(str, NFT_DECAY_TYPES))}")
    return out


def _awm_option_problems(cfg: Any) -> list[str]:
    out = []
    if cfg.awm_weighting not in AWM_WEIGHTINGS:
        out.append(f"--awm-weighting {cfg.awm_weighting!r}: use one of {', '.join(AWM_WEIGHTINGS)}")
    if not cfg.awm_ghuber_power > 0:
        out.append(f"--awm-ghuber-power {cfg.awm_ghuber_power} must be positive")
    if not cfg.awm_ema_beta >= 0:
        out.append(f"--awm-ema-beta {cfg.awm_ema_beta} cannot be negative (0 turns the EMA term off)")
    return out


def _awm_run_problems(cfg: Any) -> list[str]:
    if cfg.sampling_steps >= 1 and cfg.trainable_timesteps < 1:
        return [
            f"--objective awm trains at grid indices 1 … int(0.9·N)−1, none with --sampling-steps "
            f"{cfg.sampling_steps}: use at least 3"
        ]
    return []


CATALOGUE: dict[str, ObjectiveEntry] = {
    entry.name: entry
    for entry in (
        # The last transition cannot change the reward, so it never trains: the SDE window, or N−1.
        ObjectiveEntry(
            "grpo", "fluxgrpo.grpo.objectives.grpo:GrpoObjective", True, lambda steps, window: window or steps - 1
        ),
        ObjectiveEntry(
            "nft",
            "fluxgrpo.grpo.objectives.nft:NftObjective",
            False,
            lambda steps, window: steps,
            policy_copies=lambda cfg: (OLD_POLICY,),
            option_problems=_nft_option_problems,
        ),
        ObjectiveEntry(
            "awm",
            "fluxgrpo.grpo.objectives.awm:AwmObjective",
            False,
            lambda steps, window: max(int(steps * AWM_TIME_FRACTION) - 1, 0),
            policy_copies=lambda cfg: (EMA_POLICY,) if cfg.awm_ema_beta > 0 else (),
            option_problems=_awm_option_problems,
            run_problems=_awm_run_problems,
        ),
    )
}


def objective_names() -> tuple[str, ...]:
    return tuple(CATALOGUE)


def objective_entry(name: str) -> ObjectiveEntry:
    """The entry of ``--objective name``; KeyError for a name not in the catalogue (the config reports it)."""
    return CATALOGUE[name]


def register_objective(entry: ObjectiveEntry) -> None:
    """Add (or replace) an objective: ``--objective entry.name`` validates, sizes, guards and trains with it."""
    CATALOGUE[entry.name] = entry
