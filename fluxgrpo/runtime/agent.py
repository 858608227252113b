"""The torchrun agent as fluxgrpo runs it: ``python -m fluxgrpo.runtime.agent <torchrun arguments>``.

It is torch's own launcher (``torch.distributed.run``, same arguments, same behaviour) with what a run that owns
its processes needs around it:

- it dies with the process that started it (``die_with_parent``): ``kill -9`` of ``fluxgrpo`` sends the agent
  SIGTERM, and the agent stops its workers; every worker in turn dies with the agent (``runtime/worker.py``);
- a worker failure is written, as data, to ``$FLUXGRPO_ERROR_DIR/agent.json`` (which rank, its exit code or the
  signal that killed it) for the launching command to say in one line, instead of torchrun's ChildFailedError
  traceback and its per-worker log lines (``FLUXGRPO_DEBUG=1`` shows them);
- its exit code: 0, 1 after a worker failure, 128 + N after it was stopped by signal N.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path

ERROR_DIR_ENV = "FLUXGRPO_ERROR_DIR"  # where workers and the agent record failures (``launch.run_torchrun``)
AGENT_RECORD = "agent.json"
PARENT_PID_ENV = "FLUXGRPO_PARENT_PID"  # set for each child: the pid it must die with
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(sig: signal.Signals) -> None:
    """Ask the kernel to send this process ``sig`` when its parent exits (Linux; elsewhere a no-op).

    ``$FLUXGRPO_PARENT_PID`` names the parent we were started by: if it is already gone (it died before the
    request was made, and we were re-parented), the signal is sent now.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return
    expected = os.environ.get(PARENT_PID_ENV)
    if expected and expected.isdigit() and os.getppid() != int(expected):
        os.kill(os.getpid(), sig)


def describe_exit(exitcode: int) -> str:
    """``exited with code 3`` or ``was killed by signal 9 (SIGKILL)`` (a negative code is the signal)."""
    if exitcode >= 0:
        return f"exited with code {exitcode}"
    try:
        name = f" ({signal.Signals(-exitcode).name})"
    except ValueError:
        name = ""
    return f"was killed by signal {-exitcode}{name}"


def _quiet_torchelastic() -> None:
    """torchelastic logs every worker exit and a traceback per failure; the launcher says it in one line."""
    if os.environ.get("FLUXGRPO_DEBUG"):
        return
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _max_nodes(nnodes: str) -> int:
    """torchrun's ``--nnodes``: ``N`` or ``MIN:MAX``."""
    return int(str(nnodes).rpartition(":")[2])


def main(argv: list[str] | None = None) -> int:
    die_with_parent(signal.SIGTERM)  # torchrun stops its workers on SIGTERM
    os.environ[PARENT_PID_ENV] = str(os.getpid())  # the workers die with this agent
    quieted = _quiet_cpp_warnings()
    from torch.distributed import DistError
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    if quieted:  # read once, at torch's start: the workers keep the C++ warnings
        os.environ.pop("TORCH_CPP_LOG_LEVEL", None)

    _quiet_torchelastic()
    args = torchrun.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        torchrun.run(args)
    except ChildFailedError as exc:
        if os.environ.get("FLUXGRPO_DEBUG"):
            raise
        multi_node = _max_nodes(args.nnodes) > 1
        host = socket.gethostname()
        failures = [
            {
                "rank": rank,
                "exitcode": failure.exitcode,
                "pid": failure.pid,
                "time": failure.timestamp,
                # this node's index in the job: its workers' global ranks start at node × nproc-per-node
                "node": (rank - failure.local_rank) // int(args.nproc_per_node) if multi_node else None,
                "host": host,
            }
            for rank, failure in exc.failures.items()
        ]
        if os.environ.get(ERROR_DIR_ENV):  # the launching command says what happened
            Path(os.environ[ERROR_DIR_ENV], AGENT_RECORD).write_text(json.dumps({"failures": failures}))
        else:
            first_rank, first = exc.get_first_failure()
            print(f"torchrun: rank {first_rank} {describe_exit(first.exitcode)}", file=sys.stderr)
        return 1
    except SignalException as exc:  # the agent itself was told to stop (Ctrl-C, SIGTERM): workers are stopped
        return 128 + int(exc.sigval)
    except (RendezvousError, DistError) as exc:  # the rendezvous (node 0's store) is gone or never formed
        if os.environ.get("FLUXGRPO_DEBUG") or not os.environ.get(ERROR_DIR_ENV):
            raise
        record = {"failures": [], "rendezvous": f"{type(exc).__name__}: {exc}", "endpoint": args.rdzv_endpoint}
        Path(os.environ[ERROR_DIR_ENV], AGENT_RECORD).write_text(json.dumps(record))
        return 1
    return 0


def _quiet_cpp_warnings() -> bool:
    """The agent's own C++ store client warns with stack frames when node 0's store goes away; the launcher says
    that in one line. True when this set the variable (the user's value, and FLUXGRPO_DEBUG, win)."""
    if os.environ.get("FLUXGRPO_DEBUG") or "TORCH_CPP_LOG_LEVEL" in os.environ:
        return False
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    return True


if __name__ == "__main__":
    sys.exit(main())
