"""Issue #30.25, the hostile regression suite: a tiny run killed with SIGKILL at a seeded random point (inside a
checkpoint's writes included: a file half-written, a folder not yet renamed, a metrics line not yet appended) and
then resumed with ``--resume`` is bitwise the uninterrupted run, for grpo, nft and awm.

Each objective draws its own kill point from a seeded RNG (``kill_point``), so the suite stays three tiny runs long
and still walks different moments of a save across objectives; a failure names its site and call, and reproduces.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file
from training_helpers import run, tiny_config

from fluxgrpo.metrics import read_metrics

WORKER = Path(__file__).parents[1] / "_kill_worker.py"
ITERATIONS = 3  # checkpoints after 1, 2 and 3
# Where a run can die, with how many calls of each a 3-iteration run makes (the draw stays within it): the
# state's write_durably writes the RNG file, the trainer state, the checksum record and COMPLETE of each save;
# rename_atomically publishes the finished folder (once per save); write_state_checksums hashes the state;
# MetricsLogger.log appends one line per iteration.
KILL_SITES = {
    "fluxgrpo.checkpoint.state:write_durably": 3 * 4,
    "fluxgrpo.checkpoint.layout:rename_atomically": 3,
    "fluxgrpo.checkpoint.state:write_state_checksums": 3,
    "fluxgrpo.metrics:MetricsLogger.log": 3,
}
OBJECTIVES = {
    "grpo": {},
    "nft": {"objective": "nft", "nft_beta": 0.1},
    "awm": {"objective": "awm", "awm_ema_beta": 1.0, "kl_beta": 0.01, "clip_range": 1.0},
}
SEED = 75  # draws one moment of a save per objective: a rename, a checksum record, a trainer state


def kill_point(objective: str) -> tuple[str, int]:
    rng = random.Random(f"{SEED}-{objective}")
    site = rng.choice(sorted(KILL_SITES))
    return site, rng.randint(1, KILL_SITES[site])


def final_weights(out: Path) -> dict:
    folder = out / f"checkpoint-{ITERATIONS}" / "transformer"
    return {name: tensor for file in sorted(folder.glob("*.safetensors")) for name, tensor in load_file(file).items()}


@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_sigkill_at_a_seeded_point_then_resume_is_bitwise_the_uninterrupted_run(
    objective, tiny_weights, tiny_embeddings, tmp_path
):
    options = {**OBJECTIVES[objective], "max_train_steps": ITERATIONS, "checkpointing_steps": 1}
    straight = run(tiny_config(tiny_weights, tiny_embeddings, tmp_path / "straight", **options))

    killed = tiny_config(tiny_weights, tiny_embeddings, tmp_path / "killed", **options)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(killed.to_dict()))
    site, call = kill_point(objective)
    child = subprocess.run(
        [sys.executable, str(WORKER), str(config), site, str(call)], capture_output=True, text=True, timeout=900
    )
    assert child.returncode == -signal.SIGKILL, f"{site} call {call} was never reached: {child.stderr[-2000:]}"

    resumed = run(tiny_config(tiny_weights, tiny_embeddings, tmp_path / "killed", **options), resume="latest")
    assert [r["iteration"] for r in read_metrics(tmp_path / "killed")] == list(range(1, ITERATIONS + 1))
    assert [r["reward_mean"] for r in read_metrics(tmp_path / "killed")] == [r["reward_mean"] for r in straight]
    assert resumed[-1]["reward_mean"] == straight[-1]["reward_mean"]
    a, b = final_weights(tmp_path / "straight"), final_weights(tmp_path / "killed")
    assert a.keys() == b.keys() and a
    for name in a:
        assert a[name].equal(b[name]), f"{name} differs after a SIGKILL at {site} call {call} and --resume"
    leftovers = [p.name for p in (tmp_path / "killed").iterdir() if p.name.endswith((".tmp", ".trash"))]
    assert not leftovers, leftovers
