"""``fluxgrpo sample`` on the tiny weights: reproducible images, checkpoints (and EMA), the index, the errors, NPU
kernels through the stand-in torch_npu, and ``--dies 2`` through torchrun."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

# diffusers decides at import whether torch_npu exists; import the pipeline while the stand-in is not on sys.path.
from diffusers import FluxPipeline  # noqa: F401
from diffusers.models import attention_dispatch
from PIL import Image
from typer.testing import CliRunner

from fluxgrpo.cli.app import app
from fluxgrpo.errors import FluxgrpoError, UsageError
from fluxgrpo.run_folder import INDEX_FILE
from fluxgrpo.sample import build_request, sample
from fluxgrpo.sampling.folder import (
    GRID_CAPTION,
    GRID_GAP,
    GRID_MIN_WIDTH,
    grid_tile_origin,
    grid_tile_size,
    read_index,
)
from fluxgrpo.sampling.request import SampleSettings, image_filename, image_seed

runner = CliRunner()
FAKE_TORCH_NPU = Path(__file__).resolve().parents[1] / "fake_torch_npu"
PROMPTS = ["a red cat", "a blue dog on a hill"]
# 48 wide x 32 high: 6 x 4 latent tokens after 8x VAE and 2x2 packing; non-square so width/height mix-ups show.
TINY = {"height": 32, "width": 48, "steps": 2, "max_sequence_length": 16, "images_per_prompt": 2}
TINY_Q_K_NORMS = 2 * 4 + 2 * 2  # the tiny transformer: 4 q/k RMSNorms per double block, 2 per single block


def run_sample(flux_dir, out, *, prompts=PROMPTS, checkpoint=None, ema=False, **overrides):
    settings = SampleSettings(**{**TINY, **overrides})
    request = build_request(
        model=str(flux_dir),
        prompts=list(prompts),
        out_dir=out,
        checkpoint=checkpoint,
        ema=ema,
        settings=settings,
        device="cpu",
    )
    return sample(request, show_progress=False)


def pixels(out: Path) -> dict[str, np.ndarray]:
    """Every image of a run by file name, as uint8 arrays."""
    return {
        entry["file"]: np.asarray(Image.open(out / entry["file"]))
        for entry in json.loads((out / INDEX_FILE).read_text())["images"]
    }


def same_images(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[name], b[name]) for name in a)


def no_image_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and not any(np.array_equal(a[name], b[name]) for name in a)


# --- pure helpers ---------------------------------------------------------------------------------------------------


def test_image_seed_is_the_documented_formula_and_distinct():
    expected = int.from_bytes(hashlib.sha256(b"fluxgrpo-sample:7:3:1").digest()[:8], "big") & (2**63 - 1)
    assert image_seed(7, 3, 1) == expected
    seeds = {image_seed(s, i, j) for s in range(3) for i in range(20) for j in range(5)}
    assert len(seeds) == 3 * 20 * 5 and all(0 <= s < 2**63 for s in seeds)
    assert image_filename(3, 1) == "0003_01.png" and image_filename(12345, 100) == "12345_100.png"


def test_grid_tiles_shrink_with_the_grid_and_never_enlarge():
    # 2 x 3 grid of 64 high x 96 wide: long-side limit min(256, 4096 // 3 = 1365) = 256 >= 96, so kept as is.
    assert grid_tile_size(2, 3, 64, 96) == (96, 64)
    # 100 prompts of 720 x 720: limit 4096 // 100 = 40, scale 40/720: 40 x 40 tiles.
    assert grid_tile_size(100, 4, 720, 720) == (40, 40)
    # 1000 prompts: 4096 // 1000 = 4, raised to the 16 px floor; 720 high x 1280 wide: 16 x round(720 * 16/1280) = 9.
    assert grid_tile_size(1000, 1, 720, 1280) == (16, 9)


def test_settings_are_validated_with_the_flag_name():
    with pytest.raises(UsageError) as bad_size:
        SampleSettings(height=40).validate()
    assert str(bad_size.value) == (
        "image size 40×720 is not a positive multiple of 16 (the VAE's 8× downsampling times FLUX's 2×2 packing): "
        "set --height and --width to multiples of 16, e.g. 720 or 1024"
    )
    with pytest.raises(UsageError, match="--images-per-prompt"):
        SampleSettings(images_per_prompt=0).validate()
    with pytest.raises(UsageError, match="--attention"):
        SampleSettings(attention="flash").validate()
    with pytest.raises(UsageError, match="--seed"):
        SampleSettings(seed=-1).validate()


# --- generation -----------------------------------------------------------------------------------------------------


def test_same_seed_same_images_whatever_the_batch_size(tiny_weights, tmp_path):
    one = run_sample(tiny_weights.flux_dir, tmp_path / "b1", batch_size=1)
    run_sample(tiny_weights.flux_dir, tmp_path / "b3", batch_size=3)
    other_seed = run_sample(tiny_weights.flux_dir, tmp_path / "s1", batch_size=3, seed=1)
    assert (one.images, one.prompts, one.images_per_prompt) == (4, 2, 2)
    first = pixels(tmp_path / "b1")
    assert sorted(first) == ["0000_00.png", "0000_01.png", "0001_00.png", "0001_01.png"]
    assert all(image.shape == (32, 48, 3) for image in first.values())
    assert first["0000_00.png"].std() > 5  # a real image, not a constant
    assert same_images(first, pixels(tmp_path / "b3"))
    assert no_image_equal(first, pixels(tmp_path / "s1"))
    assert other_seed.images == 4


def test_index_lists_every_image_with_its_seed_and_the_grid_holds_them(tiny_weights, tmp_path):
    out = tmp_path / "run"
    run_sample(tiny_weights.flux_dir, out, seed=5)
    document = json.loads((out / INDEX_FILE).read_text())
    assert document["format"] == "fluxgrpo-sample-index" and document["fluxgrpo_version"]
    assert (document["checkpoint"], document["ema"], document["prompts"]) == (None, False, PROMPTS)
    assert document["settings"]["seed"] == 5 and document["settings"]["height"] == 32
    assert [(e["prompt_index"], e["image_index"]) for e in document["images"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for entry in document["images"]:
        assert entry["seed"] == image_seed(5, entry["prompt_index"], entry["image_index"])
        assert entry["prompt"] == PROMPTS[entry["prompt_index"]]
        png = Image.open(out / entry["file"])
        assert png.text == {"prompt": entry["prompt"], "seed": str(entry["seed"])}
    index = read_index(out)
    assert [image.file for image in index.images] == [e["file"] for e in document["images"]]

    # 2 rows of a caption band over 2 columns of 48 x 32 tiles, 2 px gaps; wide enough for the captions
    grid = np.asarray(Image.open(out / "grid.png").convert("RGB"))
    assert grid.shape == (2 * (GRID_CAPTION + 32 + GRID_GAP) + GRID_GAP, GRID_MIN_WIDTH, 3)
    left, top = grid_tile_origin(1, 0, (48, 32))  # prompt 1, image 0
    assert (left, top) == (GRID_GAP, GRID_GAP + GRID_CAPTION + 32 + GRID_GAP + GRID_CAPTION)
    assert np.array_equal(grid[top : top + 32, left : left + 48], pixels(out)["0001_00.png"])
    for row in range(2):  # each row's prompt is written in its band (issue #50.14: the sheet had no captions)
        band_top = grid_tile_origin(row, 0, (48, 32))[1] - GRID_CAPTION
        band = grid[band_top : band_top + GRID_CAPTION, : GRID_MIN_WIDTH // 2]
        assert (band < 128).any(), f"no caption over row {row}"


def test_accelerator_precision_samples_in_bf16_close_to_fp32(tiny_weights, tmp_path, monkeypatch):
    # On accelerators the runtime's compute dtype is bf16 (weights and autocast); cpu autocast runs the same branch.
    from fluxgrpo import sample as sample_command
    from fluxgrpo.sampling import generate

    run_sample(tiny_weights.flux_dir, tmp_path / "fp32")
    for module in (generate, sample_command):  # each names the runtime's compute_dtype at import
        monkeypatch.setattr(module, "compute_dtype", lambda device_type: torch.bfloat16)
    summary = run_sample(tiny_weights.flux_dir, tmp_path / "bf16")
    assert summary.dtype == "bfloat16" and read_index(tmp_path / "bf16").settings["dtype"] == "bfloat16"
    full, half = pixels(tmp_path / "fp32"), pixels(tmp_path / "bf16")
    assert not same_images(full, half)  # the weights really ran in bf16
    # bf16 keeps 8 significant bits (relative error 2^-9 per rounding): a few 8-bit levels at most on average
    assert all(np.abs(full[name].astype(int) - half[name].astype(int)).mean() < 3 for name in full)


def test_interrupted_run_never_looks_complete_and_a_rerun_replaces_it(tiny_weights, tmp_path, monkeypatch):
    from fluxgrpo.sampling import generate as module

    out = tmp_path / "run"
    run_sample(tiny_weights.flux_dir, out, images_per_prompt=1)
    assert (out / INDEX_FILE).is_file()
    calls = []
    real_save = module._save_png

    def fail_on_second(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real_save(*args, **kwargs)

    monkeypatch.setattr(module, "_save_png", fail_on_second)
    with pytest.raises(KeyboardInterrupt):
        run_sample(tiny_weights.flux_dir, out)
    assert not (out / INDEX_FILE).exists()  # the earlier run's index went first
    with pytest.raises(FluxgrpoError, match="not found"):
        read_index(out)
    monkeypatch.setattr(module, "_save_png", real_save)
    summary = run_sample(tiny_weights.flux_dir, out)
    assert summary.images == 4 and len(read_index(out).images) == 4


def test_output_folder_with_other_files_is_refused(tiny_weights, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(FluxgrpoError, match=r"notes\.txt.*--out"):
        run_sample(tiny_weights.flux_dir, out)
    assert (out / "notes.txt").read_text() == "keep me"


# --- checkpoints ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_run(tiny_weights, tiny_embeddings, tmp_path_factory):
    """A 2-iteration tiny-cpu training run with EMA (decay 0.5, so the EMA differs clearly from both weights)."""
    from fluxgrpo.config import build_config
    from fluxgrpo.training.launch_plan import preflight
    from fluxgrpo.training.loop import train

    output_dir = tmp_path_factory.mktemp("trained") / "grpo"
    cfg = build_config(
        "tiny-cpu",
        {
            "model": str(tiny_weights.flux_dir),
            "hps_dir": str(tiny_weights.hps_dir),
            "data_json_path": str(tiny_embeddings.index_path),
            "output_dir": str(output_dir),
            "max_train_steps": 2,
            "checkpointing_steps": 2,
            "reward": "brightness",
            "save_images_every": 0,
            "use_ema": True,
            "ema_decay": 0.5,
            "eval_every": 0,
        },
    )
    preflight(cfg)
    train(cfg)
    return output_dir


def test_checkpoint_and_its_ema_change_the_images(tiny_weights, trained_run, tmp_path):
    run_sample(tiny_weights.flux_dir, tmp_path / "base")
    trained = run_sample(tiny_weights.flux_dir, tmp_path / "trained", checkpoint=str(trained_run))  # → latest
    ema = run_sample(tiny_weights.flux_dir, tmp_path / "ema", checkpoint=str(trained_run / "checkpoint-2"), ema=True)
    assert trained.checkpoint == ema.checkpoint == str(trained_run / "checkpoint-2")
    base_px, trained_px, ema_px = (pixels(tmp_path / name) for name in ("base", "trained", "ema"))
    assert no_image_equal(base_px, trained_px)
    assert no_image_equal(trained_px, ema_px) and no_image_equal(base_px, ema_px)
    index = read_index(tmp_path / "ema")
    assert (index.checkpoint, index.ema) == (str(trained_run / "checkpoint-2"), True)


def _fake_checkpoint(tiny_weights, root: Path, has_ema: bool) -> Path:
    """A complete checkpoint whose trained weights are the base model's own (so it must sample like the base)."""
    checkpoint = root / "run" / "checkpoint-3"
    shutil.copytree(tiny_weights.flux_dir / "transformer", checkpoint / "transformer")
    (checkpoint / "COMPLETE").write_text(json.dumps({"iteration": 3, "world_size": 1, "has_ema": has_ema}))
    return checkpoint


