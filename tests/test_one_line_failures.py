"""Issue #30.4, 7, 13–24: every failure is one line, said before anything is written or started, and true.

A full disk is simulated where the write happens (the OS's ENOSPC, raised by the write itself); the rest are the
issue's own inputs."""

from __future__ import annotations

import errno
import json
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
from training_helpers import tiny_train_argv
from typer.testing import CliRunner

from fluxgrpo.cli.app import app
from fluxgrpo.config import build_config
from fluxgrpo.errors import FluxgrpoError, UsageError

runner = CliRunner()


def _one_line(text: str) -> str:
    assert "Traceback" not in text, text
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, text
    return errors[0]


def _full_disk(real_write_atomic):
    """write_atomic as it behaves on a full disk: the temporary file is begun, the write fails with ENOSPC."""

    def write(path, data, **kwargs):
        def partial(f):
            f.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device", str(path))

        return real_write_atomic(path, partial, **kwargs)

    return write


# --------------------------------------------------------------------------------------------- 4: a full disk


def test_a_full_disk_is_one_line_in_train(tiny_weights, tiny_embeddings, tmp_path, monkeypatch):
    import fluxgrpo.paths

    monkeypatch.setattr(fluxgrpo.paths, "write_atomic", _full_disk(fluxgrpo.paths.write_atomic))
    out = tmp_path / "out"
    result = runner.invoke(app, tiny_train_argv(tiny_weights, tiny_embeddings, "--output-dir", str(out)))
    assert result.exit_code == 1, result.output
    line = _one_line(result.stderr)
    assert f"no space left on device writing into {out}" in line and "MiB free there now" in line
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]  # nothing partial left


def test_a_full_disk_is_one_line_in_sample_and_preprocess(tiny_weights, tmp_path, monkeypatch):
    import fluxgrpo.data.embeddings
    import fluxgrpo.sampling.generate

    monkeypatch.setattr(fluxgrpo.sampling.generate, "write_atomic", _full_disk(fluxgrpo.sampling.generate.write_atomic))
    monkeypatch.setattr(fluxgrpo.data.embeddings, "write_atomic", _full_disk(fluxgrpo.data.embeddings.write_atomic))
    flux = str(tiny_weights.flux_dir)
    images = tmp_path / "images"
    argv = ["sample", "--model", flux, "--prompt", "a red cat", "--out", str(images), "--height", "32"]
    sampled = runner.invoke(
        app, [*argv, "--width", "32", "--steps", "2", "--max-sequence-length", "16", "--device", "cpu"]
    )
    assert sampled.exit_code == 1, sampled.output
    assert f"no space left on device writing into {images}" in _one_line(sampled.stderr)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat\n")
    embeddings = tmp_path / "embeddings"
    argv = ["preprocess", "--prompts", str(prompts), "--model", flux, "--out", str(embeddings)]
    encoded = runner.invoke(app, [*argv, "--max-sequence-length", "16", "--device", "cpu"])
    assert encoded.exit_code == 1, encoded.output
    assert "no space left on device writing into" in _one_line(encoded.stderr)
    for folder in (images, embeddings):
        assert not [p for p in folder.rglob("*.tmp")], list(folder.rglob("*"))


def test_a_full_disk_under_pil_and_torch_save_names_the_out_folder_and_leaves_no_empty_folder(
    tiny_weights, tmp_path, monkeypatch
):
    """PIL's and torch.save's writes raise ENOSPC without a file name: the line still names --out, not the
    current folder, and the folders the command made for its output are gone again."""
    import torch
    from PIL import Image

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")  # as a full disk under a file object: no filename

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(Image.Image, "save", no_space)
    monkeypatch.setattr(torch, "save", no_space)
    flux = str(tiny_weights.flux_dir)
    images = tmp_path / "made" / "images"
    argv = ["sample", "--model", flux, "--prompt", "a red cat", "--out", str(images), "--height", "32"]
    sampled = runner.invoke(
        app, [*argv, "--width", "32", "--steps", "2", "--max-sequence-length", "16", "--device", "cpu"]
    )
    assert sampled.exit_code == 1, sampled.output
    assert f"no space left on device writing into {images} " in _one_line(sampled.stderr)
    assert not (tmp_path / "made").exists()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat\n")
    embeddings = tmp_path / "embeddings"
    argv = ["preprocess", "--prompts", str(prompts), "--model", flux, "--out", str(embeddings)]
    encoded = runner.invoke(app, [*argv, "--max-sequence-length", "16", "--device", "cpu"])
    assert encoded.exit_code == 1, encoded.output
    line = _one_line(encoded.stderr)
    assert f"no space left on device writing into {embeddings}" in line and f"into {tmp_path} " not in line
    assert not [p for p in embeddings.rglob("*") if p.is_dir()]  # no empty sub-folder left (a written file may be)


