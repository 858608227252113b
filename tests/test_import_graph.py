"""The package's import graph: no circle among fluxgrpo's modules nor among its rooms (top-level folders and modules),
and the algorithm (``grpo/``) imports nothing above it. Read from the source with ``ast``, function-local imports included: a circle that only a function-local import
keeps from failing at import time is still a circle a reader has to untangle.

Imports under ``if TYPE_CHECKING:`` are left out: they never run, and an annotation naming a class of another module
(``guard_problems(cfg: TrainConfig)``) is no dependency of what the code does.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "fluxgrpo"
# What the algorithm may import: itself, the runtime (devices, collectives), the error types, the model parts and the
# rewards' protocol. The run (training/), the commands, config, checkpoints, bench and deepcheck sit above it.
GRPO_MAY_IMPORT = ("fluxgrpo.grpo", "fluxgrpo.runtime", "fluxgrpo.errors", "fluxgrpo.models", "fluxgrpo.rewards")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth, except those under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """module → the fluxgrpo modules it imports (``from pkg import mod`` counts as an import of ``pkg.mod``)."""
    files = {module_name(path, root): path for path in sorted(root.rglob("*.py"))}

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                candidates = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names
                ]
            for candidate in candidates:
                target = known(candidate) if candidate.startswith(root.name) else None
                if target is not None and target != name:
                    targets.add(target)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as one circle's modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def one_circle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A concrete path a → b → … → a inside ``component``, to print."""
    members = set(component)
    start = component[0]
    path, seen = [start], {start}
    while True:
        target = next(t for t in sorted(graph[path[-1]]) if t in members)
        if target in seen:
            return [*path[path.index(target) :], target]
        path.append(target)
        seen.add(target)


def test_no_import_cycle_in_the_package():
    graph = import_graph(PACKAGE)
    circles = [" → ".join(one_circle(graph, component)) for component in cycles(graph)]
    assert not circles, "import circles (break each by moving the shared part down):\n" + "\n".join(circles)


def room(module: str) -> str:
    """The room a module stands in: the package's top-level folder or module it belongs to (``fluxgrpo.config.checks``
    → ``fluxgrpo.config``)."""
    return ".".join(module.split(".")[:2])


def room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """room → the other rooms its modules import (an import inside a room is no arrow between rooms)."""
    rooms: dict[str, set[str]] = {}
    for module, targets in graph.items():
        rooms.setdefault(room(module), set()).update(room(target) for target in targets if room(target) != room(module))
    return rooms


def test_the_rooms_form_layers():
    """The package's top-level folders and modules import each other without a circle, so they stand in floors, each
    importing only from those below it (function-local imports counted, as for modules)."""
    graph = import_graph(PACKAGE)
    rooms = room_graph(graph)
    circles = []
    for component in cycles(rooms):
        circle = one_circle(rooms, component)
        arrows = [
            f"  {a} → {b}: "
            + ", ".join(sorted(f"{m} → {t}" for m in graph if room(m) == a for t in graph[m] if room(t) == b))
            for a, b in itertools.pairwise(circle)
        ]
        circles.append(" → ".join(circle) + "\n" + "\n".join(arrows))
    assert not circles, "rooms in a circle (move the shared part into the lower room):\n" + "\n".join(circles)


def test_the_algorithm_imports_nothing_above_it():
    graph = import_graph(PACKAGE)
    upward = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        if module.startswith("fluxgrpo.grpo")
        for target in targets
        if not any(target == allowed or target.startswith(allowed + ".") for allowed in GRPO_MAY_IMPORT)
    )
    assert not upward, "grpo/ may import only " + ", ".join(GRPO_MAY_IMPORT) + ":\n" + "\n".join(upward)


# The shapes world sits low in the house (renderer, grammar, checker, the shipped weights' layout): it may not reach up
# into the model parts, the rewards, the algorithm or the samplers. Its builder and measurements are the lab's.
SHAPES_MAY_NOT_IMPORT = ("fluxgrpo.models", "fluxgrpo.rewards", "fluxgrpo.grpo", "fluxgrpo.sampling", "fluxgrpo.lab")


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_the_shapes_world_imports_nothing_above_it():
    graph = import_graph(PACKAGE)
    upward = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        if _under(module, "fluxgrpo.shapes")
        for target in targets
        if any(_under(target, banned) for banned in SHAPES_MAY_NOT_IMPORT)
    )
    assert not upward, "the shapes world may not import " + ", ".join(SHAPES_MAY_NOT_IMPORT) + ":\n" + "\n".join(upward)


def test_nothing_in_the_product_imports_the_lab():
    graph = import_graph(PACKAGE)
    into_lab = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        if not _under(module, "fluxgrpo.lab")
        for target in targets
        if _under(target, "fluxgrpo.lab")
    )
    assert not into_lab, "the lab (builder, measurements) is the top floor; nothing imports it:\n" + "\n".join(into_lab)


@pytest.fixture
def toy_package(tmp_path):
    """a ↔ b through a function-local import, c → a at the top, d → a only under TYPE_CHECKING, a relative import."""
    root = tmp_path / "toy"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "a.py").write_text("from toy import b\n")
    (root / "b.py").write_text("def late():\n    from toy.a import thing\n")
    (root / "c.py").write_text("from . import a\n")
    (root / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from toy import c\n")
    return root


def test_rooms_are_top_level_folders_and_modules_and_a_circle_between_them_is_found(toy_package):
    (toy_package / "low").mkdir()
    (toy_package / "low" / "__init__.py").write_text("")
    (toy_package / "low" / "x.py").write_text("def late():\n    from toy import d\n")
    (toy_package / "d.py").write_text("from toy.low import x\n")
    rooms = room_graph(import_graph(toy_package))
    assert rooms["toy.low"] == {"toy.d"} and rooms["toy.d"] == {"toy.low"}
    assert ["toy.d", "toy.low"] in cycles(rooms)


def test_the_graph_reads_local_and_relative_imports_and_skips_type_checking_ones(toy_package):
    graph = import_graph(toy_package)
    assert graph == {"toy": set(), "toy.a": {"toy.b"}, "toy.b": {"toy.a"}, "toy.c": {"toy.a"}, "toy.d": set()}
    assert cycles(graph) == [["toy.a", "toy.b"]]
    assert one_circle(graph, ["toy.a", "toy.b"]) == ["toy.a", "toy.b", "toy.a"]
