"""What every command shares: stderr console, error → exit-code mapping, JSON output.

Results go to stdout (a rich table, or one JSON document with --json); logs, progress and errors go to
stderr. Exit codes: 0 ok, 1 runtime failure, 2 usage error (and 3: `train` stopped by a guard, ``training/guards.py``).
``FLUXGRPO_DEBUG=1`` shows tracebacks.

Text from users and libraries (paths, prompts, error messages such as gloo's ``[/__w/.../pair.cc:561]``) is never
rich markup: print it with ``log`` or through ``escape``, so brackets in it show as typed instead of vanishing
as style tags or raising ``MarkupError``.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from fluxgrpo.errors import FluxgrpoError, disk_full_error
from fluxgrpo.paths import HPS_DIR_HELP
from fluxgrpo.runtime.device import DEVICE_TYPES

F = TypeVar("F", bound=Callable[..., Any])

# The options several commands declare alike: one declaration each (a command whose option says something of its
# own, e.g. `score --json`'s several-reward document, declares it itself).
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object with stable keys.")]
DeviceOption = Annotated[
    str, typer.Option("--device", help=f"auto (the best found), or one of {', '.join(DEVICE_TYPES)}.")
]
HpsDirOption = Annotated[str, typer.Option("--hps-dir", help=HPS_DIR_HELP)]


err_console = Console(stderr=True)
out_console = Console()


def say(line: str) -> None:
    """One result line on stdout as the text it is, never cut into lines (rich would cut it at 80 columns,
    mid-sentence, in a pipe or a file; a terminal wraps it itself). Tables keep rich's width."""
    out_console.print(line, markup=False, highlight=False, soft_wrap=True)


def handle_errors(fn: F) -> F:
    """Turn FluxgrpoError into one red line on stderr and its exit code (1 runtime, 2 usage)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except FluxgrpoError as exc:
            if os.environ.get("FLUXGRPO_DEBUG"):  # more to read, the same exit code
                traceback.print_exc(file=sys.stderr)
            err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            err_console.print("[yellow]interrupted[/]")
            raise typer.Exit(130) from None
        except OSError as exc:  # a full disk under any write (the run's config, an image, an embedding): one line
            full = disk_full_error(exc)
            if full is None or os.environ.get("FLUXGRPO_DEBUG"):
                raise
            err_console.print(f"[bold red]error:[/] {escape(str(full))}", highlight=False, soft_wrap=True)
            raise typer.Exit(full.exit_code) from None

    return wrapper  # type: ignore[return-value]


def log(line: object) -> None:
    """One line of progress on stderr, printed as the text it is (no markup, no highlighting)."""
    err_console.print(str(line), markup=False, highlight=False, soft_wrap=True)


def print_json(document: Any) -> None:
    """One JSON document on stdout."""
    sys.stdout.write(json.dumps(document, indent=2, default=str) + "\n")
    sys.stdout.flush()
