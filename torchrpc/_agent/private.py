"""One agent's private connections at rest, and the opening of new ones
(``PrivateConnections``, held as ``agent.lanes.private``).

A private connection carries the calls of one thread at a time: a blocking call or a
parked request (private_lane.py), or a thread's burst of ``rpc_async`` (bursts.py). One not
in use waits here, by the rank of its peer, for the next such call to that worker. None
is used under TLS, and at most ``max_private_connections`` are opened to one worker;
beyond that, calls go over the shared connection.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional

from .._transport import Connection
from ..errors import RpcError
from .lifecycle import RUNNING
from .worker import WorkerInfo

if TYPE_CHECKING:
    from .agent import Agent


class PrivateConnections:
    """The idle private connections of one agent, by rank, and the ones being opened."""

    def __init__(self, agent: "Agent") -> None:
        self._agent = agent
        self._lock = agent._lock  # the agent's: debug_info counts under it
        self.enabled = True  # whether calls use private connections at all
        self.max = agent.settings.max_private_connections
        self._idle: Dict[int, List[Connection]] = {}  # idle private connections by rank
        self._opening: Dict[int, int] = {}  # rank -> private connections being opened

    def usable(self, dst: WorkerInfo) -> bool:
        """Whether calls to ``dst`` may use private connections (not to itself, not under
        TLS)."""
        agent = self._agent
        return self.enabled and dst.id != agent.rank and not agent._transport.secure

    def has_idle(self, rank: int) -> bool:
        """Whether a private connection to ``rank`` waits to be used."""
        return bool(self._idle.get(rank))

    def checkout(self, dst: WorkerInfo, opens: bool = True) -> Optional[Connection]:
        """An idle private connection to ``dst``, or with ``opens`` a new one; or None."""
        agent = self._agent
        if dst.id in agent.registry.left:  # it said GOODBYE: nothing sent now is answered
            raise agent.left_error(dst)
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
        agent.connections.to(dst)  # checks the worker; the shared one carries heartbeats
        with self._lock:  # a slot is taken before connecting: callers race here
            opened = self._opening.get(dst.id, 0) + sum(
                1 for c in agent.connections.private.get(dst.id, ())
                if c.outbound and not c.closed)
            if opened >= self.max:
                return None  # max_private_connections: this call goes over the shared one
            self._opening[dst.id] = self._opening.get(dst.id, 0) + 1
        registry = agent.registry
        host, port = registry.addresses[dst.id]
        try:
            conn = agent._transport.connect(dst.id, host, port, agent.default_timeout or 30.0,
                                            local=registry.same_host(dst.id), private=True,
                                            incarnation=registry.incarnations.get(dst.id, 0))
        except RpcError:
            return None  # the shared connection reports what is wrong
        finally:
            with self._lock:  # registered in connections.private by now (on_connect)
                self._opening[dst.id] -= 1
        return conn if conn.private else None

    def checkin(self, dst: WorkerInfo, conn: Connection) -> None:
        """``conn``, to ``dst``, is free again: it waits for the next call, unless closed
        or the agent stops."""
        if not conn.closed and self._agent.lifecycle.state is RUNNING:
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
