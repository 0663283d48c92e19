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

The table is guarded by the agent's lock, handed to it, which also guards the tables of
liveness and the registry that are read with it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Protocol

from .. import _wire
from .._transport import Connection, PollPolicy, Transport
from .._wire import Kind
from ..errors import ConnectionLostError, NotInitializedError, RpcError
from .lifecycle import RUNNING, STOPPED, STOPPING, Lifecycle
from .registry import Registry, left_error
from .worker import WorkerInfo

if TYPE_CHECKING:
    from .requests import Requests

log = logging.getLogger(__name__)


def goodbye(conn: Connection) -> None:
    """Say GOODBYE on ``conn``: this worker sends nothing more on it (a peer that reads it
    fails what it has pending here); a connection that cannot take it is closing."""
    try:
        conn.send(Kind.GOODBYE, _wire.FLAG_ONEWAY, 0, _wire.encode(None)[0], [])
    except RpcError:
        pass


class Watch(Protocol):
    """What the table tells liveness (liveness.py), and asks it."""

    timeout: float  # heartbeat_timeout: a suspect peer is not waited for longer to connect

    def runs_here(self, rank: int) -> bool: ...

    def reconnected(self, rank: int) -> None: ...

    def suspect(self, rank: int, reason: BaseException) -> None: ...


class Idle(Protocol):
    """The idle private connections (private.py), which a closed or lost one leaves."""

    def forget(self, conn: Connection) -> None: ...

    def close_idle(self, rank: int, reason: BaseException) -> None: ...


