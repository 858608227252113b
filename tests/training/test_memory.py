"""The per-die memory model: its weight/optimizer terms against what FSDP2 allocates, its activation coefficients
against autograd's saved tensors, and the refusal of a config that cannot fit."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fluxgrpo.config import build_config
from fluxgrpo.errors import UsageError
from fluxgrpo.training.memory import (
    DOUBLE_BLOCK_ACTIVATION_BYTES,
    SINGLE_BLOCK_ACTIVATION_BYTES,
    GiB,
    RunShape,
    VaeShape,
    estimate,
    estimate_for_config,
    plan_memory,
    shard_elements,
    transformer_shape,
    vae_shape,
)

WORKER_PATH = Path(__file__).parents[1] / "_load_worker.py"

# FLUX.1-dev's transformer/config.json and vae/config.json (the parts that size the model)
FLUX_DEV_TRANSFORMER = {
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": [16, 56, 56],
}
FLUX_DEV_VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "latent_channels": 16,
    "norm_num_groups": 32,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}


def test_shard_elements_pads_each_tensor_like_fsdp2():
    # rows 5 over 2 dies: chunks of 3 (the second padded), times 4 columns; a bias of 3 rows: chunks of 2
    assert shard_elements([(5, 4), (3,)], dies=2) == 3 * 4 + 2
    assert shard_elements([(5, 4), (3,)], dies=1) == 23
    assert shard_elements([(2, 7)], dies=4) == 7  # more dies than rows: one row each, some empty


def test_flux_dev_sizes_and_the_shipped_recipes_fit_an_a3_die():
    model = transformer_shape(FLUX_DEV_TRANSFORMER)
    assert model.parameters == 11_901_408_320  # FLUX.1-dev: 11.9 B parameters, 47.6 GB in fp32
    assert (model.double_blocks, model.single_blocks, model.width) == (19, 38, 3072)
    vae = vae_shape(FLUX_DEV_VAE)
    assert vae == VaeShape(83_819_683, 256)
    for name, dies in (("a3-16die", 16), ("a3-8die", 8)):
        result = estimate(model, vae, RunShape.from_config(build_config(name), dies))
        assert result.peak < 64 * GiB, (name, result.lines())
        # sharding divides the weights: 47.6 GB fp32 over the dies, padded by at most one row per tensor
        assert model.parameters * 4 / dies <= result.persistent["weights"] < model.parameters * 4 / dies * 1.001
    two_rewards = estimate(
        model, vae, RunShape.from_config(build_config("a3-16die", {"reward": "hpsv2:1,pickscore:0.5"}), 16)
    )
    assert two_rewards.persistent["reward"] == 2 * 4 * 986_109_440  # each reward model is loaded
    kl = estimate(model, vae, RunShape.from_config(build_config("a3-16die", {"kl_beta": 0.01}), 16))
    assert kl.persistent["kl reference"] == kl.persistent["weights"] // 2  # the frozen base, bf16, sharded alike
    kl_lora = estimate(
        model, vae, RunShape.from_config(build_config("a3-16die", {"kl_beta": 0.01, "lora_rank": 8}), 16)
    )
    assert kl_lora.persistent["kl reference"] == 0  # the policy with its adapters disabled
    one_die = estimate(model, vae, RunShape.from_config(build_config("a3-16die"), 1))
    assert one_die.peak > 141 * GiB  # full fine-tuning never fits one die, not even an H200


def test_checkpointing_and_micro_batch_move_the_activation_term_as_the_formula_says():
    model = transformer_shape(FLUX_DEV_TRANSFORMER)
    cfg = build_config("a3-16die")
    run = RunShape.from_config(cfg, 16)
    with_ckpt = estimate(model, VaeShape(0, 0), run).phases["update"]["activations"]
    without = estimate(
        model, VaeShape(0, 0), RunShape.from_config(build_config("a3-16die", {"gradient_checkpointing": False}), 16)
    )
    tokens = 45 * 45 + 512  # 720² → 45×45 packed latents, plus the 512 T5 tokens
    assert with_ckpt == tokens * 3072 * ((19 + 38) * 2 + DOUBLE_BLOCK_ACTIVATION_BYTES)
    assert without.phases["update"]["activations"] == tokens * 3072 * (
        19 * DOUBLE_BLOCK_ACTIVATION_BYTES + 38 * SINGLE_BLOCK_ACTIVATION_BYTES
    )
    doubled = estimate(
        model, VaeShape(0, 0), RunShape.from_config(build_config("a3-16die", {"train_micro_batch_size": 2}), 16)
    )
    assert doubled.phases["update"]["activations"] == 2 * with_ckpt


def saved_bytes_per_token_per_width(block, width: int, double: bool) -> float:
    """Slope of the bytes a bf16 block saves for backward (parameters excluded) between two token counts."""
    from diffusers.models.embeddings import FluxPosEmbed

    parameters = {p.untyped_storage().data_ptr() for p in block.parameters()}

    def saved(tokens: int) -> int:
        text = 16
        storages: dict[int, int] = {}

        def pack(tensor):
            ptr = tensor.untyped_storage().data_ptr()
            if ptr not in parameters:
                storages[ptr] = tensor.untyped_storage().nbytes()
            return tensor

        hidden = torch.randn(1, tokens - text, width, dtype=torch.bfloat16, requires_grad=True)
        context = torch.randn(1, text, width, dtype=torch.bfloat16, requires_grad=True)
        temb = torch.randn(1, width, dtype=torch.bfloat16, requires_grad=True)
        rope = FluxPosEmbed(10000, [8, 28, 28])(torch.zeros(tokens, 3))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            block(hidden_states=hidden, encoder_hidden_states=context, temb=temb, image_rotary_emb=rope)
        return sum(storages.values())

    return (saved(576) - saved(320)) / (256 * width)


def test_activation_coefficients_match_what_a_flux_block_saves():
    from diffusers import FluxTransformer2DModel

    config = {**FLUX_DEV_TRANSFORMER, "num_layers": 1, "num_single_layers": 1, "num_attention_heads": 8}
    config.update(attention_head_dim=64, axes_dims_rope=[8, 28, 28], joint_attention_dim=64)
    model = FluxTransformer2DModel(**config).to(torch.bfloat16)
    double = saved_bytes_per_token_per_width(model.transformer_blocks[0], 512, double=True)
    single = saved_bytes_per_token_per_width(model.single_transformer_blocks[0], 512, double=False)
    assert double == pytest.approx(DOUBLE_BLOCK_ACTIVATION_BYTES, rel=0.1)
    assert single == pytest.approx(SINGLE_BLOCK_ACTIVATION_BYTES, rel=0.1)


def test_weight_and_optimizer_terms_equal_what_a_single_process_allocates(tiny_weights):
    spec = importlib.util.spec_from_file_location("_load_worker", WORKER_PATH)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    from fluxgrpo.models.shard_loading import empty_transformer, fill_transformer

    model = empty_transformer(tiny_weights.flux_dir)
    fill_transformer(model, tiny_weights.flux_dir, "cpu")
    allocated = worker.allocated_terms(model)
    run = RunShape.from_config(build_config("tiny-cpu"), 1, compute_bytes=4)
    predicted = estimate(transformer_shape(json.loads(model.to_json_string())), VaeShape(0, 0), run)
    assert predicted.persistent["weights"] == allocated["weights"]
    assert predicted.persistent["optimizer"] == allocated["optimizer"]


@pytest.mark.slow
def test_weight_and_optimizer_terms_equal_what_fsdp2_allocates_on_two_ranks(tiny_weights, tmp_path):
    """A transformer whose rows do not split evenly (63 channels), so FSDP2's padding is part of the check."""
    from diffusers import FluxTransformer2DModel

    from fluxgrpo.models.tiny import TINY_TRANSFORMER_CONFIG

    config = {**TINY_TRANSFORMER_CONFIG, "in_channels": 63, "num_attention_heads": 3}
    torch.manual_seed(0)
    FluxTransformer2DModel(**config).save_pretrained(tmp_path / "flux" / "transformer")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER_PATH)]
    proc = subprocess.run(
        [*command, "terms", str(tmp_path / "flux"), str(tmp_path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    rank0 = json.loads((tmp_path / "terms_rank0.json").read_text())  # rank 0 holds the full (padded) chunks
    run = RunShape.from_config(build_config("tiny-cpu"), 2, compute_bytes=4)
    predicted = estimate(transformer_shape(config), VaeShape(0, 0), run)
    assert predicted.persistent["weights"] == rank0["weights"]
    assert predicted.persistent["optimizer"] == rank0["optimizer"]
    rank1 = json.loads((tmp_path / "terms_rank1.json").read_text())
    assert rank1["weights"] < rank0["weights"]  # the uneven rows really were split unevenly


def flux_dev_config_dir(root: Path) -> Path:
    """A folder with FLUX.1-dev's configs and no weights: all the memory model reads."""
    for part, config in (("transformer", FLUX_DEV_TRANSFORMER), ("vae", FLUX_DEV_VAE)):
        (root / part).mkdir(parents=True)
        (root / part / "config.json").write_text(json.dumps(config))
    return root


def test_a_config_that_cannot_fit_is_refused_naming_the_knobs(tmp_path, monkeypatch):
    from fluxgrpo.runtime import device as rt_device
    from fluxgrpo.runtime.device import DeviceMemory

    model_dir = flux_dev_config_dir(tmp_path / "flux")
    devices = [DeviceMemory(i, "Ascend910_9392", 64 * GiB, None) for i in range(16)]
    monkeypatch.setattr(rt_device, "describe_devices", lambda device_type: devices)
    fits = plan_memory(build_config("a3-16die", {"model": str(model_dir)}), 16, "npu")
    assert fits.peak < 64 * GiB

    too_big = build_config("a3-16die", {"model": str(model_dir), "gradient_checkpointing": False})
    with pytest.raises(UsageError) as refused:
        plan_memory(too_big, 4, "npu")
    message = str(refused.value)
    assert "exceeds the 64.0 GiB" in message
    for knob in ("--dies 8", "--gradient-checkpointing", "--cpu-offload"):
        assert knob in message
    assert "--reward-dtype" not in message  # HPSv2 keeps fp32 weights under bf16 autocast: no saving to offer
    monkeypatch.setenv("FLUXGRPO_IGNORE_MEMORY_ESTIMATE", "1")
    assert plan_memory(too_big, 4, "npu").peak > 64 * GiB
    monkeypatch.delenv("FLUXGRPO_IGNORE_MEMORY_ESTIMATE")

    # HPSv3 (7.7 B parameters on every die) in fp32 does not fit 40 GiB devices beside the 16-die run; in bf16, its
    # authors' dtype, it does, and the refusal says so.
    small = [DeviceMemory(i, "A100-SXM4-40GB", 40 * GiB, None) for i in range(16)]
    monkeypatch.setattr(rt_device, "describe_devices", lambda device_type: small)
    with_hpsv3 = {"model": str(model_dir), "reward": "hpsv3"}
    with pytest.raises(UsageError) as refused:
        plan_memory(build_config("a3-16die", with_hpsv3), 16, "cuda")
    assert re.search(r"--reward-dtype bf16: [\d.]+ GiB \(fits\)", str(refused.value)), str(refused.value)
    assert plan_memory(build_config("a3-16die", {**with_hpsv3, "reward_dtype": "bf16"}), 16, "cuda").peak < 40 * GiB


def test_shipped_configs_state_the_estimate_in_their_header(tmp_path):
    """A shipped config that quotes its estimated peak quotes what the model computes for FLUX.1-dev."""
    import re

    from fluxgrpo.config import shipped_configs

    model_dir = flux_dev_config_dir(tmp_path / "flux")
    quoted = 0
    for name, path in shipped_configs().items():
        text = path.read_text()
        figure = re.search(r"Estimated peak(?: per die)?: ([\d.]+) GiB", text)
        if figure is None:
            continue
        dies = int(re.search(r"--dies (\d+)", text).group(1)) if "--dies" in text.splitlines()[0] else 1
        result = estimate_for_config(build_config(name, {"model": str(model_dir)}), dies, "cuda")  # bf16
        assert float(figure.group(1)) == pytest.approx(result.peak / GiB, abs=0.05), name
        quoted += 1
    assert quoted >= 2


def test_a_dry_run_plans_from_the_model_the_config_names_for_its_dies(tiny_weights, tiny_embeddings):
    """Issue #31.2: on a machine holding only the tiny weights, the a3-16die plan is FLUX.1-dev's on 16 dies (the
    21.0 GiB of docs/memory.md), says so, and warns that --model holds another model; --dies still overrides the
    config."""
    from typer.testing import CliRunner

    from fluxgrpo.cli.app import app

    runner = CliRunner()
    argv = ["train", "--config", "a3-16die", "--model", str(tiny_weights.flux_dir), "--dry-run"]
    argv += ["--data-json-path", str(tiny_embeddings.index_path)]
    result = runner.invoke(app, argv)
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["derived"]["world_size"] == 16 and plan["config"]["dies"] == 16  # the config's dies, not 1
    memory = plan["memory_per_die"]
    assert memory["peak_gib"] >= 20
    assert memory["sized_from"].startswith("FLUX.1-dev's known shapes")
    assert "sized from FLUX.1-dev's known shapes" in result.stderr
    (warning,) = memory["warnings"]
    assert "holds the tiny random FLUX" in warning and "not FLUX.1-dev" in warning
    assert f"warning: {warning}" in result.stderr
    expected = estimate(
        transformer_shape(FLUX_DEV_TRANSFORMER),
        vae_shape(FLUX_DEV_VAE),
        RunShape.from_config(build_config("a3-16die"), 16),
    )
    assert memory["peak_gib"] == round(expected.peak / GiB, 2)  # FLUX.1-dev's own plan, the T5's 512 tokens
    eight = json.loads(runner.invoke(app, [*argv, "--dies", "8"]).stdout)
    assert eight["derived"]["world_size"] == 8 and eight["memory_per_die"]["peak_gib"] > memory["peak_gib"]
    # tiny-cpu names the tiny model: planned from it, with nothing to warn about
    tiny = runner.invoke(
        app, ["train", "--config", "tiny-cpu", "--model", str(tiny_weights.flux_dir), "--dry-run",
              "--data-json-path", str(tiny_embeddings.index_path)],
    )  # fmt: skip
    assert tiny.exit_code == 0, tiny.output
    tiny_memory = json.loads(tiny.stdout)["memory_per_die"]
    assert tiny_memory["warnings"] == [] and tiny_memory["peak_gib"] < 4
    assert tiny_memory["sized_from"].startswith("the tiny random FLUX")


def test_a_dry_run_without_any_weights_still_plans_and_says_what_a_launch_would_refuse():
    from typer.testing import CliRunner

    from fluxgrpo.cli.app import app

    result = CliRunner().invoke(app, ["train", "--config", "a3-16die", "--dry-run"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["memory_per_die"]["peak_gib"] >= 20 and plan["memory_per_die"]["warnings"] == []
    assert any("fetch-weights" in check for check in plan["skipped_checks"])


@pytest.mark.parametrize(
    "name",
    [
        "shapes-quickstart",
        "shapes-balanced",
        "shapes-balanced-nft",
        "shapes-cpu",
        "shapes-cpu-awm",
        "shapes-cpu-hps",
        "shapes-cpu-vgrpo",
        "shapes-overfit",
    ],
)
def test_the_shapes_configs_size_a_dry_run_from_the_world_model_and_fit_a_laptop(name, tmp_path):
    """The quickstart's configs name the world model: a --dry-run before fetch-weights plans its shapes (not
    FLUX.1-dev's, which refused the quickstart's own dry run at 168 GiB), and the shipped weights raise no warning."""
    from fluxgrpo.shapes.shipped import shipped_weights_dir

    before_fetch = estimate_for_config(build_config(name, {"model": str(tmp_path / "absent")}), 2, "cpu", True)
    assert "shapes world" in before_fetch.sized_from and before_fetch.peak / GiB < 8  # a laptop's share per die
    fetched = estimate_for_config(build_config(name, {"model": str(shipped_weights_dir() / "flux")}), 2, "cpu", True)
    assert fetched.warnings == []
