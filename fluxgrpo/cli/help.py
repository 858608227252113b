"""How every command's ``--help`` reads: text as written, examples that can be copied, metavars that say what a
flag takes.

typer renders help through rich markup and keeps every line break of a docstring, so left alone it swallows
brackets as style tags (``pip install 'fluxgrpo[report]'`` showed as ``pip install 'fluxgrpo'``), wraps a prose line
where the source happened to break it, shows ``<bool>`` beside flags that take no value and ``<list[str]>`` as a
metavar. ``HelpCommand`` fixes the text once, before the first render:

- prose paragraphs are reflowed (their source line breaks dropped); a paragraph whose first line ends with ``:``
  and whose other lines are indented (``Examples:``), or that starts with click's ``\\b``, keeps its lines, so an
  example stays one copyable command (its continuation lines end with ``\\``);
- every help text is escaped, so a ``[`` is a bracket;
- a flag shows no metavar; an option that takes a value shows click's name for its type (``INTEGER``, ``FLOAT``,
  ``TEXT``), an argument its name (``RUN_DIR``).
"""

from __future__ import annotations

import inspect
from typing import Any

from rich.markup import escape
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption


def is_verbatim_block(paragraph: str) -> bool:
    lines = paragraph.splitlines()
    if paragraph.startswith("\b"):
        return True
    return len(lines) > 1 and lines[0].rstrip().endswith(":") and all(line[:1].isspace() for line in lines[1:])


def plain_help_text(text: str) -> str:
    """A docstring as the help shows it: prose reflowed, example blocks kept, ready for rich markup (escaped)."""

    paragraphs = inspect.cleandoc(text).split("\n\n")
    out = []
    for number, paragraph in enumerate(paragraphs):
        if is_verbatim_block(paragraph):
            block = escape(paragraph.removeprefix("\b").lstrip("\n"))
            # typer dedents the text after the first paragraph as one docstring, whose first line sets no margin:
            # an empty first line keeps the examples' indentation when they come right after it
            out.append("\n" + block if number == 1 else block)
        else:
            out.append(escape(" ".join(line.strip() for line in paragraph.splitlines())))
    return "\n\n".join(out)


_TYPE_NAMES = {"int": "INTEGER", "float": "FLOAT", "str": "TEXT", "bool": "BOOLEAN", "Path": "PATH"}


def metavar_for(param: Any) -> str:
    """What the help shows after a parameter's name: nothing for a flag, its name for an argument, else click's
    name for its type (a repeatable option's element type: its help says it repeats)."""
    if isinstance(param, TyperArgument):
        return (param.name or "value").upper()
    if getattr(param, "is_flag", False):
        return ""
    kind = param.bare_type()
    kind = kind.removeprefix("list[").removesuffix("]")
    return _TYPE_NAMES.get(kind, kind.upper())


def _no_type(ctx: Any) -> None:
    return None


def prepare_help(command: Any) -> None:
    """Fix ``command``'s help text and its parameters' metavars in place (see the module docstring)."""
    if command.help:
        command.help = plain_help_text(command.help)
    for param in command.params:
        if isinstance(param, TyperOption | TyperArgument) and param.help:
            param.help = escape(" ".join(param.help.split()))
        if isinstance(param, TyperArgument):
            # typer shows an argument's Python type beside its name (``RUN_DIR <str>``); the name says it all
            param.display_type_rich = _no_type  # type: ignore[method-assign]
        elif getattr(param, "metavar", None) is None:
            param.metavar = metavar_for(param)


def _help_option_without_metavar(option: Any) -> Any:
    if option is not None:
        option.metavar = ""  # a flag: no <bool> beside --help
    return option


class HelpCommand(TyperCommand):
    """A typer command whose help text is fixed when it is built (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        prepare_help(self)
        for param in self.params:  # the off switch in words: its own column would squeeze the names at 80 columns
            if isinstance(param, TyperOption) and param.secondary_opts and param.help and "Off:" not in param.help:
                param.help = f"{param.help} Off: {', '.join(param.secondary_opts)}."

    def format_help(self, ctx: Any, formatter: Any) -> None:
        hidden = {param: param.secondary_opts for param in self.params if isinstance(param, TyperOption)}
        try:  # the help text names them; the parser still reads them (restored below)
            for param in hidden:
                param.secondary_opts = []
            return super().format_help(ctx, formatter)
        finally:
            for param, secondary in hidden.items():
                param.secondary_opts = secondary

    help_panel: str | None = None  # the panel --help is listed in (None: typer's "Options")

    def get_help_option(self, ctx: Any) -> Any:
        option = _help_option_without_metavar(super().get_help_option(ctx))
        if option is not None and self.help_panel is not None:
            option.rich_help_panel = self.help_panel
        return option


class HelpGroup(TyperGroup):
    """The root ``fluxgrpo`` group, its help fixed like the commands'."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        prepare_help(self)

    def get_help_option(self, ctx: Any) -> Any:
        return _help_option_without_metavar(super().get_help_option(ctx))
