"""Meta-device loading of the transformer: the same weights as from_pretrained, one host copy per job."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.models.flux import load_transformer
from fluxgrpo.models.shard_loading import empty_transformer, fill_transformer, read_safetensors_header

WORKER_PATH = Path(__file__).parents[1] / "_load_worker.py"
_spec = importlib.util.spec_from_file_location("_load_worker", WORKER_PATH)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)


def loaded_both_ways(flux_dir: Path):
    from diffusers import FluxTransformer2DModel

    # What build_parts did before (load_transformer without its folder check, so a transformer alone will do)
    reference = FluxTransformer2DModel.from_pretrained(flux_dir, subfolder="transformer", dtype=torch.float32)
    model = empty_transformer(flux_dir)
    assert next(model.parameters()).is_meta
    fill_transformer(model, flux_dir, "cpu")
    return reference, model


def assert_same_weights(reference, model) -> None:
    expected, found = reference.state_dict(), model.state_dict()
    assert found.keys() == expected.keys()
    for name, tensor in expected.items():
        assert found[name].dtype == torch.float32
        assert torch.equal(found[name], tensor), name


def test_meta_loading_gives_from_pretrained_weights_and_config(tiny_weights):
    reference, model = loaded_both_ways(tiny_weights.flux_dir)
    assert_same_weights(reference, model)
    assert not model.training  # from_pretrained returns eval mode; so does this
    assert json.loads(model.to_json_string()) == json.loads(reference.to_json_string())


def test_bf16_and_sharded_files_are_read_like_from_pretrained(tiny_weights, tmp_path):
    """FLUX.1-dev ships its transformer in bf16, split into shards with an index: both paths of the reader."""
    source = load_transformer(tiny_weights.flux_dir, dtype=torch.bfloat16)
    flux_dir = tmp_path / "flux"
    source.save_pretrained(flux_dir / "transformer", max_shard_size="100KB")
    assert (flux_dir / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    reference, model = loaded_both_ways(flux_dir)
    assert_same_weights(reference, model)
    assert reference.state_dict()["proj_out.weight"].dtype == torch.float32


def test_header_reader_locates_every_tensor(tiny_weights):
    from safetensors import safe_open

    path = tiny_weights.flux_dir / "transformer" / "diffusion_pytorch_model.safetensors"
    header = read_safetensors_header(path)
    with safe_open(str(path), framework="pt") as f:
        assert set(header) == set(f.keys())
        for name in header:
            assert header[name].shape == tuple(f.get_slice(name).get_shape())


def test_missing_or_truncated_weights_name_the_fix(tiny_weights, tmp_path):
    flux_dir = tmp_path / "flux"
    shutil.copytree(tiny_weights.flux_dir / "transformer", flux_dir / "transformer")
    weights = flux_dir / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(FluxgrpoError, match="fetch-weights"):
        fill_transformer(empty_transformer(flux_dir), flux_dir, "cpu")

    config = json.loads((flux_dir / "transformer" / "config.json").read_text())
    config["num_layers"] += 1  # a model with a block the file does not have
    (flux_dir / "transformer" / "config.json").write_text(json.dumps(config))
    shutil.copy(tiny_weights.flux_dir / "transformer" / "diffusion_pytorch_model.safetensors", weights)
    with pytest.raises(FluxgrpoError, match="lacks .* weights.*fetch-weights"):
        fill_transformer(empty_transformer(flux_dir), flux_dir, "cpu")


def torchrun(*args: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.run([*command, str(WORKER_PATH), *args], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


@pytest.mark.slow
def test_two_ranks_flux_shaped_model_same_shards_and_one_host_copy(tmp_path):
    flux_dir, out = tmp_path / "flux", tmp_path / "out"
    out.mkdir()
    copy_bytes = worker.write_flux_shaped_transformer(flux_dir)
    assert copy_bytes > 300 * 2**20

    # One launch: the memory measurement first, in workers that have loaded nothing yet, then the comparison.
    torchrun("memory+compare", str(flux_dir), str(out), "sharded")
    compare = json.loads((out / "compare.json").read_text())
    assert compare["param_type"] == "DTensor"
    assert compare["mismatches"] == [[], []]

    ranks = [json.loads((out / f"memory_rank{r}.json").read_text()) for r in (0, 1)]
    assert sum(r["local_parameter_bytes"] for r in ranks) >= copy_bytes  # each rank holds its half
    # from_pretrained on every rank rises by ≥ one copy per rank (2.3× here with accelerate, more without)
    assert sum(r["peak_rise"] for r in ranks) <= 1.3 * copy_bytes, ranks