def test_swapped_in_checkpoint_with_base_weights_samples_like_the_base(tiny_weights, tmp_path):
    checkpoint = _fake_checkpoint(tiny_weights, tmp_path, has_ema=False)
    run_sample(tiny_weights.flux_dir, tmp_path / "base", images_per_prompt=1)
    run_sample(tiny_weights.flux_dir, tmp_path / "ckpt", images_per_prompt=1, checkpoint=str(checkpoint.parent))
    assert same_images(pixels(tmp_path / "base"), pixels(tmp_path / "ckpt"))


def test_checkpoint_errors_are_clear(tiny_weights, tmp_path):
    checkpoint = _fake_checkpoint(tiny_weights, tmp_path, has_ema=False)
    with pytest.raises(FluxgrpoError, match=r"no EMA weights.*drop --ema"):
        run_sample(tiny_weights.flux_dir, tmp_path / "o", checkpoint=str(checkpoint), ema=True)
    with pytest.raises(UsageError, match="--ema needs --checkpoint"):
        run_sample(tiny_weights.flux_dir, tmp_path / "o", ema=True)
    with pytest.raises(FluxgrpoError, match="does not exist"):
        run_sample(tiny_weights.flux_dir, tmp_path / "o", checkpoint=str(tmp_path / "nowhere"))
    interrupted = tmp_path / "run" / "checkpoint-5"
    shutil.copytree(checkpoint / "transformer", interrupted / "transformer")
    with pytest.raises(FluxgrpoError, match="COMPLETE marker"):
        run_sample(tiny_weights.flux_dir, tmp_path / "o", checkpoint=str(interrupted))
    empty = tmp_path / "empty-run"
    empty.mkdir()
    with pytest.raises(FluxgrpoError, match="no complete checkpoint-<k>"):
        run_sample(tiny_weights.flux_dir, tmp_path / "o", checkpoint=str(empty))
    config = json.loads((checkpoint / "transformer" / "config.json").read_text())
    config["joint_attention_dim"] = 64
    (checkpoint / "transformer" / "config.json").write_text(json.dumps(config))
    with pytest.raises(FluxgrpoError, match=r"another model.*joint_attention_dim 64 vs 32.*--model"):
        run_sample(tiny_weights.flux_dir, tmp_path / "o", checkpoint=str(checkpoint))


