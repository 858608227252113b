"""The ``fluxgrpo`` command. Each subcommand lives in its own light module; heavy imports happen inside
the command body so ``fluxgrpo --help`` never imports torch."""

from __future__ import annotations

import importlib

import typer

from fluxgrpo import __version__
from fluxgrpo.cli.help import HelpCommand, HelpGroup

app = typer.Typer(
    name="fluxgrpo",
    cls=HelpGroup,
    help="GRPO fine-tuning of FLUX.1-dev against HPSv2 (DanceGRPO), on Ascend, GPUs and CPU.",
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

for _name, _module in COMMANDS:
    _cli_module = importlib.import_module(f"fluxgrpo.cli.{_module}")
    # A module may bring its own command class (train: its options grouped in panels); each is a HelpCommand.
    app.command(_name, cls=getattr(_cli_module, "command_class", HelpCommand))(_cli_module.command)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"fluxgrpo {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """GRPO fine-tuning of FLUX.1-dev against HPSv2 (DanceGRPO), on Ascend, GPUs and CPU."""
    from fluxgrpo.runtime.report import guard_torch_import

    guard_torch_import()


def main() -> None:
    app()
