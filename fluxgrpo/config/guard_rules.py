"""The rules of ``--guard`` and ``--keep-best`` (``NAME:BOUND``; the syntax and what each rule means are in
``training/guards.py``): parsing, the metrics.jsonl key each reads, and the config check. Torch-free and importing
nothing of the run, so the config validates the rules before any worker starts."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fluxgrpo.errors import UsageError
from fluxgrpo.grpo.objectives.catalogue import CATALOGUE
from fluxgrpo.rewards.reward_set import EMBEDDING_REWARDS, embedding_reward, eval_reward_names

if TYPE_CHECKING:
    from fluxgrpo.config import TrainConfig

GUARD_ACTIONS = ("warn", "stop")
# Per-iteration drift signals a rule may read: rule name → metrics.jsonl key of the iteration records.
DRIFT_SIGNALS = {"velocity_norm_ratio": "velocity_norm_ratio", "group_spread": "group_std_mean"}
DIVERSITY = "diversity"
_RELATIVE = {"-": "fall", "+": "rise"}
_ABSOLUTE = {"min=": "below", "max=": "above"}
_SYNTAX = "write NAME:-X% (fall), NAME:+X% (rise), NAME:min=V or NAME:max=V, e.g. clipscore:-3%"


@dataclass(frozen=True)
class GuardRule:
    """One ``NAME:BOUND`` entry of ``--guard``."""

    name: str  # as written: a reward name, ``diversity`` or a drift signal
    kind: str  # fall | rise (relative, percent of |baseline|) | below | above (absolute)
    bound: float  # the percentage (fall/rise) or the value (below/above)
    text: str  # the entry as written, for messages

    @property
    def key(self) -> str:
        """The metrics.jsonl key the rule reads."""
        return metric_key(self.name)

    @property
    def per_iteration(self) -> bool:
        return self.name in DRIFT_SIGNALS

    @property
    def relative(self) -> bool:
        return self.kind in ("fall", "rise")

    def limit(self, baseline: float | None) -> float | None:
        """The value beyond which the rule fires; None for a relative rule without a baseline yet."""
        if not self.relative:
            return self.bound
        if baseline is None or not math.isfinite(baseline):
            return None
        step = abs(baseline) * self.bound / 100
        return baseline - step if self.kind == "fall" else baseline + step

    def fires(self, value: float, baseline: float | None) -> bool:
        if not math.isfinite(value):
            return True
        limit = self.limit(baseline)
        if limit is None:
            return False
        return value < limit if self.kind in ("fall", "below") else value > limit

    def describe(self, value: float, baseline: float | None) -> str:
        """``clipscore 0.2888 fell 4.12 % below its iteration-0 value 0.3012 (limit −3 %: 0.2922)``."""
        limit = self.limit(baseline)
        if not math.isfinite(value):
            return f"{self.name} is {value} (not finite)"
        if self.relative and baseline is not None and limit is not None:
            change = 100 * (value - baseline) / abs(baseline) if baseline else math.inf
            return (
                f"{self.name} {value:.4g} is {change:+.2f} % from its baseline {baseline:.4g} "
                f"(rule {self.text}: limit {limit:.4g})"
            )
        return f"{self.name} {value:.4g} (rule {self.text})"


def metric_key(name: str) -> str:
    """The metrics.jsonl key of a guard or ``--keep-best`` name: a full ``eval_…`` key is kept as it is."""
    if name.startswith("eval_"):
        return name
    if name in DRIFT_SIGNALS:
        return DRIFT_SIGNALS[name]
    if name == DIVERSITY:
        return "eval_diversity"
    return f"eval_{name}_mean"


def _parse(spec: str, evaluated: list[str]) -> tuple[list[GuardRule], list[str]]:
    rules: list[GuardRule] = []
    problems: list[str] = []
    if not spec.strip():
        return [], []
    known = [*evaluated, DIVERSITY, *DRIFT_SIGNALS]
    for entry in (part.strip() for part in spec.split(",")):
        name, _, bound_text = entry.partition(":")
        name, bound_text = name.strip(), bound_text.strip().replace(" ", "")
        prefix = next((p for p in (*_RELATIVE, *_ABSOLUTE) if bound_text.startswith(p)), None)
        if not entry or prefix is None:
            problems.append(f"--guard {entry!r}: {_SYNTAX}")
            continue
        if name not in known:
            problems.append(
                f"--guard: {name!r} is not a metric the run measures; use an evaluated reward "
                f"({', '.join(evaluated)}; add others with --eval-rewards), diversity, "
                f"{' or '.join(DRIFT_SIGNALS)}"
            )
            continue
        kind = _RELATIVE.get(prefix) or _ABSOLUTE[prefix]
        relative = prefix in _RELATIVE
        number_text = bound_text[len(prefix) :]
        if relative != number_text.endswith("%"):
            problems.append(
                f"--guard {entry!r}: a fall or rise is a percentage (-3%, +5%), a limit a plain value (min=0.2, "
                "max=1.05)"
            )
            continue
        try:
            bound = float(number_text.removesuffix("%"))
        except ValueError:
            problems.append(f"--guard {entry!r}: {number_text!r} is not a number")
            continue
        if not math.isfinite(bound) or (relative and bound <= 0):
            problems.append(f"--guard {entry!r}: the percentage must be a positive number")
            continue
        if any(rule.name == name for rule in rules):
            problems.append(f"--guard: {name} has two rules; give one rule per metric")
            continue
        rules.append(GuardRule(name, kind, bound, entry))
    return rules, problems


def parse_guard_spec(spec: str, evaluated: list[str]) -> list[GuardRule]:
    """``"clipscore:-3%,velocity_norm_ratio:max=1.05"`` → rules; UsageError naming every bad entry.

    ``evaluated``: the rewards the held-out evaluation scores (``reward_set.eval_reward_names``).
    """
    rules, problems = _parse(spec, evaluated)
    if problems:
        raise UsageError("; ".join(problems))
    return rules


def guard_problems(cfg: TrainConfig) -> list[str]:
    """Every problem with ``--guard``, ``--guard-action`` and ``--keep-best`` together with the evaluation settings."""
    out = []
    if cfg.guard_action not in GUARD_ACTIONS:
        out.append(f"--guard-action {cfg.guard_action!r}: use one of {', '.join(GUARD_ACTIONS)}")
    try:
        evaluated = eval_reward_names(cfg.reward, cfg.eval_rewards)
    except UsageError:
        return out  # --reward / --eval-rewards report their own problems; the rules are checked once they are fixed
    rules, problems = _parse(cfg.guard, evaluated)
    out += problems
    best = cfg.keep_best.strip()
    if (rules or best) and cfg.eval_every <= 0:
        out.append("--guard and --keep-best act on the held-out evaluation: set --eval-every K too")
    if best and metric_key(best) not in {metric_key(name) for name in [*evaluated, DIVERSITY]}:
        out.append(
            f"--keep-best {best!r}: use an evaluated reward ({', '.join(evaluated)}; add others with --eval-rewards), "
            "diversity, or its eval_… key"
        )
    refused = set(CATALOGUE[cfg.objective].refused_guards) if cfg.objective in CATALOGUE else set()
    for name in sorted(refused & {rule.name for rule in rules}):
        out.append(
            f"{name} is measured on the SDE trajectory's trained steps, which --objective {cfg.objective} "
            "does not keep (its probe reports NaN): guard diversity, group_spread or an evaluated reward instead"
        )
    if DIVERSITY in {rule.name for rule in rules} | {best}:
        if cfg.eval_images_per_prompt < 2:
            out.append("diversity compares a prompt's images across seeds: set --eval-images-per-prompt 2 or more")
        if embedding_reward(evaluated) is None:
            out.append(
                f"diversity is measured in a reward's CLIP image features: add {' or '.join(EMBEDDING_REWARDS)} to "
                "--eval-rewards"
            )
    return out