# --- the NPU path (stand-in torch_npu) ------------------------------------------------------------------------------


@pytest.fixture
def fake_torch_npu(monkeypatch):
    """The stand-in torch_npu for this test only, with the runtime's import status reset around it."""
    from fluxgrpo.runtime import device as rt_device

    for name in [n for n in sys.modules if n == "torch_npu" or n.startswith("torch_npu.")]:
        monkeypatch.delitem(sys.modules, name)
    registry = attention_dispatch._AttentionBackendRegistry
    monkeypatch.setattr(registry, "_active_backend", registry._active_backend)  # adapt sets a process default
    monkeypatch.syspath_prepend(str(FAKE_TORCH_NPU))
    monkeypatch.setenv("FLUXGRPO_FORCE_NPU_ADAPT", "1")
    rt_device._reset_npu_status_for_tests()
    import torch_npu

    torch_npu.reset_calls()
    yield torch_npu
    for name in [n for n in sys.modules if n == "torch_npu" or n.startswith("torch_npu.")]:
        del sys.modules[name]
    rt_device._reset_npu_status_for_tests()


def test_sample_runs_through_the_swapped_rmsnorm_modules(tiny_weights, tmp_path, fake_torch_npu):
    summary = run_sample(tiny_weights.flux_dir, tmp_path / "npu", images_per_prompt=1, steps=3, batch_size=2)
    assert summary.images == 2
    # one pipeline call (2 images in one batch), 3 denoising steps, 12 swapped q/k norms per forward: 36 kernel calls
    assert fake_torch_npu.CALLS["npu_rms_norm"] == 3 * TINY_Q_K_NORMS


