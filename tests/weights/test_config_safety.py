"""Issue #23.1: no config file in a weights folder can make fluxgrpo import code.

Each test plants, in a copy of the tiny weights without manifests (a folder placed by hand), a config that names a
Python file beside it: transformers' ``auto_map``, a ``model_index.json`` component from a module of the folder, an
open_clip text tower whose tokenizer is such a folder with ``trust_remote_code``. Importing that file creates a
marker. The command or loader must refuse in one line naming the file, and the marker must never appear.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from PIL import Image
from training_helpers import tiny_train_argv
from typer.testing import CliRunner

from fluxgrpo.cli.app import app
from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.weights.config_guard import open_clip_architecture
from fluxgrpo.weights.layout import (
    CLIP_MANIFEST,
    HPS_CHECKPOINT,
    HPS_MANIFEST,
    OPEN_CLIP_WEIGHTS,
    REWARD_ARCH_FILE,
    hpsv3_dir,
    imagereward_dir,
    pickscore_dir,
)

runner = CliRunner()

_EVIL_MODULE = "evil_code"


def _plant_code(folder: Path, marker: Path) -> dict[str, list[str | None]]:
    """Write ``folder/evil_code.py``, which creates ``marker`` when imported; returns an ``auto_map`` naming it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{_EVIL_MODULE}.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class Evil(PreTrainedTokenizerFast):\n    pass\n"
    )
    entry = [f"{_EVIL_MODULE}.Evil", None]
    return {"AutoTokenizer": entry, "AutoModel": entry, "AutoConfig": entry, "AutoImageProcessor": entry}


def _edit_json(path: Path, **changes) -> None:
    document = json.loads(path.read_text())
    document.update(changes)
    path.write_text(json.dumps(document))


def _hostile_open_clip_folder(tiny_weights, tmp_path: Path, marker: Path) -> Path:
    """The tiny HPS/CLIP files, hand-placed, whose open_clip config names a remote-code tokenizer folder."""
    folder = tmp_path / "hps_ckpt"
    folder.mkdir()
    for name in (HPS_CHECKPOINT, OPEN_CLIP_WEIGHTS, REWARD_ARCH_FILE):
        shutil.copy2(tiny_weights.hps_dir / name, folder / name)
    tokenizer = tmp_path / "tokenizer"
    auto_map = _plant_code(tokenizer, marker)
    shutil.copy2(pickscore_dir(tiny_weights.hps_dir) / "processor" / "tokenizer.json", tokenizer / "tokenizer.json")
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({"auto_map": auto_map, "tokenizer_class": "Evil"}))
    config = json.loads((folder / REWARD_ARCH_FILE).read_text())
    config["text_cfg"].update(hf_tokenizer_name=str(tokenizer), tokenizer_kwargs={"trust_remote_code": True})
    (folder / REWARD_ARCH_FILE).write_text(json.dumps(config))
    return folder


def _one_error_line(output: str) -> str:
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output
    return errors[0]


def test_score_clipscore_never_imports_the_tokenizer_an_open_clip_config_names(tiny_weights, tmp_path):
    marker = tmp_path / "PWNED"
    hps_dir = _hostile_open_clip_folder(tiny_weights, tmp_path, marker)
    images = tmp_path / "images"
    images.mkdir()
    Image.new("RGB", (64, 64), (120, 30, 200)).save(images / "0.png")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a purple square\n")
    argv = ["score", "--images", str(images), "--prompts", str(prompts), "--reward", "clipscore"]
    result = runner.invoke(app, [*argv, "--hps-dir", str(hps_dir)])
    assert result.exit_code != 0, result.output
    line = _one_error_line(result.output)
    assert str(hps_dir / REWARD_ARCH_FILE) in line and "hf_tokenizer_name" in line
    assert not marker.exists(), "the open_clip config made us import code"


def test_train_hpsv2_never_imports_the_tokenizer_an_open_clip_config_names(tiny_weights, tiny_embeddings, tmp_path):
    marker = tmp_path / "PWNED"
    hps_dir = _hostile_open_clip_folder(tiny_weights, tmp_path, marker)
    argv = tiny_train_argv(tiny_weights, tiny_embeddings, "--reward", "hpsv2", "--output-dir", str(tmp_path / "run"))
    argv[argv.index("--hps-dir") + 1] = str(hps_dir)
    result = runner.invoke(app, argv)
    assert result.exit_code != 0, result.output
    line = _one_error_line(result.output)
    assert str(hps_dir / REWARD_ARCH_FILE) in line
    assert not marker.exists(), "the open_clip config made us import code"


