"""Reading a YAML config a user handed us: bounded before it is parsed, and never ambiguous.

- Size: a run config is a few KiB; a file over ``MAX_CONFIG_BYTES`` is refused unread (a 20 MB value would keep
  validation busy for minutes).
- Depth: nesting past ``MAX_CONFIG_DEPTH`` is refused from the event stream, which PyYAML parses without recursion
  (composing 5,000 levels would raise ``RecursionError``).
- Aliases (``*name``) are refused: nested ones expand a few hundred bytes into gigabytes.
- A key given twice is refused: PyYAML would silently keep the last value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from fluxgrpo.errors import UsageError

MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_DEPTH = 32


def read_config_yaml(path: Path, flag: str = "--config") -> Any:
    """The value a YAML config file holds, checked as the module docstring says.

    Raises:
        UsageError: one line naming ``path`` and ``flag``.
    """
    fix = f"pass another file with {flag}"
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise UsageError(
                f"{path} is {size / 2**20:.1f} MiB, too large for a run config (at most {MAX_CONFIG_BYTES >> 20} "
                f"MiB): {fix}"
            )
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not a text file (not UTF-8), so not a YAML config: {fix}") from None
    except OSError as exc:
        raise UsageError(f"cannot read {path} ({exc.strerror or exc}): pass a readable YAML file with {flag}") from None
    try:
        depth = 0
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent):
                raise UsageError(f"{path} uses YAML aliases (*name): write each value out; {fix}")
            if isinstance(event, yaml.MappingStartEvent | yaml.SequenceStartEvent):
                depth += 1
                if depth > MAX_CONFIG_DEPTH:
                    raise UsageError(
                        f"{path} nests deeper than {MAX_CONFIG_DEPTH} levels, so it is no run config: {fix}"
                    )
            elif isinstance(event, yaml.MappingEndEvent | yaml.SequenceEndEvent):
                depth -= 1
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        reason = " ".join(str(exc).split())  # PyYAML's message spans lines, with a caret drawing
        raise UsageError(f"{path} is not valid YAML ({reason[:300]}): fix it, or {fix}") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that gives a key twice."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str | int | float | bool) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice (line {key_node.start_mark.line + 1})", None
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


MAX_LISTED_PROBLEMS = 20


def capped(problems: list[str], limit: int = MAX_LISTED_PROBLEMS) -> list[str]:
    """At most ``limit`` problems and a line counting the rest: 200,000 unknown keys are no 200,001-line error."""
    if len(problems) <= limit:
        return problems
    return [*problems[:limit], f"... and {len(problems) - limit} more"]
