"""``--objective awm``'s settings (--awm-…, torch-free) and catalogue entry: the ODE's final samples, an EMA policy
copy when its pull is on, the shared (t, ε) draws (``flow_matching.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fluxgrpo.grpo.objectives.entry import EMA_POLICY, ObjectiveEntry
from fluxgrpo.grpo.objectives.flow_matching import FlowMatchingOptions, fm_timesteps_run_problems, fm_train_timesteps
from fluxgrpo.grpo.objectives.options import Options, option

if TYPE_CHECKING:
    from fluxgrpo.config import TrainConfig

AWM_WEIGHTINGS = ("uniform", "t", "t2", "ghuber", "huber")
AWM_TIME_FRACTION = 0.9  # AWM trains at the sampler-grid indices lo … int(0.9·N)−1
AWM_TIME_TYPES = {"discrete": 0, "discrete_wo_init": 1}  # the authors' time_type → lo (0 includes σ = 1)
# Past these no update is finite (#50: 1e30 passed and every update was skipped).
AWM_GHUBER_POWER_MAX = 2.0  # p of (mse + 1e-10)^p: 1 is the squared error itself
PULL_WEIGHT_MAX = 1e4  # --awm-ema-beta, as --kl-beta's bound


@dataclass(frozen=True)
class AwmOptions(Options):
    prefix = "awm"
    weighting: str = option("ghuber", f"AWM's weighting of the flow-matching error: {', '.join(AWM_WEIGHTINGS)}.")
    ghuber_power: float = option(0.25, "AWM's ghuber power p.")
    ema_beta: float = option(1.0, "Weight of AWM's pull towards its EMA policy (0: off, no EMA copy).")
    time_type: str = option(
        "discrete_wo_init",
        "AWM's training-timestep range: discrete_wo_init (grid indices 1…int(0.9·N)−1: the authors' GenEval/OCR rule) "
        "or discrete (from index 0, pure noise: their PickScore rule).",
        exclusive=True,
    )

    def problems(self) -> list[str]:
        out = []
        if self.time_type not in AWM_TIME_TYPES:
            out.append(f"--awm-time-type {self.time_type!r}: use one of {', '.join(AWM_TIME_TYPES)}")
        if self.weighting not in AWM_WEIGHTINGS:
            out.append(f"--awm-weighting {self.weighting!r}: use one of {', '.join(AWM_WEIGHTINGS)}")
        if not 0 < self.ghuber_power <= AWM_GHUBER_POWER_MAX:
            out.append(
                f"--awm-ghuber-power {self.ghuber_power} must be in (0, {AWM_GHUBER_POWER_MAX:g}] (1: the squared "
                "error; the authors: 0.25)"
            )
        if not 0 <= self.ema_beta <= PULL_WEIGHT_MAX:
            out.append(f"--awm-ema-beta {self.ema_beta} must be in [0, {PULL_WEIGHT_MAX:g}] (0 turns the EMA term off)")
        return out


def _lowest_index(cfg: TrainConfig) -> int:
    return AWM_TIME_TYPES.get(cfg.settings_of(AwmOptions).time_type, 1)


def _awm_trainable(cfg: TrainConfig) -> int:
    return max(int(cfg.sampling_steps * AWM_TIME_FRACTION) - _lowest_index(cfg), 0)


def _awm_run_problems(cfg: TrainConfig) -> list[str]:
    if cfg.sampling_steps >= 1 and cfg.trainable_timesteps < 1:
        return [
            f"--objective awm trains at grid indices {_lowest_index(cfg)} … int(0.9·N)−1, "
            f"none with --sampling-steps {cfg.sampling_steps}: use at least 3"
        ]
    return fm_timesteps_run_problems(cfg)


ENTRY = ObjectiveEntry(
    "awm",
    "fluxgrpo.grpo.objectives.awm.loss:AwmObjective",
    keeps_trajectory=False,
    trainable_timesteps=_awm_trainable,
    policy_copies=lambda cfg: (EMA_POLICY,) if cfg.settings_of(AwmOptions).ema_beta > 0 else (),
    run_problems=_awm_run_problems,
    settings=AwmOptions,
    shared=(FlowMatchingOptions,),
    train_timesteps=fm_train_timesteps,
    summary="Advantage-Weighted Matching",
)
