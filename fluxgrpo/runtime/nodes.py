"""What a run on several nodes needs to know about them: Slurm's description of the job, whether the output
folder is shared, whether this start of the workers is an elastic restart, and the network interface variables.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.runtime import dist as rt_dist
from fluxgrpo.runtime.launch import endpoint_reachable, parse_endpoint

if TYPE_CHECKING:
    from fluxgrpo.runtime.dist import DistContext

SHARED_CHECK_FILE = ".fluxgrpo-shared-check"  # in the output folder: written by rank 0, read on every node
SHARED_CHECK_SECONDS = 30.0  # how long a node waits to see it (an NFS client may cache "no such file" a while)
INTERFACE_VARIABLES = ("HCCL_IF_IP", "HCCL_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


# --------------------------------------------------------------------------------------------- Slurm


@dataclass(frozen=True)
class SlurmJob:
    nnodes: int
    node_rank: int
    first_host: str


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list (``a[01-03,07],b`` → ``a01 a02 a03 a07 b``), as ``scontrol show hostnames``."""
    hosts: list[str] = []
    for match in re.finditer(r"([^,\[]+)(?:\[([^\]]*)\])?(?:,|$)", nodelist.strip()):
        prefix, ranges = match.group(1), match.group(2)
        if not prefix and not ranges:
            continue
        if ranges is None:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            if not high:
                hosts.append(prefix + low)
                continue
            width = len(low)
            hosts += [prefix + str(n).zfill(width) for n in range(int(low), int(high) + 1)]
    return hosts


def slurm_job(environ: Mapping[str, str] | None = None) -> SlurmJob | None:
    """This node's place in a multi-node Slurm job step (``srun``, one task per node), or None outside one."""
    environ = os.environ if environ is None else environ
    nnodes, node_id = environ.get("SLURM_NNODES") or environ.get("SLURM_JOB_NUM_NODES"), environ.get("SLURM_NODEID")
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not (nnodes and node_id and nodelist) or not nnodes.isdigit() or not node_id.isdigit() or int(nnodes) < 2:
        return None
    hosts = expand_nodelist(nodelist)
    if not hosts:
        return None
    return SlurmJob(int(nnodes), int(node_id), hosts[0])


# --------------------------------------------------------------------------------------------- in the workers


def multi_node() -> bool:
    """Whether this worker's job spans several nodes (torchrun's ``GROUP_WORLD_SIZE``)."""
    return int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1


def restarted(ctx: DistContext, marker: Path | None) -> bool:
    """Whether this start of the workers follows an earlier one of the same run (torchrun's agent restarted them
    after a failure, or a node was started again to rejoin).

    ``marker``: a file named after this node's ``fluxgrpo train`` process (``launch_token``); its first start of
    the workers writes it, so a later start finds it. A node started again brings a new launcher and finds none,
    but the nodes that stayed do, so the ranks agree on any. torchrun's restart count alone cannot tell: a
    restart caused by a node rejoining is not counted.
    """

    again = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if marker is not None:
        again = again or marker.is_file()
        if ctx.local_rank == 0:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
    return any(rt_dist.all_gather_object(ctx, again)) if ctx.distributed else again


def check_shared_folder(ctx: DistContext, folder: Path, wait_s: float = SHARED_CHECK_SECONDS) -> None:
    """Refuse an output folder that the nodes do not share: rank 0 writes a fresh token there and the first
    rank of every node must read it back (a resume needs every rank's checkpoint files in one folder).

    A no-op on one node. Raises FluxgrpoError on every rank, naming the nodes that do not see the file.
    """

    if not (ctx.distributed and multi_node()):
        return
    path = folder / SHARED_CHECK_FILE
    token = uuid.uuid4().hex if ctx.is_main else None
    if ctx.is_main:
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(token or "")
    token = rt_dist.broadcast_object(ctx, token)
    seen = True
    if ctx.local_rank == 0:
        deadline = time.monotonic() + wait_s
        while not _holds(path, token) and time.monotonic() < deadline:
            time.sleep(0.5)
        seen = _holds(path, token)
    views: list[dict[str, Any]] = rt_dist.all_gather_object(
        ctx, {"seen": seen, "node": os.environ.get("GROUP_RANK", "?"), "host": socket.gethostname()}
    )
    blind = [v for v in views if not v["seen"]]
    if blind:
        nodes = ", ".join(f"node {v['node']} (host {v['host']})" for v in blind)
        raise FluxgrpoError(
            f"--output-dir {folder} is not shared between the nodes: {nodes} cannot see the file node 0 wrote "
            f"there within {wait_s:g} s. Checkpoints and resume need one folder that every node sees at the same "
            "path: put --output-dir on the shared filesystem (NFS, Lustre, GPFS...)"
        )


def _holds(path: Path, token: str) -> bool:
    try:
        return path.read_text() == token
    except OSError:
        return False


