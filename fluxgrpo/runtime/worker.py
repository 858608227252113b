"""What runs inside every worker process: the one prologue, and the one torchrun entry point.

``worker_session(device)`` is the prologue and epilogue every rank's work runs inside (train, sample, preprocess,
bench), in a torchrun worker or in the launching process for one worker:

- join the process group (``dist.init_distributed``: device from LOCAL_RANK, NPU environment defaults);
- on CPU, the intra-op threads the launcher chose from the cores free for each worker (``cpu_threads.py``);
- hide the libraries' own "Loading weights" / "Writing model shards" bars (``quiet_library_progress``): our
  commands print their own progress, and N workers' bars would interleave;
- silence FSDP2's "returned a view tensor" warning: FLUX blocks return views, and neither the FLUX forward nor
  our SDE step modifies a block output in place (the case the warning is about), so it would only repeat
  every iteration;
- on an error, record it for the launcher (``worker_errors.record_worker_error``) before anything else;
- on exit leave the process group, without the barrier after a failure (busy peers would never reach it).

``python -m fluxgrpo.runtime.worker MODULE --payload P.json [--summary S.json]`` is what ``launch.run_workers``
starts under torchrun: it calls ``MODULE.worker_entry(payload)`` on every rank, records an uncaught exception for
the launcher (``worker_errors.worker_errors``), which says it (the worker prints no error line of its own, so the cause
of a failure is what reaches the console, not a peer's lost connection), and rank 0 writes the entry's return
value as JSON to ``S.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.runtime import dist as rt_dist
from fluxgrpo.runtime import liveness
from fluxgrpo.runtime.agent import die_with_parent
from fluxgrpo.runtime.worker_errors import launcher_reports_errors, record_worker_error, worker_errors

ENTRY_NAME = "worker_entry"
FSDP_VIEW_WARNING = r"FSDP2-wrapped module .* returned a view tensor"


@contextlib.contextmanager
def quiet_library_progress() -> Iterator[None]:
    """Hide diffusers' and transformers' per-file loading and saving bars while the block runs."""
    import importlib.util

    switches = []
    for name in ("diffusers.utils.logging", "transformers.utils.logging"):
        if importlib.util.find_spec(name.split(".")[0]) is None:
            continue
        library_logging = importlib.import_module(name)
        switches.append((library_logging, library_logging.is_progress_bar_enabled()))
        library_logging.disable_progress_bar()
    try:
        yield
    finally:
        for library_logging, was_enabled in switches:
            if was_enabled:
                library_logging.enable_progress_bar()


@contextlib.contextmanager
def worker_session(requested_device: str | None) -> Iterator[rt_dist.DistContext]:
    """Run a rank's work inside: join the process group, set up the process, leave the group on exit."""
    warnings.filterwarnings("ignore", message=FSDP_VIEW_WARNING)
    ctx = rt_dist.init_distributed(requested_device)
    try:
        if ctx.device_type == "cpu":
            from fluxgrpo.runtime.cpu_threads import apply_cpu_threads

            apply_cpu_threads(ctx.distributed)  # the launcher's choice from the cores free for each worker
        with quiet_library_progress():
            yield ctx
    except BaseException as exc:
        _report_failure(exc)
        rt_dist.teardown(failed=True)
        raise
    rt_dist.teardown()


def _report_failure(exc: BaseException) -> None:
    """Record a rank's failure for its launcher and tell its peers, naming the rank at fault.

    An error of this rank's own (a FluxgrpoError, an OSError, a bug) is published in the store for the peers, who
    see only a closed connection. A RuntimeError (how a collective fails) is first checked against the peers: when
    another rank published an error or stopped beating, that rank is the cause, and this rank records the line
    naming it.
    """
    watch = liveness.current()
    if watch is None or isinstance(exc, KeyboardInterrupt | SystemExit):
        record_worker_error(exc)
        return
    if isinstance(exc, liveness.PeerFailed):
        record_worker_error(exc, caused_by_peer=str(exc))
        return
    if isinstance(exc, RuntimeError) and not isinstance(exc, FluxgrpoError):  # how collectives fail (gloo, DistError)
        why = watch.explain_failure(str(exc), rt_dist.current_timeout_seconds())
        if why is not None:
            record_worker_error(exc, caused_by_peer=why)
            _say_if_restarting(why)
            return
    message = str(exc) if isinstance(exc, FluxgrpoError) else f"{type(exc).__name__}: {exc}"
    watch.publish_failure(message)
    record_worker_error(exc)
    _say_if_restarting(f"{watch.me.describe()} failed: {message}")


def _say_if_restarting(line: str) -> None:
    """With restarts left (``--max-restarts``) the launcher says nothing until the run ends: say why the workers
    stop now (only local rank 0's output reaches the console)."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if restarts > int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")):
        print(
            f"warning: {line}; torchrun restarts the workers (--max-restarts {restarts})", file=sys.stderr, flush=True
        )


def entry_point(module: str) -> Callable[[dict[str, Any]], Any]:
    """``module.worker_entry``: called with the payload on every rank; rank 0's return value is the summary."""
    return getattr(importlib.import_module(module), ENTRY_NAME)


def as_summary(result: Any) -> Any:
    """The JSON form of an entry's return value (objects with ``to_dict`` are converted), as JSON reads it back."""
    if hasattr(result, "to_dict"):
        result = result.to_dict()
    return json.loads(json.dumps(result))


def main(argv: list[str] | None = None) -> int:
    """Worker entry under torchrun; returns the exit code (a FluxgrpoError's own, its message on stderr)."""
    parser = argparse.ArgumentParser(
        prog="python -m fluxgrpo.runtime.worker", description="a fluxgrpo worker (started by `fluxgrpo ... --dies N`)"
    )
    parser.add_argument("module", help="the module whose worker_entry(payload) every rank runs")
    parser.add_argument("--payload", required=True, type=Path, help="the payload as JSON")
    parser.add_argument("--summary", type=Path, default=None, help="rank 0 writes the entry's result here")
    args = parser.parse_args(argv)
    die_with_parent(signal.SIGKILL)  # never train on after the agent is gone
    try:
        result = worker_errors(lambda: entry_point(args.module)(json.loads(args.payload.read_text())))()
    except FluxgrpoError as exc:
        if not launcher_reports_errors():
            print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except Exception as exc:  # recorded with its traceback; the launching command reports it in one line
        if os.environ.get("FLUXGRPO_DEBUG"):
            raise
        if not launcher_reports_errors():
            print(f"error: {type(exc).__name__}: {exc} (FLUXGRPO_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 1
    if args.summary is not None and int(os.environ.get("RANK", "0")) == 0:
        args.summary.write_text(json.dumps(as_summary(result), indent=2) + "\n")
    return 0


def exit_now(code: int) -> None:
    """Leave a torchrun worker without the interpreter's final teardown.

    Everything the worker owes is done by now (process group left, summary and metrics written and closed), and the
    Python exit handlers still run. What is skipped is the destruction of C++ objects at interpreter exit, where a
    c10d/gloo thread still joinable aborts the process now and then ("terminate called without an active
    exception", SIGABRT), which the launcher would rightly report as a failed rank.
    """
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
