"""Guards on the held-out evaluation, the best checkpoint, and the run's drift signals: a run that starts hacking
its reward is seen, and stopped if asked, while the images are still good.

``--guard clipscore:-3%,diversity:-15%,velocity_norm_ratio:max=1.05`` is a comma-separated list of rules, one per
metric, each ``NAME:BOUND``:

- NAME is a reward the evaluation scores (the training ``--reward``s and ``--eval-rewards``: its
  ``eval_<reward>_mean``), ``diversity`` (``eval_diversity``), or a per-iteration drift signal:
  ``velocity_norm_ratio`` or ``group_spread`` (``group_std_mean``, the within-group reward spread that collapses
  before hacking).
- BOUND is ``-X%`` (fires when the value falls more than X % of |baseline| below the baseline), ``+X%`` (rises more
  than X % above it), ``min=V`` (fires below the value V) or ``max=V`` (above V): words, not ``<``/``>``, which a
  shell would take for redirections.

Relative rules compare with the run's *first* value of the metric, never with the best so far: for an evaluation
metric the base model's evaluation at iteration 0, for a drift signal its mean over the iterations up to the first
evaluation after iteration 0. A best-so-far reference would ratchet on evaluation noise (one lucky evaluation
and the next ordinary one fires) and would forgive a slow decline that never had a peak; the question a guard
answers is "is the model now worse than the one I started from". The baselines are kept in every checkpoint, so a
resumed run compares with the same numbers.

Every rule is checked at every held-out evaluation (``--eval-every``; guards need it): an evaluation metric with the
value just measured, a drift signal with its mean over the iterations since the previous evaluation. A non-finite
value fires. ``--guard-action warn`` (the default) logs and goes on; ``stop`` ends the run cleanly at that
evaluation: a checkpoint of that iteration is written, one line names the rule, the iteration and the values, and
``fluxgrpo train`` exits with ``GUARD_STOP_EXIT_CODE`` (3: neither success, 0, nor a failure, 1, nor a usage error, 2,
so a scheduler can tell "stopped by a guard" from a crash). Guards only read metrics: with ``warn`` every training
number is what it is without them.

``--keep-best METRIC`` (a reward name, ``diversity``, or the full key, e.g. ``eval_hpsv2_mean``; higher is better)
keeps the checkpoint of the best evaluation after iteration 0 among those that passed every guard as
``output_dir/best/`` (``checkpoint/best.py``): a checkpoint is written at that iteration if none was due, and
``--keep-last`` never rotates ``best/`` away. ``sample`` and ``export`` take it like any checkpoint.

metrics.jsonl gets one ``guards`` record after each checked evaluation (each rule's value, limit and whether it
fired, ``guards_fired`` and ``best_iteration``), TensorBoard / wandb the numbers of it, and the per-iteration
progress line says when a rule has fired.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fluxgrpo.checkpoint.best import publish_best, read_best
from fluxgrpo.checkpoint.layout import BEST_DIR, checkpoint_dir, is_complete_checkpoint
from fluxgrpo.config.guard_rules import GuardRule, metric_key, parse_guard_spec
from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.metrics import read_metrics
from fluxgrpo.rewards.reward_set import eval_reward_names
from fluxgrpo.runtime import dist as rt_dist
from fluxgrpo.training.drift import DriftProbe
from fluxgrpo.training.resume_state import read_training_state

GUARD_STOP_EXIT_CODE = 3
GUARD_RECORD = "guards"  # the value of ``record["record"]`` in metrics.jsonl for a guard check

if TYPE_CHECKING:
    import torch

    from fluxgrpo.config import TrainConfig
    from fluxgrpo.grpo.types import Conditioning, FinalSamples, Rollout
    from fluxgrpo.metrics import MetricsLogger
    from fluxgrpo.training.parts import TrainingParts


# --------------------------------------------------------------------------------------------- the run's monitor


@dataclass
class Verdict:
    """What the loop does after a guard check (the same on every rank)."""

    save_checkpoint: bool = False  # a new best, or a stop: this iteration needs its checkpoint
    stop: bool = False
    message: str = ""  # the stop line


@dataclass
class GuardState:
    """What a resumed run needs: the baselines, the first iteration each rule fired, the best evaluation, the
    drift probe's reference and the last evaluated iteration (plain JSON: kept in trainer_state.json)."""

    baselines: dict[str, float] = field(default_factory=dict)
    fired: dict[str, int] = field(default_factory=dict)
    best: dict[str, Any] | None = None  # {"iteration", "metric", "value"}
    last_evaluation: int = 0
    drift: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "baselines": dict(self.baselines),
            "fired": dict(self.fired),
            "best": self.best,
            "last_evaluation": self.last_evaluation,
            "drift": self.drift,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> GuardState:
        data = data or {}
        return cls(
            baselines={k: float(v) for k, v in data.get("baselines", {}).items()},
            fired={k: int(v) for k, v in data.get("fired", {}).items()},
            best=data.get("best"),
            last_evaluation=int(data.get("last_evaluation", 0)),
            drift=dict(data.get("drift", {})),
        )


