"""The exact-resume experiment behind tests/checkpoint/test_checkpoint.py, in-process (world size 1) or under torchrun (FSDP2).

Run A trains 4 AdamW steps straight. Run B trains 2, saves, then scrambles every RNG and builds fresh objects
from a different initialisation, loads the checkpoint and trains 2 more. Each step draws its inputs from the
global torch, python and numpy RNGs and its target from a caller-owned ``torch.Generator``, and the LR changes
every step, so a state that is not restored (weights, Adam moments, scheduler, any RNG) changes the result.

    torchrun --standalone --nproc_per_node=2 tests/_ckpt_worker.py OUT_DIR    # writes OUT_DIR/result.json
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

BATCH = 2
IMAGE_TOKENS = 16  # a 4x4 latent grid of packed tokens, width in_channels=64
TEXT_TOKENS = 8
STEPS_BEFORE_SAVE = 2
STEPS_AFTER_SAVE = 2


def build_tiny_transformer(init_seed: int):
    from diffusers import FluxTransformer2DModel

    from fluxgrpo.models.tiny import TINY_TRANSFORMER_CONFIG

    torch.manual_seed(init_seed)
    return FluxTransformer2DModel(**{**TINY_TRANSFORMER_CONFIG, "num_layers": 1, "num_single_layers": 1})


def full_weights(model) -> dict[str, torch.Tensor]:
    """The full fp32 state dict on rank 0 ({} elsewhere); a collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {name: tensor.detach().clone() for name, tensor in full.items()}


