"""Issue #30.5, 6, 8–12: no damaged state is trusted, and none blocks more than it must. A binary metrics tail is a
torn tail; trainer_state.json, BEST.json and the checksum records are shape-checked on resume; a damaged best/
never blocks resuming a checkpoint, and sample/export/report never take it silently; a reward architecture file
must agree with its weights; damaged FLUX weights fail env-check --deep; a pickled .bin is refused without
diffusers calling the (safe) read "unsafe"."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from training_helpers import run, tiny_config, tiny_train_argv
from typer.testing import CliRunner

from fluxgrpo.checkpoint.best import read_best
from fluxgrpo.checkpoint.layout import (
    BEST_DIR,
    BEST_FILE,
    STATE_DIR,
    TRAINER_STATE_FILE,
    read_checkpoint_info,
)
from fluxgrpo.checkpoint.state import _verify_checksums
from fluxgrpo.cli.app import app
from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.metrics import METRICS_FILE, MetricsLogger, read_metrics
from fluxgrpo.training.resume_state import read_training_state

runner = CliRunner()


@pytest.fixture(scope="module")
def finished_run(tiny_weights, tiny_embeddings, tmp_path_factory) -> Path:
    """A 2-iteration run with checkpoint-1, checkpoint-2 and a best/ copy of checkpoint-2 (read-only: copy it)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    run(tiny_config(tiny_weights, tiny_embeddings, out, max_train_steps=2, checkpointing_steps=1))
    shutil.copytree(out / "checkpoint-2", out / BEST_DIR)
    record = {"iteration": 2, "metric": "eval_brightness_mean", "value": 0.5, "checkpoint": "checkpoint-2"}
    (out / BEST_DIR / BEST_FILE).write_text(json.dumps(record))
    return out


def _copy(finished_run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    return out


def _one_line(text: str) -> str:
    assert "Traceback" not in text, text
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, text
    return errors[0]


# --------------------------------------------------------------------------------------------- 5: metrics tail


def test_a_binary_tail_on_metrics_is_a_torn_tail(tmp_path, capsys):
    whole = "".join(json.dumps({"iteration": k, "reward_mean": 0.1 * k}) + "\n" for k in (1, 2, 3))
    garbage = bytes(range(256)) + b"\n\xff\xfe\n\x80"  # not UTF-8, and holding newlines
    (tmp_path / METRICS_FILE).write_bytes(whole.encode() + garbage)
    with pytest.raises(FluxgrpoError, match="line 4 is not a JSON record"):
        read_metrics(tmp_path)  # without the resume's leave to drop a tail: refused in one line
    MetricsLogger(tmp_path, enabled=True, resume_after=2).close()
    assert "dropped the torn tail" in capsys.readouterr().err
    assert [r["iteration"] for r in read_metrics(tmp_path)] == [1, 2]


def test_a_resume_with_no_checkpoint_keeps_no_record_of_the_killed_start(tmp_path):
    """Issue #50.7: killed before its first checkpoint, then --resume: the run starts again at 0, so the first
    start's iteration-0 evaluation (and anything after) goes, or metrics.jsonl holds it twice ([0, 0, 1, 2, 2])."""
    killed = [{"iteration": 0, "eval_reward_mean": 0.5}, {"iteration": 1, "reward_mean": 0.4}]
    (tmp_path / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in killed))
    logger = MetricsLogger(tmp_path, enabled=True, resume_after=0)  # what train() passes without a checkpoint
    logger.log({"iteration": 0, "eval_reward_mean": 0.5})
    logger.close()
    assert [r["iteration"] for r in read_metrics(tmp_path)] == [0]
    logger = MetricsLogger(tmp_path, enabled=True, resume_after=1)  # from checkpoint-1: records up to 1 stay
    logger.close()
    assert [r["iteration"] for r in read_metrics(tmp_path)] == [0]


def test_binary_bytes_before_a_good_record_are_damage_not_a_tail(tmp_path):
    (tmp_path / METRICS_FILE).write_bytes(b'{"iteration": 1}\n\xff\xfe\n{"iteration": 2}\n')
    with pytest.raises(FluxgrpoError) as caught:
        MetricsLogger(tmp_path, enabled=True, resume_after=2)
    assert "line 2 is not a JSON record (binary bytes)" in str(caught.value) and "\n" not in str(caught.value)


# --------------------------------------------------------------------------------------------- 6: trainer state


