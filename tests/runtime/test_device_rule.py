"""Only fluxgrpo/runtime/ may name an accelerator or its backend (the portability rule)."""

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "fluxgrpo"
FORBIDDEN_TOKENS = {"cuda", "npu", "nccl", "hccl"}
FORBIDDEN_CALLS = re.compile(r"torch\.(cuda|npu)\.")


def offending_lines(text: str) -> list[str]:
    bad = []
    for line in text.splitlines():
        # Split on anything that is not a letter or digit, so `torch_npu`, "HCCL_TIMEOUT" and device("cuda") are
        # caught while words that merely contain the letters (input) are not.
        tokens = set(re.split(r"[^a-z0-9]+", line.lower()))
        if tokens & FORBIDDEN_TOKENS or FORBIDDEN_CALLS.search(line):
            bad.append(line.strip())
    return bad


def test_rule_catches_what_it_should():
    assert offending_lines('x = torch.device("cuda")')
    assert offending_lines("import torch_npu")
    assert offending_lines("HCCL_CONNECT_TIMEOUT")
    assert offending_lines("backend = 'nccl'")
    assert not offending_lines("inputs = model.input_ids  # computed")


def test_no_device_names_outside_runtime():
    leaks = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "runtime":
            continue
        bad = offending_lines(path.read_text())
        if bad:
            leaks[str(rel)] = bad
    assert not leaks, f"device/backend names outside fluxgrpo/runtime/ (ask the runtime instead): {leaks}"
