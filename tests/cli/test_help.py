"""Every command's --help: text as written (brackets shown), examples that can be copied, metavars that say what a
flag takes, train's options in panels like the rest (issue #31.5–6)."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from fluxgrpo.cli.app import COMMANDS, app

runner = CliRunner()
NAMES = [name for name, _ in COMMANDS]


def rendered_help(*command: str, columns: int = 80) -> str:
    result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": str(columns)}, terminal_width=columns)
    assert result.exit_code == 0, result.output
    return result.stdout


def example_lines(command_name: str) -> list[str]:
    """The indented lines of the command's docstring paragraphs that introduce examples (``…:``)."""
    import inspect

    import typer

    command = typer.main.get_command(app).commands[command_name]  # type: ignore[attr-defined]
    from fluxgrpo.cli.help import is_verbatim_block

    text = inspect.cleandoc(command.callback.__doc__ or "")
    lines = []
    for paragraph in text.split("\n\n"):
        if is_verbatim_block(paragraph):
            body = paragraph.removeprefix("\b").strip("\n").splitlines()
            lines += [line.strip() for line in body[1:] if line.strip()]
    assert lines, f"{command_name} --help shows no example"
    return lines


@pytest.mark.parametrize("name", NAMES)
def test_help_shows_what_each_flag_takes_and_nothing_a_flag_does_not(name):
    text = rendered_help(name)
    assert "<bool>" not in text and "<list[" not in text and "<str>" not in text and "<int>" not in text
    assert "[default: ]" not in text
    assert not re.search(r"│ --[\w-]*…", text), "an option name cut to fit"


@pytest.mark.parametrize("name", NAMES)
def test_every_example_is_one_copyable_line_at_80_columns(name):
    text = rendered_help(name)
    shown = [line.strip() for line in text.splitlines()]
    for line in example_lines(name):
        assert len(line) <= 76, f"{name}: example line too long for 80 columns: {line!r}"
        assert line in shown, f"{name}: example {line!r} is not shown as one line"


def test_brackets_in_help_are_shown_as_typed():
    assert "pip install 'fluxgrpo[report]'" in " ".join(rendered_help("report").split())
    assert "[default: the config's dies, else 1]" in rendered_help("train", columns=200)


def test_train_groups_its_options_in_panels():
    text = rendered_help("train")
    for panel in ("Run", "Launch", "Data and weights", "Rollout", "Policy update", "Held-out evaluation"):
        assert re.search(rf"╭─ {panel}", text), panel
    assert "Options:" not in text  # not click's plain list, as before in narrow terminals
    assert "--init-same-noise" in text and "Off: --no-init-same-noise." in " ".join(text.split())
    # the off switch still works
    from fluxgrpo.config import build_config

    assert build_config("tiny-cpu", {"init_same_noise": False}).init_same_noise is False


@pytest.mark.parametrize("name", NAMES)
def test_help_ends_with_its_reference_pages_which_ship_with_the_package(name):
    from fluxgrpo.cli.app import DOCS, REFERENCE_PAGES

    pages = REFERENCE_PAGES[name]
    assert f"Reference: {', '.join(pages)} in {DOCS}" in " ".join(rendered_help(name, columns=400).split())
    assert all((DOCS / page).is_file() for page in pages)
    root = runner.invoke(app, ["--help"], env={"COLUMNS": "400"}, terminal_width=400)
    assert f"Reference: {DOCS / 'index.md'}" in root.stdout and (DOCS / "index.md").is_file()
