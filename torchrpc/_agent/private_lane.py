"""The private lane: a connection of its own, whose reply the waiting thread reads
(``PrivateLane``, held as ``agent.lanes.private_lane``).

Theory of operation. A blocking call (``rpc_sync``, ``RRef.to_here``) would otherwise
cost two thread switches on the way back: the connection's reader takes the reply and
wakes the caller, and the GIL goes back and forth between them. On this lane the request
goes out on a private connection (private.py), which has no reader thread on this side:
the caller's future reads the reply itself when it is waited on (its ``_claim``,
:meth:`PrivateLane.read_waiting`), with no other thread involved. A deadline or a lost
peer fails the request and closes the connection (``Pending.set_exception``), which
wakes that reader. The readers of private connections poll a moment before they block,
for as long as the lanes' :class:`~torchrpc._transport.PollPolicy` says.

Parked replies. RRef creation (``remote()``) gets a reply that nobody waits for, and
usually a ``to_here()`` right after it; ``rpc_async`` gets a reply its caller usually
waits for soon. Such a request is sent on a private connection and its reply left in the
socket ("parked", entered in :attr:`PrivateLane._parked`). Whoever waits for it first
reads it: the future's ``wait()`` on the caller's own thread (a callback added to the
future has the pool read it at once, see futures.py), a blocking call that names it as
``after`` (the next call to the same worker goes out on that connection and reads both
replies), or, for a parked request nobody claims within a tick or two of the timer, a
pool thread (:meth:`PrivateLane.drain_parked`). At most ``MAX_PARKED`` requests are
parked at once (:meth:`~torchrpc._agent.lanes.Lanes.pick` says which calls park).
"""

from __future__ import annotations

import functools
import threading
import time
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

from .. import _wire
from .._transport import Connection
from ..errors import ClosedError
from .pool import WorkerPool, current_pool
from .route import IdleConnections, Route, Sender, read_replies
from .scheduler import LENT_TICK
from .worker import WorkerInfo

if TYPE_CHECKING:
    from .pending import Pending

MAX_PARKED = 8  # requests whose reply may wait unread in a private connection at once


class Claim(Route):
    """The claim of a parked request: read its reply on the calling thread, or with
    ``later`` on the pool, unless someone took it over already (see the module docs).
    It is also the route of a waiting call that takes it over (:meth:`PrivateLane.after`):
    on its connection, holding its request, with a future of its own."""

    __slots__ = ("rid", "deadline", "since", "thread", "future")

    def __init__(self, lane: "PrivateLane", conn: Connection, rid: int,
                 deadline: Optional[float], future: Any) -> None:
        self.lane = lane
        self.conn = conn
        self.held = (rid,)
        self.sync = True
        self.inline = False
        self.rid = rid
        self.deadline = deadline
        self.since = time.monotonic()
        self.thread = threading.get_ident()  # the thread that sent it
        self.future = future  # an rpc_async's, which its thread's next one may make a burst

    def __call__(self, _future: Any, later: bool) -> None:
        """Read the reply if still unclaimed: on this thread, or with ``later`` on the
        pool (the future's waiter does not block for it)."""
        lane = self.lane
        if lane.take(self.rid):
            lane.read_parked(self.conn, self.rid, later)


