"""What a run folder holds, read back for the report: metrics, resolved config, run facts and evaluations.

A training ``--output-dir`` holds (all optional except ``metrics.jsonl``):

    metrics.jsonl                   one record per iteration (``fluxgrpo.metrics``), eval records at iteration k
    config.yaml                     the resolved config, with the derived numbers in its comment header
    run_info.json                   versions and hardware of the run (``fluxgrpo.metrics.write_run_info``)
    eval/iteration-<k>[-ema]/       held-out evaluation images + ``index.json`` (``fluxgrpo.training.eval``)
    best/BEST.json                  the checkpoint ``--keep-best`` kept (``fluxgrpo.training.guards``)
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fluxgrpo.checkpoint.best import read_best
from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.metrics import read_metrics
from fluxgrpo.run_folder import CONFIG_FILE, EVAL_DIR, INDEX_FILE, METRICS_FILE, RUN_INFO_FILE
from fluxgrpo.training.guards import GUARD_RECORD

_EVAL_FOLDER = re.compile(r"^iteration-(\d+)(-ema)?$")


@dataclass(frozen=True)
class EvalImage:
    path: Path
    prompt: str
    prompt_index: int
    image_index: int
    seed: int


@dataclass(frozen=True)
class Evaluation:
    """One held-out evaluation: its iteration, whether it used the EMA weights, its images and mean scores."""

    iteration: int
    ema: bool
    folder: Path
    images: list[EvalImage]
    scores: dict[str, dict[str, float]]  # reward → {"mean", "std"}


@dataclass
class RunData:
    """Everything the report shows about one run."""

    folder: Path
    name: str
    records: list[dict[str, Any]]  # training iterations (records holding reward_mean)
    eval_records: list[dict[str, Any]]  # records with eval_* keys, by iteration
    config: dict[str, Any] = field(default_factory=dict)
    derived: dict[str, str] = field(default_factory=dict)  # the resolved config's comment header
    info: dict[str, Any] = field(default_factory=dict)
    evaluations: list[Evaluation] = field(default_factory=list)
    guard_records: list[dict[str, Any]] = field(default_factory=list)  # one per guard check (training/guards.py)
    best: dict[str, Any] | None = None  # best/BEST.json: iteration, metric, value, checkpoint
    left_out: list[str] = field(default_factory=list)  # one line per evaluation folder that could not be read

    def guard_names(self) -> list[str]:
        """The metrics the run's guards watched, in first-seen order."""
        names: dict[str, None] = {}
        for record in self.guard_records:
            for key in record:
                match = re.match(r"^guard_(.+)_value$", key)
                if match:
                    names.setdefault(match.group(1))
        return list(names)

    def series(self, key: str, records: list[dict[str, Any]] | None = None) -> tuple[list[int], list[float]]:
        """(iterations, values) of ``key`` over the records that hold a finite number for it."""
        xs, ys = [], []
        for record in self.records if records is None else records:
            value = record.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool) and value == value:
                xs.append(int(record["iteration"]))
                ys.append(float(value))
        return xs, ys

    def eval_rewards(self) -> list[str]:
        """Reward names with an ``eval_<reward>_mean`` (``eval_ema_<reward>_mean`` excluded), in first-seen order."""
        names: dict[str, None] = {}
        for record in self.eval_records:
            for key in record:
                match = re.match(r"^eval_(?!ema_)(.+)_mean$", key)
                if match:
                    names.setdefault(match.group(1))
        return list(names)