class RunMonitor:
    """Guards, the best checkpoint and the drift probe of one rank; its check is a collective (rank 0 decides)."""

    STATE_KEY = "guards"  # in trainer_state

    def __init__(self, cfg: TrainConfig, parts: TrainingParts, metrics: MetricsLogger, checkpoint: Path | None) -> None:
        self.cfg, self.ctx, self.metrics = cfg, parts.ctx, metrics
        self.rules = parse_guard_spec(cfg.guard, eval_reward_names(cfg.reward, cfg.eval_rewards))
        self.best_key = metric_key(cfg.keep_best.strip()) if cfg.keep_best.strip() else None
        saved: dict[str, Any] | None = None
        if checkpoint is not None:
            saved = read_training_state(checkpoint).get(self.STATE_KEY)
        self.state = GuardState.from_dict(saved)
        self.drift = DriftProbe(cfg, parts, self.state.drift)
        self._pending_best: dict[str, Any] | None = None
        if self.state.best is not None and self.state.best["metric"] != self.best_key:
            self.state.best = None  # --keep-best changed on resume: the best by the new metric starts over
        if checkpoint is not None and self.ctx.is_main:
            self._baselines_from_metrics()
            if self.best_key:
                self._reconcile_best()

    def state_dict(self) -> dict[str, Any]:
        self.state.drift = self.drift.state_dict()
        return self.state.to_dict()

    def measure_drift(
        self, iteration: int, rollout: Rollout | FinalSamples, cond: Conditioning, timestep_generator: torch.Generator
    ) -> dict[str, Any]:
        """This iteration's drift signals and guard status, for its metrics record (every rank)."""
        values = self.drift.measure(iteration, rollout, cond, timestep_generator)
        return {**values, "guards_fired": len(self.state.fired)}

    def check(self, iteration: int, evaluation: dict[str, Any], records: list[dict[str, Any]]) -> Verdict:
        """After the evaluation of ``iteration`` (``evaluation``: its record on rank 0, ``{}`` elsewhere or when
        none ran): check every rule, log the guard record, pick the best. Call on every rank."""

        decided: tuple[Verdict, dict[str, Any]] | None = None
        if self.ctx.is_main:
            verdict = self._check(iteration, evaluation, records) if evaluation else Verdict()
            decided = (verdict, self.state.to_dict())
        verdict, state = rt_dist.broadcast_object(self.ctx, decided)
        drift = self.state.drift
        self.state = GuardState.from_dict(state)
        self.state.drift = drift
        return verdict  # the stop line is printed once, by `fluxgrpo train`, from the guard record

    def checkpoint_saved(self, iteration: int, path: Path) -> None:
        """After checkpoint ``iteration`` is complete: publish it as ``best/`` when it is the new best."""
        pending, self._pending_best = self._pending_best, None
        if self.ctx.is_main and pending is not None and pending["iteration"] == iteration:
            best = publish_best(path, pending)
            rt_dist.rank0_print(
                self.ctx, f"best {pending['metric']} {pending['value']:.4g} at iteration {iteration}: {best}"
            )

    # ----------------------------------------------------------------------------------------- rank 0

    def _baselines_from_metrics(self) -> None:
        """A rule added on resume has no saved baseline: an evaluation metric's is in metrics.jsonl at iteration 0."""

        missing = {r.key for r in self.rules if r.relative and not r.per_iteration} - set(self.state.baselines)
        if not missing:
            return
        for record in read_metrics(Path(self.cfg.output_dir)):
            if record.get("iteration") == 0:
                for key in missing & set(record):
                    if isinstance(record[key], int | float):
                        self.state.baselines.setdefault(key, float(record[key]))

    def _reconcile_best(self) -> None:
        """Make ``best/`` the best this run's state knows: a run resumed from an earlier checkpoint than the dead
        run's last may find a ``best/`` from iterations it is about to redo; it is put back to the checkpoint the
        state names (when that checkpoint is still on disk), else removed."""

        output_dir = Path(self.cfg.output_dir)
        try:
            on_disk = read_best(output_dir)
        except FluxgrpoError as exc:  # a damaged record never blocks resuming a checkpoint; the next best replaces it
            rt_dist.rank0_print(self.ctx, f"warning: {exc}")
            return
        wanted = self.state.best
        if on_disk is None or on_disk.get("metric") != self.best_key:
            return  # none yet, or the best by another metric: kept until a best by this one replaces it
        if wanted is not None and on_disk.get("iteration") == wanted["iteration"]:
            return
        source = checkpoint_dir(output_dir, wanted["iteration"]) if wanted is not None else None
        if wanted is not None and source is not None and is_complete_checkpoint(source):
            publish_best(source, wanted)
            rt_dist.rank0_print(self.ctx, f"best/ put back to iteration {wanted['iteration']}, the resumed state's")
        else:
            shutil.rmtree(output_dir / BEST_DIR)
            rt_dist.rank0_print(
                self.ctx, f"removed best/ (iteration {on_disk.get('iteration')}): the resumed run is before it"
            )

    def _check(self, iteration: int, evaluation: dict[str, Any], records: list[dict[str, Any]]) -> Verdict:
        state = self.state
        window = [r for r in records if state.last_evaluation < r.get("iteration", 0) <= iteration]
        record: dict[str, Any] = {"iteration": iteration, "record": GUARD_RECORD}
        fired_now = []
        for rule in self.rules:
            value = self._value(rule, evaluation, window)
            if value is None:
                continue
            baseline = state.baselines.get(rule.key)
            if baseline is None and rule.relative:
                if rule.per_iteration == (iteration > 0):
                    state.baselines[rule.key] = value
                baseline = state.baselines.get(rule.key)
            fires = rule.fires(value, baseline)
            limit = rule.limit(baseline)
            record[f"guard_{rule.name}_value"] = value
            record[f"guard_{rule.name}_limit"] = limit
            record[f"guard_{rule.name}_fired"] = int(fires)
            if fires:
                fired_now.append((rule, value, baseline))
                state.fired.setdefault(rule.text, iteration)
        state.last_evaluation = iteration
        verdict = Verdict()
        best_value = evaluation.get(self.best_key) if self.best_key else None
        if (
            self.best_key
            and iteration > 0
            and not fired_now
            and isinstance(best_value, int | float)
            and math.isfinite(best_value)
            and (state.best is None or best_value > state.best["value"])
        ):
            state.best = {"iteration": iteration, "metric": self.best_key, "value": float(best_value)}
            self._pending_best = dict(state.best)
            verdict.save_checkpoint = True
        record["guards_fired"] = len(state.fired)
        record["guard_stop"] = int(bool(fired_now) and self.cfg.guard_action == "stop")
        if state.best is not None:
            record["best_iteration"] = state.best["iteration"]
        stopping = bool(fired_now) and self.cfg.guard_action == "stop"
        # a stop is said once, by `fluxgrpo train` (its last line): the rule that stops is not announced here too
        for rule, value, baseline in fired_now[1:] if stopping else fired_now:
            rt_dist.rank0_print(self.ctx, f"guard fired at iteration {iteration}: {rule.describe(value, baseline)}")
        if stopping:
            verdict.stop = verdict.save_checkpoint = True
            rule, value, baseline = fired_now[0]
            best = f"; best: iteration {state.best['iteration']} (best/)" if state.best else ""
            # Before any update (the base model, or the checkpoint a run resumed from) the loop stops before training.
            ends = f"the run ends with checkpoint-{iteration}" if iteration > 0 else "the run stops before training"
            verdict.message = (
                f"stopped by guard {rule.text} at iteration {iteration}: {rule.describe(value, baseline)}; {ends}{best}"
            )
            record["guard_stop_message"] = verdict.message
        if self.rules or self.best_key:
            self.metrics.log(record)
        return verdict

    @staticmethod
    def _value(rule: GuardRule, evaluation: dict[str, Any], window: list[dict[str, Any]]) -> float | None:
        """The rule's value at this evaluation; None when the metric was not measured here."""
        if rule.per_iteration:
            values = [r.get(rule.key) for r in window if "reward_mean" in r]
            if not values:
                return None
            numbers = [math.nan if v is None else float(v) for v in values]
            return math.fsum(numbers) / len(numbers)
        value = evaluation.get(rule.key)
        return math.nan if value is None and rule.key in evaluation else value


def guard_stop(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The guard record that stopped the run whose metrics these are (its last record), or None."""
    if records and records[-1].get("record") == GUARD_RECORD and records[-1].get("guard_stop"):
        return records[-1]
    return None