# --- the CLI --------------------------------------------------------------------------------------------------------


def test_cli_json_summary_and_exit_codes(tiny_weights, tmp_path):
    flux = str(tiny_weights.flux_dir)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat\n\na red cat\na blue dog on a hill\n")  # blank line and repeat dropped
    ok = runner.invoke(
        app,
        [
            "sample",
            "--model",
            flux,
            "--prompts",
            str(prompts),
            "--height",
            "32",
            "--width",
            "48",
            "--steps",
            "2",
            "--max-sequence-length",
            "16",
            "--out",
            str(tmp_path / "o"),
            "--device",
            "cpu",
            "--json",
        ],
    )
    assert ok.exit_code == 0, ok.output
    summary = json.loads(ok.stdout)
    assert (summary["prompts"], summary["images"], summary["world_size"]) == (2, 2, 1)
    assert read_index(summary["index_path"]).prompts == PROMPTS

    base = ["sample", "--model", flux, "--out", str(tmp_path / "x"), "--device", "cpu"]
    assert runner.invoke(app, base).exit_code == 2  # no prompts
    assert runner.invoke(app, [*base, "--prompt", "a", "--prompts", str(prompts)]).exit_code == 2
    assert runner.invoke(app, [*base, "--prompt", "a", "--ema"]).exit_code == 2
    bad_size = runner.invoke(app, [*base, "--prompt", "a", "--height", "40"])
    assert bad_size.exit_code == 2 and "image size 40×" in bad_size.stderr and "--height and --width" in bad_size.stderr
    assert runner.invoke(app, [*base, "--prompt", "a", "--dies", "0"]).exit_code == 2
    missing = runner.invoke(app, [*base, "--prompts", str(tmp_path / "none.txt")])
    assert missing.exit_code == 1 and "none.txt" in missing.stderr
    no_checkpoint = runner.invoke(app, [*base, "--prompt", "a", "--checkpoint", str(tmp_path / "nowhere")])
    assert no_checkpoint.exit_code == 1 and "--checkpoint" in no_checkpoint.stderr
    no_weights = runner.invoke(app, ["sample", "--model", str(tmp_path / "nothing"), "--prompt", "a"])
    assert no_weights.exit_code == 1 and "fetch-weights" in no_weights.stderr


