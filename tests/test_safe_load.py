"""Nothing a file holds runs code: every pickle fluxgrpo reads, replaced by one that would run code, is refused
with one line naming the file, and its payload never runs. Damaged checkpoint files are one line too."""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from training_helpers import tiny_train_argv

from fluxgrpo.checkpoint.state import TrainingState, load_checkpoint, save_checkpoint
from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.runtime.dist import DistContext
from fluxgrpo.safe_dcp import read_dcp_metadata
from fluxgrpo.safe_load import UnsafeFileError, load_plain

WORKER_PATH = Path(__file__).with_name("_ckpt_worker.py")
_spec = importlib.util.spec_from_file_location("_ckpt_worker", WORKER_PATH)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

SINGLE = DistContext(rank=0, local_rank=0, world_size=1, device_type="cpu", device=torch.device("cpu"), backend="gloo")


class Payload:
    """Unpickling this creates ``marker``: proof that the file ran code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def write_evil_torch_file(path: Path, marker: Path) -> None:
    torch.save({"state_dict": Payload(marker)}, path)


def write_evil_pickle(path: Path, marker: Path) -> None:
    path.write_bytes(pickle.dumps(Payload(marker)))


def one_line(message: str) -> str:
    assert "\n" not in message.strip() and "Traceback" not in message, message
    return message


def build():
    model, optimizer, scheduler, _ = worker.build_training(init_seed=0, shard=False)
    return model, optimizer, scheduler


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    rng = {"noise": torch.Generator().manual_seed(3).get_state()}
    return save_checkpoint(
        root, 1, SINGLE, TrainingState(*build()), trainer_state={"iteration": 1}, keep_last=None, rng_states=rng
    )


def reseal(checkpoint: Path) -> None:
    """Record the state files' checksums as they are now, as whoever planted or damaged them could: these tests
    are about the safe loaders behind the checksums (checkpoint/test_checkpoint.py tests the checksums themselves)."""
    from fluxgrpo.checkpoint.state import write_state_checksums

    if (checkpoint / "state").is_dir():
        write_state_checksums(checkpoint / "state", 0)


@pytest.fixture
def checkpoint_copy(saved_checkpoint, tmp_path) -> Path:
    copy = tmp_path / "out" / saved_checkpoint.name
    shutil.copytree(saved_checkpoint, copy)
    return copy


# --------------------------------------------------------------------------------------------- code-running files


def test_a_code_running_rng_file_is_refused_and_does_not_run(checkpoint_copy, tmp_path):
    marker = tmp_path / "PWNED"
    rng_file = checkpoint_copy / "state" / "rng_rank0.pt"
    write_evil_torch_file(rng_file, marker)
    reseal(checkpoint_copy)
    with pytest.raises(UnsafeFileError) as caught:
        load_checkpoint(checkpoint_copy, SINGLE, TrainingState(*build()))
    message = one_line(str(caught.value))
    assert str(rng_file) in message and "asks to call" in message
    assert not marker.exists()


def test_a_code_running_dcp_metadata_is_refused_and_does_not_run(checkpoint_copy, tmp_path):
    marker = tmp_path / "PWNED"
    metadata = checkpoint_copy / "state" / ".metadata"
    write_evil_pickle(metadata, marker)
    reseal(checkpoint_copy)
    with pytest.raises(UnsafeFileError) as caught:
        load_checkpoint(checkpoint_copy, SINGLE, TrainingState(*build()))
    assert str(metadata) in one_line(str(caught.value))
    assert not marker.exists()


def test_the_real_dcp_metadata_passes_the_restricted_reader(saved_checkpoint):
    from torch.distributed.checkpoint.metadata import Metadata

    assert isinstance(read_dcp_metadata(saved_checkpoint / "state" / ".metadata"), Metadata)


class EvilScheduler:
    """An LR scheduler whose saved state hides a payload under a key the real scheduler has."""

    def __init__(self, real, marker: Path):
        self.real, self.marker = real, marker

    def state_dict(self):
        return {**self.real.state_dict(), "base_lrs": Payload(self.marker)}


def test_a_code_running_value_inside_the_distcp_files_is_refused_and_does_not_run(tmp_path):
    marker = tmp_path / "PWNED"
    model, optimizer, scheduler = build()
    path = save_checkpoint(
        tmp_path / "out",
        1,
        SINGLE,
        TrainingState(model, optimizer, EvilScheduler(scheduler, marker)),
        trainer_state={},
        keep_last=1,
    )
    assert not marker.exists()  # saving only pickles the payload
    with pytest.raises(UnsafeFileError, match="base_lrs") as caught:
        load_checkpoint(path, SINGLE, TrainingState(*build()))
    one_line(str(caught.value))
    assert not marker.exists()


def test_a_code_running_embedding_file_is_refused_and_does_not_run(tiny_embeddings, tmp_path):
    from fluxgrpo.data.embeddings import EmbeddingDataset

    emb = tmp_path / "emb"
    shutil.copytree(tiny_embeddings.out_dir, emb)
    marker = tmp_path / "PWNED"
    evil = emb / "pooled_prompt_embeds" / "3.pt"
    write_evil_torch_file(evil, marker)
    dataset = EmbeddingDataset(emb / "videos2caption.json")
    with pytest.raises(FluxgrpoError) as caught:
        dataset[3]
    message = one_line(str(caught.value))
    assert str(evil) in message and "fluxgrpo preprocess" in message
    with pytest.raises(FluxgrpoError, match="3.pt"):
        dataset.validate()
    assert not marker.exists()


def test_load_plain_names_the_file_for_raw_pickles_and_truncated_files(tmp_path):
    marker = tmp_path / "PWNED"
    raw = tmp_path / "raw.pt"
    raw.write_bytes(pickle.dumps(Payload(marker), protocol=2))
    with pytest.raises(UnsafeFileError, match="raw.pt holds more than tensors .*asks to call getattr.*: fix it"):
        load_plain(raw, "fix it")
    framed = tmp_path / "framed.pt"
    framed.write_bytes(pickle.dumps(Payload(marker), protocol=5))  # an opcode torch's safe reader never reads
    with pytest.raises(FluxgrpoError, match="framed.pt is damaged or not a torch file"):
        load_plain(framed, "fix it")
    good = tmp_path / "good.pt"
    torch.save(torch.ones(3), good)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:40])
    with pytest.raises(FluxgrpoError, match=r"truncated.pt is damaged or not a torch file .*: fix it") as caught:
        load_plain(truncated, "fix it")
    one_line(str(caught.value))
    assert torch.equal(load_plain(good, "fix it"), torch.ones(3))
    assert not marker.exists()


def test_rng_states_that_a_safe_resume_could_not_read_are_refused_at_save(tmp_path):
    import numpy as np

    with pytest.raises(TypeError, match="rng_states may hold only tensors and plain values"):
        save_checkpoint(
            tmp_path,
            1,
            SINGLE,
            TrainingState(*build()),
            trainer_state={},
            keep_last=None,
            rng_states={"np": np.zeros(3)},
        )


def test_a_checkpoint_with_the_old_unsafe_rng_format_is_refused_with_a_reason(checkpoint_copy):
    info = json.loads((checkpoint_copy / "COMPLETE").read_text())
    (checkpoint_copy / "COMPLETE").write_text(json.dumps({**info, "format_version": 1}))
    with pytest.raises(FluxgrpoError, match="older fluxgrpo") as caught:
        load_checkpoint(checkpoint_copy, SINGLE, TrainingState(*build()))
    one_line(str(caught.value))


# --------------------------------------------------------------------------------------------- damaged checkpoints


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda c: (c / "COMPLETE").write_text("garbage{"), r"COMPLETE is damaged"),
        (lambda c: (c / "COMPLETE").write_text("[1, 2]"), r"COMPLETE is malformed"),
        (lambda c: _truncate(c / "state" / "trainer_state.json", 10), r"trainer_state.json is damaged"),
        (lambda c: (c / "state" / ".metadata").unlink(), r"\.metadata is missing"),
        (lambda c: _truncate(c / "state" / ".metadata", 30), r"\.metadata is damaged"),
        (lambda c: _truncate(c / "state" / "__0_0.distcp", 100), r"cannot read the training state in"),
        (lambda c: _truncate(c / "state" / "rng_rank0.pt", 50), r"rng_rank0.pt is damaged"),
        (lambda c: (c / "state" / "rng_rank0.pt").unlink(), r"rng_rank0.pt is missing"),
    ],
    ids=["complete-garbage", "complete-list", "trainer-state", "no-metadata", "metadata", "distcp", "rng", "no-rng"],
)
def test_a_damaged_checkpoint_is_one_line_naming_what_to_do(checkpoint_copy, damage, expected):
    damage(checkpoint_copy)
    reseal(checkpoint_copy)
    with pytest.raises(FluxgrpoError, match=expected) as caught:
        load_checkpoint(checkpoint_copy, SINGLE, TrainingState(*build()))
    message = one_line(str(caught.value))
    assert "--resume-from" in message
    assert "CheckpointException" not in message


def _truncate(path: Path, size: int) -> None:
    path.write_bytes(path.read_bytes()[:size])


def test_a_full_disk_during_the_dcp_save_says_so_naming_the_folder(tmp_path, monkeypatch):
    import torch.distributed.checkpoint.filesystem as dcp_fs

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(dcp_fs, "_write_item", no_space)
    with pytest.raises(FluxgrpoError) as caught:
        save_checkpoint(tmp_path, 1, SINGLE, TrainingState(*build()), trainer_state={}, keep_last=None)
    message = one_line(str(caught.value))
    assert message.startswith(f"no space left on device writing {tmp_path / 'checkpoint-1.tmp' / 'state'}")
    assert "CheckpointException" not in message
    assert not (tmp_path / "checkpoint-1").exists()


def test_a_full_disk_writing_the_export_says_so_naming_the_file(tmp_path, monkeypatch):
    import safetensors.torch

    def no_space(tensors, filename, metadata=None):
        raise safetensors.SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        )

    monkeypatch.setattr(safetensors.torch, "save_file", no_space)
    with pytest.raises(FluxgrpoError, match=r"^no space left on device writing .*diffusion_pytorch_model.safetensors"):
        save_checkpoint(tmp_path, 1, SINGLE, TrainingState(*build()), trainer_state={}, keep_last=None)


def test_train_resume_from_a_code_running_checkpoint_is_one_line_and_runs_nothing(
    tiny_weights, tiny_embeddings, tmp_path
):
    from typer.testing import CliRunner

    from fluxgrpo.cli.app import app

    out = tmp_path / "out"
    command = [
        *tiny_train_argv(tiny_weights, tiny_embeddings),
        "--output-dir",
        str(out),
        "--num-generations",
        "2",
        "--rollout-batch-size",
        "2",
        "--train-micro-batch-size",
        "2",
        "--sampling-steps",
        "3",
        "--save-images-every",
        "0",
    ]
    first = CliRunner().invoke(app, [*command, "--max-train-steps", "1"])
    assert first.exit_code == 0, first.output
    marker = tmp_path / "PWNED"
    rng_file = out / "checkpoint-1" / "state" / "rng_rank0.pt"
    write_evil_torch_file(rng_file, marker)
    reseal(out / "checkpoint-1")
    resumed = CliRunner().invoke(app, [*command, "--max-train-steps", "2", "--resume"])
    assert resumed.exit_code == 1, resumed.output
    errors = [line for line in resumed.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "rng_rank0.pt holds more than tensors" in errors[0], resumed.output
    assert "Traceback" not in resumed.output
    assert not marker.exists()


def test_checkpoint_files_are_readable_by_all(tmp_path):
    previous = os.umask(0o022)
    try:
        path = save_checkpoint(tmp_path, 1, SINGLE, TrainingState(*build()), trainer_state={}, keep_last=None)
    finally:
        os.umask(previous)
    modes = {f.relative_to(path).as_posix(): oct(f.stat().st_mode & 0o777) for f in path.rglob("*") if f.is_file()}
    assert "transformer/diffusion_pytorch_model.safetensors" in modes
    assert set(modes.values()) == {"0o644"}, modes
