"""The agent's table of connections (``Connections``, held as ``agent.connections``).

Theory of operation. Connections to a peer open lazily, on the first frame for it, and
carry both directions. ``shared`` maps a rank to the connection new requests to it go out
on; ``all`` keeps every open shared connection by rank (two workers that connect to each
other at once end up with two, and either may carry replies). Private connections (see
lanes.py) are registered in ``private`` both ways, only so that liveness watches them
and a lost peer's are closed: nothing else is ever sent on them. A shared connection
that breaks with others to the same peer still open fails only the requests on it; the
last one to break makes the peer *suspect* (``lost``, with why) and fails every request
pending on it, and liveness decides whether it is gone by connecting again.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Dict, List, Optional

from .._transport import Connection
from ..errors import ConnectionLostError, NotInitializedError, RpcError
from .lifecycle import RUNNING, STOPPED, STOPPING
from .worker import WorkerInfo

if TYPE_CHECKING:
    from .agent import Agent

log = logging.getLogger(__name__)


class Connections:
    """The connections of one agent, by peer rank, and the peers whose connections broke."""

    def __init__(self, agent: "Agent") -> None:
        self._agent = agent
        self._lock = agent._lock  # the agent's: debug_info and liveness read under it
        self.shared: Dict[int, Connection] = {}  # rank -> where requests to it go out
        self.all: Dict[int, List[Connection]] = {}  # rank -> its open shared connections
        self.private: Dict[int, List[Connection]] = {}  # rank -> its private ones, both ways
        self.lost: Dict[int, str] = {}  # rank -> why it seems lost (connections broke, silent)
        self._connect_locks: Dict[int, threading.Lock] = {}

    def to(self, dst: WorkerInfo, patient: bool = False,
           limit: Optional[float] = None) -> Connection:
        """The shared connection to ``dst``, opened if there is none; ``patient``: wait
        for a suspect peer as long as for any other; ``limit``: seconds the caller has
        left, which bound the wait to connect."""
        agent = self._agent
        conn = self.shared.get(dst.id)
        if conn is not None and not conn.closed:
            if dst.id in agent.registry.left:  # it said GOODBYE: nothing sent now is answered
                raise agent.left_error(dst)
            return conn
        with self._lock:
            lock = self._connect_locks.setdefault(dst.id, threading.Lock())
        with lock:
            conn = self.shared.get(dst.id)
            if conn is not None and not conn.closed:
                return conn
            if dst.id in agent.registry.left:
                raise agent.left_error(dst)
            state = agent.lifecycle.state
            if state is not RUNNING and state is not STOPPING:
                raise NotInitializedError(f"RPC agent of {agent.name!r} is {state.value}")
            host, port = agent.registry.addresses[dst.id]
            lost = self.lost.get(dst.id)
            timeout = agent.default_timeout or 30.0
            hb_timeout = agent.liveness.timeout
            if lost is not None and hb_timeout > 0 and not patient:
                timeout = min(timeout, max(hb_timeout, 1.0))  # don't wait long on the dead
            if limit is not None:
                timeout = min(timeout, limit)
            try:
                conn = self._open(dst, host, port, timeout)
            except RpcError as exc:
                raise ConnectionLostError(
                    f"cannot reach worker {dst.name} (rank {dst.id}) at {host}:{port}: {exc}"
                    + (f" (its connection was lost before: {lost})" if lost else ""),
                    worker=dst.name) from exc
            return self.shared.get(dst.id) or conn

    def _open(self, dst: WorkerInfo, host: str, port: int, timeout: float) -> Connection:
        """Connect to ``dst`` within ``timeout``. A peer on this host that runs but did not
        finish the handshake in time (or reset it) is busy, not gone: with dozens of
        workers connecting to each other at once on a few cores, a handshake can take
        longer than the transport waits for one. It is tried again until ``timeout``."""
        agent = self._agent
        deadline = time.monotonic() + timeout
        delay = 0.05
        while True:
            try:
                return agent._transport.connect(dst.id, host, port,
                                                max(deadline - time.monotonic(), 0.5),
                                                local=agent.registry.same_host(dst.id),
                                                incarnation=agent.registry.incarnations.get(
                                                    dst.id, 0))
            except RpcError as exc:
                busy = isinstance(exc.__cause__, (TimeoutError, ConnectionResetError,
                                                  BrokenPipeError)) \
                    and agent.liveness.runs_here(dst.id)
                if not busy or time.monotonic() + delay >= deadline:
                    raise
                log.info("%s: worker %s is busy (%s); connecting again in %.2g s",
                         agent.name, dst.name, exc, delay)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def on_connect(self, conn: Connection) -> None:
        """The transport opened ``conn`` (either way): enter it in the tables."""
        agent = self._agent
        if conn.private:
            # Used by one call at a time; registered for liveness (see liveness.py).
            conn.poll = agent.lanes.poll
            with self._lock:
                self.private.setdefault(conn.peer_rank, []).append(conn)
            return
        with self._lock:
            self.all.setdefault(conn.peer_rank, []).append(conn)
            current = self.shared.get(conn.peer_rank)
            if current is None or current.closed:
                self.shared[conn.peer_rank] = conn
            self.lost.pop(conn.peer_rank, None)
            agent.liveness.reconnected(conn.peer_rank)
        if agent.lifecycle.state is STOPPING or agent.lifecycle.state is STOPPED:
            # Perhaps too late for the GOODBYEs of Shutdown.stop: without its own, a caller
            # on this connection would wait for a reply until its timeout. (Not while
            # starting: a peer that finished rendezvous first may connect before this agent
            # runs.)
            agent.shutdown_protocol.goodbye(conn)

    def on_close(self, conn: Connection, reason: Optional[BaseException]) -> None:
        """``conn`` closed (``reason``: why, None when this worker closed it): drop it from
        the tables, and fail what can no longer be answered."""
        agent = self._agent
        if conn.private:
            # Its caller learns it from read_frame; the shared connection watches the peer.
            with self._lock:
                try:
                    self.private.get(conn.peer_rank, []).remove(conn)
                except ValueError:
                    pass  # never there
            agent.lanes.private.forget(conn)
            return
        rank = conn.peer_rank
        with self._lock:
            conns = self.all.get(rank, [])
            if conn in conns:
                conns.remove(conn)
            open_conns = [c for c in conns if not c.closed]
            if self.shared.get(rank) is conn:
                if open_conns:
                    self.shared[rank] = open_conns[0]
                else:
                    del self.shared[rank]
        if agent.lifecycle.state is not RUNNING:
            return
        w = agent.registry.workers.get(rank)
        name = w.name if w else f"rank{rank}"
        if rank in agent.registry.left:
            # A request sent while the GOODBYE was on its way was on this connection.
            if w is not None:
                agent.requests.fail_peer(rank, agent.left_error(w))
            return
        if reason is None or open_conns:
            # Closed here (the frames still in its outbox are gone), or broken while the peer
            # is still reachable: what went out on this connection may be lost.
            how = ("was closed by this worker with this request on it" if reason is None
                   else f"broke with this request on it: {reason}")
            agent.requests.fail_matching(lambda p: p.conn is conn, ConnectionLostError(
                f"a connection to worker {name} (rank {rank}) {how}", worker=name))
            return
        with self._lock:
            self.lost[rank] = str(reason)
        log.warning("%s lost its connection to worker %s (rank %d): %s", agent.name,
                    name, rank, reason)
        agent.lanes.private.close_idle(rank, reason)
        agent.requests.fail_peer(rank, ConnectionLostError(
            f"connection to worker {name} (rank {rank}) was lost: {reason}. The worker may have "
            f"died.", worker=name))
        agent.liveness.suspect(rank, reason)

    def note_lost(self, rank: int, why: str) -> None:
        """Under the agent's lock: worker ``rank`` seems lost (silent, or gone in the
        store's record of the shutdown), with why."""
        self.lost[rank] = why

    def forget_lost(self, rank: int) -> None:
        """Under the agent's lock: a new worker took ``rank``; it is not lost."""
        self.lost.pop(rank, None)

    def of(self, rank: int) -> List[Connection]:
        """The open connections, shared and private, with worker ``rank``."""
        with self._lock:
            return [c for table in (self.all, self.private)
                    for c in table.get(rank, ()) if not c.closed]

    def every_shared(self) -> List[Connection]:
        """Every shared connection in the table, open or closing."""
        with self._lock:
            return [c for conns in self.all.values() for c in conns]

    def count(self) -> int:
        """How many shared connections are in the table."""
        with self._lock:
            return sum(len(v) for v in self.all.values())
