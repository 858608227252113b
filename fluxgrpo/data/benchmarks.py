"""Benchmark prompt sets the papers evaluate on, fetched like weights and named by ``train --eval-prompts NAME``.

Each set is fetched as its authors publish it (``fluxgrpo fetch-weights --only <part>``, verified and resumable like
every part, into ``--prompts-dir``, default ``data/eval_prompts``) and never vendored in the package:

- ``hpdv2``: HPDv2's 400 test prompts (``zhwang/HPDv2`` on Hugging Face, ``test.json``; Apache-2.0, the HPSv2
  authors' release), the prompts HPS scores are usually reported on.

Three sets ship inside the package, no fetch (``SHIPPED_SETS``): the shapes world's training captions
``shapes-train`` (``preprocess --prompts shapes-train``), the same drawn about evenly per family
``shapes-train-balanced`` (repeated lines: its sampling weights, which ``preprocess`` keeps) and its held-out
captions ``shapes-heldout`` (``train --eval-prompts shapes-heldout``), seen and novel attribute combinations
(``shapes/world.py``); a test keeps the files equal to ``shapes.world.prompt_set``.

GenEval's 553 prompts (MIT, published on GitHub only) and DrawBench's 200 (no stated licence) have no verified copy
on either hub yet, so they are not offered; pass their prompt file with ``--eval-prompts FILE``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fluxgrpo.paths import DEFAULT_PROMPTS_DIR


@dataclass(frozen=True)
class Benchmark:
    name: str
    part: str  # the fetch-weights part that brings it
    file: str  # below the prompts folder
    prompts: int  # how many prompts the published set holds


BENCHMARKS = {b.name: b for b in (Benchmark("hpdv2", "hpdv2-prompts", "hpdv2/test.json", 400),)}


SHIPPED_SETS = ("shapes-train", "shapes-train-balanced", "shapes-heldout")
# Shipped sets whose repeated lines are sampling weights: `preprocess` keeps them (once encoded, listed per line).
WEIGHTED_SETS = ("shapes-train-balanced",)


def shipped_set_path(name: str) -> Path:
    """The file of a prompt set shipped inside the package (``SHIPPED_SETS``)."""
    return Path(__file__).with_name(f"{name}.txt")


def prompts_path(value: str) -> Path:
    """``preprocess --prompts``: a shipped set's name (shapes-train) or a file path."""
    return shipped_set_path(value) if value in SHIPPED_SETS else Path(value)


def benchmark_path(name: str, prompts_dir: str | Path = DEFAULT_PROMPTS_DIR) -> Path:
    return Path(prompts_dir) / BENCHMARKS[name].file


def eval_prompts_path(value: str) -> Path:
    """``--eval-prompts``: a shipped set's name, a benchmark name (its fetched file in the default prompts folder)
    or a file path."""
    if value in SHIPPED_SETS:
        return shipped_set_path(value)
    return benchmark_path(value) if value in BENCHMARKS else Path(value)


# ``--eval-prompts training``: the run's own training captions (the overfit check: did the prompts it trains on
# get better, judged on fresh seeds with the evaluation's sampler).
TRAINING_SET = "training"


def eval_prompts_problem(value: str) -> str | None:
    """Why ``--eval-prompts value`` cannot be read, or None (``training`` is read from the run's prompt index, which
    the data checks already require)."""
    if value == TRAINING_SET:
        return None
    path = eval_prompts_path(value)
    if path.is_file():
        return None
    if value in BENCHMARKS:
        part = BENCHMARKS[value].part
        return (
            f"--eval-prompts {value}: {path} is missing; fetch it with `fluxgrpo fetch-weights --only {part}` "
            f"(or pass the fetched file's path if you used --prompts-dir)"
        )
    names = ", ".join([*SHIPPED_SETS, *BENCHMARKS, TRAINING_SET])
    return f"--eval-prompts {value}: no such file (one prompt per line), nor a benchmark name ({names})"
