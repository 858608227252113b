"""Issue #11.1: no reward weights file can run code. A code-running pickle in place of each file kind a reward reads
gives one clear line naming the file, and the code never runs (its marker file is never created)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.weights.layout import CLIP_MANIFEST, HPS_CHECKPOINT, HPS_MANIFEST, OPEN_CLIP_WEIGHTS, pickscore_dir


class _RunsCode:
    """Unpickling this calls os.system: what a hostile checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _write_hostile(path: Path, marker: Path, wrap_state_dict: bool) -> None:
    payload = _RunsCode(marker)
    torch.save({"state_dict": payload} if wrap_state_dict else {"weight": payload}, path)


def _hand_placed_hps(tiny_weights, tmp_path: Path) -> Path:
    """A copy of the tiny HPS folder without manifests, as if placed by hand (files are checked for presence only)."""
    folder = tmp_path / "hps_ckpt"
    shutil.copytree(tiny_weights.hps_dir, folder)
    for name in (HPS_MANIFEST, CLIP_MANIFEST):
        (folder / name).unlink()
    return folder


def _assert_one_line_naming(exc: pytest.ExceptionInfo, path: Path, marker: Path) -> None:
    message = str(exc.value)
    assert str(path) in message and "\n" not in message, message
    assert "fetch-weights" in message
    assert not marker.exists(), "the pickle ran code"


def test_a_code_running_hps_checkpoint_is_refused_and_never_runs(tiny_weights, tmp_path):
    from fluxgrpo.rewards import load_reward

    folder = _hand_placed_hps(tiny_weights, tmp_path)
    marker = tmp_path / "PWNED"
    _write_hostile(folder / HPS_CHECKPOINT, marker, wrap_state_dict=True)
    with pytest.raises(FluxgrpoError) as exc:
        load_reward("hpsv2", folder)
    _assert_one_line_naming(exc, folder / HPS_CHECKPOINT, marker)


def test_a_code_running_open_clip_bin_is_refused_and_never_runs(tiny_weights, tmp_path):
    from fluxgrpo.rewards import load_reward

    folder = _hand_placed_hps(tiny_weights, tmp_path)
    # An HPS checkpoint missing one key makes the loader read the open_clip initial weights to fill it.
    state = torch.load(folder / HPS_CHECKPOINT, weights_only=True)["state_dict"]
    state.pop(next(iter(state)))
    torch.save({"state_dict": state}, folder / HPS_CHECKPOINT)
    marker = tmp_path / "PWNED"
    _write_hostile(folder / OPEN_CLIP_WEIGHTS, marker, wrap_state_dict=False)
    with pytest.raises(FluxgrpoError) as exc:
        load_reward("hpsv2", folder)
    _assert_one_line_naming(exc, folder / OPEN_CLIP_WEIGHTS, marker)


def test_a_code_running_pickscore_bin_is_refused_and_never_runs(tiny_weights, tmp_path):
    from fluxgrpo.rewards import load_reward

    folder = tmp_path / "hps_ckpt"
    shutil.copytree(pickscore_dir(tiny_weights.hps_dir), pickscore_dir(folder))
    model_dir = pickscore_dir(folder) / "model"
    (model_dir / "manifest.json").unlink()
    (model_dir / "model.safetensors").unlink()  # the hub repo also has the .bin; only it is left
    marker = tmp_path / "PWNED"
    _write_hostile(model_dir / "pytorch_model.bin", marker, wrap_state_dict=False)
    with pytest.raises(FluxgrpoError) as exc:
        load_reward("pickscore", folder)
    _assert_one_line_naming(exc, model_dir, marker)
