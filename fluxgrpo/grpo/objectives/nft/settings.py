"""``--objective nft``'s settings (--nft-…, torch-free) and catalogue entry: the ODE's final samples, the old policy
θ_old it rolls out with, the shared (t, ε) draws (``flow_matching.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from fluxgrpo.grpo.objectives.entry import OLD_POLICY, ObjectiveEntry
from fluxgrpo.grpo.objectives.flow_matching import FlowMatchingOptions, fm_timesteps_run_problems, fm_train_timesteps
from fluxgrpo.grpo.objectives.options import Options, option

NFT_DECAY_TYPES = (0, 1, 2)
NFT_BETA_MAX = 10.0  # β of the implicit policies (1 ± β)·v: the loss divides by β (#50: past it no update is finite)


@dataclass(frozen=True)
class NftOptions(Options):
    prefix = "nft"
    beta: float = option(1.0, "DiffusionNFT's β: the step of its implicit positive/negative policies.")
    decay_type: int = option(
        1,
        "DiffusionNFT's old-policy decay: 1 min(0.001·s, 0.5), 2 (0 for 75 steps, then 0.0075/step up to 0.999), 0 none.",
    )

    def problems(self) -> list[str]:
        out = []
        if not 0 < self.beta <= NFT_BETA_MAX:
            out.append(f"--nft-beta {self.beta} must be in (0, {NFT_BETA_MAX:g}] (the authors: 1)")
        if self.decay_type not in NFT_DECAY_TYPES:
            out.append(f"--nft-decay-type {self.decay_type}: use one of {', '.join(map(str, NFT_DECAY_TYPES))}")
        return out


ENTRY = ObjectiveEntry(
    "nft",
    "fluxgrpo.grpo.objectives.nft.loss:NftObjective",
    keeps_trajectory=False,
    trainable_timesteps=lambda cfg: cfg.sampling_steps,
    policy_copies=lambda cfg: (OLD_POLICY,),
    run_problems=fm_timesteps_run_problems,
    settings=NftOptions,
    shared=(FlowMatchingOptions,),
    train_timesteps=fm_train_timesteps,
    draws=("sample", "random"),
    ignores=("clip_range",),  # no probability ratio to clip: its loss is the implicit policies' regression
    summary="DiffusionNFT",
)
