"""README's set-up commands stay true: CI runs the README's quickstart, then exactly the README's test command."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def shell_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    test_command = shell_blocks(readme)[1].strip()
    assert "pytest" in test_command
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines


def test_ci_runs_the_quickstart_before_the_test_suite():
    """The suite must pass in a checkout the quickstart has filled (data/, hps_ckpt/), as a user runs it."""
    readme = (ROOT / "README.md").read_text()
    quickstart, test_command = (block.strip() for block in shell_blocks(readme)[:2])
    install, _, commands = quickstart.partition(" && ")
    assert install.startswith("pip install") and commands.startswith("fluxgrpo ")
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert ci_lines.index(commands) < ci_lines.index(test_command)


def test_quickstart_uses_only_existing_commands_and_configs():
    from fluxgrpo.cli.app import COMMANDS
    from fluxgrpo.config import shipped_configs

    quickstart = shell_blocks((ROOT / "README.md").read_text())[0]
    used = re.findall(r"fluxgrpo ([a-z-]+)", quickstart)
    assert used and set(used) <= {name for name, _ in COMMANDS}
    for config in re.findall(r"--config (\S+)", quickstart):
        assert config in shipped_configs()
