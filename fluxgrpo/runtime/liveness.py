"""Every rank's whereabouts and heartbeat in the job's store, so that a failure names the node, host and rank at
fault on every node, and a rank that works alone (rank 0 writing a checkpoint) is waited for only while it lives.

torchrun's store (the c10d TCPStore every worker already reaches, hosted on node 0) holds, under a prefix that is
new for every start of the workers:

- ``where/<rank>``: ``{"rank", "node", "host", "pid"}``, written once at start;
- ``beat/<rank>``: ``"<counter> <position>"``, rewritten every ``HEARTBEAT_SECONDS`` by a thread with its own
  connection; the position is what the loop last said it was doing (``mark``: "iteration 42: rollout");
- ``failed/<rank>``: a rank's own error, published before it leaves the process group, so that its peers, who
  see only a closed connection, can say what happened;
- ``rank0/<n>``: rank 0 reached the n-th point where the others wait for its lone work (``wait_for_rank0``).

A heartbeat counts, not a clock: observers compare counters over their own monotonic time, so the nodes' clocks
never need to agree. A rank stopped with SIGSTOP, killed, or on a lost host stops beating; a rank stuck in a
device kernel still beats but its position stays behind, and both are said.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fluxgrpo.errors import FluxgrpoError

if TYPE_CHECKING:
    from torch.distributed import Store

HEARTBEAT_SECONDS = 1.0
SILENT_BEATS = 3  # a rank whose counter did not move for this many intervals has stopped
FAILURE_LINGER_SECONDS = 1.0  # a failing rank's wait before it leaves, so that its peers read why (5 polls)
STORE_OP_SECONDS = 5.0  # a store operation while diagnosing a failure: the store's host may be gone with it


@dataclass(frozen=True)
class Whereabouts:
    rank: int
    node: int
    host: str
    pid: int

    def describe(self) -> str:
        return f"node {self.node} (host {self.host}) rank {self.rank}"


class Liveness:
    """One rank's registration, heartbeat thread and view of its peers (see the module docstring)."""

    def __init__(self, store: Store, rank: int, world_size: int, node: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.me = Whereabouts(rank, node, socket.gethostname(), os.getpid())
        self.position = self._base = "starting"
        self._rank0_points = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------------------------------- this rank

    def start(self) -> None:
        self.store.set(f"where/{self.rank}", json.dumps(self.me.__dict__))
        self._beat(self.store, 0)
        beat_store = self.store.clone()  # its own connection: never waits behind the main thread's store calls
        self._thread = threading.Thread(target=self._beat_forever, args=(beat_store,), daemon=True, name="heartbeat")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def mark(self, position: str, phase_done: str | None = None) -> None:
        self._base = position if phase_done is None else self._base
        self.position = self._base if phase_done is None else f"{self._base}, {phase_done} done"
        with contextlib.suppress(Exception):  # at once, not at the next beat: iterations can be shorter than it
            self.store.set(f"at/{self.rank}", self.position)

    def _beat(self, store: Store, counter: int) -> None:
        store.set(f"beat/{self.rank}", f"{counter} {self.position}")

    def _beat_forever(self, store: Store) -> None:
        counter = 1
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                self._beat(store, counter)
            except Exception:  # the store's host is gone: the main thread finds out in its next collective
                return
            counter += 1

    def publish_failure(self, message: str) -> None:
        """Tell the peers why this rank is leaving (best effort: the store may be gone too), and give those polling
        for it (``wait_for_rank0``) time to read it: on node 0 the store leaves with this node's agent."""
        with contextlib.suppress(Exception):
            self._short_timeouts()
            self.store.set(f"failed/{self.rank}", message)
            time.sleep(FAILURE_LINGER_SECONDS)

    # ---------------------------------------------------------------------------------------- the peers

    def _short_timeouts(self) -> None:
        self.store.set_timeout(datetime.timedelta(seconds=STORE_OP_SECONDS))

    def _get(self, key: str) -> str | None:
        if not self.store.check([key]):
            return None
        return self.store.get(key).decode()

    def whereabouts(self, rank: int) -> Whereabouts | None:
        text = self._get(f"where/{rank}")
        return None if text is None else Whereabouts(**json.loads(text))

    def describe(self, rank: int) -> str:
        where = self.whereabouts(rank)
        return where.describe() if where is not None else f"rank {rank}"

    def failures(self) -> dict[int, str]:
        """The errors other ranks published, by rank."""
        found = {}
        for rank in range(self.world_size):
            if rank != self.rank:
                message = self._get(f"failed/{rank}")
                if message is not None:
                    found[rank] = message
        return found

    def beats(self) -> dict[int, tuple[int, str]]:
        """rank → (counter, position) of every other rank that has beaten at least once."""
        found = {}
        for rank in range(self.world_size):
            if rank != self.rank:
                text = self._get(f"beat/{rank}")
                if text is not None:
                    counter, _, position = text.partition(" ")
                    found[rank] = (int(counter), self._get(f"at/{rank}") or position)
        return found

    def silent_ranks(self, observe_seconds: float | None = None) -> dict[int, str]:
        """The other ranks whose heartbeat did not move while we watched (``SILENT_BEATS`` beats by default),
        with their last position."""
        first = self.beats()
        time.sleep(SILENT_BEATS * HEARTBEAT_SECONDS if observe_seconds is None else observe_seconds)
        last = self.beats()
        return {
            rank: position for rank, (counter, position) in first.items() if last.get(rank, (counter,))[0] == counter
        }

    def explain_failure(self, error: str, timeout_s: float | None) -> str | None:
        """Why this rank's collective failed (``error``: what the backend said), when the cause is another rank:
        a published error, or the ranks that stopped beating (killed, stopped, or their host lost). None when no
        peer is at fault (this rank's own error is the cause) or the store cannot tell."""
        try:
            self._short_timeouts()
            failed = self.failures()
            if not failed:
                silent = self.silent_ranks()
                failed = self.failures()  # it may have published its error while we watched
        except Exception:  # the store lives on node 0: if it is unreachable, node 0 is what was lost
            return None if self.me.node == 0 else self._store_lost()
        if failed:
            rank = min(failed)
            return f"{self.describe(rank)} failed: {failed[rank]}"
        if not silent:
            return None
        rank = min(silent)
        more = sorted(silent)[1:]
        others = f" (so did rank(s) {', '.join(map(str, more))})" if more else ""
        silence = f"no heartbeat for {SILENT_BEATS * HEARTBEAT_SECONDS:g} s, last seen at {silent[rank]!r}"
        here = self._base
        if "timed out" in error.lower() or "timeout" in error.lower():
            waited = f" within {timeout_s:g} s" if timeout_s else ""
            return (
                f"{self.describe(rank)} did not reach the collective of {here}{waited}: it stopped responding"
                f"{others} ({silence}; stopped, hung, or its host lost?)"
            )
        return (
            f"{self.describe(rank)} was lost at {here}: its connection closed and it stopped responding{others} "
            f"({silence}; killed, or its host went down?)"
        )

    def _store_lost(self) -> str:
        return (
            "lost the connection to node 0 (the host of the rendezvous store): node 0's run stopped or its host "
            "was lost; its own output says why"
        )

    # ---------------------------------------------------------------------------------------- rank 0 alone

    def wait_for_rank0(self, what: str, timeout_s: float) -> None:
        """On rank 0: say it has finished ``what``. Elsewhere: wait for that while rank 0 beats, and raise
        ``PeerFailed`` as soon as rank 0 publishes an error or stays silent for ``timeout_s``."""
        self._rank0_points += 1
        key = f"rank0/{self._rank0_points}"
        if self.rank == 0:
            self.store.set(key, "done")
            return
        last_counter, last_change = -1, time.monotonic()
        while not self.store.check([key]):
            failed = self._get("failed/0")
            if failed is not None:
                raise PeerFailed(f"{self.describe(0)} failed while {what}: {failed}")
            beat = self._get("beat/0")
            counter = int(beat.partition(" ")[0]) if beat else -1
            now = time.monotonic()
            if counter != last_counter:
                last_counter, last_change = counter, now
            elif now - last_change > timeout_s:
                raise PeerFailed(
                    f"{self.describe(0)} stopped responding while {what}: no heartbeat for {timeout_s:g} s"
                )
            time.sleep(min(0.2, HEARTBEAT_SECONDS / 2))


class PeerFailed(FluxgrpoError):
    """Another rank failed or stopped; the message names it (this rank only follows)."""


_current: Liveness | None = None


def current() -> Liveness | None:
    return _current


def install(liveness: Liveness | None) -> None:
    global _current
    if _current is not None:
        _current.stop()
    _current = liveness
    if liveness is not None:
        liveness.start()


def mark(position: str) -> None:
    """Say what this rank is doing (shown when it stops or falls behind); a no-op outside a distributed run."""
    if _current is not None:
        _current.mark(position)


def mark_phase_done(phase: str) -> None:
    """A phase of the position last marked is done ("iteration 42, rollout done")."""
    if _current is not None:
        _current.mark(_current._base, phase_done=phase)
