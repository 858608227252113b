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
        ],
    )
    assert result.exit_code == 1  # training could not start
    report = json.loads(result.stdout)
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