class Connections:
    """The connections of one agent, by peer rank, and the peers whose connections broke.

    Handed the worker's ``name``, the agent's ``lock`` (shared: see the module docs), the
    ``lifecycle``, the ``registry`` (where peers listen, which have left), the
    ``requests`` to fail when a connection breaks, ``timeout()``, the agent's current
    default RPC timeout (it bounds a connect), and ``transport()``, the agent's transport
    once started (what it connects with). :meth:`attach` hands it the parts built after
    it.
    """

    _watch: Watch  # set by attach, as are the two below
    _idle: Idle
    _poll: PollPolicy

    def __init__(self, name: str, lock: "threading.Lock", lifecycle: Lifecycle,
                 registry: Registry, requests: "Requests", timeout: Callable[[], float],
                 transport: Callable[[], Optional[Transport]]) -> None:
        self._name = name
        self._lock = lock  # the agent's: debug_info and liveness read under it
        self._lifecycle = lifecycle
        self._registry = registry
        self._requests = requests
        self._timeout = timeout
        self._transport = transport
        self.shared: Dict[int, Connection] = {}  # rank -> where requests to it go out
        self.all: Dict[int, List[Connection]] = {}  # rank -> its open shared connections
        self.private: Dict[int, List[Connection]] = {}  # rank -> its private ones, both ways
        self.lost: Dict[int, str] = {}  # rank -> why it seems lost (connections broke, silent)
        self._connect_locks: Dict[int, threading.Lock] = {}

    def attach(self, watch: Watch, idle: Idle, poll: PollPolicy) -> None:
        """Hand the table the parts built after it: liveness (``watch``), the idle private
        connections (``idle``), and the ``poll`` policy every private connection gets."""
        self._watch = watch
        self._idle = idle
        self._poll = poll

    def send(self, dst: WorkerInfo, kind: int, flags: int, rid: int, env: bytes, bufs: Any,
             keep: Any, via: Optional[Connection] = None) -> None:
        """Send one frame to ``dst`` (on ``via``, if given); raise :class:`RpcError` when
        it cannot."""
        (via or self.to(dst)).send(kind, flags, rid, env, bufs, keep)

    def to(self, dst: WorkerInfo, patient: bool = False,
           limit: Optional[float] = None) -> Connection:
        """The shared connection to ``dst``, opened if there is none; ``patient``: wait
        for a suspect peer as long as for any other; ``limit``: seconds the caller has
        left, which bound the wait to connect."""
        conn = self.shared.get(dst.id)
        if conn is not None and not conn.closed:
            if dst.id in self._registry.left:  # it said GOODBYE: nothing sent now is answered
                raise left_error(dst)
            return conn
        with self._lock:
            lock = self._connect_locks.setdefault(dst.id, threading.Lock())
        with lock:
            conn = self.shared.get(dst.id)
            if conn is not None and not conn.closed:
                return conn
            if dst.id in self._registry.left:
                raise left_error(dst)
            state = self._lifecycle.state
            if state is not RUNNING and state is not STOPPING:
                raise NotInitializedError(f"RPC agent of {self._name!r} is {state.value}")
            host, port = self._registry.addresses[dst.id]
            lost = self.lost.get(dst.id)
            timeout = self._timeout() or 30.0
            hb_timeout = self._watch.timeout
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
        registry = self._registry
        deadline = time.monotonic() + timeout
        delay = 0.05
        while True:
            try:
                return self._transport().connect(dst.id, host, port,
                                                 max(deadline - time.monotonic(), 0.5),
                                                 local=registry.same_host(dst.id),
                                                 incarnation=registry.incarnations.get(dst.id, 0))
            except RpcError as exc:
                busy = isinstance(exc.__cause__, (TimeoutError, ConnectionResetError,
                                                  BrokenPipeError)) \
                    and self._watch.runs_here(dst.id)
                if not busy or time.monotonic() + delay >= deadline:
                    raise
                log.info("%s: worker %s is busy (%s); connecting again in %.2g s",
                         self._name, dst.name, exc, delay)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def on_connect(self, conn: Connection) -> None:
        """The transport opened ``conn`` (either way): enter it in the tables."""
        if conn.private:
            # Used by one call at a time; registered for liveness (see liveness.py).
            conn.poll = self._poll
            with self._lock:
                self.private.setdefault(conn.peer_rank, []).append(conn)
            return
        with self._lock:
            self.all.setdefault(conn.peer_rank, []).append(conn)
            current = self.shared.get(conn.peer_rank)
            if current is None or current.closed:
                self.shared[conn.peer_rank] = conn
            self.lost.pop(conn.peer_rank, None)
            self._watch.reconnected(conn.peer_rank)
        state = self._lifecycle.state
        if state is STOPPING or state is STOPPED:
            # Perhaps too late for the GOODBYEs of Shutdown.stop: without its own, a caller
            # on this connection would wait for a reply until its timeout. (Not while
            # starting: a peer that finished rendezvous first may connect before this agent
            # runs.)
            goodbye(conn)

    def on_close(self, conn: Connection, reason: Optional[BaseException]) -> None:
        """``conn`` closed (``reason``: why, None when this worker closed it): drop it from
        the tables, and fail what can no longer be answered."""
        registry, requests = self._registry, self._requests
        if conn.private:
            # Its caller learns it from read_frame; the shared connection watches the peer.
            with self._lock:
                try:
                    self.private.get(conn.peer_rank, []).remove(conn)
                except ValueError:
                    pass  # never there
            self._idle.forget(conn)
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
        if self._lifecycle.state is not RUNNING:
            return
        w = registry.workers.get(rank)
        name = w.name if w else f"rank{rank}"
        if rank in registry.left:
            # A request sent while the GOODBYE was on its way was on this connection.
            if w is not None:
                requests.fail_peer(rank, left_error(w))
            return
        if reason is None or open_conns:
            # Closed here (the frames still in its outbox are gone), or broken while the peer
            # is still reachable: what went out on this connection may be lost.
            how = ("was closed by this worker with this request on it" if reason is None
                   else f"broke with this request on it: {reason}")
            requests.fail_matching(lambda p: p.conn is conn, ConnectionLostError(
                f"a connection to worker {name} (rank {rank}) {how}", worker=name))
            return
        with self._lock:
            self.lost[rank] = str(reason)
        log.warning("%s lost its connection to worker %s (rank %d): %s", self._name,
                    name, rank, reason)
        self._idle.close_idle(rank, reason)
        requests.fail_peer(rank, ConnectionLostError(
            f"connection to worker {name} (rank {rank}) was lost: {reason}. The worker may have "
            f"died.", worker=name))
        self._watch.suspect(rank, reason)

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