@pytest.mark.slow
def test_two_processes_write_every_image_once_and_match_one_process(tiny_weights, tmp_path, monkeypatch):
    # `--dies 2` runs `python -m fluxgrpo.runtime.agent --standalone --nproc-per-node=2 -m fluxgrpo.runtime.worker
    # fluxgrpo.sample ...` (torchrun)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # 2 cores, 2 workers
    three = [*PROMPTS, "a green tree"]
    out = tmp_path / "two"
    args = [
        "sample",
        "--model",
        str(tiny_weights.flux_dir),
        "--height",
        "32",
        "--width",
        "48",
        "--steps",
        "2",
        "--max-sequence-length",
        "16",
        "--images-per-prompt",
        "2",
        "--device",
        "cpu",
        "--json",
        "--out",
        str(out),
    ]
    for text in three:
        args += ["--prompt", text]
    result = runner.invoke(app, [*args, "--dies", "2"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert (summary["world_size"], summary["images"]) == (2, 6)
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted([image_filename(i, j) for i in range(3) for j in range(2)] + ["grid.png", INDEX_FILE])
    index = read_index(out)
    assert [(im.prompt_index, im.image_index) for im in index.images] == [(i, j) for i in range(3) for j in range(2)]
    assert index.settings["world_size"] == 2
    run_sample(tiny_weights.flux_dir, tmp_path / "one", prompts=three)
    assert same_images(pixels(out), pixels(tmp_path / "one"))


def test_the_shapes_world_samples_with_its_evaluations_steps_and_its_shipped_prompt_sets(tmp_path):
    """Issue #50.14: `sample --steps` defaulted to FLUX.1-dev's 28 on the shapes world, whose evaluation samples with
    12; its held-out prompts had to be written to a file (eval_prompts.txt left in the working folder)."""
    from fluxgrpo.sample import model_sample_guidance, model_sample_steps
    from fluxgrpo.shapes.shipped import write_shapes_weights

    write_shapes_weights(tmp_path / "flux", tmp_path / "hps", parts=["flux"])
    assert model_sample_steps(tmp_path / "flux") == 12
    assert model_sample_steps(tmp_path / "nothing") == 28  # FLUX.1-dev's; the request then names the fix
    assert (model_sample_guidance(tmp_path / "flux"), model_sample_guidance(tmp_path / "nothing")) == (1.75, 3.5)
    out = tmp_path / "samples"
    argv = ["sample", "--model", str(tmp_path / "flux"), "--prompt", "two red squares", "--out", str(out)]
    result = CliRunner().invoke(app, [*argv, "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    settings = json.loads((out / INDEX_FILE).read_text())["settings"]
    assert (settings["steps"], settings["guidance"]) == (12, 1.75)
    assert "evaluated with 12 steps at guidance 1.75: its own are the defaults" in result.stderr
    # a guidance given is the guidance drawn at
    given = CliRunner().invoke(app, [*argv[:-1], str(tmp_path / "given"), "--guidance", "3.5", "--device", "cpu"])
    assert given.exit_code == 0, given.output
    assert json.loads((tmp_path / "given" / INDEX_FILE).read_text())["settings"]["guidance"] == 3.5
    named = CliRunner().invoke(app, ["sample", "--model", str(tmp_path / "none"), "--prompts", "shapes-heldout"])
    assert named.exit_code == 1 and "prompt file" not in named.stderr and "fetch-weights" in named.stderr
