"""fluxgrpo.checkpoint: exact resume (plain and FSDP2), the diffusers export, atomic saves, keep-last, --resume."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fluxgrpo.checkpoint import layout, state
from fluxgrpo.checkpoint.layout import latest_checkpoint, list_checkpoints, resolve_resume
from fluxgrpo.checkpoint.state import TrainingState, load_checkpoint, save_checkpoint
from fluxgrpo.errors import FluxgrpoError, UsageError
from fluxgrpo.runtime.dist import DistContext

WORKER_PATH = Path(__file__).parents[1] / "_ckpt_worker.py"
_spec = importlib.util.spec_from_file_location("_ckpt_worker", WORKER_PATH)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

SINGLE = DistContext(rank=0, local_rank=0, world_size=1, device_type="cpu", device=torch.device("cpu"), backend="gloo")


def assert_exact_resume(result: dict) -> None:
    assert result["trained_moved_weights"], "training did not change the weights: the resume check would be vacuous"
    assert result["ema_differs_from_weights"], "EMA equals the weights: the EMA checks would be vacuous"
    assert result["resume_mismatches"] == [], "2 steps + save + load + 2 steps differs from 4 straight steps"
    assert result["ema_resume_mismatches"] == []
    assert result["export_names_match"]
    assert result["export_mismatches"] == [], "from_pretrained(checkpoint/transformer) differs from the weights"
    assert result["ema_export_mismatches"] == []
    assert result["iteration"] == 2
    assert result["trainer_state"] == {"iteration": 2, "sampler": {"epoch": 0, "position": 7}}
    # linear schedule, warmup 1 of 10 steps, base lr 1e-2: after 2 scheduler steps lr = 1e-2 * (10-2)/(10-1) = 8/900
    assert result["lr_after_load"] == result["lr_at_save"] == pytest.approx(8 / 900)


def test_exact_resume_and_export_world_size_1(tmp_path):
    result = worker.exact_resume_experiment(SINGLE, tmp_path, shard=False)
    assert_exact_resume(result)
    assert result["param_type"] == "Parameter"


@pytest.mark.slow
def test_exact_resume_and_export_fsdp2_two_processes(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.run(
        [*command, str(WORKER_PATH), str(tmp_path)], env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["world_size"] == 2
    assert result["param_type"] == "DTensor"  # the model really was sharded
    assert_exact_resume(result)
    state = Path(result["path"]) / "state"
    assert {p.name for p in state.iterdir()} >= {"__0_0.distcp", "__1_0.distcp", "rng_rank0.pt", "rng_rank1.pt"}


def build():
    model, optimizer, scheduler, _ = worker.build_training(init_seed=0, shard=False)
    return model, optimizer, scheduler


def save(output_dir, iteration, objects, **kwargs):
    kwargs.setdefault("trainer_state", {"iteration": iteration})
    kwargs.setdefault("keep_last", None)
    ema = kwargs.pop("ema", None)
    return save_checkpoint(output_dir, iteration, SINGLE, TrainingState(*objects, ema=ema), **kwargs)


def names(output_dir) -> list[str]:
    return sorted(p.name for p in Path(output_dir).iterdir())


def test_sharded_bf16_export_loads_with_from_pretrained(tmp_path):
    from diffusers import FluxTransformer2DModel

    objects = build()
    model = objects[0]
    path = save(tmp_path, 3, objects, export_dtype=torch.bfloat16, max_shard_size=100_000)
    folder = path / "transformer"
    index = json.loads((folder / "diffusion_pytorch_model.safetensors.index.json").read_text())
    shard_files = sorted(set(index["weight_map"].values()))
    count = len(shard_files)
    assert count >= 2
    assert shard_files == [f"diffusion_pytorch_model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert sorted(p.name for p in folder.glob("*.safetensors")) == shard_files
    # bf16 is 2 bytes an element, so the index's total is twice the parameter count.
    assert index["metadata"]["total_size"] == 2 * sum(t.numel() for t in model.state_dict().values())

    from safetensors import safe_open

    with safe_open(str(folder / shard_files[0]), framework="pt") as f:
        assert {f.get_slice(key).get_dtype() for key in f.keys()} == {"BF16"}  # noqa: SIM118 - safe_open is not iterable

    loaded = FluxTransformer2DModel.from_pretrained(folder, torch_dtype=torch.bfloat16)
    reference = model.state_dict()
    assert sorted(loaded.state_dict()) == sorted(reference)
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, reference[name].to(torch.bfloat16)), name
    # The resume state keeps the fp32 master weights whatever the export dtype.
    fresh = build()
    load_checkpoint(path, SINGLE, TrainingState(*fresh))
    for name, value in fresh[0].state_dict().items():
        assert value.dtype == torch.float32 and torch.equal(value, reference[name]), name


def test_interrupted_saves_never_look_complete_and_are_cleaned_up(tmp_path, monkeypatch):
    objects = build()
    first = save(tmp_path, 1, objects)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    # Crash after every file (COMPLETE included) is in checkpoint-2.tmp, before the rename.
    monkeypatch.setattr(layout, "rename_atomically", killed)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, 2, objects)
    monkeypatch.undo()
    assert (tmp_path / "checkpoint-2.tmp" / "COMPLETE").is_file()
    assert latest_checkpoint(tmp_path) == first
    with pytest.raises(FluxgrpoError, match="interrupted save"):
        resolve_resume(tmp_path, str(tmp_path / "checkpoint-2.tmp"))

    # A worker killed in the middle of writing the training state: no marker at all.
    monkeypatch.setattr(state, "_save_training_state", killed)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, 3, objects)
    monkeypatch.undo()
    assert (tmp_path / "checkpoint-3.tmp" / "transformer").is_dir()
    assert not (tmp_path / "checkpoint-3.tmp" / "COMPLETE").exists()

    # A checkpoint-N folder without the marker (copied by hand, half-way) is not complete either.
    (tmp_path / "checkpoint-9" / "state").mkdir(parents=True)
    assert latest_checkpoint(tmp_path) == first
    assert list_checkpoints(tmp_path) == [first]
    with pytest.raises(FluxgrpoError, match="no COMPLETE marker"):
        resolve_resume(tmp_path, "checkpoint-9")

    # The next save removes the leftovers of both crashes (and leaves a foreign folder alone).
    save(tmp_path, 4, objects)
    assert names(tmp_path) == ["checkpoint-1", "checkpoint-4", "checkpoint-9"]
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-4"


def test_saving_an_existing_iteration_replaces_it(tmp_path):
    objects = build()
    save(tmp_path, 5, objects, trainer_state={"run": "old"})
    path = save(tmp_path, 5, objects, trainer_state={"run": "new"})
    assert names(tmp_path) == ["checkpoint-5"]
    assert load_checkpoint(path, SINGLE, TrainingState(*build())).trainer_state == {"run": "new"}


def test_keep_last(tmp_path):
    objects = build()
    for iteration in (1, 2, 3):
        save(tmp_path, iteration, objects, keep_last=2)
    assert names(tmp_path) == ["checkpoint-2", "checkpoint-3"]
    # A run restarted from an earlier point: the checkpoint just written survives even though it is not
    # among the highest iterations.
    save(tmp_path, 1, objects, keep_last=1)
    assert names(tmp_path) == ["checkpoint-1", "checkpoint-3"]
    with pytest.raises(UsageError, match="keep at least 1"):
        save(tmp_path, 4, objects, keep_last=0)


def test_trainer_state_must_be_json_before_anything_is_written(tmp_path):
    with pytest.raises(TypeError):
        save(tmp_path / "out", 1, build(), trainer_state={"bad": object()})
    assert not (tmp_path / "out").exists()


def test_resolve_resume(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    output = tmp_path / "out"
    assert resolve_resume(output, None) is None
    assert resolve_resume(output, False) is None
    assert resolve_resume(output, True) is None  # nothing saved yet: the same command starts the run
    with pytest.raises(FluxgrpoError, match="no complete checkpoint .* drop --resume"):
        resolve_resume(output, "checkpoint-1")

    objects = build()
    first, second = save(output, 10, objects), save(output, 20, objects)
    assert resolve_resume(output, True) == second
    assert resolve_resume(output, "latest") == second
    assert resolve_resume(output, str(first)) == first
    assert resolve_resume(output, "checkpoint-10") == output / "checkpoint-10"  # a name inside output_dir
    with pytest.raises(FluxgrpoError, match="does not exist.*checkpoint-10, checkpoint-20"):
        resolve_resume(output, "checkpoint-15")
    (output / "notes").mkdir()
    with pytest.raises(FluxgrpoError, match="not checkpoint-<iteration>"):
        resolve_resume(output, str(output / "notes"))


def test_load_refuses_other_world_size_and_missing_ema(tmp_path):
    objects = build()
    path = save(tmp_path, 1, objects)
    with pytest.raises(FluxgrpoError, match="has no EMA state"):
        load_checkpoint(path, SINGLE, TrainingState(*build(), ema=worker.TinyEma(objects[0])))
    marker = path / "COMPLETE"
    info = json.loads(marker.read_text())
    marker.write_text(json.dumps({**info, "world_size": 2}))
    with pytest.raises(FluxgrpoError, match="saved by 2 process.*this run has 1.*--dies 2"):
        load_checkpoint(path, SINGLE, TrainingState(*build()))
    with pytest.raises(FluxgrpoError, match="not a complete checkpoint"):
        load_checkpoint(tmp_path / "checkpoint-7", SINGLE, TrainingState(*build()))


@pytest.mark.parametrize("entry", [{"foo": 1}, {"r": 0}, {"r": "4"}, {"r": 4}, ["r"]])
def test_a_lora_entry_in_a_full_checkpoints_marker_is_called_damaged(tmp_path, entry):
    """Issue #50.8: a full fine-tuning checkpoint whose COMPLETE names a LoRA adapter (it holds transformer/, no
    lora/) is a damaged marker, not a --lora-rank to resume with (the hint said the run's own value, 0)."""
    path = save(tmp_path, 1, build())
    marker = path / "COMPLETE"
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "lora": entry}))
    with pytest.raises(FluxgrpoError) as caught:
        load_checkpoint(path, SINGLE, TrainingState(*build()))
    message = str(caught.value)
    assert f"{marker} is damaged" in message and "--resume-from" in message and "--lora-rank" not in message


def test_a_changed_byte_inside_a_state_file_is_caught_on_resume(tmp_path):
    """Issue #23.9: every rank records the sha256 of the state files it wrote; a resume verifies them, so damage
    inside a tensor's bytes (which no header check sees) is one line naming the file, not a silent resume."""
    path = save(tmp_path, 1, build())
    state = path / "state"
    assert json.loads((path / "COMPLETE").read_text())["checksums"] is True
    recorded = json.loads((state / "checksums_rank0.json").read_text())
    assert set(recorded) == {"__0_0.distcp", ".metadata", "rng_rank0.pt", "trainer_state.json"}
    load_checkpoint(path, SINGLE, TrainingState(*build()))  # intact: verified and loaded
    shard = state / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(FluxgrpoError, match=r"__0_0.distcp does not match the checksum recorded") as caught:
        load_checkpoint(path, SINGLE, TrainingState(*build()))
    assert "\n" not in str(caught.value) and "--resume-from" in str(caught.value)
    (state / "checksums_rank0.json").write_text("{garbled")
    with pytest.raises(FluxgrpoError, match="checksums_rank0.json is missing or damaged"):
        load_checkpoint(path, SINGLE, TrainingState(*build()))
