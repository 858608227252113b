"""The CLI surface: every subcommand's --help, no torch at --help time, env-check table and JSON."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from fluxgrpo.cli.app import COMMANDS, app

runner = CliRunner()


def test_root_help_and_version():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for name, _ in COMMANDS:
        assert name in result.output
    assert runner.invoke(app, ["--version"]).output.startswith("fluxgrpo ")


@pytest.mark.parametrize("name", [name for name, _ in COMMANDS])
def test_every_subcommand_help_exits_zero(name):
    result = runner.invoke(app, [name, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output


def test_unknown_option_is_a_usage_error():
    result = runner.invoke(app, ["env-check", "--no-such-flag"])
    assert result.exit_code == 2


def test_help_does_not_import_torch():
    code = (
        "import sys\n"
        "from fluxgrpo.cli.app import main\n"
        "sys.argv = ['fluxgrpo', '--help']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'diffusers', 'transformers', 'open_clip') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_python_dash_m_entry_point():
    out = subprocess.run([sys.executable, "-m", "fluxgrpo", "--version"], check=True, capture_output=True, text=True)
    assert out.stdout.startswith("fluxgrpo ")


def test_env_check_json_on_a_machine_without_weights(tmp_path):
    result, report = env_check_json(tmp_path)
    assert result.exit_code == 1  # training could not start
    for key in (
        "fluxgrpo_version",
        "platform",
        "python",
        "packages",
        "device",
        "accelerator_env",
        "weights",
        "embeddings",
        "disk",
        "shm",
        "checks",
        "ready",
    ):
        assert key in report
    assert report["ready"] is False
    assert report["device"]["type"] == "cpu" and report["device"]["backend"] == "gloo"
    failing = {c["name"]: c for c in report["checks"] if c["status"] == "fail"}
    assert set(failing) == {"weights: flux", "weights: hps", "weights: clip", "embeddings"}
    assert "fluxgrpo fetch-weights" in failing["weights: flux"]["fix"]
    assert "fluxgrpo preprocess" in failing["embeddings"]["fix"]
    env_names = {row["name"] for row in report["accelerator_env"]}
    assert {"TASK_QUEUE_ENABLE", "COMBINED_ENABLE", "PYTORCH_NPU_ALLOC_CONF", "HCCL_CONNECT_TIMEOUT"} <= env_names


def test_env_check_table(tmp_path):
    result = runner.invoke(app, ["env-check", "--flux-dir", str(tmp_path / "flux")])
    assert result.exit_code == 1
    assert "weights: flux" in result.stdout and "fetch-weights" in result.stdout
    assert "not ready" in result.stdout


def env_check_json(tmp_path, *extra):
    result = runner.invoke(
        app,
        [
            "env-check",
            "--json",
            "--flux-dir",
            str(tmp_path / "flux"),
            "--hps-dir",
            str(tmp_path / "hps"),
            "--embeddings",
            str(tmp_path / "emb"),
            *extra,
        ],
    )
    return result, json.loads(result.stdout) if result.stdout.strip() else None


def test_env_check_reports_every_rewards_weights_once_and_only_the_runs_fail(tmp_path):
    from fluxgrpo.rewards import reward_names, reward_weights_status

    result, report = env_check_json(tmp_path)
    parts = {"flux"} | {part.name for name in reward_names() for part in reward_weights_status(name, tmp_path)}
    assert {"imagereward", "pickscore", "clip", "hps"} <= parts
    assert set(report["weights"]) == parts
    weight_checks = [c["name"] for c in report["checks"] if c["name"].startswith("weights: ")]
    assert sorted(weight_checks) == sorted(f"weights: {part}" for part in parts)  # each part once
    assert report["weights"]["clip"]["used_by"] == ["hpsv2", "clipscore"]
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    # the default --reward hpsv2 needs hps and clip; the other rewards' missing weights only warn
    assert statuses["weights: hps"] == statuses["weights: clip"] == "fail"
    assert statuses["weights: pickscore"] == statuses["weights: imagereward"] == "warn"
    assert report["reward"] == "hpsv2" and report["rewards"]["brightness"] == {
        "weights": [],
        "ready": True,
        "in_run": False,
    }
    assert result.exit_code == 1

    _, report = env_check_json(tmp_path, "--reward", "imagereward:1,brightness:0.5")
    statuses = {c["name"]: c for c in report["checks"]}
    assert statuses["weights: imagereward"]["status"] == "fail"
    assert "imagereward needs it" in statuses["weights: imagereward"]["detail"]
    assert statuses["weights: hps"]["status"] == statuses["weights: clip"]["status"] == "warn"
    assert "--reward hpsv2 or --reward clipscore" in statuses["weights: clip"]["detail"]


def test_env_check_refuses_a_reward_that_is_not_one():
    result = runner.invoke(app, ["env-check", "--reward", "hpsv9"])
    assert result.exit_code == 2
    assert "unknown reward 'hpsv9'" in result.stderr


def test_a_reward_added_to_the_registry_shows_in_env_check_with_no_change_there(tmp_path):
    from fluxgrpo.rewards.registry import RewardRecord, WeightsPart, register_reward, unregister_reward
    from fluxgrpo.weights.layout import PartStatus

    own = WeightsPart("future", lambda hps_dir: PartStatus("future", str(hps_dir / "future"), complete=False))
    # Reads the shared clip weights and one part of its own.
    register_reward(RewardRecord("future", lambda *_: None, parts=(own,), reads=("clip", "future")))  # type: ignore[arg-type,return-value]
    try:
        _, report = env_check_json(tmp_path)
    finally:
        unregister_reward("future")
    assert report["weights"]["clip"]["used_by"] == ["hpsv2", "clipscore", "future"]
    assert report["rewards"]["future"] == {"weights": ["clip", "future"], "ready": False, "in_run": False}
    assert [c["status"] for c in report["checks"] if c["name"] == "weights: future"] == ["warn"]


def test_env_check_with_every_weight_in_place_is_ready(tiny_weights, tiny_embeddings):
    result = runner.invoke(
        app,
        [
            "env-check",
            "--flux-dir",
            str(tiny_weights.flux_dir),
            "--hps-dir",
            str(tiny_weights.hps_dir),
            "--embeddings",
            str(tiny_embeddings.out_dir),
            "--reward",
            "hpsv2,pickscore,clipscore,imagereward",
        ],
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.count("weights: clip") == 1
    assert "weights: imagereward" in result.stdout and "weights missing" not in result.stdout
    assert "ready to train (--reward hpsv2,pickscore,clipscore,imagereward)" in " ".join(result.stdout.split())


def test_env_check_judges_the_run_a_config_starts(tiny_weights, tiny_embeddings, tmp_path):
    """Issue #50.11: inside the quickstart chain env-check judged `--reward hpsv2` and `cpu × 1` while the run trained
    on another reward with 2 workers. With --config (and --dies) it judges that run: its rewards, folders, workers."""
    config = tmp_path / "run.yaml"
    config.write_text(
        f"model: {tiny_weights.flux_dir}\nhps_dir: {tmp_path / 'no-reward-weights'}\n"
        f"data_json_path: {tiny_embeddings.index_path}\nreward: brightness\neval_every: 0\ndevice: cpu\n"
    )
    result = runner.invoke(app, ["env-check", "--config", str(config), "--dies", "2"])
    assert result.exit_code == 0, result.output
    said = " ".join(result.stdout.split())
    assert f"ready to train (--config {config} --dies 2: brightness)" in said, said
    assert "2 CPU worker(s) on" in said and "GiB available" in said  # host memory as the kernel can hand it out
    assert "(backend gloo; the run: 2 worker(s))" in said  # not a bare `cpu × 1` before a 2-worker run
    result = runner.invoke(app, ["env-check", "--config", str(config), "--dies", "4096", "--json"])
    report = json.loads(result.stdout)
    assert result.exit_code == 1 and report["run"]["dies"] == 4096
    assert [c["status"] for c in report["checks"] if c["name"] == "workers"] == ["fail"]
    assert runner.invoke(app, ["env-check", "--dies", "2"]).exit_code == 2  # the workers of which run?


def test_host_memory_is_what_the_kernel_reports_available(tmp_path):
    from fluxgrpo.runtime.device import host_available_bytes

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemFree:          200000 kB\nMemAvailable:   20000000 kB\n")
    assert host_available_bytes(str(meminfo)) == 20000000 * 1024  # not MemFree's 0.2 GiB
    assert host_available_bytes(str(tmp_path / "none")) is None
