"""Loading the FLUX transformer sharded (meta device + per-rank slice reads) versus ``from_pretrained`` per rank.

Run under torchrun by tests/models/test_shard_loading.py, or by hand for the README's memory figures:

    torchrun --standalone --nproc_per_node=2 tests/_load_worker.py compare FLUX_DIR OUT_DIR
    torchrun --standalone --nproc_per_node=2 tests/_load_worker.py memory FLUX_DIR OUT_DIR {sharded|pretrained}
    torchrun --standalone --nproc_per_node=2 tests/_load_worker.py terms FLUX_DIR OUT_DIR
    torchrun --standalone --nproc_per_node=2 tests/_load_worker.py lora-bf16 FLUX_DIR OUT_DIR

``compare`` checks that every rank's shard of every parameter is bitwise the same both ways. ``memory`` loads one
way and writes, per rank, how far the process's resident memory rose above what it held just before loading
(peak RSS, with the kernel's high-water mark reset first), to ``OUT_DIR/memory_rank{r}.json``. ``terms`` writes
the bytes each rank's weight shards and AdamW moments take, for the memory model's test.

Several modes joined by ``+`` run one after the other in the same launch (``memory+compare FLUX_DIR OUT_DIR
sharded``): a launch of two workers costs tens of seconds of imports on a small CPU host. ``memory`` must come first
there, so that its peak is measured in a process that has loaded nothing yet.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

# A FLUX.1-dev-shaped transformer (double + single blocks, guidance embedder, 64 packed channels), small enough
# for a CPU test yet large enough that loading dominates the process's memory: 82.8 M parameters, 316 MiB fp32.
FLUX_SHAPED_CONFIG = {
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 2,
    "num_single_layers": 4,
    "attention_head_dim": 64,
    "num_attention_heads": 12,
    "joint_attention_dim": 1024,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": (8, 28, 28),
}


def write_flux_shaped_transformer(flux_dir: Path, seed: int = 0) -> int:
    """``flux_dir/transformer`` with random fp32 weights of FLUX_SHAPED_CONFIG; returns the weights' bytes."""
    from diffusers import FluxTransformer2DModel

    generator = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = FluxTransformer2DModel(**FLUX_SHAPED_CONFIG)
    model.load_state_dict(
        {name: torch.randn(p.shape, generator=generator) * 0.02 for name, p in model.named_parameters()},
        assign=True,
    )
    model.save_pretrained(flux_dir / "transformer")
    return sum(p.numel() * p.element_size() for p in model.parameters())


def shard(model) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
        fully_shard(block)
    fully_shard(model)


def load_sharded(flux_dir: str):
    from fluxgrpo.models.shard_loading import empty_transformer, fill_transformer

    model = empty_transformer(flux_dir)
    shard(model)
    fill_transformer(model, flux_dir, "cpu")
    return model


def load_pretrained(flux_dir: str):
    """What build_parts did before: a full fp32 model per rank, then sharded."""
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel.from_pretrained(flux_dir, subfolder="transformer", dtype=torch.float32)
    shard(model)
    return model


