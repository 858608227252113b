"""One deep check's outcome and the report that holds them all (``env-check --deep``), JSON both ways."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float as None, so the report is strict JSON (no NaN, which
    ``json.dumps`` would write and most readers refuse); tuples become lists, as JSON reads them back."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(key): json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


STATUSES = (PASSED, FAILED, SKIPPED)


@dataclass
class CheckResult:
    """A check's verdict, its headline figure against its rule, and every figure it measured.

    ``figure`` is the number the rule judges (None when skipped); ``rule`` states the rule with its tolerance, so
    the table reads on its own; ``detail`` is one line: the measurement when it passed, what broke when it
    failed, why it did not run when skipped. ``measured`` holds everything else (per-dtype errors, per-phase
    peaks, bandwidths, timings) for the JSON report.
    """

    name: str
    status: str
    figure: float | None
    unit: str
    rule: str
    detail: str
    measured: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")

    def to_dict(self) -> dict[str, Any]:
        return json_safe(asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CheckResult:
        return cls(**data)


def skipped(name: str, rule: str, reason: str, unit: str = "") -> CheckResult:
    """A check that did not run on this machine: never reported as passed."""
    return CheckResult(name, SKIPPED, None, unit, rule, reason)


@dataclass
class DeepReport:
    """Everything ``env-check --deep`` found: where it ran, with what, and every check."""

    environment: dict[str, Any]  # versions, device, settings
    checks: list[CheckResult]
    seconds: float = 0.0

    @property
    def failed(self) -> list[CheckResult]:
        return [check for check in self.checks if check.status == FAILED]

    @property
    def ok(self) -> bool:
        return not self.failed

    def to_dict(self) -> dict[str, Any]:
        return {
            "environment": json_safe(self.environment),
            "checks": [check.to_dict() for check in self.checks],
            "seconds": self.seconds,
            "ok": self.ok,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeepReport:
        return cls(data["environment"], [CheckResult.from_dict(c) for c in data["checks"]], data["seconds"])