class PrivateLane:
    """Requests on private connections, and the parked ones among them."""

    def __init__(self, calls: Sender, private: IdleConnections,
                 pending: Dict[int, "Pending"], pool: WorkerPool) -> None:
        self._calls = calls
        self._pending = pending  # the request table's (requests.py), read only
        self._private = private
        self._pool = pool
        self._lock = threading.Lock()
        self._parked: Dict[int, Claim] = {}  # unclaimed parked requests by request id
        self.num_parked = 0  # parked requests nobody has taken over yet
        # Connection -> its routes, indexed by Expect (made once: see routes_of()).
        self.routes: Dict[Connection, Tuple[Optional[Route], ...]] = {}

    # -- the lane ------------------------------------------------------------------------------

    def routes_of(self, conn: Connection) -> Tuple[Optional[Route], ...]:
        """The routes of the calls on private connection ``conn``, indexed by
        :class:`~torchrpc._agent.route.Expect` (``ANY`` has none): a waiting call's, a
        parked ``rpc_async``'s, a parked RRef creation's. Made on its first call and kept
        in :attr:`routes` until it closes (:meth:`forget_closed`); ``Lanes.pick`` reads
        them there."""
        routes = self.routes.get(conn)
        if routes is None:
            routes = self.routes[conn] = (
                None, Route(self, conn, (), sync=True), Route(self, conn, None),
                Route(self, conn, None, sync=True, inline=True))
        return routes

    def send(self, route: Route, rid: int, p: "Pending", kind: int, flags: int, env: bytes,
             bufs: Any, keep: Any) -> None:
        """Send request ``rid`` on the route's connection; its future's claim reads the
        reply (and those of the parked requests the route took over)."""
        conn, also = route.conn, route.held
        if not self._calls.transmit(conn, rid, p, kind, flags, env, bufs, keep):
            self.release(route, p.dst)  # failed, or gone to retry the shared way
            return
        future = p.future
        if also is not None:  # a waiting call: its caller reads at once
            # Its claim: read the reply (and those of the parked requests taken over) on
            # the waiting thread. The encoder's cache is made ready meanwhile.
            future._claim = functools.partial(self.read_waiting, conn, rid, p, also)
            _wire.prepare_encode()  # while the callee works
            return
        claim = Claim(self, conn, rid, time.monotonic() + p.timeout if p.timeout > 0 else None,
                      None if route.sync else future)
        with self._lock:
            self.num_parked += 1
        self._parked[rid] = claim
        future._claim = claim

    def release(self, route: Route, dst: WorkerInfo) -> None:
        """The request was not sent on the route's connection after all: read the parked
        reply it took over on the pool, or give the connection back."""
        also = route.held
        if also:
            self._pool.submit(self._drain, route.conn, also[0])
        else:
            self._private.checkin(dst, route.conn)

    def after(self, future: Any, timeout: float) -> Optional[Route]:
        """The route of a waiting call with ``timeout`` that takes over the parked
        request of ``future`` (see :meth:`Lanes.pick`), or None. A request that may time
        out first does not: its timeout would close the connection under the parked
        request."""
        claim = getattr(future, "_claim", None)
        if type(claim) is not Claim:
            return None
        if timeout > 0 and (claim.deadline is None
                            or time.monotonic() + timeout < claim.deadline):
            return None
        if self._parked.pop(claim.rid, None) is None:
            return None
        with self._lock:
            self.num_parked -= 1
        future._claim = None
        return claim

    # -- reading ------------------------------------------------------------------------------

    def take(self, rid: int) -> bool:
        """Take parked request ``rid`` over (its taker reads the reply), if still there."""
        if self._parked.pop(rid, None) is None:
            return False
        self._unpark()
        return True

    def read_parked(self, conn: Connection, rid: int, later: bool) -> None:
        """Read the reply of parked request ``rid`` (taken over) from ``conn``: on this
        thread, or with ``later`` on the pool."""
        if not later:
            self._drain(conn, rid)
            return
        try:
            self._pool.submit(self._drain, conn, rid)
        except ClosedError:
            pass  # shutting down: the pending call is failed there

    def read_waiting(self, conn: Connection, rid: int, p: "Pending",
                     also: Tuple[int, ...] = (), _future: Any = None,
                     _later: bool = False) -> None:
        """Read replies from private connection ``conn`` until request ``rid`` and the
        requests ``also`` (sent on it before) are answered, as a blocked thread in the
        eyes of the pool; then give ``conn`` back. (A waiting call's claim, on the
        waiting thread.)"""
        waiting = {rid, *also}
        # Given back before the caller wakes, for its next call.
        free = functools.partial(self._private.checkin, p.dst, conn, p)
        calls = self._calls
        pool = current_pool()
        if pool is None:
            error = read_replies(conn, calls, waiting, free)
        else:
            with pool.blocking():
                error = read_replies(conn, calls, waiting, free)
        if error is not None:  # the requests still waiting went with the connection
            for lost in waiting:
                calls.request_lost(lost, p.dst, error)

    # -- parked replies ------------------------------------------------------------------------

    def take_parked(self, rank: int) -> Optional[Claim]:
        """This thread's unclaimed parked ``rpc_async`` to ``rank``, taken over (it is
        parked no more: the taker reads its reply), or None."""
        parked = self._parked
        if not parked:
            return None
        me = threading.get_ident()
        mine = next((p for p in list(parked.values()) if p.future is not None
                     and p.thread == me and p.conn.peer_rank == rank), None)
        if mine is None or parked.pop(mine.rid, None) is None:
            return None
        self._unpark()
        return mine

    def parked_to(self, rank: int) -> bool:
        """Whether an unclaimed parked request waits for a reply from ``rank``."""
        return any(p.conn.peer_rank == rank for p in list(self._parked.values()))

    def drain_parked(self, now: float) -> None:
        """Timer: unclaimed parked requests older than a tick get their reply read."""
        if not self._parked:
            return
        for rid in list(self._parked):  # the keys: one C-level copy, see docs/design.md
            parked = self._parked.get(rid)
            if parked is not None and now - parked.since > LENT_TICK \
                    and self._parked.pop(rid, None) is not None:
                self._unpark()
                try:
                    self._pool.submit(self._drain, parked.conn, rid)
                except ClosedError:
                    pass  # shutting down: the pending call is failed there

    def forget_closed(self) -> None:
        """Timer: forget the routes of the connections that have closed."""
        routes = self.routes
        if routes:
            for conn in list(routes):  # the keys: one C-level copy, see docs/design.md
                if conn.closed:
                    routes.pop(conn, None)

    def clear(self) -> None:
        """The agent stops: forget the parked requests and the routes."""
        self._parked.clear()
        self.routes.clear()

    def _unpark(self) -> None:
        with self._lock:
            self.num_parked -= 1

    def _drain(self, conn: Connection, rid: int) -> None:
        """Read the reply of parked request ``rid`` (claimed by this thread) from ``conn``."""
        p = self._pending.get(rid)
        if p is None:  # failed already (which closed the connection)
            return
        self.read_waiting(conn, rid, p, (rid,))
