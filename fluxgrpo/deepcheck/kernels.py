"""Check 1: the kernels the runtime swaps in on an accelerator against the plain PyTorch ops (one result per kernel
and dtype). The comparisons themselves are device-specific and live in ``runtime/kernel_check.py``."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from fluxgrpo.deepcheck.result import FAILED, PASSED, CheckResult, skipped
from fluxgrpo.runtime.kernel_check import compare_swapped_kernels, kernel_check_skip_reason

if TYPE_CHECKING:
    import torch

RULE = "normwise max error ≤ tolerance"


def check_kernels(device: torch.device, height: int, width: int, text_tokens: int) -> list[CheckResult]:
    reason = kernel_check_skip_reason(device.type)
    if reason is not None:
        return [skipped("kernels", RULE, reason)]
    start = time.perf_counter()
    comparisons = compare_swapped_kernels(device, height, width, text_tokens)
    seconds = round((time.perf_counter() - start) / max(1, len(comparisons)), 3)
    results = []
    for comparison in comparisons:
        error = comparison.max_error
        figure = "?" if error is None else f"{error:.1e}"
        if comparison.ok:
            detail = f"{figure} ≤ {comparison.tolerance:.1e}: {comparison.kernel}, {comparison.shape}"
        else:
            why = comparison.problem or f"max error {figure} > {comparison.tolerance:.1e}"
            detail = f"{why}: {comparison.kernel}, {comparison.shape}"
        results.append(
            CheckResult(
                f"kernel {comparison.op} {comparison.dtype}",
                PASSED if comparison.ok else FAILED,
                error,
                "max error",
                f"{RULE} {comparison.tolerance:.1e}",
                detail,
                comparison.to_dict(),
                seconds,
            )
        )
    return results