class TinyEma:
    """Stand-in with the interface of fluxgrpo.grpo.weight_copies.ShardedEMA: a full CPU copy kept on rank 0 only,
    like DanceGRPO's."""

    def __init__(self, model, decay: float = 0.5):
        self.decay = decay
        self.shadow = full_weights(model)

    def update(self, model) -> None:
        current = full_weights(model)
        for name, value in self.shadow.items():
            value.mul_(self.decay).add_(current[name], alpha=1 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        # Copies, so a resume that forgets load_state_dict (DCP loads in place) is caught.
        return {name: value.clone() for name, value in self.shadow.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, value in self.shadow.items():
            value.copy_(state[name])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.shadow


def build_training(init_seed: int, shard: bool):
    """Transformer (FSDP2-sharded per block and at the root when ``shard``), AdamW, a linear LR schedule, EMA."""
    from diffusers.optimization import get_scheduler

    model = build_tiny_transformer(init_seed)
    if shard:
        from torch.distributed.fsdp import fully_shard

        for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=1, num_training_steps=10)
    return model, optimizer, scheduler, TinyEma(model)


def train_steps(model, optimizer, scheduler, ema: TinyEma, noise: torch.Generator, steps: int) -> None:
    grid = torch.arange(IMAGE_TOKENS)
    img_ids = torch.stack([torch.zeros_like(grid), grid // 4, grid % 4], dim=1).float()  # [16, 3]
    txt_ids = torch.zeros(TEXT_TOKENS, 3)
    for _ in range(steps):
        hidden = torch.randn(BATCH, IMAGE_TOKENS, 64)
        text = torch.randn(BATCH, TEXT_TOKENS, 32)
        pooled = torch.randn(BATCH, 32)
        timestep = torch.tensor([random.random() for _ in range(BATCH)])
        guidance = torch.from_numpy(np.random.uniform(1.0, 5.0, size=BATCH)).float()
        target = torch.randn(BATCH, IMAGE_TOKENS, 64, generator=noise)
        out = model(
            hidden_states=hidden, encoder_hidden_states=text, pooled_projections=pooled, timestep=timestep,
            img_ids=img_ids, txt_ids=txt_ids, guidance=guidance,
        ).sample  # fmt: skip
        torch.nn.functional.mse_loss(out, target).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        ema.update(model)


def exact_resume_experiment(ctx, out_dir: Path, shard: bool) -> dict[str, Any]:
    """Run A and run B (see the module docstring); on rank 0 returns what the test asserts on, else {}."""
    from diffusers import FluxTransformer2DModel

    from fluxgrpo.checkpoint.state import TrainingState, load_checkpoint, save_checkpoint
    from fluxgrpo.runtime.device import seed_everything

    def seed_data() -> torch.Generator:
        seed_everything(100 + ctx.rank)  # ranks see different data, as in training
        return torch.Generator().manual_seed(200 + ctx.rank)

    # Run A: 4 steps straight.
    model, optimizer, scheduler, ema = build_training(init_seed=0, shard=shard)
    noise = seed_data()
    train_steps(model, optimizer, scheduler, ema, noise, STEPS_BEFORE_SAVE + STEPS_AFTER_SAVE)
    straight = full_weights(model)
    straight_ema = {k: v.clone() for k, v in ema.full_state_dict().items()}

    # Run B: 2 steps, save.
    model, optimizer, scheduler, ema = build_training(init_seed=0, shard=shard)
    noise = seed_data()
    train_steps(model, optimizer, scheduler, ema, noise, STEPS_BEFORE_SAVE)
    trainer_state = {"iteration": STEPS_BEFORE_SAVE, "sampler": {"epoch": 0, "position": 7}}
    path = save_checkpoint(
        out_dir, STEPS_BEFORE_SAVE, ctx, TrainingState(model, optimizer, scheduler, ema=ema), trainer_state=trainer_state,
        keep_last=None, rng_states={"noise": noise.get_state()},
    )  # fmt: skip
    at_save = full_weights(model)
    ema_at_save = {k: v.clone() for k, v in ema.full_state_dict().items()}
    lr_at_save = scheduler.get_last_lr()[0]

    # ... every RNG scrambled, fresh objects from another initialisation, load, 2 more steps.
    seed_everything(999)
    model, optimizer, scheduler, ema = build_training(init_seed=1, shard=shard)
    noise = torch.Generator().manual_seed(12345)
    loaded = load_checkpoint(path, ctx, TrainingState(model, optimizer, scheduler, ema=ema))
    noise.set_state(loaded.rng_states["noise"])
    lr_after_load = scheduler.get_last_lr()[0]
    train_steps(model, optimizer, scheduler, ema, noise, STEPS_AFTER_SAVE)
    resumed = full_weights(model)
    resumed_ema = ema.full_state_dict()
    param_type = type(next(model.parameters())).__name__

    if not ctx.is_main:
        return {}
    exported = FluxTransformer2DModel.from_pretrained(path / "transformer").state_dict()
    exported_ema = FluxTransformer2DModel.from_pretrained(path / "transformer_ema").state_dict()
    return {
        "path": str(path),
        "names": sorted(straight),
        "resume_mismatches": sorted(k for k in straight if not torch.equal(straight[k], resumed[k])),
        "ema_resume_mismatches": sorted(k for k in straight_ema if not torch.equal(straight_ema[k], resumed_ema[k])),
        "export_names_match": sorted(exported) == sorted(at_save),
        "export_mismatches": sorted(k for k in at_save if not torch.equal(at_save[k], exported[k])),
        "ema_export_mismatches": sorted(k for k in ema_at_save if not torch.equal(ema_at_save[k], exported_ema[k])),
        # A non-trivial check only if training moved the weights and the EMA differs from them.
        "trained_moved_weights": any(not torch.equal(at_save[k], straight[k]) for k in straight),
        "ema_differs_from_weights": any(not torch.equal(at_save[k], ema_at_save[k]) for k in at_save),
        "trainer_state": loaded.trainer_state,
        "iteration": loaded.iteration,
        "lr_at_save": lr_at_save,
        "lr_after_load": lr_after_load,
        "param_type": param_type,
    }


def main() -> None:
    torch.set_num_threads(1)
    from fluxgrpo.runtime import dist as rt_dist

    out_dir = Path(sys.argv[1])
    ctx = rt_dist.init_distributed("cpu")
    try:
        result = exact_resume_experiment(ctx, out_dir / "run", shard=True)
        if ctx.is_main:
            result["world_size"] = ctx.world_size
            (out_dir / "result.json").write_text(json.dumps(result, indent=2))
    finally:
        rt_dist.teardown()


if __name__ == "__main__":
    from fluxgrpo.runtime.worker import exit_now

    main()
    # Leave as the product's workers do (runtime.worker.exit_now): the interpreter's C++ teardown can abort a
    # finished rank now and then ("terminate called without an active exception").
    exit_now(0)