def read_run(folder: str | Path) -> RunData:
    """Read a training output folder.

    Raises:
        FluxgrpoError: the folder has no metrics.jsonl, or it cannot be parsed.
    """
    folder = Path(folder)
    if not (folder / METRICS_FILE).is_file():
        why = "it does not exist" if not folder.exists() else f"it has no {METRICS_FILE}"
        raise FluxgrpoError(
            f"cannot report on {folder}: {why}; pass the --output-dir of a `fluxgrpo train` run "
            "(metrics.jsonl appears after its first iteration)"
        )
    records = read_metrics(folder, on_torn_last_line=lambda _: None)  # a live run may be writing its last line
    records = [_plottable(r) for r in records if isinstance(r, dict) and isinstance(r.get("iteration"), int)]
    records.sort(key=lambda r: r["iteration"])
    train = [r for r in records if "reward_mean" in r]
    evals = [r for r in records if any(k.startswith("eval_") for k in r)]
    guards = [r for r in records if r.get("record") == GUARD_RECORD]
    config, derived = _read_config(folder / CONFIG_FILE)
    left_out: list[str] = []
    info: dict[str, Any] = {}
    if (folder / RUN_INFO_FILE).is_file():
        try:
            info = json.loads((folder / RUN_INFO_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            info = {}
    return RunData(
        folder=folder,
        name=folder.resolve().name,
        records=train,
        eval_records=evals,
        config=config,
        derived=derived,
        info=_plain_info(info),
        evaluations=read_evaluations(folder, left_out),
        left_out=left_out,
        guard_records=guards,
        best=_read_best(folder, left_out),
    )


# A metric beyond this magnitude is a diverged run, not a point to plot: left out of the curves, like NaN.
MAX_PLOTTED_MAGNITUDE = 1e30


def _plottable_value(value: Any) -> Any:
    if isinstance(value, list):
        return [_plottable_value(item) for item in value]
    if isinstance(value, str | bool) or value is None:
        return value
    if not isinstance(value, int | float):
        return None
    return value if math.isfinite(value) and abs(value) <= MAX_PLOTTED_MAGNITUDE else None


def _plottable(record: dict[str, Any]) -> dict[str, Any]:
    """A metrics record whose numbers are plottable or None (NaN, ±1e308 and the like: None). A text value stays
    text (a guard record's ``record`` and stop line), but where a metric should be it is None."""
    return {key: value if key == "iteration" else _clean(key, value) for key, value in record.items()}


def _clean(key: str, value: Any) -> Any:
    if isinstance(value, str):
        return value if key in _TEXT_KEYS or key.startswith("guard_") else None
    return _plottable_value(value)


_TEXT_KEYS = frozenset({"record"})


def _plain_info(info: Any) -> dict[str, dict[str, str]]:
    """run_info.json's ``versions`` and ``hardware`` tables as text, whatever the file holds."""
    if not isinstance(info, dict):
        return {}
    return {
        name: {str(key): str(value) for key, value in table.items()}
        for name, table in info.items()
        if name in ("versions", "hardware") and isinstance(table, dict)
    }


def _read_best(folder: Path, left_out: list[str]) -> dict[str, Any] | None:
    try:
        return read_best(folder)
    except FluxgrpoError as exc:
        left_out.append(str(exc))  # a damaged best/ is left out of the report, and the report says so
        return None


def _read_config(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """The resolved config's keys and its ``#   key: value`` header lines (derived numbers, device, env)."""

    if not path.is_file():
        return {}, {}
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):  # not the text config training writes: reported without it
        return {}, {}
    derived = {}
    for line in text.splitlines():
        if line.startswith("#   ") and ": " in line:
            key, value = line[4:].split(": ", 1)
            derived[key.strip()] = value.strip()
    try:
        config = yaml.safe_load(text) or {}
    except yaml.YAMLError:
        config = {}
    return (config if isinstance(config, dict) else {}), derived


def read_evaluations(folder: Path, left_out: list[str] | None = None) -> list[Evaluation]:
    """Every complete evaluation (a folder with its index.json) under ``folder/eval``, by iteration, EMA last; one
    whose index.json cannot be read is appended to ``left_out`` (a line saying so) instead."""
    root = folder / EVAL_DIR
    if not root.is_dir():
        return []
    out = []
    for child in root.iterdir():
        match = _EVAL_FOLDER.match(child.name)
        index = child / INDEX_FILE
        if not match or not index.is_file():
            continue
        try:
            document = json.loads(index.read_text(encoding="utf-8"))
            images = [
                EvalImage(
                    path=child / str(entry["file"]),
                    prompt=str(entry["prompt"]),
                    prompt_index=int(entry["prompt_index"]),
                    image_index=int(entry["image_index"]),
                    seed=int(entry["seed"]),
                )
                for entry in document.get("images") or []
            ]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            if left_out is not None:  # a damaged index is left out of the report, not fatal to it
                left_out.append(f"left out {index} ({type(exc).__name__}: the index is damaged)")
            continue
        scores = {
            str(name): {"mean": float(s["mean"]), "std": float(s["std"])}
            for name, s in (document.get("scores") or {}).items()
            if isinstance(s, dict) and "mean" in s and "std" in s
        }
        out.append(Evaluation(int(match.group(1)), bool(match.group(2)), child, images, scores))
    out.sort(key=lambda e: (e.ema, e.iteration))
    return out