def test_a_full_disk_during_export_leaves_nothing_in_out(tiny_weights, tmp_path, monkeypatch):
    from fluxgrpo.export import _writing

    source = tiny_weights.flux_dir / "transformer"
    out = tmp_path / "export"
    real_copyfile = shutil.copyfile
    copied: list[str] = []

    def copy_until_full(src, dst, *args, **kwargs):
        if copied:
            Path(dst).write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        copied.append(src)
        return real_copyfile(src, dst, *args, **kwargs)

    monkeypatch.setattr(shutil, "copyfile", copy_until_full)
    with pytest.raises(FluxgrpoError) as caught, _writing(out, 123 << 20) as staging:
        shutil.copytree(source, staging, dirs_exist_ok=True)
    message = str(caught.value)
    assert f"no space left on device writing into {tmp_path}" in message and "needs about 123.0 MiB" in message
    assert "\n" not in message and "[(" not in message  # never the repr of shutil.Error's list
    assert not out.exists() and list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------- 7, 17: YAML


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a: " + "[" * 5000 + "]" * 5000 + "\n", "nests deeper than"),
        ("output_dir: " + "x" * (2 << 20) + "\n", "too large for a run config"),
        ("learning_rate: 0.1\nseed: 1\nlearning_rate: 0.2\n", "the key 'learning_rate' is given twice (line 3)"),
    ],
    ids=["5000-deep", "2-MiB-value", "duplicate-key"],
)
def test_a_hostile_yaml_config_is_one_line_exit_2(tmp_path, text, expected):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(UsageError) as caught:
        build_config(str(path))
    assert expected in str(caught.value) and "\n" not in str(caught.value)
    result = runner.invoke(app, ["train", "--config", str(path), "--dry-run"])
    assert result.exit_code == 2 and expected in _one_line(result.stderr)