@pytest.mark.parametrize(
    "tower, key, value",
    [
        ("text_cfg", "hf_model_name", "some/model"),
        ("text_cfg", "hf_tokenizer_name", "some/tokenizer"),
        ("text_cfg", "tokenizer_kwargs", {"trust_remote_code": True}),
        ("vision_cfg", "timm_model_name", "vit_base_patch16_224"),
        (None, "custom_text", True),
        (None, "multimodal_cfg", {}),
        ("text_cfg", "width", "32"),
        ("text_cfg", "layers", True),
        ("vision_cfg", "width", 10**12),
        ("vision_cfg", "mlp_ratio", float("nan")),
    ],
)
def test_an_open_clip_config_holds_only_numeric_architecture_keys(tower, key, value):
    from fluxgrpo.rewards.tiny import TINY_REWARD_CONFIG

    config = json.loads(json.dumps(TINY_REWARD_CONFIG))
    (config[tower] if tower else config)[key] = value
    with pytest.raises(FluxgrpoError, match=key) as caught:
        open_clip_architecture(Path("open_clip_config.json"), config)
    assert "\n" not in str(caught.value)


def test_laions_own_open_clip_config_is_accepted_as_vit_h_14():
    vit_h_14 = {
        "embed_dim": 1024,
        "vision_cfg": {"image_size": 224, "layers": 32, "width": 1280, "head_width": 80, "patch_size": 14},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 1024, "heads": 16, "layers": 24},
    }
    wrapped = {"model_cfg": vit_h_14, "preprocess_cfg": {"mean": [0.48, 0.45, 0.40], "std": [0.26, 0.26, 0.27]}}
    assert open_clip_architecture(Path("open_clip_config.json"), wrapped) == vit_h_14


# --------------------------------------------------------------------------------------------- every config kind


def _copy_reward_part(tiny_weights, tmp_path: Path, part_dir) -> Path:
    """A hand-placed copy (no manifests) of one reward's subfolder of the tiny HPS folder; returns the HPS folder."""
    hps_dir = tmp_path / "hps_ckpt"
    shutil.copytree(part_dir(tiny_weights.hps_dir), part_dir(hps_dir))
    for manifest in part_dir(hps_dir).rglob("manifest.json"):
        manifest.unlink()
    return hps_dir


@pytest.mark.parametrize(
    "reward, part_dir, config",
    [
        ("pickscore", pickscore_dir, "model/config.json"),
        ("pickscore", pickscore_dir, "processor/tokenizer_config.json"),
        ("pickscore", pickscore_dir, "processor/preprocessor_config.json"),
        ("imagereward", imagereward_dir, "model/med_config.json"),
        ("imagereward", imagereward_dir, "model/vision_config.json"),
        ("imagereward", imagereward_dir, "tokenizer/tokenizer_config.json"),
        ("hpsv3", hpsv3_dir, "base/config.json"),
        ("hpsv3", hpsv3_dir, "base/tokenizer_config.json"),
    ],
)
def test_a_reward_config_naming_code_is_refused_and_never_imported(tiny_weights, tmp_path, reward, part_dir, config):
    from fluxgrpo.rewards import load_reward

    hps_dir = _copy_reward_part(tiny_weights, tmp_path, part_dir)
    path = part_dir(hps_dir) / config
    marker = tmp_path / "PWNED"
    _edit_json(path, auto_map=_plant_code(path.parent, marker), trust_remote_code=True)
    with pytest.raises(FluxgrpoError) as caught:
        load_reward(reward, hps_dir)
    message = str(caught.value)
    assert str(path) in message and "auto_map" in message and "\n" not in message, message
    assert not marker.exists(), f"{config} made us import code"


def _hand_placed_flux(tiny_weights, tmp_path: Path) -> Path:
    flux_dir = tmp_path / "flux"
    shutil.copytree(tiny_weights.flux_dir, flux_dir)
    (flux_dir / "manifest.json").unlink()
    return flux_dir


@pytest.mark.parametrize(
    "config, loader",
    [
        ("transformer/config.json", "load_transformer"),
        ("vae/config.json", "load_vae"),
        ("text_encoder/config.json", "load_text_encoders"),
        ("text_encoder_2/config.json", "load_text_encoders"),
        ("tokenizer/tokenizer_config.json", "load_text_encoders"),
        ("tokenizer_2/tokenizer_config.json", "load_text_encoders"),
        ("scheduler/scheduler_config.json", "load_scheduler_config"),
    ],
)
def test_a_flux_config_naming_code_is_refused_and_never_imported(tiny_weights, tmp_path, monkeypatch, config, loader):
    from fluxgrpo.models import flux
    from fluxgrpo.models.flux import require_flux_dir

    flux_dir = _hand_placed_flux(tiny_weights, tmp_path)
    path = flux_dir / config
    marker = tmp_path / "PWNED"
    _edit_json(path, auto_map=_plant_code(path.parent, marker))
    with pytest.raises(FluxgrpoError) as caught:
        require_flux_dir(flux_dir)
    message = str(caught.value)
    assert str(path) in message and "auto_map" in message and "\n" not in message, message
    # Behind the guard, the concrete classes each loader names never follow auto_map either.
    monkeypatch.setattr(flux, "require_flux_dir", Path)
    getattr(flux, loader)(flux_dir)
    assert not marker.exists(), f"{config} made us import code"


