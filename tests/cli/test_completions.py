"""Shell completion scripts in completions/ are generated from the CLI and must not go stale."""

import shutil
import subprocess
from pathlib import Path

import pytest

from fluxgrpo.cli.app import COMMANDS
from fluxgrpo.cli.completions import SHELLS, completion_script

COMPLETIONS = Path(__file__).resolve().parents[2] / "completions"


@pytest.mark.parametrize("shell", sorted(SHELLS))
def test_committed_script_matches_the_cli(shell):
    committed = (COMPLETIONS / SHELLS[shell]).read_text()
    assert committed == completion_script(shell), (
        f"completions/{SHELLS[shell]} is stale: run `python -m fluxgrpo.cli.completions`"
    )


@pytest.mark.parametrize("shell", sorted(SHELLS))
def test_scripts_name_every_subcommand(shell):
    script = completion_script(shell)
    for name, _ in COMMANDS:
        assert name in script


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not installed")
def test_bash_completion_offers_subcommands_and_flags():
    script = COMPLETIONS / SHELLS["bash"]

    def complete(words: str) -> list[str]:
        cword = len(words.split()) - 1
        probe = (
            f'source "{script}"; COMP_WORDS=({words}); COMP_CWORD={cword}; _fluxgrpo; '
            'printf "%s\\n" "${COMPREPLY[@]}"'
        )
        return subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True).stdout.split()

    assert "train" in complete("fluxgrpo tr")
    assert complete("fluxgrpo train --num-gen") == ["--num-generations"]
    assert "--json" in complete("fluxgrpo env-check --js")


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not installed")
def test_bash_completion_offers_the_names_a_flag_takes():
    script = COMPLETIONS / SHELLS["bash"]

    def complete(words: str) -> list[str]:
        cword = len(words.split()) - 1
        probe = (
            f'source "{script}"; COMP_WORDS=({words}); COMP_CWORD={cword}; _fluxgrpo; '
            'printf "%s\\n" "${COMPREPLY[@]}"'
        )
        return subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True).stdout.split()

    assert complete("fluxgrpo train --reward sha") == ["shapes", "shapes-scene", "shapes-strict"]
    assert complete("fluxgrpo train --eval-prompts shapes-h") == ["shapes-heldout"]
    assert complete("fluxgrpo preprocess --prompts shapes-t") == ["shapes-train", "shapes-train-balanced"]
    assert "tiny-cpu" in complete("fluxgrpo train --config tiny")
    assert complete("fluxgrpo bench --algorithms mixgrpo-flash-") == ["mixgrpo-flash-w2"]
    assert complete("fluxgrpo train --num-gen") == ["--num-generations"]  # flags still complete as flags


@pytest.mark.parametrize("shell", sorted(SHELLS))
def test_every_script_offers_the_worlds_names(shell):
    script = completion_script(shell)
    for name in ("shapes-train", "shapes-heldout", "shapes"):
        assert name in script


def test_the_completion_command_prints_the_committed_scripts():
    """Issue #31.9: a pip-installed fluxgrpo has no completions/ folder; `fluxgrpo completion SHELL` prints it."""
    from typer.testing import CliRunner

    from fluxgrpo.cli.app import app

    runner = CliRunner()
    for shell in sorted(SHELLS):
        result = runner.invoke(app, ["completion", shell])
        assert result.exit_code == 0, result.output
        assert result.stdout == (COMPLETIONS / SHELLS[shell]).read_text()
    refused = runner.invoke(app, ["completion", "tcsh"])
    assert refused.exit_code == 2 and "bash, zsh, fish" in refused.stderr
