"""Shell completion scripts in completions/ are generated from the CLI and must not go stale."""

import shutil
import subprocess
from pathlib import Path

import pytest

from fluxgrpo.cli.app import COMMANDS
from fluxgrpo.cli.completions import SHELLS, completion_script

COMPLETIONS = Path(__file__).resolve().parents[1] / "completions"


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
def test_bash_completion_offers_the_values_of_flags_that_take_one_of_a_set(tmp_path):
    """Issue #31.9: after --config, --objective, --reward, --sampler, --device Tab offers their values."""
    script = COMPLETIONS / SHELLS["bash"]
    (tmp_path / "a3-mine.yaml").write_text("seed: 1\n")

    def complete(words: str) -> list[str]:
        """COMPREPLY for the command line ``words``; a trailing space means the next word is still empty."""
        empty_word = " ''" if words.endswith(" ") else ""
        cword = len(words.split()) - (0 if empty_word else 1)
        probe = (
            f'cd "{tmp_path}"; source "{script}"; COMP_WORDS=({words}{empty_word}); COMP_CWORD={cword}; '
            '_fluxgrpo; printf "%s\\n" "${COMPREPLY[@]}"'
        )
        return subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True).stdout.split()

    assert complete("fluxgrpo train --config a3-16die-m") == ["a3-16die-mixgrpo", "a3-16die-mixgrpo-flash"]
    assert "a3-mine.yaml" in complete("fluxgrpo train --config a3-")  # a YAML file is a --config too
    assert complete("fluxgrpo train --objective ") == ["grpo", "nft", "awm"]
    assert complete("fluxgrpo train --sampler ") == ["dance", "flow-grpo", "cps"]
    assert {"hpsv2", "pickscore", "brightness"} <= set(complete("fluxgrpo score --reward "))
    assert complete("fluxgrpo sample --device c") == ["cuda", "cpu"]


def test_the_completion_command_prints_the_committed_scripts():
    from typer.testing import CliRunner

    from fluxgrpo.cli.app import app

    runner = CliRunner()
    for shell in sorted(SHELLS):
        result = runner.invoke(app, ["completion", shell])
        assert result.exit_code == 0, result.output
        assert result.stdout == (COMPLETIONS / SHELLS[shell]).read_text()
    refused = runner.invoke(app, ["completion", "tcsh"])
    assert refused.exit_code == 2 and "bash, zsh, fish" in refused.stderr
