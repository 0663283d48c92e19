"""One agent's private connections at rest, and the opening of new ones
(``PrivateConnections``, held as ``agent.lanes.private``).

A private connection carries the calls of one thread at a time: a blocking call or a
parked request (private_lane.py), or a thread's burst of ``rpc_async`` (bursts.py). One not
in use waits here, by the rank of its peer, for the next such call to that worker. None
is used under TLS, and at most ``max_private_connections`` are opened to one worker;
beyond that, calls go over the shared connection.
"""

from __future__ import annotations

import threading
from typing import Callable, Collection, Dict, List, Mapping, Optional, Protocol, Tuple

from .._transport import Connection, Transport
from ..errors import RpcError, WorkerLeftError
from .lifecycle import RUNNING, Lifecycle
from .pending import Pending
from .worker import WorkerInfo


class Peers(Protocol):
    """What the private connections need of the group's table (registry.py's ``Registry``)."""

    addresses: Mapping[int, Tuple[str, int]]  # rank -> where it listens
    incarnations: Mapping[int, int]  # rank -> which of its lives this is
    left: Collection[int]  # the ranks that said GOODBYE

    def same_host(self, rank: int) -> bool:
        """Whether worker ``rank`` runs on this host."""


class SharedLinks(Protocol):
    """What the private connections need of the connection table (connections.py's
    ``Connections``)."""

    private: Mapping[int, List[Connection]]  # rank -> its private connections, both ways

    def to(self, dst: WorkerInfo) -> Connection:
        """The shared connection to ``dst``, opened if there is none."""


class PrivateConnections:
    """The idle private connections of one agent, by rank, and the ones being opened.

    ``rank``: this worker's; ``max_per_peer``: the ``max_private_connections`` option;
    ``lifecycle``: whether the agent runs; ``peers``, ``links``: the group's table and the
    connection table; ``left_error(dst)``: the error of a call to a worker that left;
    ``connect_timeout()``: how long opening one may take (the agent's current timeout).
    The transport is adopted once started (:meth:`adopt`).
    """

    def __init__(self, rank: int, max_per_peer: int, lifecycle: Lifecycle, peers: Peers,
                 links: SharedLinks, left_error: Callable[[WorkerInfo], WorkerLeftError],
                 connect_timeout: Callable[[], float]) -> None:
        self._rank = rank
        self._lifecycle = lifecycle
        self._peers = peers
        self._links = links
        self._left_error = left_error
        self._connect_timeout = connect_timeout
        self._transport: Optional[Transport] = None
        self._secure = True  # no private connection before there is a transport
        self._lock = threading.Lock()
        self.enabled = True  # whether calls use private connections at all
        self.max = max_per_peer
        self._idle: Dict[int, List[Connection]] = {}  # idle private connections by rank
        self._opening: Dict[int, int] = {}  # rank -> private connections being opened

    def adopt(self, transport: Transport) -> None:
        """The agent has started ``transport``: open private connections with it (unless
        it is secure: none under TLS)."""
        self._transport = transport
        self._secure = transport.secure

    def usable(self, dst: WorkerInfo) -> bool:
        """Whether calls to ``dst`` may use private connections (not to itself, not under
        TLS)."""
        return self.enabled and dst.id != self._rank and not self._secure

    def has_idle(self, rank: int) -> bool:
        """Whether a private connection to ``rank`` waits to be used."""
        return bool(self._idle.get(rank))

    def checkout(self, dst: WorkerInfo, opens: bool = True) -> Optional[Connection]:
        """An idle private connection to ``dst``, or with ``opens`` a new one; or None,
        also where calls to ``dst`` may not use private connections (:meth:`usable`)."""
        if not self.enabled or dst.id == self._rank or self._secure:
            return None
        if dst.id in self._peers.left:  # it said GOODBYE: nothing sent now is answered
            raise self._left_error(dst)
        free = self._idle.get(dst.id)
        while free:
            try:
                conn = free.pop()
            except IndexError:
                break
            if not conn.closed:
                return conn
        if not opens:
            return None
        links = self._links
        links.to(dst)  # checks the worker; the shared one carries heartbeats
        with self._lock:  # a slot is taken before connecting: callers race here
            # (a copy: the connection table changes its lists under its own lock)
            opened = self._opening.get(dst.id, 0) + sum(
                1 for c in list(links.private.get(dst.id, ())) if c.outbound and not c.closed)
            if opened >= self.max:
                return None  # max_private_connections: this call goes over the shared one
            self._opening[dst.id] = self._opening.get(dst.id, 0) + 1
        peers = self._peers
        host, port = peers.addresses[dst.id]
        try:
            conn = self._transport.connect(dst.id, host, port, self._connect_timeout() or 30.0,
                                           local=peers.same_host(dst.id), private=True,
                                           incarnation=peers.incarnations.get(dst.id, 0))
        except RpcError:
            return None  # the shared connection reports what is wrong
        finally:
            with self._lock:  # registered in connections.private by now (on_connect)
                self._opening[dst.id] -= 1
        return conn if conn.private else None

    def checkin(self, dst: WorkerInfo, conn: Connection, carried: Optional[Pending] = None
                ) -> None:
        """``conn``, to ``dst``, is free again: it waits for the next call, unless closed
        or the agent stops. ``carried``: the request it carried, answered, which lets go
        of it first (its failure must not close a connection another call may use)."""
        if carried is not None:
            carried.private = None
        if not conn.closed and self._lifecycle.state is RUNNING:
            free = self._idle.get(dst.id)
            if free is None:
                with self._lock:  # keys change under the lock only (debug_info iterates)
                    free = self._idle.setdefault(dst.id, [])
            free.append(conn)

    def forget(self, conn: Connection) -> None:
        """Private connection ``conn`` closed: it is idle no more."""
        with self._lock:
            try:
                self._idle.get(conn.peer_rank, []).remove(conn)
            except ValueError:
                pass  # checked out, or never there

    def close_idle(self, rank: int, reason: BaseException) -> None:
        """Close the idle private connections to ``rank``, lost: nobody reads them, and
        the next call to a restarted worker must not go out on one to its predecessor."""
        with self._lock:
            idle = list(self._idle.get(rank, ()))
        for conn in idle:
            conn.close(reason)

    def clear(self) -> None:
        """The agent stops: forget the idle connections."""
        with self._lock:
            self._idle.clear()

    def num_idle(self) -> int:
        """How many idle private connections wait to be used."""
        with self._lock:
            return sum(len(v) for v in self._idle.values())

    def idle_to(self, rank: int) -> List[Connection]:
        """The idle private connections to ``rank``."""
        return list(self._idle.get(rank, ()))
