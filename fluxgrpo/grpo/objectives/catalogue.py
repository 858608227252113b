"""The catalogue of training objectives (``--objective``): everything the run's config, settings, memory model and
guards know of an objective, without importing torch (validation runs before any worker starts).

An objective is one folder and one line. The folder ``grpo/objectives/<name>/`` holds its torch-free
``settings.py`` (its settings class: the flags ``--<name>-…`` with their help and checks, ``options.py``; and its
``ObjectiveEntry``, ``entry.py``: what its rollout needs, its sizes, its run's checks) and its ``loss.py`` (a class
whose ``from_config(run, policy_copies)`` turns an ``entry.ObjectiveRun`` into a ``base.Objective``). The line is
its ``register_objective`` below. The flags and YAML keys are generated from the settings classes
(``config.schema.config_fields``); ``TrainConfig`` names no objective's setting.
"""

from __future__ import annotations

from typing import Any

from fluxgrpo.grpo.objectives.awm import settings as awm
from fluxgrpo.grpo.objectives.awm.settings import AWM_TIME_FRACTION, AWM_TIME_TYPES, AWM_WEIGHTINGS
from fluxgrpo.grpo.objectives.entry import (
    EMA_POLICY,
    OLD_POLICY,
    TRAJECTORY_GUARDS,
    TRAJECTORY_SETTINGS,
    ObjectiveEntry,
    ObjectiveRun,
)
from fluxgrpo.grpo.objectives.flow_matching import FM_DRAWS, FM_TIMESTEP_RULES, FlowMatchingOptions
from fluxgrpo.grpo.objectives.grpo import settings as grpo
from fluxgrpo.grpo.objectives.neighbor import settings as neighbor
from fluxgrpo.grpo.objectives.nft import settings as nft
from fluxgrpo.grpo.objectives.nft.settings import NFT_DECAY_TYPES
from fluxgrpo.grpo.objectives.options import OptionField, Options, option_fields
from fluxgrpo.grpo.objectives.vgrpo import settings as vgrpo

__all__ = [
    "AWM_TIME_FRACTION",
    "AWM_TIME_TYPES",
    "AWM_WEIGHTINGS",
    "CATALOGUE",
    "EMA_POLICY",
    "FM_DRAWS",
    "FM_TIMESTEP_RULES",
    "NFT_DECAY_TYPES",
    "OLD_POLICY",
    "TRAJECTORY_GUARDS",
    "TRAJECTORY_SETTINGS",
    "ObjectiveEntry",
    "ObjectiveRun",
    "objective_entry",
    "objective_help",
    "objective_names",
    "option_groups",
    "option_key_fields",
    "register_objective",
    "register_settings",
    "settings_not_read",
]

CATALOGUE: dict[str, ObjectiveEntry] = {}
_SETTINGS: dict[type[Options], None] = {}  # the settings classes in the order their flags are listed


def register_settings(cls: type[Options]) -> None:
    """List a settings class's flags here in the order (an objective's own class is listed when it registers; a
    class several share may be listed by its own line, else after the first objective naming it)."""
    _SETTINGS.setdefault(cls)


def register_objective(entry: ObjectiveEntry) -> None:
    """Add (or replace) an objective: ``--objective entry.name`` validates, sizes, guards and trains with it, and its
    settings classes' flags exist."""
    CATALOGUE[entry.name] = entry
    if entry.settings is not None:
        register_settings(entry.settings)


register_objective(grpo.ENTRY)
register_objective(nft.ENTRY)
register_objective(awm.ENTRY)
register_settings(FlowMatchingOptions)  # the (t, ε) draws nft, awm and vgrpo share
register_objective(vgrpo.ENTRY)
register_objective(neighbor.ENTRY)


def objective_names() -> tuple[str, ...]:
    return tuple(CATALOGUE)


def objective_help() -> str:
    """--objective's help, from the catalogue: each objective's name and summary, and which roll out with the ODE."""
    named = [f"{entry.name} ({entry.summary})" if entry.summary else entry.name for entry in CATALOGUE.values()]
    listed = named[0] if len(named) == 1 else f"{', '.join(named[:-1])} or {named[-1]}"
    sde = [entry.name for entry in CATALOGUE.values() if entry.keeps_trajectory]
    ode = "" if len(sde) == len(named) else f"; all but {' and '.join(sde)} roll out with the DPM-Solver++(2M) ODE"
    if not sde:
        ode = "; all roll out with the DPM-Solver++(2M) ODE"
    return f"Training objective: {listed}{ode}."


def objective_entry(name: str) -> ObjectiveEntry:
    """The entry of ``--objective name``; KeyError for a name not in the catalogue (the config reports it)."""
    return CATALOGUE[name]


def option_groups() -> tuple[type[Options], ...]:
    """The settings classes of the catalogue's objectives, once each: in the order registered, then any not
    registered (an entry placed in ``CATALOGUE`` directly) in the catalogue's order."""
    used = dict.fromkeys(group for entry in CATALOGUE.values() for group in entry.groups)
    return (*(group for group in _SETTINGS if group in used), *(group for group in used if group not in _SETTINGS))


def option_key_fields() -> dict[str, OptionField]:
    """Config key → field of every registered settings class (the flags generated from them)."""
    return {f.key: f for group in option_groups() for f in option_fields(group)}


def settings_not_read(name: str, settings: dict[str, Any]) -> list[str]:
    """The keys of ``settings`` (a run's resolved config) that ``--objective name`` does not read: the flags of the
    settings classes it does not read, the SDE rollout's without a trajectory, the entry's ``ignores``, and what its
    settings' values make unread (--timestep-fraction where --fm-timesteps replaces it); none for a name not here."""
    entry = CATALOGUE.get(name)
    if entry is None:
        return []
    unread: set[str] = set(option_key_fields()) - set(entry.reads)
    unread |= set(entry.ignores)
    if not entry.keeps_trajectory:
        unread |= set(TRAJECTORY_SETTINGS)
    for group in entry.groups:
        if any(f.key in entry.reads for f in option_fields(group)):
            unread |= set(group.unread_with(settings))
    return [key for key in settings if key in unread]
