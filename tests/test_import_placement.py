"""Imports stand at the top of each module, where a reader sees what the module depends on (issue #49.4).

A function-local import is allowed only in the modules listed below, each with its reason: the modules that
``fluxgrpo --help``, ``fluxgrpo <command> --help`` and the config's validation import (they stay torch-free and
instant: ``tests/cli/test_cli.py::test_help_does_not_import_torch``), and the few that import an optional dependency
only where it is used. Read from the source with ``ast``; imports under ``if TYPE_CHECKING:`` are no imports at run
time and are left out, as in ``test_import_graph.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fluxgrpo"

HELP_PATH = "imported by --help or the config's validation, which stay torch-free: the heavy parts load when called"
REWARD_ON_HELP = (
    "the reward registry imports each reward module so --reward's help and the config's checks can name it; the "
    "model code (torch, open_clip, transformers) loads when the reward is built"
)
TORCH_NPU = "torch_npu is on Ascend only, and its import fails without CANN: it is imported where the NPU is used"

# path relative to fluxgrpo/ (a folder ends with "/") → why its functions may import.
LAZY_IMPORTS_ALLOWED: dict[str, str] = {
    "runtime/launch.py": "the launcher, the process Ctrl-C reaches, stays torch-free (with torch loaded at its start "
    "it did not exit within 90 s of Ctrl-C in the full suite: tests/test_runs.py)",
    "runtime/dist.py": "imported by the launcher for its timeout names: torch only where a worker needs it",
    "runtime/worker.py": "imported by the launcher's in-process path: torch only where a worker needs it",
    "cli/": "every command module is imported for `fluxgrpo --help`; a command imports what it runs when it runs",
    "config/schema.py": HELP_PATH + " (the σ schedule that sizes the SDE window needs torch)",
    "models/tiny.py": HELP_PATH + " (models.known's --model-family list; the tiny FLUX is built with diffusers)",
    "tiny_tokenizers.py": HELP_PATH + " (read by models/tiny.py and the rewards; the tokenizers are transformers')",
    "runtime/device.py": HELP_PATH + " (its DEVICE_TYPES are --device's choices)",
    "runtime/adapt.py": HELP_PATH + " (its ATTENTION_BACKENDS are --attention's choices; the NPU patches need torch)",
    "runtime/cann.py": "imports where `import torch` fails (torch-npu without CANN), so env-check still reports it",
    "envcheck.py": "env-check reports a torch that does not import (torch-npu without CANN): the worker checks that "
    "import torch load when reached",
    "runtime/agent.py": "TORCH_CPP_LOG_LEVEL is read once, when torch starts: the agent sets it, then imports torch",
    "runtime/report.py": HELP_PATH + " (env-check's report, which still answers when `import torch` fails)",
    "bench/efficiency.py": HELP_PATH + " (bench --help's algorithm choices; the runs it times import the loop)",
    "rewards/base.py": REWARD_ON_HELP,
    "rewards/clipscore.py": REWARD_ON_HELP,
    "rewards/hpsv2.py": REWARD_ON_HELP,
    "rewards/hpsv3.py": REWARD_ON_HELP + "; Qwen2-VL's classes need transformers ≥ 4.52, named in the error if not",
    "rewards/imagereward.py": REWARD_ON_HELP,
    "rewards/open_clip_model.py": REWARD_ON_HELP,
    "rewards/pickscore.py": REWARD_ON_HELP,
    "rewards/reward_set.py": REWARD_ON_HELP,
    "rewards/shapes.py": REWARD_ON_HELP,
    "rewards/structure.py": REWARD_ON_HELP,
    "training/memory.py": "the launcher sizes memory from the model's config files without diffusers "
    "(tests/models/test_flux_shapes.py); diffusers' classes and the run's settings load only where a run is measured",
    "metrics.py": "tensorboard and wandb are optional extras, imported when --tensorboard / --wandb asks for them",
    "report/figures.py": "matplotlib is the optional report extra: a missing one is named in the error",
    "bench/heldout_plot.py": "matplotlib is the optional report extra: a missing one is named in the error",
    "runtime/npu.py": TORCH_NPU + "; diffusers' attention and norm classes differ between its versions",
    "runtime/kernel_check.py": TORCH_NPU,
    "runtime/peak.py": TORCH_NPU,
    "weights/hub_clients.py": "each hub's library is imported when its client is built, so a missing one is one "
    "FluxgrpoError line (`--source hf needs huggingface_hub`)",
    "lab/": "owned by the world rebuild, to do",
    "shapes/": "owned by the world rebuild, to do",
}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def local_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The imports inside a function (at any depth in it), except those under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child, in_function)
            return
        if in_function and isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(tree, False)
    return found


def allowed(relative: str) -> bool:
    return any(
        relative == entry or (entry.endswith("/") and relative.startswith(entry)) for entry in LAZY_IMPORTS_ALLOWED
    )


def modules_with_local_imports(root: Path) -> dict[str, list[int]]:
    """path relative to ``root`` → the line of each function-local import in it."""
    found: dict[str, list[int]] = {}
    for path in sorted(root.rglob("*.py")):
        lines = [node.lineno for node in local_imports(ast.parse(path.read_text(encoding="utf-8")))]
        if lines:
            found[path.relative_to(root).as_posix()] = lines
    return found


def test_imports_stand_at_the_top_outside_the_allowed_modules():
    found = modules_with_local_imports(PACKAGE)
    offending = [f"fluxgrpo/{path}:{line}" for path, lines in found.items() if not allowed(path) for line in lines]
    assert not offending, (
        "function-local imports (move them to the top of the module; a module on the --help path or one importing an "
        "optional dependency goes into LAZY_IMPORTS_ALLOWED with its reason):\n" + "\n".join(offending)
    )


def test_every_allowed_entry_still_needs_its_place():
    found = modules_with_local_imports(PACKAGE)
    stale = [
        entry
        for entry in LAZY_IMPORTS_ALLOWED
        if not any(path == entry or (entry.endswith("/") and path.startswith(entry)) for path in found)
    ]
    assert not stale, f"allow-listed but importing nothing inside a function (drop them from the list): {stale}"


def test_the_rule_reads_nested_and_type_checking_imports(tmp_path):
    (tmp_path / "top.py").write_text(
        "import os\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import json\n"
    )
    (tmp_path / "late.py").write_text(
        "def f():\n    if True:\n        import json\n    def g():\n        from os import path\n"
        "    if TYPE_CHECKING:\n        import re\n"
    )
    assert modules_with_local_imports(tmp_path) == {"late.py": [3, 5]}
