"""What ``fetch-weights`` takes from which repository: each part's repos on both hubs, its allow-list, and where its
files go in the standard layout (``layout.py``). FLUX's part and the benchmark prompt sets are here; each reward's
are in its record (``rewards/registry.py``). ``hub.py`` plans, downloads and verifies them.
"""

from __future__ import annotations

from collections.abc import Sequence

from fluxgrpo.errors import UsageError
from fluxgrpo.weights.hub_part import HubPart
from fluxgrpo.weights.layout import FLUX_COMPONENTS
from fluxgrpo.weights.manifest import MANIFEST_NAME

FLUX_PART = HubPart(
    "flux",
    {"hf": ("black-forest-labs/FLUX.1-dev",), "modelscope": ("black-forest-labs/FLUX.1-dev",)},
    allow=("model_index.json", *(f"{component}/*" for component in FLUX_COMPONENTS)),
    root="flux",
    manifest_name=MANIFEST_NAME,
)
# Benchmark prompt sets (``data/benchmarks.py``, `train --eval-prompts NAME`), fetched into --prompts-dir.
PROMPT_PARTS = (
    HubPart(
        "hpdv2-prompts",
        # HPSv2's authors' dataset repo (Apache-2.0): test.json, the 400 test prompts of HPDv2 with their images'
        # paths and human rankings. No ModelScope copy was verified, so this part is Hugging Face only.
        {"hf": ("zhwang/HPDv2",), "modelscope": ()},
        allow=("test.json",),
        root="prompts",
        manifest_name=MANIFEST_NAME,
        subdir="hpdv2",
        repo_type="dataset",
    ),
)
# What a plain `fetch-weights` fetches: everything training with the default reward (HPSv2.1) needs.
DEFAULT_PARTS: tuple[str, ...] = ("flux", "hps", "clip")


def hub_parts() -> dict[str, HubPart]:
    """Every downloadable part by name: FLUX, then each reward's (its record's ``parts``), in registry order."""
    from fluxgrpo.rewards.registry import weights_parts

    rewards = {hub.name: hub for part in weights_parts().values() for hub in part.hub}
    return {FLUX_PART.name: FLUX_PART, **rewards, **{part.name: part for part in PROMPT_PARTS}}


def part_groups() -> dict[str, tuple[str, ...]]:
    """Names --only accepts besides the parts themselves: a reward part kept in several repos names them all."""
    from fluxgrpo.rewards.registry import weights_parts

    groups = {part.name: tuple(hub.name for hub in part.hub) for part in weights_parts().values() if part.hub}
    return {name: members for name, members in groups.items() if members != (name,)}


def part_choices() -> tuple[str, ...]:
    """What --only accepts, in the order its errors list them."""
    groups = part_groups()
    return (*DEFAULT_PARTS, *groups, *(p for p in hub_parts() if p not in DEFAULT_PARTS))


def expand_parts(names: Sequence[str]) -> list[str]:
    """Part names with each group (``pickscore``) replaced by its parts, in ``hub_parts()`` order, without repeats.

    Raises UsageError naming --only for an unknown name or an empty selection.
    """
    parts, groups = hub_parts(), part_groups()
    unknown = [name for name in names if name not in parts and name not in groups]
    if unknown:
        raise UsageError(f"unknown part {unknown[0]!r}: choose from {', '.join(part_choices())} (--only)")
    wanted = {part for name in names for part in groups.get(name, (name,))}
    if not wanted:
        raise UsageError(f"no part selected: choose from {', '.join(part_choices())} (--only)")
    return [name for name in parts if name in wanted]
