"""``fluxgrpo completion bash|zsh|fish``: the shell completion script, for a pip-installed fluxgrpo (a clone has
the same scripts in ``completions/``)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from fluxgrpo.cli.common import handle_errors
from fluxgrpo.errors import UsageError

SHELLS = ("bash", "zsh", "fish")


@handle_errors
def command(
    shell: Annotated[str, typer.Argument(help=f"The shell: {', '.join(SHELLS)}.", show_default=False)],
) -> None:
    """Print the completion script for SHELL (subcommands, flags, and the values of --config, --reward, …).

    Install it once:

    \b
      bash: fluxgrpo completion bash > ~/.local/share/bash-completion/completions/fluxgrpo
      zsh:  fluxgrpo completion zsh > "${fpath[1]}/_fluxgrpo"   (then restart zsh)
      fish: fluxgrpo completion fish > ~/.config/fish/completions/fluxgrpo.fish
    """
    if shell not in SHELLS:
        raise UsageError(f"unknown shell {shell!r}: use one of {', '.join(SHELLS)} (`fluxgrpo completion bash`)")

    from fluxgrpo.cli.completions import completion_script

    sys.stdout.write(completion_script(shell))
