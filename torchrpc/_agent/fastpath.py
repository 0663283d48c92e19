"""The fast paths of calls and replies (``FastPath``, held as ``agent.fastpath``).

Theory of operation (private connections). A blocking call (``rpc_sync``,
``RRef.to_here``) would otherwise cost two thread switches on the way back: the
connection's reader takes the reply and wakes the caller, and the GIL goes back and
forth between them. Instead it goes out on a private connection, used by this one call
at a time, and the calling thread reads the reply from the socket itself. The call still
sits in the pending table, so deadlines, lost workers and shutdown fail it like any
other; failing it closes the private connection, which wakes the caller blocked on it
(``Pending.set_exception``). The readers of private connections poll a moment before they
block, for as long as :attr:`FastPath.poll` says.

Theory of operation (parked replies). RRef creation (``remote()``) gets a reply that
nobody waits for, and usually a ``to_here()`` right after it; ``rpc_async`` gets a reply
its caller usually waits for soon. Such a request is sent on a private connection and its
reply left in the socket ("parked"). Whoever waits for it first reads it: the future's
``wait()`` on the caller's own thread (a callback added to the future has the pool read
it at once, see futures.py), a ``call(after=...)`` to the same worker that goes out on
that connection and reads both replies, or, for a parked request nobody claims within a
tick or two of the timer, a pool thread (``drain_parked``). (``rpc_sync`` parks nothing:
it is a :meth:`call`.) At most ``_MAX_PARKED`` requests are parked at once; an
``rpc_async`` parks only on an idle private connection (it never waits for one to open)
and while no other reply from its worker is parked (a burst of calls to one worker would
otherwise take a connection, and a reading thread on both sides, each). Beyond that, and
wherever private connections are not used, they are plain requests.

Which thread reads the shared connections, and lends that role while it serves a
request, is :class:`~torchrpc._agent.reading.Reading`'s; which private connections wait
idle, :class:`~torchrpc._agent.private.PrivateConnections`'. This object holds both.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

import torch

from .. import _wire
from .._transport import Connection, PollPolicy
from .._wire import Kind
from .bursts import Bursts
from ..errors import ClosedError, RpcError
from .cpus import usable_cpus as _usable_cpus
from .futures import RpcFuture
from .pool import current_pool
from .private import PrivateConnections
from .reading import Reading
from .requests import Pending
from .retry import RetryPolicy
from .scheduler import LENT_TICK
from .lifecycle import RUNNING
from .worker import WorkerInfo

if TYPE_CHECKING:
    from .agent import Agent

_MAX_PARKED = 8  # requests whose reply may wait unread in a private connection at once


class Parked:
    """A request sent on a private connection whose reply waits there unread (see
    :meth:`FastPath.park`)."""

    __slots__ = ("conn", "rid", "deadline", "since", "thread", "future")

    def __init__(self, conn: Connection, rid: int, deadline: Optional[float],
                 future: Optional[RpcFuture] = None) -> None:
        self.conn = conn
        self.rid = rid
        self.deadline = deadline
        self.since = time.monotonic()
        self.thread = threading.get_ident()  # the thread that sent it
        self.future = future  # an rpc_async's, which its thread's next one may make a burst


class FastPath:
    """One agent's private connections, parked replies, poll policy and reading part."""

    def __init__(self, agent: "Agent") -> None:
        self._agent = agent
        self._lock = agent._lock  # the agent's: debug_info counts under it
        # handed to every private connection (Connections.on_connect); the spin_us option
        self.poll = PollPolicy.from_option(agent.settings.spin_us)
        self.reading = Reading(agent)
        self.private = PrivateConnections(agent)
        self.bursts = Bursts(agent, self)
        self._parked: Dict[int, Parked] = {}  # unclaimed parked requests by request id
        self.num_parked = 0  # parked requests whose reply is not read yet

    # -- the agent's interface ---------------------------------------------------------------

    def call(self, dst: WorkerInfo, kind: int, payload: Any, timeout: float, what: Any = None,
             retry: Optional[RetryPolicy] = None, after: Optional[Parked] = None) -> Any:
        """Send a request and wait for the reply; the calling thread reads it itself.

        With ``after`` (a request to ``dst`` parked by :meth:`park`), the request goes
        out on the parked request's connection if it is still unclaimed and this call's
        deadline is not earlier than the parked one's; this thread then reads both
        replies.
        """
        agent = self._agent
        if agent.failure is not None or agent.lifecycle.state is not RUNNING:
            agent.check_running()  # raises
        conn = None
        also: Tuple[int, ...] = ()
        if after is not None and self._claim(after, timeout):
            conn, also = after.conn, (after.rid,)
        elif self.private.usable(dst):
            # With retry, an attempt that fails on the connection is sent again on the
            # shared one, and its reply read there (see Requests.fail).
            conn = self.private.checkout(dst)
        if conn is None:
            return agent.request(dst, kind, payload, timeout, what=what, retry=retry).wait()
        rid, p, sent = self._send(conn, also, dst, kind, payload, timeout, what, retry, True)
        if sent:
            _wire.prepare_encode()  # while the callee works
            self._read_blocking(conn, rid, p, also)
        return p.future.wait()

    def park(self, dst: WorkerInfo, kind: int, payload: Any, timeout: float, what: Any = None,
             retry: Optional[RetryPolicy] = None, by_future: bool = False,
             on_done: Optional[Callable[[Any], None]] = None) -> Tuple[Any, Optional[Parked]]:
        """Send a request, parking the reply; the future of the reply, and the parked
        request (None if it went the usual way). ``by_future``: the future's waiter reads
        the reply (else a :meth:`call` with ``after``). See the module docs for when it
        parks. With ``on_done``, called with the future once it completes, a parked
        request's future is a :class:`~torchrpc._agent.futures.SyncFuture` (nobody waits
        for it but its ``after`` call) and ``on_done`` runs where it completes."""
        agent, private = self._agent, self.private
        conn = None
        burst = by_future and self.bursts.of(dst)
        if burst:
            return self.bursts.send(burst, kind, payload, timeout, what), None
        # An rpc_async parks only on an idle private connection: with none, no more checks.
        if not by_future or private.has_idle(dst.id):
            agent.check_running()
            fits = self.num_parked < _MAX_PARKED and not (by_future and self._parked_to(dst.id))
            if fits and private.usable(dst):
                conn = private.checkout(dst, opens=not by_future)
        if conn is None:
            if by_future and not private.has_idle(dst.id):
                self.bursts.went_shared(dst)
            fut = agent.request(dst, kind, payload, timeout, what=what, retry=retry)
            if on_done is not None:
                fut.add_done_callback(on_done)
            return fut, None
        rid, p, sent = self._send(conn, (), dst, kind, payload, timeout, what, retry,
                                  sync=on_done is not None, on_done=on_done)
        if not sent:
            return p.future, None
        parked = Parked(conn, rid, time.monotonic() + timeout if timeout > 0 else None,
                        p.future if by_future else None)
        with self._lock:
            self.num_parked += 1
        self._parked[rid] = parked
        if by_future:
            p.future._claim = functools.partial(self._read_parked, parked)
        return p.future, parked

    def clear(self) -> None:
        """The agent stops: forget the idle connections and the parked requests."""
        self.private.clear()
        self._parked.clear()
        self.bursts.clear()

    def check_cpus(self, workers: int) -> None:
        """Timer: have readers poll as the ``workers`` on this host and its CPUs allow."""
        self.poll.for_host(torch.get_num_threads(), workers, _usable_cpus())

    def drain_parked(self, now: float) -> None:
        """Timer: unclaimed parked requests older than a tick get their reply read."""
        if not self._parked:
            return
        pool = self._agent.pool
        for rid in list(self._parked):  # the keys: one C-level copy, see docs/design.md
            parked = self._parked.get(rid)
            if parked is not None and now - parked.since > LENT_TICK \
                    and self._parked.pop(rid, None) is not None:
                try:
                    pool.submit(self._drain, parked.conn, rid)
                except ClosedError:
                    self._unpark()  # shutting down: the pending call is failed there

    # -- private connections ------------------------------------------------------------------

    def _send(self, conn: Connection, also: Tuple[int, ...], dst: WorkerInfo, kind: int,
              payload: Any, timeout: float, what: Any, retry: Optional[RetryPolicy] = None,
              sync: bool = False, on_done: Optional[Callable[[Any], None]] = None
              ) -> Tuple[int, Pending, bool]:
        """Enter a request and send it on private connection ``conn`` (which carries the
        parked requests ``also``); the request id, its pending record, and whether it was
        sent (if not, it has failed or gone to retry, and ``conn`` was released)."""
        calls = self._agent.calls
        try:
            rid, p, flags, env, bufs, keep = calls.new_request(
                dst, kind, payload, timeout, what, retry=retry, private=conn, sync=sync,
                on_done=on_done)
        except BaseException:
            self._release(dst, conn, also)
            raise
        r = p.resend
        was_sent = r is not None and r.sent
        if r is not None:
            r.sent = True  # from here the frame may arrive, even if the connection breaks
        try:
            conn.send(kind, flags, rid, env, bufs, keep)
        except RpcError as exc:  # raised before the frame was queued: it did not go
            if r is not None:
                r.sent = was_sent
            p.private = None  # nobody reads ``conn`` for it: a retry goes the shared way
            calls.send_failed(kind, rid, dst, exc)
            self._release(dst, conn, also)
            return rid, p, False
        return rid, p, True

    def _release(self, dst: WorkerInfo, conn: Connection, also: Tuple[int, ...]) -> None:
        """A claimed parked connection carries no new request after all: read the parked
        reply on the pool; a plain private connection goes back to the free list."""
        if also:
            self._agent.pool.submit(self._drain, conn, also[0])
        else:
            self.private.checkin(dst, conn)

    def _read_blocking(self, conn: Connection, rid: int, p: Pending,
                       also: Tuple[int, ...] = ()) -> None:
        """:meth:`_read_reply`, as a blocked thread in the eyes of the pool."""
        pool = current_pool()
        if pool is None:
            self._read_reply(conn, rid, p, also)
        else:
            with pool.blocking():
                self._read_reply(conn, rid, p, also)

    def _read_reply(self, conn: Connection, rid: int, p: Pending,
                    also: Tuple[int, ...] = ()) -> None:
        """Read replies from private connection ``conn`` until request ``rid`` and the
        requests ``also`` (sent on it before) are answered; then give ``conn`` back."""
        calls = self._agent.calls
        waiting = {rid, *also}
        while waiting:
            try:
                header, envelope, buffers = conn.read_frame()
            except RpcError as exc:  # broken, or closed because a call failed already
                for r in waiting:
                    calls.request_lost(r, p.dst, exc)
                if also:
                    self._unpark()
                return
            if header.request_id in waiting and (header.kind == Kind.RESPONSE
                                                 or header.kind == Kind.ERROR):
                waiting.discard(header.request_id)
                if not waiting:
                    p.private = None
                    if also:
                        self._unpark()
                    self.private.checkin(p.dst, conn)
                calls.on_reply(conn, header, envelope, buffers)
            # Nothing else is sent on a private connection; ignore what a peer sends anyway.
            envelope = buffers = None

    # -- parked replies ------------------------------------------------------------------------

    def _claim(self, parked: Parked, timeout: float) -> bool:
        """Take ``parked`` over for a request with ``timeout``, if still unclaimed. A
        request that may time out first does not: its timeout would close the connection
        under the parked request."""
        if timeout > 0 and (parked.deadline is None
                            or time.monotonic() + timeout < parked.deadline):
            return False
        return self._parked.pop(parked.rid, None) is not None

    def take_parked(self, rank: int) -> Optional[Parked]:
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

    def _parked_to(self, rank: int) -> bool:
        """Whether an unclaimed parked request waits for a reply from ``rank``."""
        return any(p.conn.peer_rank == rank for p in list(self._parked.values()))

    def _read_parked(self, parked: Parked, _future: Any, later: bool) -> None:
        """Read the reply of ``parked`` if it is still unclaimed: on this thread, or with
        ``later`` on a pool thread (the future's waiter does not block for it)."""
        if self._parked.pop(parked.rid, None) is None:
            return
        if not later:
            self._drain(parked.conn, parked.rid)
            return
        try:
            self._agent.pool.submit(self._drain, parked.conn, parked.rid)
        except ClosedError:
            self._unpark()  # shutting down: the pending call is failed there

    def _unpark(self) -> None:
        with self._lock:
            self.num_parked -= 1

    def _drain(self, conn: Connection, rid: int) -> None:
        """Read the reply of parked request ``rid`` (claimed by this thread) from ``conn``."""
        p = self._agent.requests.pending.get(rid)
        if p is None:  # failed already (which closed the connection)
            self._unpark()
            return
        self._read_blocking(conn, rid, p, (rid,))

