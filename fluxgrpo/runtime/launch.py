"""The one way fluxgrpo runs workers: ``run_workers(module, payload, spec, device)``.

A command that runs on N workers (train, sample, preprocess; bench once it adopts this) provides, in its library
module, ``worker_entry(payload: dict)``, which opens ``runtime.worker.worker_session(device)`` (the one worker
prologue: process group, threads, warning filters; see ``runtime/worker.py``) and returns rank 0's result::

    def worker_entry(payload):
        cfg = BenchConfig.from_dict(payload["config"])
        with worker_session(cfg.device) as ctx:
            return {"records": bench_on_rank(cfg, ctx, ...)}

    summary = run_workers("fluxgrpo.bench", {"config": cfg.to_dict()}, LaunchSpec(nproc_per_node=dies), device)

``--dies 1`` on one node calls the entry in this process; more workers (or nodes) run it under torchrun
(``python -m fluxgrpo.runtime.worker <module> --payload FILE --summary FILE``). The result comes back the same
way in both cases (through JSON), so a command has no in-process branch of its own.

The torchrun command is built as data (``build_torchrun_argv``, a pure, tested function). Workers record an
uncaught exception in ``$FLUXGRPO_ERROR_DIR/rank<R>.json`` (``worker_errors.py``) so the launching command can name
the rank that failed first and its error in one line, instead of leaving the user to dig through interleaved
tracebacks. torchrun itself stops every other worker when one fails. A worker started this way prints no error
line of its own (``launcher_reports_errors``): a rank that only lost its connection to a failed peer fails first
often enough, and its gloo/HCCL "connection reset" would reach the console ahead of the cause. With a log folder,
every rank's error and traceback are kept in ``errors.txt`` there, the cause first and the rest marked as what
followed from it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fluxgrpo.errors import FluxgrpoError, UsageError
from fluxgrpo.paths import write_atomic
from fluxgrpo.run_folder import ERRORS_FILE
from fluxgrpo.runtime.agent import AGENT_RECORD, ERROR_DIR_ENV, PARENT_PID_ENV, describe_exit
from fluxgrpo.runtime.dist import COLLECTIVE_TIMEOUT_ENV, CollectiveTimeout
from fluxgrpo.runtime.npu_env import NPU_ENV_DEFAULTS
from fluxgrpo.runtime.worker_errors import first_worker_error, worker_records

AGENT_MODULE = "fluxgrpo.runtime.agent"
AGENT_STOP_SECONDS = 60  # after Ctrl-C: time for the agent to stop its workers before it is killed
WORKER_MODULE = "fluxgrpo.runtime.worker"


@dataclass(frozen=True)
class LaunchSpec:
    """How many workers, on how many nodes (torchrun's vocabulary).

    Two ways to meet: a static rendezvous at ``master_addr:master_port`` (node 0 hosts it; node ranks fixed), or
    torchrun's elastic c10d rendezvous at ``rdzv_endpoint`` (``host:port`` on node 0) under ``run_id``, which
    also lets the agent restart every worker after a failure (``max_restarts``) and a lost node rejoin.
    """

    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_endpoint: str | None = None
    run_id: str | None = None
    max_restarts: int = 0
    collective_timeout: CollectiveTimeout | None = None

    def validate(self) -> None:
        if self.nproc_per_node < 1:
            raise UsageError(f"--dies must be at least 1 (got {self.nproc_per_node})")
        if self.nnodes < 1:
            raise UsageError(f"--nnodes must be at least 1 (got {self.nnodes})")
        if not 0 <= self.node_rank < self.nnodes:
            raise UsageError(f"--node-rank must be in [0, {self.nnodes - 1}] for --nnodes {self.nnodes}")
        if self.rdzv_endpoint is not None and self.master_addr is not None:
            raise UsageError(
                "--rdzv-endpoint (elastic) and --master-addr (static) both say where node 0 is: pass one of them"
            )
        if self.nnodes > 1 and not (self.master_addr or self.rdzv_endpoint):
            raise UsageError(
                "--nnodes > 1 needs --rdzv-endpoint HOST:PORT (elastic, restartable) or --master-addr (static): "
                "the address of node 0, reachable from every node"
            )
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise UsageError(f"--master-port must be a TCP port (got {self.master_port})")
        if self.rdzv_endpoint is not None:
            parse_endpoint(self.rdzv_endpoint)
        if self.max_restarts < 0:
            raise UsageError(f"--max-restarts must be 0 or more (got {self.max_restarts})")
        if self.max_restarts and self.master_addr is not None:
            raise UsageError(
                "--max-restarts needs the elastic rendezvous: a static one (--master-addr) cannot form again "
                "after a failure; use --rdzv-endpoint HOST:PORT instead of --master-addr/--master-port"
            )
        if self.collective_timeout is not None:
            self.collective_timeout.validate()

    @property
    def elastic(self) -> bool:
        return self.rdzv_endpoint is not None

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def rendezvous_address(self) -> tuple[str, int] | None:
        """Where the nodes meet (host, port) in a multi-node run; None on one node."""
        if self.rdzv_endpoint is not None:
            return parse_endpoint(self.rdzv_endpoint)
        if self.master_addr is not None:
            return self.master_addr, self.master_port or DEFAULT_PORT
        return None


DEFAULT_PORT = 29500  # torchrun's


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too; the port defaults to 29500) → (host, port)."""
    host, sep, port_text = endpoint.rpartition(":")
    if not sep or "]" in port_text:
        host, port_text = endpoint, str(DEFAULT_PORT)
    host = host.strip("[]")
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise UsageError(f"--rdzv-endpoint {endpoint!r} is not HOST:PORT (e.g. 10.0.0.1:29500)")
    return host, int(port_text)


def run_id_for(output_dir: str | Path) -> str:
    """The rendezvous id of the run writing ``output_dir``: nodes meet only when they name the same folder (the
    path as given, made absolute, so the same command on every node gives the same id)."""
    import hashlib

    return "fluxgrpo-" + hashlib.sha256(os.path.abspath(output_dir).encode()).hexdigest()[:16]


def worker_env_defaults(device_type: str) -> dict[str, str]:
    """The NPU recipe's variables for workers on ``device_type``: the user's value where set, else ours."""
    if device_type != "npu":
        return {}
    return {v.name: os.environ.get(v.name, v.recommended) for v in NPU_ENV_DEFAULTS}


def collective_env(
    device_type: str, timeouts: CollectiveTimeout | None, log_dir: str | Path | None = None
) -> dict[str, str]:
    """The workers' variables that bound their collectives and diagnose a hang, the user's values winning.

    - ``$FLUXGRPO_COLLECTIVE_TIMEOUT``: the process group's timeouts (``runtime/dist.py``);
    - NCCL: the flight recorder (its trace buffer, dumped on a timeout into the log folder) and desync debug,
      which names the rank a collective waited for, as torchtitan runs them;
    - HCCL: the device-side execution timeout is fixed for the process, so it is the start-up value (the
      process group's own timeout bounds the steady state); the flight recorder as torchtitan-npu turns it on.
    """
    if timeouts is None:
        return {}
    env = {COLLECTIVE_TIMEOUT_ENV: timeouts.text()}
    trace_prefix = str(Path(log_dir, "collective_trace_rank_")) if log_dir is not None else None
    ours: dict[str, str] = {}
    if device_type == "cuda":
        ours = {
            "TORCH_NCCL_TRACE_BUFFER_SIZE": "20000",
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DESYNC_DEBUG": "1",
        }
        if trace_prefix:
            ours["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = trace_prefix
    elif device_type == "npu":
        ours = {
            "HCCL_EXEC_TIMEOUT": str(int(timeouts.startup)),
            "HCCL_ASYNC_ERROR_HANDLING": "1",
            "TORCH_HCCL_TRACE_BUFFER_SIZE": "20000",
            "TORCH_HCCL_DUMP_ON_TIMEOUT": "1",
        }
        if trace_prefix:
            ours["TORCH_HCCL_DEBUG_INFO_TEMP_FILE"] = trace_prefix
    env.update({name: os.environ.get(name, value) for name, value in ours.items()})
    return env


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
    argv = [python or sys.executable, "-m", AGENT_MODULE]
    if spec.rdzv_endpoint is not None:
        host, port = parse_endpoint(spec.rdzv_endpoint)
        # The node given --node-rank 0 hosts the store at the endpoint; the others only connect to it. Nodes wait
        # for each other (at start and after a restart) as long as the collectives' start-up timeout.
        join_timeout = int((spec.collective_timeout or CollectiveTimeout()).startup)
        argv += [
            f"--nnodes={spec.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={host}:{port}",
            f"--rdzv-id={spec.run_id or 'fluxgrpo'}",
            f"--rdzv-conf=join_timeout={join_timeout},is_host={str(spec.node_rank == 0).lower()}",
        ]
    elif spec.nnodes == 1 and spec.master_addr is None and spec.master_port is None:
        argv.append("--standalone")
    else:
        argv += [
            f"--nnodes={spec.nnodes}",
            f"--node-rank={spec.node_rank}",
            f"--master-addr={spec.master_addr or '127.0.0.1'}",
            f"--master-port={spec.master_port or DEFAULT_PORT}",
        ]
    if spec.max_restarts:
        argv.append(f"--max-restarts={spec.max_restarts}")
    argv.append(f"--nproc-per-node={spec.nproc_per_node}")
    if log_dir is not None:
        # An empty role rendered by the prefix template is an empty prefix: rank 0's lines reach the console as
        # the worker wrote them, without torchrun's "[default0]:" (only local rank 0 is shown anyway).
        argv += [
            f"--log-dir={log_dir}",
            "--tee=3",
            "--local-ranks-filter=0",
            "--role=",
            "--log-line-prefix-template=${role_name}",
        ]
    argv += ["-m", module, *args]
    return argv


def run_torchrun(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    runner: Callable[..., int] | None = None,
    errors_file: Path | None = None,
) -> None:
    """Run a torchrun command; on failure raise FluxgrpoError saying in one line which rank failed and how.

    Args:
        argv: from ``build_torchrun_argv``.
        env: extra environment variables for the workers (merged over os.environ).
        runner: injectable for tests; called as ``runner(argv, env=full_env)`` and returns the exit code.
        errors_file: on failure, write every rank's recorded error and traceback there (``errors_report``).

    Raises:
        KeyboardInterrupt: Ctrl-C, after the agent has stopped the workers.
    """
    if errors_file is not None:
        errors_file.unlink(missing_ok=True)  # what it says is always about the last run
    remove_stale_temp_folders()
    with tempfile.TemporaryDirectory(prefix=f"{ERRORS_TEMP_PREFIX}{os.getpid()}-") as error_dir:
        full_env = {**os.environ, **(env or {}), ERROR_DIR_ENV: error_dir, PARENT_PID_ENV: str(os.getpid())}
        code = (runner or _run_agent)(argv, env=full_env)
        if code != 0:
            if errors_file is not None:
                with contextlib.suppress(OSError):  # the one-line message below matters more than the file
                    errors_file.parent.mkdir(parents=True, exist_ok=True)
                    write_atomic(errors_file, errors_report(Path(error_dir), code))
            raise FluxgrpoError(failure_message(Path(error_dir), code))


def _run_agent(argv: Sequence[str], env: Mapping[str, str]) -> int:
    """Run the agent in its own session (a terminal's Ctrl-C reaches only us), and never leave it behind."""
    agent = subprocess.Popen(list(argv), env=dict(env), start_new_session=True)
    try:
        return agent.wait()
    except BaseException:  # Ctrl-C, or this process is being stopped: the agent stops its workers first
        _stop_session(agent)
        try:
            agent.wait(timeout=AGENT_STOP_SECONDS)
        except subprocess.TimeoutExpired:
            pass  # killed below; its workers die with it
        finally:  # also after a second Ctrl-C
            if agent.poll() is None:
                agent.kill()
                agent.wait()
        raise


def _stop_session(agent: subprocess.Popen) -> None:
    """SIGTERM to the agent and its workers at once (its session's process group): each worker stops now, in
    parallel, instead of after the agent has noticed the signal and forwarded it one worker at a time (seconds on
    a loaded host)."""
    try:
        os.killpg(agent.pid, signal.SIGTERM)  # start_new_session: the group is the agent's own pid
    except OSError:
        agent.terminate()


def _agent_failures(error_dir: Path) -> list[dict[str, Any]]:
    with contextlib.suppress(OSError, ValueError, KeyError):
        return json.loads((error_dir / AGENT_RECORD).read_text())["failures"]
    return []


def _lost_rendezvous(error_dir: Path) -> str | None:
    """The agent's own failure to reach the rendezvous, as one line (None when it did not fail so)."""
    with contextlib.suppress(OSError, ValueError):
        record = json.loads((error_dir / AGENT_RECORD).read_text())
        if record.get("rendezvous"):
            return (
                f"lost node 0's rendezvous at {record.get('endpoint') or '?'}: node 0's run stopped or its host was "
                f"lost (its own output says why), or the nodes never met ({record['rendezvous'].splitlines()[0]})"
            )
    return None


def _killed_from_outside(agent_failures: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first rank killed by a signal other than SIGTERM (the one torchrun stops the other workers with)."""
    killed = [f for f in agent_failures if f["exitcode"] < 0 and -f["exitcode"] != signal.SIGTERM]
    return min(killed, key=lambda f: f["time"]) if killed else None


def _where(agent_failure: dict[str, Any]) -> str:
    """``node 1 (host h) rank 5`` for a failure the agent saw on a node of a multi-node run, else ``rank 5``."""
    if agent_failure.get("node") is None:
        return f"rank {agent_failure['rank']}"
    return f"node {agent_failure['node']} (host {agent_failure['host']}) rank {agent_failure['rank']}"


def failure_message(error_dir: Path, code: int) -> str:
    """One line for a failed run, from what the workers and the agent recorded in ``error_dir``.

    A rank killed by a signal other than SIGTERM (the one torchrun stops the other workers with) was killed from
    outside, by the kernel's OOM killer or a user: that is the cause, and its peers' errors are only the
    connection they lost. Otherwise the error recorded first is the cause.
    """
    agent_failures = _agent_failures(error_dir)
    killed = _killed_from_outside(agent_failures)
    lost = _lost_rendezvous(error_dir)
    if killed is None and lost is not None and first_worker_error(error_dir) is None:
        return lost
    if killed is not None:
        return (
            f"{_where(killed)} {describe_exit(killed['exitcode'])}: it was killed from outside (out of host "
            "memory? the kernel's OOM killer sends SIGKILL; see `dmesg`), and the other workers were stopped"
        )
    recorded = first_worker_error(error_dir)
    if recorded is not None:
        if recorded.get("peer"):  # another rank (often on another node) is the cause; the line names it
            return str(recorded["error"])
        # A FluxgrpoError says what to do; anything else is a bug or a library failure, and its traceback helps.
        hint = " (FLUXGRPO_DEBUG=1 shows the traceback)" if recorded.get("expected") is False else ""
        where = recorded.get("where") or f"rank {recorded['rank']}"
        return f"{where} failed: {recorded['error']}{hint}"
    if agent_failures:
        first = min(agent_failures, key=lambda f: f["time"])
        return f"{_where(first)} {describe_exit(first['exitcode'])} without recording an error: see its output"
    if code < 0 or code > 128:
        sig = -code if code < 0 else code - 128
        return f"the torchrun agent {describe_exit(-sig)}; it stops its workers (no checkpoint is written)"
    return f"the workers exited with code {code} and recorded no error: see their output above"


def errors_report(error_dir: Path, code: int) -> str:
    """Every error the ranks recorded, with its traceback: the cause (``failure_message``) first, then, in the
    order they happened, the errors that followed from it (a peer's lost connection, torchrun's SIGTERM)."""
    lines = [f"cause: {failure_message(error_dir, code)}"]
    records = worker_records(error_dir)
    cause_recorded = _killed_from_outside(_agent_failures(error_dir)) is None
    for index, record in enumerate(records):
        where = record.get("where") or f"rank {record['rank']}"
        if record.get("peer"):
            heading = f"{where} stopped because another rank failed: {record['error']}"
        elif index == 0 and cause_recorded:
            heading = f"{where} failed (the cause): {record['error']}"
        else:
            heading = f"{where} failed after the cause, as a consequence: {record['error']}"
        lines += ["", heading, record.get("traceback", "").rstrip()]
    return "\n".join(lines).rstrip() + "\n"


def run_workers(
    module: str,
    payload: dict[str, Any],
    spec: LaunchSpec,
    device: str | None,
    *,
    log_dir: str | Path | None = None,
    log: Callable[[str], None] | None = None,
) -> Any:
    """Run ``module.worker_entry(payload)`` on ``spec``'s workers; returns rank 0's result in its JSON form.

    One worker on one node runs in this process (no torchrun, no rendezvous); otherwise torchrun starts
    ``python -m fluxgrpo.runtime.worker module`` on every worker with the payload as a JSON file. Either way the
    entry runs inside ``worker.worker_session`` (it opens the session itself) and the result comes back the same:
    ``to_dict()`` of what it returns, through JSON. On a node without rank 0 (``node_rank > 0``) it is None.

    Args:
        module: a module with ``worker_entry(payload: dict) -> result`` (a JSON-able value, an object with
            ``to_dict()``, or None).
        payload: JSON-able; everything the workers need (never live objects: they run in other processes).
        device: the requested device (``--device``; None or "auto" for the best found); checked against
            ``spec.nproc_per_node``, and the NPU recipe's environment variables go to the workers.
        log_dir: keep every worker's output in files there; only local rank 0 reaches the console.
        log: gets the torchrun command line.
    """
    from fluxgrpo.runtime import device as rt_device
    from fluxgrpo.runtime import worker
    from fluxgrpo.runtime.cpu_threads import THREADS_ENV, plan_cpu_threads

    spec.validate()
    device_type = rt_device.resolve_device_type(device)
    check_dies_fit(device_type, spec.nproc_per_node)
    worker_env = worker_env_defaults(device_type)
    if device_type == "cpu":  # the intra-op threads each worker runs (runtime/cpu_threads.py), said at start-up
        worker_env[THREADS_ENV] = str(plan_cpu_threads(spec.nproc_per_node).threads)
    if spec.world_size == 1 and not spec.max_restarts:  # restarts are torchrun's agent's: it must run
        os.environ.update({k: v for k, v in worker_env.items() if k not in os.environ})
        return worker.as_summary(worker.entry_point(module)(payload))
    worker_env.update(collective_env(device_type, spec.collective_timeout, log_dir))
    if spec.elastic:
        # torch shares the rendezvous TCPStore with the workers and caches who hosts it from the first round: a
        # node started again (fresh agent) then waits forever in the next round for an address that the others
        # never publish again. Without the sharing every round publishes it (torch's own opt-out).
        worker_env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    address = spec.rendezvous_address()
    if address is not None and spec.node_rank > 0:  # node 0 hosts the rendezvous: the others must reach it
        timeouts = spec.collective_timeout or CollectiveTimeout()
        wait_for_endpoint(
            *address, timeout_s=timeouts.startup, flag="--rdzv-endpoint" if spec.elastic else "--master-addr"
        )
    remove_stale_temp_folders()
    with tempfile.TemporaryDirectory(prefix=f"{WORKERS_TEMP_PREFIX}{os.getpid()}-") as tmp:
        payload_path, summary_path = Path(tmp) / "payload.json", Path(tmp) / "summary.json"
        payload_path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
        args = [module, "--payload", str(payload_path), "--summary", str(summary_path)]
        argv = build_torchrun_argv(WORKER_MODULE, args, spec, log_dir=log_dir)
        if log is not None and os.environ.get("FLUXGRPO_DEBUG"):  # the internal command line, for debugging only
            log("launching: " + " ".join(argv))
        # Every node keeps its own errors file in the shared log folder: node 0 errors.txt, node k errors-node<k>.txt
        errors_name = ERRORS_FILE if spec.node_rank == 0 else f"errors-node{spec.node_rank}.txt"
        run_torchrun(argv, env=worker_env, errors_file=None if log_dir is None else Path(log_dir, errors_name))
        return json.loads(summary_path.read_text()) if summary_path.is_file() else None


# Temporary folders of a launch, named with the launching process's id: one whose process is gone was left by a
# kill -9 or SIGTERM (no cleanup ran), and the next launch removes it.
WORKERS_TEMP_PREFIX = "fluxgrpo-workers-"
ERRORS_TEMP_PREFIX = "fluxgrpo-errors-"
_TEMP_NAME = re.compile(rf"^({re.escape(WORKERS_TEMP_PREFIX)}|{re.escape(ERRORS_TEMP_PREFIX)})(\d+)-")


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_temp_folders(root: str | Path | None = None) -> list[Path]:
    """Remove this user's launch folders in ``root`` (default: the temporary folder) whose process has exited;
    returns what was removed. Never follows a link, never touches another user's folder."""
    import shutil

    removed = []
    folder = Path(root or tempfile.gettempdir())
    with contextlib.suppress(OSError):
        for entry in folder.iterdir():
            found = _TEMP_NAME.match(entry.name)
            if found is None or entry.is_symlink() or not entry.is_dir():
                continue
            with contextlib.suppress(OSError):
                if entry.stat().st_uid != os.getuid() or _process_alive(int(found.group(2))):
                    continue
                shutil.rmtree(entry)
                removed.append(entry)
    return removed


def endpoint_reachable(host: str, port: int, timeout_s: float = 2.0) -> str | None:
    """None when a TCP connection to ``host:port`` opens, else why not (one attempt)."""
    import socket

    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__


def wait_for_endpoint(host: str, port: int, *, timeout_s: float, flag: str, retry_s: float = 1.0) -> None:
    """Wait until node 0's rendezvous port accepts connections (node 0 may start a little later), at most
    ``timeout_s``; then raise one line saying what to check."""
    deadline = time.monotonic() + timeout_s
    while True:
        why = endpoint_reachable(host, port, timeout_s=min(2.0, timeout_s))
        if why is None:
            return
        if time.monotonic() >= deadline:
            raise FluxgrpoError(
                f"cannot reach node 0's rendezvous at {host}:{port} ({flag}) within {timeout_s:g} s: {why}. "
                "Is `fluxgrpo train` running on node 0 with the same flags, and is the port open between the "
                f"nodes? `fluxgrpo env-check --rdzv-endpoint {host}:{port}` checks it from here"
            )
        time.sleep(min(retry_s, max(0.0, deadline - time.monotonic())))


def check_dies_fit(device_type: str, nproc: int) -> None:
    """``--dies`` must not exceed the visible accelerators, or on the CPU the cores this process may use."""
    if device_type == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        if nproc > cores:
            raise UsageError(
                f"--dies {nproc} but only {cores} CPU core(s) are available: CPU workers need a core each, "
                f"use --dies {cores} or fewer"
            )
        return
    from fluxgrpo.runtime import device as rt_device

    available = rt_device.device_count(device_type)
    if nproc > available:
        raise UsageError(
            f"--dies {nproc} but only {available} {device_type} device(s) are visible (check the visible-device mask)"
        )
