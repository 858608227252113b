"""The cross-rank gradient check (issue #32 item 6): after one optimizer step on 2 gloo ranks, each training its half
of a global batch, both ranks hold identical weights, equal to one rank's step over the whole global batch.

A DanceGRPO script once left its model unwrapped, so every rank trained its own copy on its own data with no
gradient sync (XueZeyue/DanceGRPO#110). Here the model is sharded with the product's ``shard_transformer`` (FSDP2,
as ``training/parts.py`` does for every run on more than one die) and updated through the product's update driver
(``run_update``) and optimizer; the control at the end shows the check would fail for an unsynced update.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


@pytest.mark.slow
def test_one_step_on_two_ranks_equals_one_rank_over_the_global_batch(tmp_path: Path):
    # tests/ (training_helpers) on the workers' path: this script runs from tests/grpo/
    helpers = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLUXGRPO_TEST_OUT": str(tmp_path), "PYTHONPATH": helpers}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    assert (tmp_path / "ok-0").exists() and (tmp_path / "ok-1").exists()


# ---------------------------------------------------------------------------------------------- worker

GLOBAL_BATCH, NUM_STEPS, LR = 4, 4, 1e-3


def _rows(rollout, start: int, stop: int):
    """The rollout of trajectories start…stop−1 (every per-trajectory tensor sliced)."""
    sliced = {
        name: getattr(rollout, name)[start:stop]
        for name in ("latents", "log_probs", "final_x0", "means", "final_latent")
        if getattr(rollout, name) is not None
    }
    captions = None if rollout.captions is None else rollout.captions[start:stop]
    return dataclasses.replace(rollout, captions=captions, **sliced)


def _worker() -> None:
    import torch.distributed as dist
    from diffusers import FluxTransformer2DModel
    from training_helpers import grpo_update, sde_rollout  # tests/ is on PYTHONPATH (the test above)

    from fluxgrpo.grpo.latents import image_ids
    from fluxgrpo.grpo.schedule import sigma_schedule
    from fluxgrpo.grpo.types import Conditioning
    from fluxgrpo.models.tiny import TINY_TRANSFORMER_CONFIG
    from fluxgrpo.runtime.dist import shard_transformer

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(os.environ["FLUXGRPO_TEST_OUT"])

    torch.manual_seed(0)  # identical initial weights on both ranks
    config = {**TINY_TRANSFORMER_CONFIG, "num_layers": 1, "num_single_layers": 1, "joint_attention_dim": 32,
              "pooled_projection_dim": 32}  # fmt: skip
    single = FluxTransformer2DModel(**config)
    initial = {name: parameter.detach().clone() for name, parameter in single.named_parameters()}
    sharded = copy.deepcopy(single)
    shard_transformer(sharded, cpu_offload=False)

    # One global batch, built identically on both ranks; the rollout (collective-safe: both ranks run it) is shared
    # by the two updates, which is what this test compares.
    generator = torch.Generator().manual_seed(7)
    cond = Conditioning(torch.randn(GLOBAL_BATCH, 8, 32, generator=generator),
                        torch.randn(GLOBAL_BATCH, 32, generator=generator), torch.zeros(8, 3))  # fmt: skip
    noise = torch.randn(GLOBAL_BATCH, 16, 64, generator=generator)
    rollout = sde_rollout(
        sharded, cond, noise, sigma_schedule(NUM_STEPS, 3.0), eta=0.3, guidance=3.5, img_ids=image_ids(64, 64),
        rollout_batch_size=GLOBAL_BATCH, device_type="cpu", generator=torch.Generator().manual_seed(8),
    )  # fmt: skip
    advantages = torch.tensor([1.0, -0.5, 0.5, -1.0])
    share = GLOBAL_BATCH // world

    def step(module, rows: slice, grad_accum_steps: int) -> None:
        """One optimizer step of the product's GRPO update (AdamW, grad-norm clip 1) on trajectories ``rows``:
        every trainable transition of each (T = N−1), so the split does not change which steps are trained."""
        optimizer = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=1e-4)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        stats = grpo_update(
            module, _rows(rollout, rows.start, rows.stop), cond.rows(rows.start, rows.stop), advantages[rows],
            optimizer, scheduler, num_train_timesteps=NUM_STEPS - 1, clip_range=1e-4, micro_batch_size=1,
            grad_accum_steps=grad_accum_steps, max_grad_norm=1.0, device_type="cpu",
            generator_cpu=torch.Generator().manual_seed(3),
        )  # fmt: skip
        assert stats.optimizer_steps == 1 and stats.skipped_steps == 0, stats

    # 2 ranks: each its half (2 micro-batches, GA 2: one optimizer step), gradients averaged by FSDP2.
    step(sharded, slice(rank * share, (rank + 1) * share), grad_accum_steps=GLOBAL_BATCH // world)
    synced = {name: parameter.full_tensor().detach().clone() for name, parameter in sharded.named_parameters()}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, synced)
    for name in synced:  # bitwise: both ranks hold the same weights
        assert torch.equal(gathered[0][name], gathered[1][name]), name
    assert all(not torch.equal(synced[name], initial[name]) for name in synced), "the step changed nothing"

    # 1 rank over the global batch (4 micro-batches, GA 4: the same 1/(GA·T) scale as the two ranks' average).
    # Equal up to summation order (reduce-scatter vs one rank's accumulation): AdamW's first step divides each
    # gradient element by its own magnitude, which shows those ~1e-7 relative differences in the near-zero elements
    # at up to ~1e-4 of the learning rate; an unsynced step is off by up to 2·lr (the control below).
    alone = copy.deepcopy(single)
    step(alone, slice(0, GLOBAL_BATCH), grad_accum_steps=GLOBAL_BATCH)
    for name, parameter in alone.named_parameters():
        assert torch.allclose(parameter, synced[name], rtol=0, atol=LR * 1e-3), (
            name, (parameter - synced[name]).abs().max().item(),
        )  # fmt: skip

    # Control: a rank that trained its own copy on its own half (no sync) ends elsewhere, so the check can fail.
    own = copy.deepcopy(single)
    step(own, slice(rank * share, (rank + 1) * share), grad_accum_steps=GLOBAL_BATCH // world)
    differs = max((parameter - synced[name]).abs().max().item() for name, parameter in own.named_parameters())
    assert differs > LR * 0.5, differs
    (out / f"ok-{rank}").write_text("ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    from fluxgrpo.runtime.worker import exit_now

    _worker()
    exit_now(0)
