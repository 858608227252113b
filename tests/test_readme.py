"""README's set-up commands stay true: CI runs exactly the README's test command."""

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


def test_quickstart_uses_only_existing_commands_and_configs():
    from fluxgrpo.cli.app import COMMANDS
    from fluxgrpo.config import shipped_configs

    quickstart = shell_blocks((ROOT / "README.md").read_text())[0]
    used = re.findall(r"fluxgrpo ([a-z-]+)", quickstart)
    assert used and set(used) <= {name for name, _ in COMMANDS}
    for config in re.findall(r"--config (\S+)", quickstart):
        assert config in shipped_configs()
