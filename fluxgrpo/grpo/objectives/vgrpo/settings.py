"""``--objective vgrpo``'s settings (--vgrpo-…, torch-free) and catalogue entry: the ODE's final samples, N_MC
(t, ε) pairs per sample from the shared draws (``flow_matching.py``), one batch per trained sample."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fluxgrpo.grpo.objectives.entry import ObjectiveEntry
from fluxgrpo.grpo.objectives.flow_matching import FlowMatchingOptions
from fluxgrpo.grpo.objectives.options import Options, option

if TYPE_CHECKING:
    from fluxgrpo.config import TrainConfig

SOFT_CLIP_MAX = 100.0  # η of η·tanh(A/η): past --adv-clip-max it leaves A as is


@dataclass(frozen=True)
class VgrpoOptions(Options):
    prefix = "vgrpo"
    mc_samples: int = option(
        4, "V-GRPO's N_MC: (timestep, noise) pairs of each sample's surrogate (2 is too few).", exclusive=True
    )
    adv_soft_clip: float = option(
        0.0,
        "V-GRPO's advantage soft clip η: A → η·tanh(A/η) (0: off, the authors' FLUX setting; SD3.5 stage 1: 3).",
        exclusive=True,
    )

    def problems(self) -> list[str]:
        out = []
        if self.mc_samples < 1:
            out.append(f"--vgrpo-mc-samples {self.mc_samples} must be at least 1 (the authors' N_MC: 4)")
        if not 0 <= self.adv_soft_clip <= SOFT_CLIP_MAX:
            out.append(
                f"--vgrpo-adv-soft-clip {self.adv_soft_clip} must be in [0, {SOFT_CLIP_MAX:g}] (0: off; the "
                "authors' SD3.5: 3)"
            )
        return out


def _mc_samples(cfg: TrainConfig) -> int:
    return cfg.settings_of(VgrpoOptions).mc_samples


def _vgrpo_run_problems(cfg: TrainConfig) -> list[str]:
    if _mc_samples(cfg) > cfg.sampling_steps >= 1:
        return [
            f"--vgrpo-mc-samples {_mc_samples(cfg)}: one pair per stratum of the {cfg.sampling_steps} "
            "--sampling-steps timesteps at most"
        ]
    return []


# V-GRPO: the N sampler timesteps σ_0 … σ_{N−1}, N_MC of them (one per stratum) per sample.
ENTRY = ObjectiveEntry(
    "vgrpo",
    "fluxgrpo.grpo.objectives.vgrpo.loss:VgrpoObjective",
    keeps_trajectory=False,
    trainable_timesteps=lambda cfg: cfg.sampling_steps,
    run_problems=_vgrpo_run_problems,
    settings=VgrpoOptions,
    shared=(FlowMatchingOptions,),
    train_timesteps=_mc_samples,
    draws=("group", "stratified"),
    rows_per_forward=_mc_samples,
    ignores=("timestep_fraction", "fm_timesteps"),  # its N_MC pairs are its T_train
    summary="V-GRPO: PPO-clip on an ELBO surrogate",
)