def _rewrite_state(checkpoint: Path, change) -> Path:
    """Change trainer_state.json as a hand edit would, with its checksum recomputed (so only the shape is wrong)."""
    state_dir = checkpoint / STATE_DIR
    path = state_dir / TRAINER_STATE_FILE
    state = json.loads(path.read_text())
    change(state)
    path.write_text(json.dumps(state))
    sums_path = state_dir / "checksums_rank0.json"
    sums = json.loads(sums_path.read_text())
    sums[TRAINER_STATE_FILE] = hashlib.sha256(path.read_bytes()).hexdigest()
    sums_path.write_text(json.dumps(sums))
    return path


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s.pop("sampler"),
        lambda s: s["sampler"].pop("0"),
        lambda s: s["sampler"]["0"].update(position="three"),
        lambda s: s.update(iteration=7),
        lambda s: s.update(config=[]),
        lambda s: s.update(guards={"baselines": {"x": "high"}}),
    ],
    ids=["no-sampler", "no-rank-0", "position-text", "iteration-7", "config-list", "guard-baseline-text"],
)
def test_a_trainer_state_of_the_wrong_shape_is_refused_naming_the_file(
    finished_run, tiny_weights, tiny_embeddings, tmp_path, change
):
    out = _copy(finished_run, tmp_path)
    path = _rewrite_state(out / "checkpoint-2", change)
    with pytest.raises(FluxgrpoError, match="is malformed"):
        read_training_state(out / "checkpoint-2")
    argv = tiny_train_argv(
        tiny_weights, tiny_embeddings, "--output-dir", str(out), "--max-train-steps", "3", "--save-images-every", "0"
    )
    result = runner.invoke(app, [*argv, "--checkpointing-steps", "1", "--resume", "--dry-run"])
    assert result.exit_code == 1, result.output
    assert str(path) in _one_line(result.stderr)


# --------------------------------------------------------------------------------------------- 11: checksums


def test_an_emptied_or_thinned_checksum_record_leaves_no_file_unverified(finished_run, tmp_path):
    out = _copy(finished_run, tmp_path)
    state_dir = out / "checkpoint-2" / STATE_DIR
    _verify_checksums(state_dir, 0)  # as written: every file verifies
    (shard,) = state_dir.glob("__0_*.distcp")
    shard.write_bytes(os.urandom(shard.stat().st_size))
    record = state_dir / "checksums_rank0.json"
    sums = json.loads(record.read_text())
    record.write_text("{}\n")
    with pytest.raises(FluxgrpoError, match="has no checksum for .*, so that file cannot be verified"):
        _verify_checksums(state_dir, 0)
    thinned = {name: digest for name, digest in sums.items() if name != shard.name}
    record.write_text(json.dumps(thinned))
    with pytest.raises(FluxgrpoError, match=f"no checksum for {shard.name}"):
        _verify_checksums(state_dir, 0)
    record.write_text(json.dumps({**sums, shard.name: "not a digest"}))
    with pytest.raises(FluxgrpoError, match="not a sha256 per file"):
        _verify_checksums(state_dir, 0)
    record.write_text(json.dumps(sums))
    with pytest.raises(FluxgrpoError, match="does not match the checksum"):
        _verify_checksums(state_dir, 0)


# --------------------------------------------------------------------------------------------- 9: best/


@pytest.mark.parametrize("damage", ["not json {", '{"iteration": "two"}', "[]"])
def test_a_damaged_best_record_is_named_by_sample_export_and_report_and_never_blocks_a_resume(
    finished_run, tmp_path, monkeypatch, damage
):
    from fluxgrpo.report.run import read_run
    from fluxgrpo.sampling.checkpoints import resolve_checkpoint
    from fluxgrpo.training.guards import GuardState, RunMonitor

    out = _copy(finished_run, tmp_path)
    (out / BEST_DIR / BEST_FILE).write_text(damage)
    best = out / BEST_DIR
    for use in (lambda: read_best(out), lambda: read_checkpoint_info(best), lambda: resolve_checkpoint(best, False)):
        with pytest.raises(FluxgrpoError) as caught:
            use()
        assert f"remove {best}" in str(caught.value) and "\n" not in str(caught.value)
    exported = runner.invoke(app, ["export", "--checkpoint", str(best), "--out", str(tmp_path / "export")])
    assert exported.exit_code == 1 and f"remove {best}" in " ".join(_one_line(exported.stderr).split())
    assert not (tmp_path / "export").exists()
    report = read_run(out)
    assert report.best is None and any(BEST_FILE in line and f"remove {best}" in line for line in report.left_out)

    # A resume with --keep-best: the monitor warns, and goes on (the next best replaces best/).
    said: list[str] = []
    monitor = SimpleNamespace(
        cfg=SimpleNamespace(output_dir=str(out)),
        ctx=SimpleNamespace(is_main=True, rank=0),
        best_key="eval_brightness_mean",
        state=GuardState(),
    )
    monkeypatch.setattr("fluxgrpo.runtime.dist.rank0_print", lambda ctx, line: said.append(line))
    RunMonitor._reconcile_best(monitor)  # type: ignore[arg-type]
    assert len(said) == 1 and said[0].startswith("warning:") and f"remove {best}" in said[0]
    assert (best / BEST_FILE).read_text() == damage  # nothing removed behind the user's back
    assert read_checkpoint_info(out / "checkpoint-2")["iteration"] == 2  # the checkpoints are untouched


