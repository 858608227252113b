"""LoRA training on the tiny weights: only adapters train, the adapter file loads in a FluxPipeline and reproduces
the trained transformer, exact resume, a rising reward, and the merged export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from training_helpers import run, tiny_config

from fluxgrpo.config import build_config
from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.lora import LORA_WEIGHTS_NAME
from fluxgrpo.metrics import read_metrics, reward_trend
from fluxgrpo.runtime.dist import DistContext

SINGLE = DistContext(rank=0, local_rank=0, world_size=1, device_type="cpu", device=torch.device("cpu"), backend="gloo")


def lora_config(tiny_weights, tiny_embeddings, output_dir: Path, **overrides):
    values = {"lora_rank": 4, "lora_alpha": 8.0, "learning_rate": 0.03, **overrides}
    return tiny_config(tiny_weights, tiny_embeddings, output_dir, **values)


def model_inputs(generator: torch.Generator) -> dict[str, torch.Tensor]:
    grid = torch.arange(16)
    return {
        "hidden_states": torch.randn(2, 16, 64, generator=generator),
        "encoder_hidden_states": torch.randn(2, 8, 32, generator=generator),
        "pooled_projections": torch.randn(2, 32, generator=generator),
        "timestep": torch.tensor([0.3, 0.7]),
        "img_ids": torch.stack([torch.zeros_like(grid), grid // 4, grid % 4], dim=1).float(),
        "txt_ids": torch.zeros(8, 3),
        "guidance": torch.tensor([3.5, 3.5]),
    }


def test_only_adapters_train_and_the_adapter_file_reproduces_the_model_in_a_pipeline(
    tiny_weights, tiny_embeddings, tmp_path
):
    from diffusers import FluxPipeline
    from diffusers.optimization import get_scheduler

    from fluxgrpo.checkpoint.state import TrainingState, save_checkpoint
    from fluxgrpo.training.parts import build_transformer

    cfg = lora_config(tiny_weights, tiny_embeddings, tmp_path / "out")
    model = build_transformer(cfg, SINGLE)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # cpu: compute dtype fp32
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(2):
        model(**model_inputs(generator)).sample.pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert changed == trainable  # every adapter moved (B left 0), no base weight did

    scheduler = get_scheduler("constant", optimizer)
    trainer_state = {"config": cfg.to_dict()}
    path = save_checkpoint(
        tmp_path / "out",
        1,
        SINGLE,
        TrainingState(model, optimizer, scheduler),
        trainer_state=trainer_state,
        keep_last=None,
    )
    assert not (path / "transformer").exists()  # no 47.6 GB full export for an adapter run
    info = json.loads((path / "COMPLETE").read_text())
    assert info["lora"]["r"] == 4 and info["lora"]["lora_alpha"] == 8.0

    pipeline = FluxPipeline.from_pretrained(tiny_weights.flux_dir, torch_dtype=torch.float32)
    pipeline.load_lora_weights(path / "lora", weight_name=LORA_WEIGHTS_NAME)
    inputs = model_inputs(torch.Generator().manual_seed(1))
    model.eval()
    with torch.no_grad():
        expected = model(**inputs).sample
        found = pipeline.transformer(**inputs).sample
        base = FluxPipeline.from_pretrained(tiny_weights.flux_dir, torch_dtype=torch.float32).transformer(**inputs)
    assert not torch.allclose(expected, base.sample, atol=1e-4)  # the adapter matters
    torch.testing.assert_close(found, expected, rtol=1e-5, atol=1e-6)

    # export --merge: a plain diffusers transformer (no peft layers) computing the same function
    from diffusers import FluxTransformer2DModel
    from typer.testing import CliRunner

    from fluxgrpo.cli.app import app

    merged_dir = tmp_path / "merged"
    result = CliRunner().invoke(
        app, ["export", "--checkpoint", str(path), "--merge", "--out", str(merged_dir), "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["base_model"] == str(tiny_weights.flux_dir)  # as the checkpoint recorded it
    merged = FluxTransformer2DModel.from_pretrained(merged_dir)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged(**inputs).sample, expected, rtol=1e-4, atol=1e-5)
    adapter_only = CliRunner().invoke(app, ["export", "--checkpoint", str(path), "--out", str(tmp_path / "adapter")])
    assert adapter_only.exit_code == 0, adapter_only.output
    assert (tmp_path / "adapter" / LORA_WEIGHTS_NAME).read_bytes() == (path / "lora" / LORA_WEIGHTS_NAME).read_bytes()

    # sample --checkpoint takes the LoRA checkpoint: its images differ from the base model's
    from fluxgrpo.sample import build_request, sample
    from fluxgrpo.sampling.request import SampleSettings

    def sample_images(out: Path, checkpoint: str | None) -> list[bytes]:
        settings = SampleSettings(height=32, width=48, steps=2, max_sequence_length=16, images_per_prompt=1)
        request = build_request(
            model=str(tiny_weights.flux_dir), prompts=["a red cat"], out_dir=out, checkpoint=checkpoint,
            ema=False, settings=settings, device="cpu",
        )  # fmt: skip
        assert (request.lora_file is not None) == (checkpoint is not None)
        sample(request, show_progress=False)
        return [p.read_bytes() for p in sorted(out.glob("0*.png"))]

    assert sample_images(tmp_path / "lora-images", str(path)) != sample_images(tmp_path / "base-images", None)
    assert (path / "lora" / LORA_WEIGHTS_NAME).stat().st_mode & 0o777 == 0o644  # like every other output (umask 022)
    check_damaged_adapters_are_one_line(path, tmp_path)


def check_damaged_adapters_are_one_line(checkpoint: Path, tmp_path: Path) -> None:
    """Issue #23.6/9: a truncated, pickled, renamed or NaN adapter: `export --merge` and `sample --checkpoint` say
    so in one line naming the file, exit 1, and write nothing."""
    import shutil

    from safetensors.torch import load_file, save_file
    from typer.testing import CliRunner

    from fluxgrpo.cli.app import app
    from fluxgrpo.errors import FluxgrpoError
    from fluxgrpo.sampling.checkpoints import resolve_checkpoint

    good = load_file(checkpoint / "lora" / LORA_WEIGHTS_NAME)
    first = next(iter(good))

    def truncate(file: Path) -> None:
        file.write_bytes(file.read_bytes()[:100])

    def pickle_it(file: Path) -> None:
        torch.save(good, file)

    def rename(file: Path) -> None:
        save_file({k.replace("transformer.", "unet.", 1): v for k, v in good.items()}, str(file))

    def rename_module(file: Path) -> None:
        save_file({k.replace(".to_q.", ".to_nowhere."): v for k, v in good.items()}, str(file))

    def poison(file: Path) -> None:
        save_file({**good, first: torch.full_like(good[first], float("nan"))}, str(file))

    for damage, says in (
        (truncate, "is not a readable adapter file"),
        (pickle_it, "is not a readable adapter file"),
        (rename, "not a FLUX LoRA key"),
        (rename_module, "of them exist in"),
        (poison, "non-finite values"),
    ):
        damaged = tmp_path / f"damaged-{damage.__name__}" / checkpoint.name
        shutil.copytree(checkpoint, damaged)
        damage(damaged / "lora" / LORA_WEIGHTS_NAME)
        out = tmp_path / f"merged-{damage.__name__}"
        result = CliRunner().invoke(app, ["export", "--checkpoint", str(damaged), "--merge", "--out", str(out)])
        assert result.exit_code == 1, result.output
        errors = [line for line in result.output.splitlines() if line.startswith("error:")]
        assert "Traceback" not in result.output and len(errors) == 1, result.output
        assert says in errors[0] and LORA_WEIGHTS_NAME in errors[0], errors[0]
        assert not out.exists() or not any(out.iterdir())
        if damage is not rename_module:  # a module the base lacks is found only against the model
            with pytest.raises(FluxgrpoError, match=says):
                resolve_checkpoint(damaged, False)

    import errno
    from unittest import mock

    full = OSError(errno.ENOSPC, "No space left on device")
    with mock.patch("fluxgrpo.export.shutil.copy2", side_effect=full):
        result = CliRunner().invoke(app, ["export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "full")])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    # one line naming the folder and its free space (errors.disk_full_error), and nothing partial left in --out
    assert f"no space left on device writing into {tmp_path}" in result.output and "MiB free there" in result.output
    assert not (tmp_path / "full").exists() or not any((tmp_path / "full").iterdir())


def test_lora_exact_resume_and_rising_reward(tiny_weights, tiny_embeddings, tmp_path):
    straight = lora_config(tiny_weights, tiny_embeddings, tmp_path / "straight", use_ema=True, ema_decay=0.9)
    records = run(straight)
    run(
        lora_config(tiny_weights, tiny_embeddings, tmp_path / "resumed", use_ema=True, ema_decay=0.9, max_train_steps=2)
    )
    resumed = lora_config(tiny_weights, tiny_embeddings, tmp_path / "resumed", use_ema=True, ema_decay=0.9)
    run(resumed, resume="latest")
    for folder in ("lora", "lora_ema"):
        a = load_file(tmp_path / "straight" / "checkpoint-4" / folder / LORA_WEIGHTS_NAME)
        b = load_file(tmp_path / "resumed" / "checkpoint-4" / folder / LORA_WEIGHTS_NAME)
        assert a.keys() == b.keys() and a
        for name in a:
            assert torch.equal(a[name], b[name]), f"{folder}/{name} differs after resume"
    assert [r["reward_mean"] for r in read_metrics(tmp_path / "straight")] == [
        r["reward_mean"] for r in read_metrics(tmp_path / "resumed")
    ]
    # the resume state holds the adapters, not the frozen base (read back from the base model's files)
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(tmp_path / "straight" / "checkpoint-4" / "state")).read_metadata()
    model_keys = [key for key in saved.state_dict_metadata if key.startswith("model.")]
    assert model_keys and all(".lora_A." in key or ".lora_B." in key for key in model_keys)
    assert all(r["ratio_mean"] > 0 for r in records)

    with pytest.raises(FluxgrpoError, match="--lora-rank"):
        run(
            lora_config(tiny_weights, tiny_embeddings, tmp_path / "straight", lora_rank=0, max_train_steps=5),
            resume="latest",
        )


def test_reward_rises_with_lora(tiny_weights, tiny_embeddings, tmp_path):
    cfg = lora_config(
        tiny_weights,
        tiny_embeddings,
        tmp_path / "out",
        max_train_steps=12,
        checkpointing_steps=12,
        num_generations=8,
        rollout_batch_size=8,
        train_micro_batch_size=4,
        sampling_steps=8,
        lora_rank=8,
        lora_alpha=16.0,
    )
    trend = reward_trend(run(cfg), window=3)
    assert trend["last"] > trend["first"], trend


def test_unknown_targets_are_named(tiny_weights):
    from fluxgrpo.lora import LoraSpec, add_lora
    from fluxgrpo.models.shard_loading import empty_transformer

    with pytest.raises(FluxgrpoError, match=r"--lora-targets attn\.to_qq match no module"):
        add_lora(
            empty_transformer(tiny_weights.flux_dir), LoraSpec(4, 8.0, ("attn.to_q", "attn.to_qq"), 0.0), torch.float32
        )


def test_lora_options_are_validated():
    from fluxgrpo.errors import UsageError

    with pytest.raises(UsageError) as bad:
        build_config("tiny-cpu", {"lora_rank": -1})
    assert "--lora-rank -1" in str(bad.value)
    with pytest.raises(UsageError) as bad:
        build_config("tiny-cpu", {"lora_rank": 4, "lora_alpha": 0.0, "lora_dropout": 1.0, "lora_targets": " , "})
    message = str(bad.value)
    assert "--lora-alpha" in message and "--lora-dropout" in message and "--lora-targets" in message


@pytest.mark.slow
def test_two_workers_lora_trains_and_resumes_exactly(tiny_weights, tiny_embeddings, tmp_path):
    """FSDP2 shards the frozen base and the fp32 adapters together; the adapter-only resume state restores them."""
    overrides = {"max_train_steps": 2, "checkpointing_steps": 1, "num_generations": 2, "train_batch_size": 1}
    overrides.update(rollout_batch_size=2, train_micro_batch_size=2, sampling_steps=4)
    run(lora_config(tiny_weights, tiny_embeddings, tmp_path / "straight", **overrides), dies=2)
    # Resumed from the straight run's own checkpoint-1 into a folder of its own: one launch of two workers fewer than
    # running an interrupted copy first (tens of seconds of imports on a small host), the same restore of the state.
    checkpoint = str(tmp_path / "straight" / "checkpoint-1")
    run(lora_config(tiny_weights, tiny_embeddings, tmp_path / "resumed", **overrides), dies=2, resume=checkpoint)
    assert not (tmp_path / "resumed" / "checkpoint-1").exists()  # it really started from the other folder's state
    a = load_file(tmp_path / "straight" / "checkpoint-2" / "lora" / LORA_WEIGHTS_NAME)
    b = load_file(tmp_path / "resumed" / "checkpoint-2" / "lora" / LORA_WEIGHTS_NAME)
    assert a.keys() == b.keys()
    assert any(name.endswith("lora_B.weight") and a[name].abs().sum() > 0 for name in a)  # the adapters trained
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.slow
def test_two_ranks_bf16_base_and_fp32_adapters_train_under_fsdp2(tiny_weights, tmp_path):
    """The accelerator layout (bf16 frozen base, fp32 adapters, FSDP2 gathering in bf16), run on 2 cpu ranks."""
    import os
    import subprocess
    import sys

    worker = Path(__file__).with_name("_load_worker.py")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(worker)]
    proc = subprocess.run(
        [*command, "lora-bf16", str(tiny_weights.flux_dir), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"lora_rank{rank}.json").read_text())
        assert result["adapter_dtypes"] == ["torch.float32"] and result["base_dtypes"] == ["torch.bfloat16"]
        assert result["changed"] == result["trainable"]  # every adapter shard moved, no base shard did
