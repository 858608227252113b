"""The shape of every JSON file a resume trusts: a file that parses but holds the wrong shape (a hand edit, another
tool, damage with its checksum recomputed) is refused in one line naming it, never met later as a ``KeyError``.

- ``check_trainer_state`` (read for a resume by ``training/resume_state.read_training_state``): a training run's ``state/trainer_state.json`` (iteration,
  each rank's sampler position, the config, the guards' state), checked wherever a resume reads it.
- ``check_best_record``: ``best/BEST.json`` (iteration, metric, value, checkpoint).
- ``check_checksum_record``: ``state/checksums_rank<r>.json`` names every state file its rank wrote, each with a
  sha256: an emptied or thinned record would leave files unverified.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fluxgrpo.errors import FluxgrpoError

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _is_int(value: Any, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _trainer_state_problem(state: Any, world_size: int | None) -> str | None:
    if not isinstance(state, dict):
        return f"it holds a {type(state).__name__}, not an object"
    if not _is_int(state.get("iteration")):
        return "its iteration is not a count"
    samplers = state.get("sampler")
    if not isinstance(samplers, dict) or not samplers:
        return "it has no sampler positions"
    ranks = [str(rank) for rank in range(world_size)] if world_size else list(samplers)
    for rank in ranks:
        position = samplers.get(rank)
        if not isinstance(position, dict) or set(position) != {"epoch", "position"}:
            return f"rank {rank}'s sampler position is missing or not {{epoch, position}}"
        if not all(_is_int(value) for value in position.values()):
            return f"rank {rank}'s sampler position is not two counts"
    if not isinstance(state.get("config"), dict):
        return "its config is not an object"
    guards = state.get("guards")
    if guards is not None:
        if not isinstance(guards, dict):
            return "its guards state is not an object"
        if not all(isinstance(guards.get(k, {}), dict) for k in ("baselines", "fired", "drift")):
            return "its guards' baselines, fired rules or drift reference are not objects"
        if not all(_is_number(v) for v in guards.get("baselines", {}).values()):
            return "a guard baseline is not a number"
        if not all(_is_int(v) for v in guards.get("fired", {}).values()):
            return "a fired guard's iteration is not a count"
        if not _is_int(guards.get("last_evaluation", 0)):
            return "its last evaluated iteration is not a count"
        best = guards.get("best")
        if best is not None and _best_problem(best, with_checkpoint=False) is not None:
            return f"its best evaluation is malformed ({_best_problem(best, with_checkpoint=False)})"
    return None


def check_trainer_state(state: Any, path: Path, world_size: int | None, fix: str) -> dict[str, Any]:
    """``state`` (read from ``path``) when it has the shape fluxgrpo writes, for ``world_size`` ranks.

    Raises:
        FluxgrpoError: one line naming ``path``, what is wrong, and ``fix``.
    """
    problem = _trainer_state_problem(state, world_size)
    if problem is not None:
        raise FluxgrpoError(f"{path} is malformed ({problem}; not the training state fluxgrpo writes): {fix}")
    return state


def _best_problem(record: Any, *, with_checkpoint: bool) -> str | None:
    if not isinstance(record, dict):
        return f"it holds a {type(record).__name__}, not an object"
    if not _is_int(record.get("iteration"), minimum=1):
        return "its iteration is not a positive count"
    if not isinstance(record.get("metric"), str) or not record["metric"]:
        return "its metric is not a name"
    if not _is_number(record.get("value")):
        return "its value is not a number"
    if with_checkpoint and not isinstance(record.get("checkpoint"), str):
        return "it names no checkpoint"
    return None


def check_best_record(record: Any, path: Path) -> dict[str, Any]:
    """``best/BEST.json``'s record when it has the shape fluxgrpo writes.

    Raises:
        FluxgrpoError: one line naming the file and saying what to remove (the run's checkpoints are unaffected).
    """
    problem = _best_problem(record, with_checkpoint=True)
    if problem is not None:
        raise FluxgrpoError(best_damaged_message(path, problem))
    return record


def best_damaged_message(path: Path, problem: str) -> str:
    return (
        f"{path} is damaged ({problem}), so {path.parent} is not a usable best checkpoint: remove {path.parent} "
        "(the run publishes a new best at its next best evaluation), or pass a checkpoint-<k> folder instead"
    )


def check_checksum_record(sums: Any, record: Path, files: Iterable[Path], fix: str) -> dict[str, str]:
    """``sums`` (read from ``record``) when it holds a sha256 for every one of ``files`` (the state files its rank
    wrote), so no file goes unverified.

    Raises:
        FluxgrpoError: one line naming the record and the first file without a checksum.
    """
    if not isinstance(sums, dict) or not all(isinstance(v, str) and _SHA256.match(v) for v in sums.values()):
        raise FluxgrpoError(f"{record} is damaged (not a sha256 per file): {fix}")
    for path in files:
        if path.name not in sums:
            raise FluxgrpoError(
                f"{record} has no checksum for {path.name}, so that file cannot be verified: the checkpoint's "
                f"checksums were altered; {fix}"
            )
    return sums