@pytest.mark.parametrize(
    "component, entry",
    [
        ("scheduler", [_EVIL_MODULE, "Evil"]),  # diffusers' custom component: <component>/<library>.py
        ("text_encoder", ["transformers", "AutoModel"]),
        ("tokenizer_2", ["transformers", "AutoTokenizer"]),
    ],
)
def test_model_index_naming_another_class_is_refused_by_sample(tiny_weights, tmp_path, component, entry):
    flux_dir = _hand_placed_flux(tiny_weights, tmp_path)
    marker = tmp_path / "PWNED"
    _plant_code(flux_dir / component, marker)
    _edit_json(flux_dir / "model_index.json", **{component: entry})
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cube\n")
    argv = ["sample", "--model", str(flux_dir), "--prompts", str(prompts), "--out", str(tmp_path / "out")]
    result = runner.invoke(app, [*argv, "--height", "64", "--width", "64", "--steps", "1"])
    assert result.exit_code != 0, result.output
    line = _one_error_line(result.output)
    assert "model_index.json" in line and component in line
    assert not marker.exists(), "model_index.json made us import code"


def test_a_checkpoint_transformer_config_naming_code_is_refused(tmp_path):
    from fluxgrpo.weights.config_guard import folder_config_problems

    folder = tmp_path / "transformer"
    marker = tmp_path / "PWNED"
    auto_map = _plant_code(folder, marker)
    (folder / "config.json").write_text(json.dumps({"_class_name": "FluxTransformer2DModel", "auto_map": auto_map}))
    (problem,) = folder_config_problems(folder)
    assert str(folder / "config.json") in problem and "auto_map" in problem
    (folder / "config.json").write_text('{"_class_name": "FluxTransformer2DModel", "num_layers": 1')
    assert "not readable JSON" in folder_config_problems(folder)[0]
    assert not marker.exists()


def test_the_shipped_tiny_folders_pass_the_config_guard(tiny_weights):
    from fluxgrpo.rewards import reward_names, reward_weights_status
    from fluxgrpo.weights.layout import check_flux_dir

    assert check_flux_dir(tiny_weights.flux_dir).complete
    for name in reward_names():
        assert all(part.complete for part in reward_weights_status(name, tiny_weights.hps_dir)), name


def test_hps_manifests_do_not_exempt_the_architecture_file(tiny_weights, tmp_path):
    """The manifest is plain JSON beside the files: an attacker edits it too. The guard does not trust it."""
    folder = tmp_path / "hps_ckpt"
    folder.mkdir()
    for name in (HPS_CHECKPOINT, OPEN_CLIP_WEIGHTS, REWARD_ARCH_FILE, HPS_MANIFEST, CLIP_MANIFEST):
        shutil.copy2(tiny_weights.hps_dir / name, folder / name)
    _edit_json(folder / REWARD_ARCH_FILE, custom_text=True)
    from fluxgrpo.weights.manifest import describe_files, read_manifest, write_manifest

    manifest = read_manifest(folder, HPS_MANIFEST)
    assert manifest is not None
    rewritten = dataclasses.replace(manifest, files=describe_files(folder, [HPS_CHECKPOINT, REWARD_ARCH_FILE]))
    write_manifest(folder, rewritten, HPS_MANIFEST)
    from fluxgrpo.rewards import load_reward

    with pytest.raises(FluxgrpoError, match="custom_text"):
        load_reward("hpsv2", folder)


# --------------------------------------------------------------------------------------------- #23.6: damaged .bin


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("damage", ["pickled", "truncated"])
@pytest.mark.parametrize(
    "component, weights, bin_name",
    [
        ("text_encoder", "model.safetensors", "pytorch_model.bin"),
        ("vae", "diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin"),
    ],
)
def test_a_pickled_or_truncated_bin_in_the_flux_folder_is_one_line(
    tiny_weights, tmp_path, component, weights, bin_name, damage
):
    import torch

    flux_dir = _hand_placed_flux(tiny_weights, tmp_path)
    (flux_dir / component / weights).unlink()
    marker = tmp_path / "PWNED"
    if damage == "pickled":
        torch.save({"weight": _RunsCode(marker)}, flux_dir / component / bin_name)
    else:
        torch.save({"weight": torch.zeros(64, 64)}, flux_dir / component / bin_name)
        path = flux_dir / component / bin_name
        path.write_bytes(path.read_bytes()[:200])
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cube\n")
    argv = ["sample", "--model", str(flux_dir), "--prompts", str(prompts), "--out", str(tmp_path / "out")]
    result = runner.invoke(app, [*argv, "--height", "64", "--width", "64", "--steps", "1"])
    assert result.exit_code == 1, result.output
    line = _one_error_line(result.output)
    assert str(flux_dir) in line and "weights_only" not in line and "can still be loaded" not in line, line
    assert not marker.exists()
