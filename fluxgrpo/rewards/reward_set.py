"""Several rewards at once: ``--reward hpsv2:1.0,pickscore:0.5`` → a ``RewardSet`` scoring every image with each.

The spec is a comma-separated list of ``name`` or ``name:weight`` (weight 1 when omitted, > 0). As MixGRPO does,
the weights are normalised to sum to 1, so ``hpsv2`` and ``hpsv2:2`` are the same run and a single reward is
today's reward exactly (weight 1.0). How the scores become advantages (``sum-rewards`` or ``sum-advantages``) is
``grpo/advantages.py``'s business; the set only scores.

``parse_reward_list`` is the one parser of every reward list (``train --reward``, ``score --reward``,
``--eval-rewards``), with one set of error messages; ``run_reward_names`` says which rewards' weights a run loads
(launch planning and the memory estimate ask it, not the evaluation module).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import fluxgrpo.rewards
from fluxgrpo.errors import UsageError
from fluxgrpo.rewards.registry import reward_names

if TYPE_CHECKING:
    import torch

    from fluxgrpo.rewards.base import RewardFn


@dataclass(frozen=True)
class RewardTerm:
    name: str
    weight: float  # as written; RewardSet.weights normalises


def parse_reward_list(
    spec: str, flag: str = "--reward", *, weights: bool = True, empty_ok: bool = False
) -> tuple[list[RewardTerm], list[str]]:
    """The one parser of a comma-separated reward list: ``train --reward`` (``name[:weight]``, ``weights=True``),
    ``score --reward`` and ``--eval-rewards`` (names only). Returns the terms and every problem found, each message
    naming ``flag``; ``empty_ok`` accepts an empty spec as no reward (``--eval-rewards ""``)."""

    known = reward_names()
    if empty_ok and not spec.strip():
        return [], []
    form, example = ("name[:weight]", "hpsv2:1,pickscore:0.5") if weights else ("name", "hpsv2,pickscore")
    entries = [entry.strip() for entry in spec.split(",")]
    if not all(entries):
        return [], [f"{flag} {spec!r} has an empty name: write one or more {form} separated by commas, e.g. {example}"]
    terms: list[RewardTerm] = []
    problems: list[str] = []
    unknown: list[str] = []
    for entry in entries:
        name, _, weight_text = entry.partition(":") if weights else (entry, "", "")
        name = name.strip()
        if name not in known:
            unknown.append(name)
            continue
        try:
            weight = float(weight_text) if weight_text.strip() else 1.0
        except ValueError:
            problems.append(f"{flag}: weight {weight_text!r} of {name} is not a number")
            continue
        if not (math.isfinite(weight) and weight > 0):
            problems.append(f"{flag}: weight of {name} must be a positive number (got {weight_text})")
            continue
        terms.append(RewardTerm(name, weight))
    if unknown:
        hint = ""
        if not weights and any(":" in name for name in unknown):
            hint = " (names only here; name:weight is for `fluxgrpo train --reward`)"
        problems.insert(
            0, f"{flag}: unknown reward {', '.join(map(repr, unknown))}: use one or more of {', '.join(known)}{hint}"
        )
    names = [term.name for term in terms]
    repeated = [name for name in dict.fromkeys(names) if names.count(name) > 1]
    if repeated:
        problems.append(f"{flag} lists {', '.join(repeated)} more than once: give each reward once")
    try:
        total = math.fsum(term.weight for term in terms)
    except OverflowError:
        total = math.inf
    if not math.isfinite(total):
        problems.append(
            f"{flag} {spec!r}: the weights add up past the largest float; scale them down (only their ratios matter)"
        )
    return terms, problems


def reward_spec_problems(spec: str) -> list[str]:
    """Every problem with a ``train --reward`` spec (empty when it is valid), for config validation."""
    return parse_reward_list(spec)[1]


def parse_reward_spec(spec: str) -> list[RewardTerm]:
    """``"hpsv2:1.0,pickscore:0.5"`` → [RewardTerm("hpsv2", 1.0), RewardTerm("pickscore", 0.5)]; UsageError if bad."""
    return _valid(*parse_reward_list(spec))


def reward_spec_names(spec: str) -> list[str]:
    """The reward names a valid ``train --reward`` spec lists, in order."""
    return [term.name for term in parse_reward_spec(spec)]


def reward_names_list(spec: str, flag: str = "--reward", *, empty_ok: bool = False) -> list[str]:
    """The names of a names-only list (``score --reward``, ``--eval-rewards``); UsageError naming ``flag`` if bad."""
    return [term.name for term in _valid(*parse_reward_list(spec, flag, weights=False, empty_ok=empty_ok))]


def _valid(terms: list[RewardTerm], problems: list[str]) -> list[RewardTerm]:
    if problems:
        raise UsageError("; ".join(problems))
    return terms


def eval_reward_names(reward: str, eval_rewards: str) -> list[str]:
    """The rewards a held-out evaluation scores with: the training reward(s) first, then ``--eval-rewards``, each
    once."""
    return list(
        dict.fromkeys([*reward_spec_names(reward), *reward_names_list(eval_rewards, "--eval-rewards", empty_ok=True)])
    )


# Rewards whose scorer exposes ``embed_pil`` (CLIP image features), most general first: plain CLIP, then HPSv2's
# fine-tuned CLIP. Named here, away from torch, so the config can validate a diversity guard without loading them
# (``training/eval.py`` measures the diversity).
EMBEDDING_REWARDS = ("clipscore", "hpsv2")


def embedding_reward(reward_names: Sequence[str]) -> str | None:
    """The reward whose image features measure diversity among ``reward_names`` (None: none of them has any)."""
    return next((name for name in EMBEDDING_REWARDS if name in reward_names), None)


def run_reward_names(reward: str, eval_rewards: str, eval_every: int) -> list[str]:
    """Which rewards' weights a run loads: the training ones, and with evaluation on (``eval_every`` > 0) the
    evaluation's too (they load at iteration 0, so launch planning checks them with the training's)."""
    return eval_reward_names(reward, eval_rewards) if eval_every > 0 else reward_spec_names(reward)


class RewardSet:
    """Each reward of a spec, loaded once; ``set(images, prompts)`` → scores [B, K] float32, one column per reward.

    ``names`` and ``weights`` (normalised to sum 1, float32, on the scores' device) are in the spec's order.
    """

    def __init__(self, terms: list[RewardTerm], rewards: list[RewardFn], device: torch.device | str = "cpu") -> None:
        import torch

        self.names = [term.name for term in terms]
        self.rewards = rewards
        total = math.fsum(term.weight for term in terms)
        self.weights = torch.tensor([term.weight / total for term in terms], dtype=torch.float32, device=device)

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        import torch

        return torch.stack([reward(images, prompts).float() for reward in self.rewards], dim=1)


def load_reward_set(
    spec: str, hps_dir: str | Path, device: torch.device | str = "cpu", reward_dtype: str = "fp32"
) -> RewardSet:
    """Parse ``spec`` and load each reward it names (``rewards.load_reward``) onto ``device``."""

    terms = parse_reward_spec(spec)
    return RewardSet(
        terms, [fluxgrpo.rewards.load_reward(term.name, hps_dir, device, reward_dtype) for term in terms], device
    )