def test_many_unknown_keys_are_listed_with_a_cap(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("".join(f"unknown_{i}: 1\n" for i in range(5000)))
    with pytest.raises(UsageError) as caught:
        build_config(str(path))
    lines = str(caught.value).splitlines()
    assert len(lines) == 22 and lines[-1].endswith("... and 4980 more")


# --------------------------------------------------------------------------------------------- 13, 19: prompts


@pytest.mark.parametrize("content", [b"", b"\n  \n\t\n", b"\x00\x00\x00\n", b"\xff\xfe\x00binary\x80"])
def test_a_bad_eval_prompts_file_names_the_flag_before_any_run_file(tiny_weights, tiny_embeddings, tmp_path, content):
    prompts = tmp_path / "eval.txt"
    prompts.write_bytes(content)
    out = tmp_path / "out"
    extra = ["--output-dir", str(out), "--eval-every", "1", "--eval-prompts", str(prompts)]
    result = runner.invoke(app, tiny_train_argv(tiny_weights, tiny_embeddings, *extra))
    assert result.exit_code == 1, result.output
    line = _one_line(result.stderr)
    assert "--eval-prompts" in line and "--prompts" not in line.replace("--eval-prompts", "")
    assert not out.exists() or not [p.name for p in out.iterdir() if p.name != ".fluxgrpo.lock"]


def test_a_prompt_of_nul_bytes_is_blank(tmp_path):
    from fluxgrpo.data.prompts import read_prompts

    path = tmp_path / "p.txt"
    path.write_bytes(b"\x00\x00\n\x01\x02 \n")
    with pytest.raises(FluxgrpoError, match="holds no prompts"):
        read_prompts(path)
    path.write_bytes(b"\x00\x00\na cat\n")
    assert read_prompts(path) == ["a cat"]


# --------------------------------------------------------------------------------------------- 14, 15, 16, 21


def test_deep_check_refuses_dies_that_cannot_fit_before_any_check(monkeypatch):
    import fluxgrpo.deepcheck.kernels

    def not_reached(*args, **kwargs):
        raise AssertionError("a check ran before the --dies refusal")

    monkeypatch.setattr(fluxgrpo.deepcheck.kernels, "check_kernels", not_reached)
    result = runner.invoke(app, ["env-check", "--deep", "--quick", "--device", "cpu", "--dies", "100000"])
    assert result.exit_code == 2, result.output
    assert "--dies" in _one_line(result.stderr)


def test_a_negative_sde_window_is_refused_in_whole_sentences():
    with pytest.raises(UsageError) as caught:
        build_config("tiny-cpu", {"sde_window": -1})
    problems = str(caught.value).splitlines()[1:]
    assert len(problems) == 1 and "--sde-window -1 must be between 0 (off) and" in problems[0]
    with pytest.raises(UsageError) as caught:
        build_config("tiny-cpu", {"timestep_fraction": 0.1})
    assert "trains no timestep: raise --timestep-fraction or --sampling-steps" in str(caught.value)


def test_an_index_entry_outside_its_folder_is_refused_as_outside_even_when_absent(tiny_embeddings, tmp_path):
    from fluxgrpo.envcheck import embeddings_status

    folder = tmp_path / "emb"
    shutil.copytree(tiny_embeddings.out_dir, folder)
    index = folder / "videos2caption.json"
    entries = json.loads(index.read_text())
    entries[0]["prompt_embed_path"] = "../../../etc/passwd-that-does-not-exist"
    index.write_text(json.dumps(entries))
    status = embeddings_status(folder)
    assert not status["complete"]
    assert "not a file in" in status["problems"][0] and "missing" not in status["problems"][0]


def test_the_memory_refusal_names_the_smaller_image_that_fits(tiny_weights, monkeypatch):
    from fluxgrpo.training import memory

    model = str(tiny_weights.flux_dir)
    cfg = build_config("tiny-cpu", {"model": model, "height": 8192, "width": 8192})
    monkeypatch.setattr(memory, "host_memory_per_worker", lambda workers: 8 << 30)
    with pytest.raises(UsageError) as caught:
        memory.plan_memory(cfg, 1, "cpu")
    found = str(caught.value).split("--height ")[1]
    height, width = int(found.split()[0]), int(found.split("--width ")[1].split(":")[0])
    assert height == width and height < 8192 and height % 16 == 0 and "(fits)" in found.split(";")[0]
    smaller = build_config("tiny-cpu", {"model": model, "height": height, "width": width})
    assert memory.checked_peak(memory.estimate_for_config(smaller, 1, "cpu"), "cpu") <= 8 << 30


# --------------------------------------------------------------------------------------------- 18, 20, 22, 23


def test_lora_files_are_byte_reproducible_whatever_the_metadata_order(tmp_path):
    from safetensors.torch import load_file, save_file

    from fluxgrpo.lora import sort_header_metadata

    tensors = {"b": __import__("torch").ones(2), "a": __import__("torch").zeros(3)}
    save_file(tensors, str(tmp_path / "x"), metadata={"lora_adapter_metadata": '{"r": 4}', "format": "pt"})
    save_file(tensors, str(tmp_path / "y"), metadata={"format": "pt", "lora_adapter_metadata": '{"r": 4}'})
    for name in ("x", "y"):
        sort_header_metadata(tmp_path / name)
    assert (tmp_path / "x").read_bytes() == (tmp_path / "y").read_bytes()
    (length,) = struct.unpack("<Q", (tmp_path / "x").read_bytes()[:8])
    header = json.loads((tmp_path / "x").read_bytes()[8 : 8 + length])
    assert list(header["__metadata__"]) == ["format", "lora_adapter_metadata"]
    assert load_file(str(tmp_path / "x"))["b"].tolist() == [1.0, 1.0]


def test_registering_a_reward_architecture_leaves_no_temporary_folder(tmp_path, monkeypatch):
    import open_clip

    from fluxgrpo.rewards.open_clip_model import register_open_clip_config

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    config = {
        "embed_dim": 8,
        "vision_cfg": {"image_size": 32, "layers": 1, "width": 16, "head_width": 8, "patch_size": 16},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 16, "heads": 2, "layers": 1},
    }
    name = register_open_clip_config(config)
    assert name in open_clip.list_models() and list(tmp_path.iterdir()) == []
    other = register_open_clip_config({**config, "embed_dim": 12})  # a rescan after the first file is gone
    assert {name, other} <= set(open_clip.list_models())
    assert open_clip.get_model_config(name)["embed_dim"] == 8


def test_a_cpu_compile_drops_the_cuda_home_warning():
    import logging

    from fluxgrpo.runtime.adapt import compile_backend

    assert compile_backend("cpu") == "inductor"
    logger = logging.getLogger("torch.utils.cpp_extension")

    def record(message: str) -> logging.LogRecord:
        return logger.makeRecord(logger.name, logging.WARNING, __file__, 0, message, ("/usr/local/cuda",), None)

    assert not logger.filter(record("No CUDA runtime is found, using CUDA_HOME='%s'"))
    assert logger.filter(record("another warning about %s"))


def test_an_unpaired_lora_layer_is_worded_as_such(tmp_path):
    import torch
    from safetensors.torch import save_file

    from fluxgrpo.lora import check_adapter_file

    path = tmp_path / "pytorch_lora_weights.safetensors"
    save_file({"transformer.bogus.lora_A.weight": torch.zeros(2, 2)}, str(path))
    with pytest.raises(FluxgrpoError) as caught:
        check_adapter_file(path, "pass another --checkpoint")
    assert "holds an unpaired adapter: layer 'bogus' has only one of lora_A and lora_B" in str(caught.value)
