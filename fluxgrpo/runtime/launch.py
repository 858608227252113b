"""Build the torchrun command as data (a pure, tested function), then run it and report failing ranks.

Workers record an uncaught exception in ``$FLUXGRPO_ERROR_DIR/rank<R>.json`` (see ``worker_errors``) so the
launching command can name the rank that failed first and its error in one line, instead of leaving the
user to dig through interleaved tracebacks. torchrun itself stops every other worker when one fails.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fluxgrpo.errors import FluxgrpoError, UsageError
from fluxgrpo.runtime.npu_env import NPU_ENV_DEFAULTS

ERROR_DIR_ENV = "FLUXGRPO_ERROR_DIR"


@dataclass(frozen=True)
class LaunchSpec:
    """How many workers, on how many nodes (torchrun's vocabulary)."""

    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None

    def validate(self) -> None:
        if self.nproc_per_node < 1:
            raise UsageError(f"--dies must be at least 1 (got {self.nproc_per_node})")
        if self.nnodes < 1:
            raise UsageError(f"--nnodes must be at least 1 (got {self.nnodes})")
        if not 0 <= self.node_rank < self.nnodes:
            raise UsageError(f"--node-rank must be in [0, {self.nnodes - 1}] for --nnodes {self.nnodes}")
        if self.nnodes > 1 and not self.master_addr:
            raise UsageError("--nnodes > 1 needs --master-addr (the address of node 0, reachable from every node)")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise UsageError(f"--master-port must be a TCP port (got {self.master_port})")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def worker_env_defaults(device_type: str) -> dict[str, str]:
    """The NPU recipe's variables for workers on ``device_type``: the user's value where set, else ours."""
    if device_type != "npu":
        return {}
    return {v.name: os.environ.get(v.name, v.recommended) for v in NPU_ENV_DEFAULTS}


def build_torchrun_argv(
    module: str,
    args: Sequence[str],
    spec: LaunchSpec,
    *,
    python: str | None = None,
    log_dir: str | Path | None = None,
) -> list[str]:
    """The torchrun command that runs ``python -m <module> <args>`` on ``spec.nproc_per_node`` workers.

    Single node without a master address uses ``--standalone`` (a free local port, no rendezvous server).
    Multi-node uses a static c10d rendezvous at ``master_addr:master_port`` (default port 29500), the same
    command on every node with its own ``--node-rank``. With ``log_dir``, every worker's output is kept in
    files there and only local rank 0 reaches the console.
    """
    spec.validate()
    argv = [python or sys.executable, "-m", "torch.distributed.run"]
    if spec.nnodes == 1 and spec.master_addr is None and spec.master_port is None:
        argv.append("--standalone")
    else:
        argv += [
            f"--nnodes={spec.nnodes}",
            f"--node-rank={spec.node_rank}",
            f"--master-addr={spec.master_addr or '127.0.0.1'}",
            f"--master-port={spec.master_port or 29500}",
        ]
    argv.append(f"--nproc-per-node={spec.nproc_per_node}")
    if log_dir is not None:
        argv += [f"--log-dir={log_dir}", "--tee=3", "--local-ranks-filter=0"]
    argv += ["-m", module, *args]
    return argv


def run_torchrun(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    runner: Callable[..., int] | None = None,
) -> None:
    """Run a torchrun command; on failure raise FluxgrpoError naming the first rank that failed and why.

    Args:
        argv: from ``build_torchrun_argv``.
        env: extra environment variables for the workers (merged over os.environ).
        runner: injectable for tests; called as ``runner(argv, env=full_env)`` and returns the exit code.
    """
    with tempfile.TemporaryDirectory(prefix="fluxgrpo-errors-") as error_dir:
        full_env = {**os.environ, **(env or {}), ERROR_DIR_ENV: error_dir}
        run = runner or (lambda a, env: subprocess.call(list(a), env=env))
        try:
            code = run(argv, env=full_env)
        except KeyboardInterrupt:
            raise FluxgrpoError(
                "interrupted: workers stopped (no checkpoint is marked complete unless it was)"
            ) from None
        if code != 0:
            first = first_worker_error(Path(error_dir))
            if first is not None:
                raise FluxgrpoError(f"rank {first['rank']} failed: {first['error']}")
            raise FluxgrpoError(
                f"workers exited with code {code} and recorded no error (killed, or out of memory?): "
                "see the worker logs above"
            )


def first_worker_error(error_dir: Path) -> dict[str, Any] | None:
    """The earliest error recorded by any rank, or None."""
    records = []
    for path in error_dir.glob("rank*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except ValueError:
            continue
    if not records:
        return None
    return min(records, key=lambda r: r["time"])


def worker_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a worker entry point: record an uncaught exception for the launcher, then re-raise."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except BaseException as exc:
            error_dir = os.environ.get(ERROR_DIR_ENV)
            if error_dir and not isinstance(exc, SystemExit | KeyboardInterrupt):
                rank = os.environ.get("RANK", "0")
                message = str(exc) if isinstance(exc, FluxgrpoError) else f"{type(exc).__name__}: {exc}"
                record = {"rank": int(rank), "error": message, "time": time.time(), "traceback": traceback.format_exc()}
                Path(error_dir, f"rank{rank}.json").write_text(json.dumps(record))
            raise

    return wrapper


def run_worker(work: Callable[[], Any], summary_json: str | None = None) -> int:
    """The body of a torchrun worker's ``main``: run ``work``, leave the process group, report.

    The process group is left without a barrier after a failure (peers may be inside a collective and would
    wait forever); the failure is recorded for the launcher (``worker_errors``). Rank 0 writes the result's
    ``to_dict()`` to ``summary_json`` for the launching command.

    Returns:
        The exit code: 0, or the FluxgrpoError's code (its message printed to stderr).
    """
    from fluxgrpo.runtime import dist as rt_dist

    @worker_errors
    def guarded() -> Any:
        try:
            result = work()
        except BaseException:
            rt_dist.teardown(failed=True)
            raise
        rt_dist.teardown()
        return result

    try:
        result = guarded()
    except FluxgrpoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    if summary_json and int(os.environ.get("RANK", "0")) == 0:
        Path(summary_json).write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    return 0


def launch_with_summary(
    module: str,
    worker_args: Callable[[Path], list[str]],
    nproc: int,
    device_type: str,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run ``python -m module`` on ``nproc`` local workers and return rank 0's summary.

    Args:
        worker_args: given a scratch folder, the worker's arguments; they must make rank 0 write
            ``<scratch>/summary.json`` (``run_worker``'s ``summary_json``).
        device_type: checked against the visible devices; the NPU recipe's variables go to the workers.
    """
    check_dies_fit(device_type, nproc)
    with tempfile.TemporaryDirectory(prefix=f"{module.replace('.', '-')}-") as tmp:
        argv = build_torchrun_argv(module, worker_args(Path(tmp)), LaunchSpec(nproc_per_node=nproc))
        if log is not None:
            log(f"launching {nproc} workers: {' '.join(argv)}")
        run_torchrun(argv, env=worker_env_defaults(device_type))
        return json.loads((Path(tmp) / "summary.json").read_text())


def check_dies_fit(device_type: str, nproc: int) -> None:
    """``--dies`` must not exceed the visible accelerators (the CPU takes any number of workers)."""
    if device_type == "cpu":
        return
    from fluxgrpo.runtime import device as rt_device

    available = rt_device.device_count(device_type)
    if nproc > available:
        raise UsageError(
            f"--dies {nproc} but only {available} {device_type} device(s) are visible (check the visible-device mask)"
        )
