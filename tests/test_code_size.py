"""No god function and no god file: the limits the structure issue set, read from the source with ``ast``.

A function's length is its body without the docstring (a CLI command's option list is its signature, not its body);
its parameters are counted without ``self``/``cls``. The commands under ``fluxgrpo/cli/`` are exempt from the
parameter limit only: typer takes each option as a parameter.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fluxgrpo"
MAX_BODY_LINES = 80
MAX_PARAMETERS = 10
MAX_FILE_LINES = 700
OPTION_LISTS = PACKAGE / "cli"


def body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = node.body
    first = body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        body = body[1:]
    if not body:
        return 0
    end = body[-1].end_lineno
    assert end is not None
    return end - body[0].lineno + 1


def parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = node.args
    named = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs) if a.arg not in ("self", "cls")]
    return len(named) + (args.vararg is not None) + (args.kwarg is not None)


def functions(path: Path) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]


def sources() -> list[Path]:
    found = sorted(PACKAGE.rglob("*.py"))
    assert len(found) > 100, f"the package's sources were not found under {PACKAGE}"
    return found


def test_no_function_is_longer_than_the_limit():
    too_long = [
        f"{path.relative_to(PACKAGE.parent)}:{node.name} ({body_lines(node)} lines)"
        for path in sources()
        for node in functions(path)
        if body_lines(node) > MAX_BODY_LINES
    ]
    assert not too_long, f"functions over {MAX_BODY_LINES} lines: split them by concern: {too_long}"


def test_no_function_outside_the_commands_takes_more_parameters_than_the_limit():
    too_many = [
        f"{path.relative_to(PACKAGE.parent)}:{node.name} ({parameter_count(node)} parameters)"
        for path in sources()
        if OPTION_LISTS not in path.parents
        for node in functions(path)
        if parameter_count(node) > MAX_PARAMETERS
    ]
    assert not too_many, f"functions over {MAX_PARAMETERS} parameters: pass a record instead: {too_many}"


def test_no_file_is_longer_than_the_limit():
    too_long = [
        f"{path.relative_to(PACKAGE.parent)} ({lines} lines)"
        for path in sources()
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_FILE_LINES
    ]
    assert not too_long, f"files over {MAX_FILE_LINES} lines: split them by concern: {too_long}"


def test_the_measures_count_what_they_say():
    """The measures on a hand-written function: a docstring is not body, self is not a parameter."""
    source = (
        'class A:\n    def f(self, a, b=1, *rest, c, **more):\n        """Doc."""\n        x = 1\n\n        return x\n'
    )
    (method,) = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)]
    assert body_lines(method) == 3
    assert parameter_count(method) == 5


def test_the_files_scheduled_first_exist():
    """conftest's SLOWEST_FILES go to the workers first: a renamed file there would quietly lose its place."""
    from conftest import SLOWEST_FILES

    root = PACKAGE.parent
    assert [name for name in SLOWEST_FILES if not (root / name).is_file()] == []
