"""The ``fluxgrpo`` command. Each subcommand lives in its own light module; heavy imports happen inside
the command body so ``fluxgrpo --help`` never imports torch."""

from __future__ import annotations

import importlib
from pathlib import Path

import typer

from fluxgrpo import __version__
from fluxgrpo.cli.help import HelpCommand, HelpGroup
from fluxgrpo.runtime.report import guard_torch_import

# The reference pages (fluxgrpo/docs/, shipped with the package); each command's --help ends with its own.
DOCS = Path(__file__).resolve().parents[1] / "docs"

app = typer.Typer(
    name="fluxgrpo",
    cls=HelpGroup,
    help="GRPO fine-tuning of FLUX.1-dev against HPSv2 (DanceGRPO), on Ascend, GPUs and CPU.",
    epilog=f"Reference: {DOCS / 'index.md'}",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,  # static scripts ship in completions/ (see fluxgrpo/cli/completions.py)
    rich_markup_mode="rich",
)

# (command name, module under fluxgrpo.cli); each module defines `command`.
COMMANDS: tuple[tuple[str, str], ...] = (
    ("env-check", "env_check"),
    ("fetch-weights", "fetch_weights"),
    ("preprocess", "preprocess"),
    ("train", "train"),
    ("bench", "bench"),
    ("sample", "sample"),
    ("score", "score"),
    ("report", "report"),
    ("export", "export"),
    ("completion", "completion"),
)

REFERENCE_PAGES: dict[str, tuple[str, ...]] = {
    "env-check": ("hardware.md", "deep-check.md"),
    "fetch-weights": ("weights.md",),
    "preprocess": ("training.md",),
    "train": ("training.md", "algorithms.md", "multi-node.md", "memory.md", "monitoring.md"),
    "bench": ("performance.md", "results/performance.md", "results/algorithms.md"),
    "sample": ("evaluate.md",),
    "score": ("evaluate.md",),
    "report": ("monitoring.md",),
    "export": ("training.md",),
    "completion": ("completion.md",),
}


def reference_epilog(name: str) -> str:
    return f"Reference: {', '.join(REFERENCE_PAGES[name])} in {DOCS}"


for _name, _module in COMMANDS:
    _cli_module = importlib.import_module(f"fluxgrpo.cli.{_module}")
    # A module may bring its own command class (train: its options grouped in panels); each is a HelpCommand.
    _command_class = getattr(_cli_module, "command_class", HelpCommand)
    app.command(_name, cls=_command_class, epilog=reference_epilog(_name))(_cli_module.command)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"fluxgrpo {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """GRPO fine-tuning of FLUX.1-dev against HPSv2 (DanceGRPO), on Ascend, GPUs and CPU."""

    guard_torch_import()


def main() -> None:
    app()