def allocated_terms(model) -> dict[str, int]:
    """Bytes of this rank's weight shards and AdamW moments after one optimizer step (what FSDP2 allocates)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()

    def local_bytes(tensor) -> int:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        return local.numel() * local.element_size()

    moments = [t for state in optimizer.state.values() for k, t in state.items() if k in ("exp_avg", "exp_avg_sq")]
    return {
        "weights": sum(local_bytes(p) for p in model.parameters()),
        "optimizer": sum(local_bytes(t) for t in moments),
    }


def lora_bf16_steps(flux_dir: str, rank: int) -> dict:
    """The accelerator layout on cpu: bf16 frozen base + fp32 adapters, FSDP2 gathering in bf16, checkpointing,
    autocast; two optimizer steps. Reports the dtypes and which parameters moved."""
    from fluxgrpo.lora import LoraSpec, add_lora, base_weight_name, init_adapters, parse_targets
    from fluxgrpo.models.known import LORA_DEFAULT_TARGETS
    from fluxgrpo.models.shard_loading import empty_transformer, fill_transformer
    from fluxgrpo.runtime.dist import shard_transformer

    model = empty_transformer(flux_dir)
    add_lora(model, LoraSpec(4, 8.0, parse_targets(LORA_DEFAULT_TARGETS), 0.0), torch.bfloat16)
    model.enable_gradient_checkpointing()
    shard_transformer(model, False, torch.bfloat16)
    fill_transformer(model, flux_dir, "cpu", stored_name=base_weight_name)
    init_adapters(model, 42)
    before = {name: p.to_local().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    generator = torch.Generator().manual_seed(rank)
    grid = torch.arange(16)
    img_ids = torch.stack([torch.zeros_like(grid), grid // 4, grid % 4], dim=1).float()
    model.train()
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(
                hidden_states=torch.randn(2, 16, 64, generator=generator),
                encoder_hidden_states=torch.randn(2, 8, 32, generator=generator),
                pooled_projections=torch.randn(2, 32, generator=generator),
                timestep=torch.tensor([0.3, 0.6]), img_ids=img_ids, txt_ids=torch.zeros(8, 3),
                guidance=torch.tensor([3.5, 3.5]),
            ).sample  # fmt: skip
        out.float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return {
        "adapter_dtypes": sorted({str(p.dtype) for n, p in model.named_parameters() if p.requires_grad}),
        "base_dtypes": sorted({str(p.dtype) for n, p in model.named_parameters() if not p.requires_grad}),
        "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
        "changed": sorted(n for n, p in model.named_parameters() if not torch.equal(p.to_local(), before[n])),
    }


def _proc_status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/self/status")


def main() -> None:
    from fluxgrpo.runtime import dist as rt_dist

    torch.set_num_threads(1)
    modes, flux_dir, out_dir = sys.argv[1].split("+"), sys.argv[2], Path(sys.argv[3])
    if "memory" in modes and modes[0] != "memory":
        raise SystemExit("memory must be the first mode: its peak is measured in a process that loaded nothing yet")
    ctx = rt_dist.init_distributed("cpu")
    try:
        for mode in modes:
            run_mode(mode, ctx, flux_dir, out_dir)
    finally:
        rt_dist.teardown()


def run_mode(mode: str, ctx, flux_dir: str, out_dir: Path) -> None:
    """One mode on every rank (the module docstring says what each writes)."""
    import torch.distributed as dist

    from fluxgrpo.runtime import dist as rt_dist

    if mode == "compare":
        sharded, pretrained = load_sharded(flux_dir), load_pretrained(flux_dir)
        mismatches = [
            name
            for (name, a), (_, b) in zip(sharded.named_parameters(), pretrained.named_parameters(), strict=True)
            if not torch.equal(a.to_local(), b.to_local())
        ]
        all_mismatches = rt_dist.all_gather_object(ctx, mismatches)
        if ctx.is_main:
            result = {
                "mismatches": all_mismatches,
                "param_type": type(next(sharded.parameters())).__name__,
                "parameters": len(list(sharded.parameters())),
                "training": sharded.training,
            }
            (out_dir / "compare.json").write_text(json.dumps(result))
    elif mode == "lora-bf16":
        (out_dir / f"lora_rank{ctx.rank}.json").write_text(json.dumps(lora_bf16_steps(flux_dir, ctx.rank)))
    elif mode == "terms":
        (out_dir / f"terms_rank{ctx.rank}.json").write_text(json.dumps(allocated_terms(load_sharded(flux_dir))))
    else:
        loader = {"sharded": load_sharded, "pretrained": load_pretrained}[sys.argv[4]]
        # Imports first: diffusers alone adds ~300 MB to a process, which is not the weights' memory.
        import diffusers.models  # noqa: F401
        from diffusers import FluxTransformer2DModel  # noqa: F401
        from torch.distributed.fsdp import fully_shard  # noqa: F401

        import fluxgrpo.models.shard_loading  # noqa: F401

        dist.barrier()
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark to the current RSS
        before = _proc_status_kib("VmRSS")
        model = loader(flux_dir)
        peak = _proc_status_kib("VmHWM")
        local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        record = {"rank": ctx.rank, "rss_before": before * 1024, "peak_rise": (peak - before) * 1024}
        record["local_parameter_bytes"] = local
        (out_dir / f"memory_rank{ctx.rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    from fluxgrpo.runtime.worker import exit_now

    main()
    # Leave as the product's workers do (runtime.worker.exit_now): the interpreter's C++ teardown can abort a
    # finished rank now and then ("terminate called without an active exception").
    exit_now(0)