# --------------------------------------------------------------------------------------------- interfaces


def interface_status(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """The interface variables the backends read (None where unset: the backend picks an interface itself)."""
    environ = os.environ if environ is None else environ
    return {name: environ.get(name) for name in INTERFACE_VARIABLES}


def route_interface(host: str, port: int) -> tuple[str, str | None] | None:
    """(local address, interface name) this machine uses to reach ``host:port``, or None when there is no route.

    A UDP socket connected to the address picks the route without sending anything.
    """
    try:
        family = socket.getaddrinfo(host, port, proto=socket.IPPROTO_UDP)[0]
        with socket.socket(family[0], socket.SOCK_DGRAM) as probe:
            probe.connect(family[4])
            local = probe.getsockname()[0]
    except OSError:
        return None
    return local, _interface_of(local)


def _interface_of(address: str) -> str | None:
    """The interface holding ``address`` (Linux: from ``ip -o addr``; None when it cannot tell)."""

    if shutil.which("ip") is None:
        return None
    try:
        out = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, timeout=5, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[3].split("/")[0] == address:
            return fields[1]
    return None


# --------------------------------------------------------------------------------------------- env-check

INTERFACE_VARIABLES_BY_DEVICE = {
    "npu": ("HCCL_IF_IP", "HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"),
    "cuda": ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"),
    "cpu": ("GLOO_SOCKET_IFNAME",),
}


def rendezvous_checks(
    device_type: str | None, nnodes: int, endpoint: str | None, environ: Mapping[str, str] | None = None
) -> list[tuple[str, str, str, str | None]]:
    """env-check's multi-node checks as (name, ok|warn|fail, detail, what to do).

    - the endpoint: on node 0 (an address of this machine) its port must be free to listen on; elsewhere it must
      accept a connection (node 0's run started first);
    - the interface variables of this device's backends: set, or inferable from the route to node 0.
    """

    environ = os.environ if environ is None else environ
    checks: list[tuple[str, str, str, str | None]] = []
    if endpoint is None:
        if nnodes > 1:
            checks.append(
                (
                    "rendezvous",
                    "fail",
                    f"--nnodes {nnodes} without --rdzv-endpoint",
                    "pass --rdzv-endpoint HOST:PORT (node 0's address and a port open between the nodes)",
                )
            )
        return checks
    host, port = parse_endpoint(endpoint)
    if _is_local(host):
        why = _port_free(port)
        checks.append(
            (
                "rendezvous",
                "ok" if why is None else "fail",
                f"{host}:{port} is this machine (node 0 hosts the rendezvous); port {port} "
                + ("is free" if why is None else f"cannot be listened on: {why}"),
                None if why is None else f"choose another port in --rdzv-endpoint, or stop what holds {port}",
            )
        )
    else:
        why = endpoint_reachable(host, port)
        checks.append(
            (
                "rendezvous",
                "ok" if why is None else "fail",
                f"{host}:{port} " + ("accepts connections" if why is None else f"is not reachable: {why}"),
                None
                if why is None
                else "start `fluxgrpo train` on node 0 first (it listens there), and open the port between the nodes",
            )
        )
    route = route_interface(host, port)
    names = INTERFACE_VARIABLES_BY_DEVICE.get(device_type or "cpu", ("GLOO_SOCKET_IFNAME",))
    set_vars = {name: environ[name] for name in names if environ.get(name)}
    if set_vars:
        detail = ", ".join(f"{k}={v}" for k, v in set_vars.items())
        if route is not None:
            detail += f"; the route to {host} leaves through {route[1] or '?'} ({route[0]})"
        checks.append(("network interface", "ok", detail, None))
    elif route is not None and route[1] not in (None, "lo"):
        checks.append(
            (
                "network interface",
                "ok",
                f"{', '.join(names)} unset: inferable, the route to {host} leaves through {route[1]} ({route[0]})",
                None,
            )
        )
    else:
        where = "" if route is None else f" (the route to {host} leaves through {route[1] or '?'}, {route[0]})"
        checks.append(
            (
                "network interface",
                "warn",
                f"{', '.join(names)} unset and the interface between the nodes cannot be inferred{where}",
                f"set {names[0]} (e.g. {names[0]}=eth0) to the interface that reaches the other nodes, on every node",
            )
        )
    return checks


def _is_local(host: str) -> bool:
    """Whether ``host`` names this machine (a loopback address, its hostname, or one of its addresses)."""
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return False
    if address.startswith("127.") or host in (socket.gethostname(), socket.getfqdn()):
        return True
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.bind((address, 0))
        return True
    except OSError:
        return False


def _port_free(port: int) -> str | None:
    try:
        with socket.socket() as probe:
            probe.bind(("", port))
        return None
    except OSError as exc:
        return exc.strerror or str(exc)
