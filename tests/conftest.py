"""Shared fixtures. One is autouse: every test runs in its own empty working directory (``hermetic_cwd``), so no
test reads or writes what the cwd holds (the quickstart's ``data/``, ``hps_ckpt/``); the others a test asks for by
name.

``tiny_weights`` -> ``TinyWeights(flux_dir, hps_dir)``
    Tiny random FLUX (diffusers folder) and HPS (``HPS_v2.1_compressed.pt``, ``open_clip_pytorch_model.bin``,
    ``open_clip_config.json``) weights from ``fetch-weights --source tiny`` with seed 0, written once per test
    session. Both folders pass ``check_flux_dir`` / ``check_hps_dir``. Shared: treat them as read-only (copy
    them with ``shutil.copytree`` into ``tmp_path`` before changing anything).

``tiny_embeddings`` -> ``TinyEmbeddings(out_dir, index_path, prompts_path, prompts, flux_dir)``
    The first 8 bundled prompts preprocessed in-process on cpu with ``max_sequence_length`` 32 by the tiny
    encoders: DanceGRPO's layout under ``out_dir`` (prompt_embed [32, 32], pooled [32], float32), index at
    ``index_path``. Written once per session; read-only as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

TINY_EMBEDDING_PROMPTS = 8
TINY_SEQUENCE_LENGTH = 32

# The test files that take longest, longest first (seconds of their tests on the 2-core CI machine, 2026-12-06;
# 1,163 s in all, so two workers need at least 582 s: the suite ran in 608 s in this order):
# handed to the two workers before the rest (pyproject's --no-loadscope-reorder keeps this order), so the quick
# files fill the gaps at the end instead of one worker running a two-minute file alone while the other idles.
# A stale list costs only balance, never a result.
SLOWEST_FILES = (
    "tests/runtime/test_multinode.py",  # 248 s
    "tests/test_runs.py",  # 125 s
    "tests/models/test_compile.py",  # 94 s
    "tests/training/test_retain_training.py",  # 69 s
    "tests/test_lora.py",  # 65 s
    "tests/training/test_train.py",  # 51 s
    "tests/checkpoint/test_hostile_resume.py",  # 38 s
    "tests/shapes/test_shapes_checker.py",  # 37 s
    "tests/bench/test_bench.py",  # 31 s
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slowest files first (``SLOWEST_FILES``); every other test keeps its place (a stable sort)."""
    rank = {name: index for index, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@dataclass(frozen=True)
class TinyWeights:
    flux_dir: Path
    hps_dir: Path


@dataclass(frozen=True)
class TinyEmbeddings:
    out_dir: Path
    index_path: Path
    prompts_path: Path
    prompts: list[str]
    flux_dir: Path


@pytest.fixture(autouse=True)
def hermetic_cwd(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run the test in a fresh empty folder: the default paths (``data/flux``, ``hps_ckpt``, ``data/outputs/...``)
    then resolve inside it, whatever the folder pytest was started from holds."""
    cwd = tmp_path_factory.mktemp("cwd")
    monkeypatch.chdir(cwd)
    return cwd


@pytest.fixture(scope="session")
def tiny_weights(tmp_path_factory: pytest.TempPathFactory) -> TinyWeights:
    from fluxgrpo.rewards.tiny_weights import write_tiny_weights

    root = tmp_path_factory.mktemp("tiny-weights")
    weights = TinyWeights(flux_dir=root / "flux", hps_dir=root / "hps_ckpt")
    write_tiny_weights(weights.flux_dir, weights.hps_dir, seed=0)
    return weights


@pytest.fixture(scope="session")
def tiny_embeddings(tmp_path_factory: pytest.TempPathFactory, tiny_weights: TinyWeights) -> TinyEmbeddings:
    from fluxgrpo.data.prompts import bundled_prompts_path, read_prompts
    from fluxgrpo.preprocess import preprocess

    root = tmp_path_factory.mktemp("tiny-embeddings")
    prompts = read_prompts(bundled_prompts_path())[:TINY_EMBEDDING_PROMPTS]
    prompts_path = root / "prompts.txt"
    prompts_path.write_text("\n".join(prompts) + "\n")
    out_dir = root / "rl_embeddings"
    summary = preprocess(prompts_path, tiny_weights.flux_dir, out_dir, TINY_SEQUENCE_LENGTH, device="cpu")
    return TinyEmbeddings(out_dir, Path(summary.index_path), prompts_path, prompts, tiny_weights.flux_dir)
