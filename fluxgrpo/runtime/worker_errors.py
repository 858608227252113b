"""What a worker leaves for its launcher when it fails: ``$FLUXGRPO_ERROR_DIR/rank<R>.json``, written by the worker
(``record_worker_error``, ``worker_errors``) and read by the launcher (``worker_records``, ``first_worker_error``).

Kept apart from ``launch.py`` (which reads them) and ``worker.py`` (which writes them), so neither imports the other.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.runtime.agent import ERROR_DIR_ENV


def worker_records(error_dir: Path) -> list[dict[str, Any]]:
    """The errors the ranks recorded in ``error_dir`` in the last start of the workers (an elastic restart
    starts them again), earliest first."""
    records = []
    for path in error_dir.glob("rank*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except ValueError:
            continue
    last = max((r.get("attempt", 0) for r in records), default=0)
    return sorted((r for r in records if r.get("attempt", 0) == last), key=lambda r: r["time"])


def first_worker_error(error_dir: Path) -> dict[str, Any] | None:
    """The earliest error recorded by any rank, or None."""
    records = worker_records(error_dir)
    return records[0] if records else None


def launcher_reports_errors() -> bool:
    """True in a worker started by ``run_torchrun``: the launching command says what failed, so the worker must
    not print its own error line (it would reach the console first, even when it only follows a peer's failure)."""
    return bool(os.environ.get(ERROR_DIR_ENV))


def record_worker_error(exc: BaseException, *, caused_by_peer: str | None = None) -> None:
    """Record this rank's first uncaught error for the launcher (a no-op outside ``run_torchrun``'s workers).

    Called where the error happens, before the process group is left: a peer notices the lost connection only
    after that, so the recorded times put the rank that really failed first. ``caused_by_peer`` is the line that
    names another rank as the cause (``liveness.Liveness.explain_failure``): this rank only followed it, and the
    launcher says that line as it is. After an elastic restart a rank records again (``attempt``).
    """
    error_dir = os.environ.get(ERROR_DIR_ENV)
    if not error_dir or isinstance(exc, SystemExit | KeyboardInterrupt):
        return
    rank = os.environ.get("RANK", "0")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    path = Path(error_dir, f"rank{rank}.json")
    if _recorded_attempt(path) == int(attempt):  # recorded already, where it happened
        return
    expected = isinstance(exc, FluxgrpoError) or caused_by_peer is not None
    message = caused_by_peer or (str(exc) if isinstance(exc, FluxgrpoError) else f"{type(exc).__name__}: {exc}")
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    record = {
        "rank": int(rank),
        "where": worker_whereabouts(int(rank)),
        "attempt": int(attempt),
        "error": message,
        "peer": caused_by_peer is not None,
        "time": time.time(),
        "expected": expected,
        "traceback": tb,
    }
    path.write_text(json.dumps(record))


def _recorded_attempt(path: Path) -> int | None:
    """The start of the workers (torchrun's restart count) that recorded ``path``; None if none did."""
    try:
        return int(json.loads(path.read_text()).get("attempt", 0))
    except (OSError, ValueError):
        return None


def worker_whereabouts(rank: int) -> str:
    """``node 1 (host h) rank 5`` in a multi-node run, ``rank 5`` on one node (torchrun's variables)."""
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1:
        return f"node {os.environ.get('GROUP_RANK', '?')} (host {socket.gethostname()}) rank {rank}"
    return f"rank {rank}"


def worker_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a worker entry point: record an uncaught exception for the launcher, then re-raise."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except BaseException as exc:
            record_worker_error(exc)
            raise

    return wrapper
