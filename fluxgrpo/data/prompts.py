"""Prompt files: one prompt per line, UTF-8."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

from fluxgrpo.errors import FluxgrpoError


def bundled_prompts_path() -> Path:
    """The prompt list shipped with fluxgrpo (varied English prompts, for trials and tests)."""
    return Path(__file__).with_name("prompts.txt")


def _text_of(line: str) -> str:
    """A line stripped; "" when it holds only whitespace and control characters (NUL bytes are no prompt)."""
    line = line.strip()
    return line if any(not unicodedata.category(c).startswith("C") for c in line) else ""


def read_prompts(path: str | Path, *, keep_repeats: bool = False, flag: str = "--prompts") -> list[str]:
    """The prompts in ``path``: each line stripped, blank lines dropped, duplicates kept once (first occurrence).

    A ``.json`` file is a benchmark prompt set as its authors publish it: a list of objects, each with a ``"prompt"``
    (HPDv2's ``test.json``, ``fetch-weights --only hpdv2-prompts``), read in order.

    Dropping duplicates keeps each prompt's embedding and its GRPO group statistics from being counted twice.
    ``keep_repeats=True`` keeps every line instead (``score --images --prompts``: one line per image).

    Raises:
        FluxgrpoError: the file is missing, unreadable, not UTF-8, or holds no prompt (naming ``flag``, the option
            that chose the file).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FluxgrpoError(f"prompt file {path} not found: pass an existing file with {flag}") from None
    except UnicodeDecodeError:
        raise FluxgrpoError(f"prompt file {path} is not UTF-8 text: pass a text file with {flag}") from None
    except OSError as exc:
        raise FluxgrpoError(
            f"cannot read prompt file {path} ({exc.strerror or exc}): pass a readable file with {flag}"
        ) from None
    if path.suffix == ".json":
        lines = _json_prompts(text, path)
    else:
        lines = [_text_of(line) for line in text.splitlines() if _text_of(line)]
    prompts = lines if keep_repeats else list(dict.fromkeys(lines))
    if not prompts:
        raise FluxgrpoError(f"prompt file {path} holds no prompts (one per line): pass another file with {flag}")
    return prompts


def _json_prompts(text: str, path: Path) -> list[str]:
    """The ``"prompt"`` of each object of a JSON list (HPDv2's test.json), stripped, empty ones dropped."""

    try:
        document = json.loads(text)
    except ValueError as exc:
        raise FluxgrpoError(f"prompt file {path} is not valid JSON ({exc}): pass a prompt set as published") from None
    if not isinstance(document, list) or not all(isinstance(e, dict) and "prompt" in e for e in document):
        raise FluxgrpoError(
            f'prompt file {path} is not a list of objects with a "prompt" (HPDv2\'s test.json layout): pass a text '
            "file with one prompt per line instead"
        )
    return [str(entry["prompt"]).strip() for entry in document if str(entry["prompt"]).strip()]
