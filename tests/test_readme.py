"""README's set-up commands stay true: CI runs the README's quickstart, then exactly the README's test command."""

import itertools
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
    installs, commands = install_steps(quickstart)
    assert installs and commands.startswith("fluxgrpo ")
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert ci_lines.index(commands) < ci_lines.index(test_command)


def install_steps(command: str) -> tuple[list[str], str]:
    """A README command's leading ``pip install`` steps, and what runs after them."""
    steps = command.split(" && ")
    installs = list(itertools.takewhile(lambda step: step.startswith("pip install"), steps))
    return installs, " && ".join(steps[len(installs) :])


def test_the_first_screen_installs_cpu_wheels():
    """On a machine without an NVIDIA GPU, commands 1 and 2 install PyTorch's CPU wheels first, not the default
    ones with about 3 GB of CUDA libraries."""
    for block in shell_blocks((ROOT / "README.md").read_text())[:2]:
        installs, _ = install_steps(block.strip())
        assert (
            installs[0].startswith("pip install torch==")
            and "--index-url https://download.pytorch.org/whl/cpu" in installs[0]
        )


def test_quickstart_uses_only_existing_commands_and_configs():
    from fluxgrpo.cli.app import COMMANDS
    from fluxgrpo.config import shipped_configs

    quickstart = shell_blocks((ROOT / "README.md").read_text())[0]
    used = re.findall(r"fluxgrpo ([a-z-]+)", quickstart)
    assert used and set(used) <= {name for name, _ in COMMANDS}
    for config in re.findall(r"--config (\S+)", quickstart):
        assert config in shipped_configs()


def test_the_readme_is_a_product_page_whose_links_resolve():
    """The README stays short (reference and results live in the pages that ship with the package), and every
    relative link of the README and of those pages names a file that exists."""
    readme = ROOT / "README.md"
    assert len(readme.read_bytes()) <= 30_000
    pages = [readme, *sorted((ROOT / "fluxgrpo" / "docs").rglob("*.md"))]
    assert len(pages) > 10
    for page in pages:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to {target}, which is missing"
