"""One record per reward, and the registry every other module reads them from.

A reward's module declares its ``RECORD`` (a ``RewardRecord``): its name, its loader, the weights parts it owns
inside ``--hps-dir`` (each with its layout check and the hub repos `fetch-weights` takes it from), the parts it
reads, its parameter count and dtype rule for the memory estimate, and its tiny writer for `fetch-weights --source
tiny`. ``BUILTIN_REWARD_MODULES`` lists the modules in the order the CLI shows the rewards. Adding a reward is its
module plus one line here: `env-check`, `fetch-weights` (hub and tiny), `train`, `score` and the memory estimate
all read the registry (``register_reward`` adds one at run time, as the tests do).

Reward modules are imported when the registry is first read, never at import; they import only light modules at
their top (torch and the model libraries inside their loaders).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fluxgrpo.errors import UsageError

if TYPE_CHECKING:
    import torch

    from fluxgrpo.rewards.base import RewardFn
    from fluxgrpo.weights.hub_part import HubPart
    from fluxgrpo.weights.layout import PartStatus

# A loader builds one reward: (hps_dir, device, encoder dtype) → RewardFn.
RewardLoader = Callable[[Path, "torch.device | str", "torch.dtype"], "RewardFn"]

# In the order `--reward`'s help, env-check and `score` list them; hpsv2 (the default) first.
BUILTIN_REWARD_MODULES = (
    "fluxgrpo.rewards.hpsv2",
    "fluxgrpo.rewards.pickscore",
    "fluxgrpo.rewards.clipscore",
    "fluxgrpo.rewards.imagereward",
    "fluxgrpo.rewards.hpsv3",
    "fluxgrpo.rewards.brightness",
    "fluxgrpo.rewards.exposure",
    "fluxgrpo.rewards.structure",
    "fluxgrpo.rewards.shapes",  # the shapes world's checker
    "fluxgrpo.rewards.shapes_scene",  # the checker and "nothing else in the image", a training reward
    "fluxgrpo.rewards.shapes_strict",  # shapes-scene all or nothing, a training reward
)


@dataclass(frozen=True)
class WeightsPart:
    """One weights part a reward owns inside ``--hps-dir``: what `fetch-weights --only NAME` fetches and env-check
    reports as ``weights: NAME``."""

    name: str
    check: Callable[[Path], PartStatus]  # hps_dir → whether the part is complete there, and what to do if not
    # The hub repos it comes from (``weights/hub_parts.py``); several are fetched together under ``name``.
    hub: tuple[HubPart, ...] = ()


@dataclass(frozen=True)
class RewardRecord:
    """Everything the rest of fluxgrpo needs to know about one reward."""

    name: str
    load: RewardLoader
    parts: tuple[WeightsPart, ...] = ()  # the weights parts this reward owns
    # The parts it reads, by name (its own, or another reward's: clipscore reads hpsv2's clip); default its own.
    reads: tuple[str, ...] | None = None
    # (hps_dir, seed) → bytes written per owned part: tiny random weights in the real layout, a manifest per part.
    write_tiny: Callable[[Path, int], Mapping[str, int]] | None = None
    parameters: int = 0  # the reward model's parameter count, for the memory estimate
    # Whether --reward-dtype bf16 casts its weights (HPSv3, as its authors run it); the others keep float32 weights
    # and run their encoders under bf16 autocast, so they cost 4 bytes a parameter either way.
    casts_weights: bool = False
    # (prompts, per-image scores) → more numbers beside the mean, for `score` and the held-out evaluation (shapes:
    # the strict all-claims rate, seen and novel combinations apart).
    summarize: Callable[[Sequence[str], Sequence[float]], dict[str, float]] | None = None
    # (image file, prompt) → one line per reason behind its score, for the report's grid captions (shapes: each
    # claim ✓/✗); [] when there is nothing to say.
    explain: Callable[[Path, str], list[str]] | None = None
    # prompts → problems, for a reward that reads only some prompts (shapes: its world's captions); the training
    # captions and the held-out prompts are checked before any worker starts.
    prompt_problems: Callable[[Sequence[str]], list[str]] | None = None
    # (height, width) → problems, for a reward that reads only some image sizes; checked before any worker starts.
    image_size_problems: Callable[[int, int], list[str]] | None = None

    @property
    def read_parts(self) -> tuple[str, ...]:
        return tuple(part.name for part in self.parts) if self.reads is None else self.reads

    def weight_bytes(self, reward_bytes: int) -> int:
        """Bytes of its weights on a die for ``--reward-dtype`` of ``reward_bytes`` (4 fp32, 2 bf16)."""
        return (reward_bytes if self.casts_weights else 4) * self.parameters


_records: dict[str, RewardRecord] = {}


def _registry() -> dict[str, RewardRecord]:
    if not _records:
        for module in BUILTIN_REWARD_MODULES:
            record: RewardRecord = importlib.import_module(module).RECORD
            _records[record.name] = record
    return _records


def register_reward(record: RewardRecord) -> None:
    """Add ``record`` after the built-in rewards (replacing one of the same name)."""
    _registry()[record.name] = record


def unregister_reward(name: str) -> None:
    _registry().pop(name, None)


def reward_records() -> list[RewardRecord]:
    return list(_registry().values())


def reward_names() -> list[str]:
    return list(_registry())


def reward_record(name: str) -> RewardRecord:
    """The record of reward ``name``; UsageError naming --reward and the choices when there is none."""
    record = _registry().get(name)
    if record is None:
        raise UsageError(f"unknown reward {name!r}: use --reward with one of {', '.join(_registry())}")
    return record


def weights_parts() -> dict[str, WeightsPart]:
    """Every reward weights part by name, in registry order (each once, under the reward that owns it)."""
    return {part.name: part for record in _registry().values() for part in record.parts}


def reward_weights_status(name: str, hps_dir: str | Path) -> list[PartStatus]:
    """The weight parts reward ``name`` reads from ``hps_dir``, each checked; [] for none."""
    parts = weights_parts()
    return [parts[part].check(Path(hps_dir)) for part in reward_record(name).read_parts]
