"""ShardedEMA on plain modules (hand-worked values) and on FSDP2 modules in a 2-process gloo world.

Run as a script under torchrun, this file is the worker of ``test_fsdp2_two_processes``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.grpo.weight_copies import ShardedEMA


def two_weight_model() -> nn.Module:
    model = nn.Sequential(nn.Linear(2, 1, bias=False), nn.Linear(1, 1))
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[1.0, 2.0]]))
    model[1].requires_grad_(False)  # frozen parameters have no EMA
    return model


def set_weight(model: nn.Module, values: list[float]) -> None:
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([values]))


def test_update_hand_worked():
    # decay 0.9: θ = [2, 4] → EMA = 0.9·[1, 2] + 0.1·[2, 4] = [1.1, 2.2];
    #            θ = [3, 6] → EMA = 0.9·[1.1, 2.2] + 0.1·[3, 6] = [0.99 + 0.3, 1.98 + 0.6] = [1.29, 2.58].
    model = two_weight_model()
    ema = ShardedEMA(model, decay=0.9)
    assert list(ema.state_dict()) == ["0.weight"]
    set_weight(model, [2.0, 4.0])
    ema.update(model)
    assert torch.allclose(ema.state_dict()["0.weight"], torch.tensor([[1.1, 2.2]]))
    set_weight(model, [3.0, 6.0])
    ema.update(model)
    assert torch.allclose(ema.state_dict()["0.weight"], torch.tensor([[1.29, 2.58]]))
    assert torch.equal(model[0].weight, torch.tensor([[3.0, 6.0]]))  # the model itself is untouched


def test_swap_into_restores_trained_weights_even_on_error():
    model = two_weight_model()
    ema = ShardedEMA(model, decay=0.5)
    set_weight(model, [3.0, 4.0])
    ema.update(model)  # EMA = 0.5·[1, 2] + 0.5·[3, 4] = [2, 3]
    with ema.swap_into(model):
        assert torch.equal(model[0].weight, torch.tensor([[2.0, 3.0]]))
    assert torch.equal(model[0].weight, torch.tensor([[3.0, 4.0]]))
    with pytest.raises(RuntimeError, match="boom"), ema.swap_into(model):
        raise RuntimeError("boom")
    assert torch.equal(model[0].weight, torch.tensor([[3.0, 4.0]]))


def test_state_dict_round_trip_and_mismatch():
    model = two_weight_model()
    ema = ShardedEMA(model, decay=0.5)
    saved = {name: tensor.clone() for name, tensor in ema.state_dict().items()}
    set_weight(model, [5.0, 5.0])
    ema.update(model)
    ema.load_state_dict(saved)
    assert torch.equal(ema.state_dict()["0.weight"], torch.tensor([[1.0, 2.0]]))
    full = ema.full_state_dict()
    assert full["0.weight"].device.type == "cpu" and torch.equal(full["0.weight"], torch.tensor([[1.0, 2.0]]))
    with pytest.raises(FluxgrpoError, match="does not match"):
        ema.load_state_dict({"other.weight": torch.zeros(1, 2)})


def test_names_ignore_activation_checkpoint_wrappers():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    plain = two_weight_model()
    wrapped = two_weight_model()
    wrapped[0] = checkpoint_wrapper(wrapped[0])
    assert ShardedEMA(wrapped, 0.9).state_dict().keys() == ShardedEMA(plain, 0.9).state_dict().keys()


def test_bf16_parameters_get_an_fp32_average():
    model = two_weight_model().to(torch.bfloat16)
    ema = ShardedEMA(model, decay=0.9)
    assert ema.state_dict()["0.weight"].dtype == torch.float32


@pytest.mark.slow
def test_fsdp2_two_processes(tmp_path: Path):
    # tests/ (training_helpers) on the workers' path: this script runs from tests/grpo/
    helpers = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLUXGRPO_TEST_OUT": str(tmp_path), "PYTHONPATH": helpers}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    assert (tmp_path / "ok-0").exists() and (tmp_path / "ok-1").exists()


# ---------------------------------------------------------------------------------------------- worker


def _worker() -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(os.environ["FLUXGRPO_TEST_OUT"])

    # --- EMA on a sharded Linear: hand-worked values, local-only storage, swap, DCP round trip.
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(1.0)
    fully_shard(model[0])
    fully_shard(model)
    with torch.no_grad():
        model(torch.ones(1, 4))  # leaves the root's parameters unsharded; the EMA must cope
    ema = ShardedEMA(model, decay=0.75)
    shadow = ema.state_dict()["0.weight"]
    assert isinstance(shadow, DTensor) and shadow.placements == (Shard(0),)
    assert shadow.to_local().shape == (3, 4), shadow.to_local().shape  # half of [6, 4] per rank
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.to_local().fill_(3.0)
    ema.update(model)
    # 0.75·1 + 0.25·3 = 1.5 everywhere
    assert (ema.full_state_dict() == {}) == (rank == 1)  # gathered to rank 0 only by default
    full = ema.full_state_dict(rank0_only=False)
    assert set(full) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert full["0.weight"].shape == (6, 4) and full["0.weight"].device.type == "cpu"
    assert all(torch.allclose(tensor, torch.full_like(tensor, 1.5)) for tensor in full.values())
    with ema.swap_into(model):
        assert torch.allclose(model[0].weight.full_tensor(), torch.full((6, 4), 1.5))
        with torch.no_grad():
            swapped_output = model(torch.ones(1, 4))
    assert torch.allclose(model[0].weight.full_tensor(), torch.full((6, 4), 3.0))
    # EMA weights: layer 0 gives 4·1.5 + 1.5 = 7.5 per unit; layer 1 gives 6·1.5·7.5 + 1.5 = 69.
    assert torch.allclose(swapped_output, torch.full((1, 2), 69.0))

    checkpoint_dir = out / "ema-dcp"
    dcp.save(ema.state_dict(), checkpoint_id=str(checkpoint_dir))
    ema.update(model)  # 0.75·1.5 + 0.25·3 = 1.875
    assert torch.allclose(ema.full_state_dict(rank0_only=False)["0.bias"], torch.full((6,), 1.875))
    restored = ema.state_dict()
    dcp.load(restored, checkpoint_id=str(checkpoint_dir))
    assert torch.allclose(ema.full_state_dict(rank0_only=False)["0.bias"], torch.full((6,), 1.5))

    # --- rollout + policy update on a sharded tiny FLUX, with different data per rank.
    from diffusers import FluxTransformer2DModel
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock
    from training_helpers import grpo_update, sde_rollout  # tests/ is on PYTHONPATH (the test above)

    from fluxgrpo.grpo.latents import image_ids
    from fluxgrpo.grpo.schedule import sigma_schedule
    from fluxgrpo.grpo.types import Conditioning
    from fluxgrpo.models.tiny import TINY_TRANSFORMER_CONFIG

    torch.manual_seed(0)  # identical initial weights on both ranks
    transformer = FluxTransformer2DModel(**{**TINY_TRANSFORMER_CONFIG, "num_layers": 1, "num_single_layers": 1})
    for block in transformer.modules():
        if isinstance(block, FluxTransformerBlock | FluxSingleTransformerBlock):
            fully_shard(block)
    fully_shard(transformer)
    initial = {name: parameter.full_tensor().clone() for name, parameter in transformer.named_parameters()}

    generator = torch.Generator().manual_seed(100 + rank)
    cond = Conditioning(torch.randn(3, 8, 32, generator=generator), torch.randn(3, 32, generator=generator),
                        torch.zeros(8, 3))  # fmt: skip
    rollout = sde_rollout(
        transformer, cond, torch.randn(3, 16, 64, generator=generator), sigma_schedule(4, 3.0), eta=0.3,
        guidance=3.5, img_ids=image_ids(64, 64), rollout_batch_size=3, device_type="cpu",
        generator=torch.Generator().manual_seed(200 + rank),
    )  # fmt: skip
    ema = ShardedEMA(transformer, decay=0.9)
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=1e-3, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    def update(advantages: torch.Tensor, optimizer=optimizer, max_grad_norm=1.0, ema=ema):
        # T = int((4 − 1)·0.7) = 2 timesteps per trajectory
        stats = grpo_update(transformer, rollout, cond, advantages, optimizer, scheduler, num_train_timesteps=2,
                            clip_range=1e-4, micro_batch_size=1, grad_accum_steps=3, max_grad_norm=max_grad_norm,
                            device_type="cpu", generator_cpu=torch.Generator().manual_seed(3))  # fmt: skip
        if ema is not None and stats.optimizer_steps:
            ema.update(transformer)  # once per iteration that stepped, as the training loop does
        return stats

    stats = update(torch.tensor([1.0, -0.5, -0.5]) * (1 if rank == 0 else -1))
    assert stats.first_microbatch_max_abs_log_ratio.item() < 1e-5, stats.first_microbatch_max_abs_log_ratio
    assert stats.optimizer_steps == 1 and stats.skipped_steps == 0
    assert torch.isfinite(stats.grad_norms).all() and stats.grad_norms.shape == (1,)
    stepped = {name: parameter.full_tensor().clone() for name, parameter in transformer.named_parameters()}
    changed = [name for name in stepped if not torch.equal(stepped[name], initial[name])]
    assert len(changed) == len(stepped), sorted(set(stepped) - set(changed))
    # One EMA step from the initial weights: 0.9·θ0 + 0.1·θ1.
    ema_full = ema.full_state_dict(rank0_only=False)
    for name, value in ema_full.items():
        assert torch.allclose(value, 0.9 * initial[name] + 0.1 * stepped[name], atol=1e-6), name
    gathered = [None, None]
    dist.all_gather_object(gathered, {name: value.sum().item() for name, value in stepped.items()})
    assert gathered[0] == gathered[1]  # the ranks agree on the weights

    # A NaN on one rank only: the global grad norm is NaN on both, so both skip and stay in step.
    nan_advantages = torch.tensor([float("nan"), 1.0, 1.0]) if rank == 1 else torch.tensor([1.0, 1.0, -2.0])
    stats = update(nan_advantages)
    assert stats.skipped_steps == 1 and stats.optimizer_steps == 0
    for name, parameter in transformer.named_parameters():
        assert torch.equal(parameter.full_tensor(), stepped[name]), name

    # Clipping covers every parameter, the root's too, even right after a no-grad forward (which leaves FSDP2's
    # root unsharded): with SGD at lr 1, the whole update's norm is exactly max_grad_norm.
    sgd = torch.optim.SGD(transformer.parameters(), lr=1.0)  # built on the sharded parameters
    with torch.no_grad():
        transformer(hidden_states=rollout.latents[:, 0], encoder_hidden_states=cond.prompt_embeds,
                    pooled_projections=cond.pooled, timestep=torch.ones(3), img_ids=rollout.img_ids,
                    txt_ids=cond.text_ids, guidance=torch.full((3,), 3.5))  # fmt: skip
    stats = update(torch.tensor([1.0, -0.5, -0.5]), optimizer=sgd, max_grad_norm=1e-3, ema=None)
    assert stats.grad_norms.item() > 1e-2  # so the clip is active
    change = torch.stack([(parameter.full_tensor() - stepped[name]).norm()
                          for name, parameter in transformer.named_parameters()]).norm()  # fmt: skip
    assert abs(change.item() - 1e-3) < 1e-6, change.item()
    (out / f"ok-{rank}").write_text("ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    from fluxgrpo.runtime.worker import exit_now

    _worker()
    # Leave as the product's workers do (runtime.worker.exit_now): the interpreter's C++ teardown can abort a
    # finished rank now and then ("terminate called without an active exception").
    exit_now(0)