# --------------------------------------------------------------------------------------------- 8: architecture


def test_an_architecture_file_that_disagrees_with_its_weights_builds_nothing(tiny_weights, tmp_path, monkeypatch):
    from fluxgrpo.rewards import open_clip_model
    from fluxgrpo.rewards.clipscore import load_clip_model

    hps = tmp_path / "hps"
    shutil.copytree(tiny_weights.hps_dir, hps)
    arch_file = hps / "open_clip_config.json"
    honest = json.loads(arch_file.read_text())
    built: list[str] = []
    real_create = open_clip_model.create_empty_open_clip
    monkeypatch.setattr(open_clip_model, "create_empty_open_clip", lambda arch: built.append(arch) or real_create(arch))
    load_clip_model(hps)  # the honest file builds its model
    assert len(built) == 1
    for tower, key, value in (("vision_cfg", "width", 1 << 20), ("text_cfg", "layers", 4096), ("", "embed_dim", 4096)):
        tampered = json.loads(json.dumps(honest))
        (tampered[tower] if tower else tampered)[key] = value
        arch_file.write_text(json.dumps(tampered))
        with pytest.raises(FluxgrpoError) as caught:
            load_clip_model(hps)
        where = f"{tower}.{key}" if tower else key
        assert f"{where} is {value}, but the weights' tensors imply" in str(caught.value)
        assert "no model was built" in str(caught.value)
    assert len(built) == 1


# --------------------------------------------------------------------------------------------- 10: env-check


def test_damaged_flux_weights_fail_the_deep_load_check_and_absent_ones_skip_it(tiny_weights, tmp_path):
    from fluxgrpo.deepcheck.result import FAILED, SKIPPED
    from fluxgrpo.deepcheck.run import _load_payload, _load_result

    flux = tmp_path / "fx"
    shutil.copytree(tiny_weights.flux_dir, flux)
    shard = next((flux / "transformer").glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    settings = SimpleNamespace(quick=True)
    payload, reason = _load_payload(settings, SimpleNamespace(model=str(flux)))  # type: ignore[arg-type]
    assert payload is None and _load_result(None, reason).status == FAILED
    payload, reason = _load_payload(settings, SimpleNamespace(model=str(tmp_path / "none")))  # type: ignore[arg-type]
    assert payload is None and _load_result(None, reason).status == SKIPPED


# --------------------------------------------------------------------------------------------- 12: pickled .bin


def test_a_pickled_bin_is_refused_without_diffusers_calling_the_read_unsafe(tiny_weights, tmp_path, capfd):
    import pickle

    from diffusers import FluxTransformer2DModel

    from fluxgrpo.safe_load import load_pretrained

    folder = tmp_path / "transformer"  # a checkpoint's transformer/ as `sample --checkpoint` loads it
    folder.mkdir()
    shutil.copy(tiny_weights.flux_dir / "transformer" / "config.json", folder)
    marker = tmp_path / "ran"

    class Planted:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (folder / "diffusion_pytorch_model.bin").write_bytes(pickle.dumps(Planted()))
    capfd.readouterr()
    with pytest.raises(FluxgrpoError) as caught:
        load_pretrained(
            lambda: FluxTransformer2DModel.from_pretrained(folder), "the trained transformer", folder, "fix"
        )
    assert "nothing in it ran" in str(caught.value)
    printed = capfd.readouterr()
    assert "unsafe serialization" not in printed.err + printed.out
    assert "An error occurred while trying to fetch" not in printed.err + printed.out
    assert "Detected pickle protocol" not in printed.err + printed.out
    assert not marker.exists()
