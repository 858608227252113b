"""The settings the objectives that train on forward-noised final samples share (nft, awm, vgrpo), without torch:
the (t, ε) draws (``draws.py``): who shares a draw, how the timesteps are chosen, how many each sample trains at."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fluxgrpo.grpo.objectives.options import Options, option

if TYPE_CHECKING:
    from fluxgrpo.config import TrainConfig

# ``auto`` is each objective's authors' rule (``ObjectiveEntry.draws``).
FM_DRAWS = ("auto", "sample", "group")
FM_TIMESTEP_RULES = ("auto", "random", "stratified")


@dataclass(frozen=True)
class FlowMatchingOptions(Options):
    """--fm-draws, --fm-timestep-rule, --fm-timesteps: shared by nft, awm and vgrpo, checked once here."""

    prefix = "fm"
    draws: str = option(
        "auto",
        "nft/awm/vgrpo: who shares a (timestep, noise) draw: sample (each sample its own; AWM's authors share the "
        "timesteps per micro-batch), group (one set per prompt group: V-GRPO's), auto (vgrpo group, else sample).",
        exclusive=True,
    )
    timestep_rule: str = option(
        "auto",
        "nft/awm/vgrpo: how the trained timesteps are drawn from the grid: random (a random permutation's first T: "
        "NFT's), stratified (one per stratum: AWM's, V-GRPO's), auto (nft random, else stratified).",
        exclusive=True,
    )
    timesteps: int = option(
        0,
        "nft/awm: timesteps each sample trains at (practitioners run 2-4); 0: int(trainable · --timestep-fraction).",
        exclusive=True,
    )

    def problems(self) -> list[str]:
        out = []
        for flag, value, allowed in (
            ("--fm-draws", self.draws, FM_DRAWS),
            ("--fm-timestep-rule", self.timestep_rule, FM_TIMESTEP_RULES),
        ):
            if value not in allowed:
                out.append(f"{flag} {value!r}: use one of {', '.join(allowed)}")
        if self.timesteps < 0:
            out.append(f"--fm-timesteps {self.timesteps} cannot be negative (0: from --timestep-fraction)")
        return out

    @classmethod
    def unread_with(cls, values: Mapping[str, Any]) -> tuple[str, ...]:
        """--fm-timesteps replaces --timestep-fraction."""
        return ("timestep_fraction",) if values.get("fm_timesteps") else ()


def resolved_draws(options: FlowMatchingOptions, authors: tuple[str, str]) -> tuple[str, str]:
    """(sharing, timestep rule) of the draws, ``auto`` resolved to the objective's ``authors`` rules."""
    sharing, rule = authors
    return (
        sharing if options.draws == "auto" else options.draws,
        rule if options.timestep_rule == "auto" else options.timestep_rule,
    )


def fm_train_timesteps(cfg: TrainConfig) -> int:
    """T_train of nft and awm: --fm-timesteps when set, else int(trainable · --timestep-fraction)."""
    return cfg.settings_of(FlowMatchingOptions).timesteps or int(cfg.trainable_timesteps * cfg.timestep_fraction)


def fm_timesteps_run_problems(cfg: TrainConfig) -> list[str]:
    timesteps = cfg.settings_of(FlowMatchingOptions).timesteps
    if timesteps > cfg.trainable_timesteps:
        return [
            f"--fm-timesteps {timesteps}: --objective {cfg.objective} has only {cfg.trainable_timesteps} "
            f"timesteps to train with --sampling-steps {cfg.sampling_steps}"
        ]
    return []
