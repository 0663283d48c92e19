"""Frames as they arrive, and which thread reads and serves them (``Reading``).

Theory of operation (reading). A connection is read by whichever thread holds its
reading role (``Connection.read_frames``). The transport's own thread reads first; as
soon as the pool has an idle thread the role moves into the pool, where a reading
thread counts as blocked (it waits for the network, not for work).

A pool thread that reads a request runs it at once, itself: no other thread is woken,
and on two cores a wake-up and the GIL hand-over that follows cost more than a small
request does. While it runs the request, the reading role is *lent* (``_lent``): it goes
to another pool thread the moment the request blocks on an RPC (``WorkerPool.blocking``
calls :meth:`Reading.lend_out`), so a nested call, even back to the caller over this very
connection, never waits for itself; and the timer hands it on when a request runs for
longer than ``INLINE_LIMIT`` without returning (blocked on a lock, sleeping, computing),
so one slow request holds the frames behind it up for INLINE_LIMIT plus a tick at most.
Only shared connections need that, and private ones that carry a caller's burst of calls
(FLAG_MANY, see bursts.py): the caller on another private connection waits for this
very reply (its parked requests, if any, are about the same RRef), so the timer wakes
every LENT_TICK only while a shared connection's role is lent (or a tick hook has work
queued), and every TICK otherwise. On two cores each wake-up of a helper thread takes a
CPU, and the GIL, from the request path: in the benchmark's training loop the caller's
main thread was preempted 237 times a second with a fast tick throughout, 82 with this
rule. A reader whose role went elsewhere stops reading when its request returns.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

import torch

from .. import _wire
from .._threads import Guard
from .._transport import Connection
from .._wire import Kind
from ..errors import ClosedError, ConnectionLostError
from .futures import mark_reader_thread
from .pool import current_pool
from .lifecycle import RUNNING
from .stats import nbytes
from .worker import WorkerInfo

if TYPE_CHECKING:
    from .agent import Agent

# A request running on its reading thread for longer than this hands the reading role on.
INLINE_LIMIT = 0.01
_inline = threading.local()  # .conn: the connection whose reading role this thread lends


class Reading:
    """The frame callback of one agent's connections, and the lending of reading roles."""

    def __init__(self, agent: "Agent") -> None:
        self._agent = agent
        self._pool = agent.pool
        self._lent: Dict[Connection, float] = {}  # reading roles lent to inline requests
        # Whether a request was served inline on a shared connection (or a burst's) since
        # the timer last asked: it keeps ticking fast meanwhile (see lends_shared).
        self._served = False

    def on_frame(self, conn: Connection, header: _wire.Header, envelope: bytes,
                 buffers: List[torch.Tensor]) -> Optional[Callable[[], None]]:
        """A frame arrived on ``conn``: complete a reply, note a control message, or serve
        a request; return work for this thread if its reading role went elsewhere."""
        mark_reader_thread()
        agent = self._agent
        if not agent.ready:
            # A peer may finish rendezvous and call us before init_rpc here has returned.
            agent._ready.wait(120.0)
        kind = header.kind
        if kind == Kind.RESPONSE or kind == Kind.ERROR:
            agent.calls.on_reply(conn, header, envelope, buffers)
            return self._to_pool(conn)
        registry = agent.registry
        src = registry.workers.get(conn.peer_rank)
        if src is None and agent.elastic:
            registry.refresh()  # a new member may call before we saw it join
            src = registry.workers.get(conn.peer_rank)
        if src is None:
            raise ConnectionLostError(f"frame from unknown rank {conn.peer_rank}")
        if kind == Kind.GOODBYE:
            registry.left.add(src.id)
            agent.requests.fail_peer(src.id, agent.left_error(src))
            return None
        if kind == Kind.HEARTBEAT:
            agent.liveness.beating.add(src.id)
            return self._to_pool(conn)
        if kind == Kind.ONCE_PROBE:
            agent.dispatch.answer_probe(conn, src, envelope)
            return self._to_pool(conn)
        if kind == Kind.ONCE_STATUS:
            agent.calls.probes.on_status(conn, envelope)
            return self._to_pool(conn)
        stats = agent._peer_stats.get(src.id) or agent.new_stats(src.id)
        stats.calls_in += 1
        stats.bytes_in += len(envelope) + nbytes(buffers) if buffers else len(envelope)
        dispatch = agent.dispatch
        handler = dispatch.handlers.get(kind)
        via = conn  # the reply goes back on it: the caller watches that connection for it
        if header.flags & _wire.FLAG_MANY:
            conn.many = True
        if header.flags & _wire.FLAG_ONCE and not dispatch.first_time(src, header.request_id, via):
            return self._to_pool(conn)
        pool = self._pool
        if current_pool() is pool and agent.lifecycle.state is RUNNING:
            return self._serve_inline(conn, src, header, envelope, buffers, handler, via)
        # A transport thread. With a pool thread idle, it takes the request and the
        # reading role with it, and serves what comes next as it comes, inline. Otherwise
        # (and until then) this thread reads on and passes each request to the pool,
        # which costs a wake-up per request: where both CPUs are taken by this thread
        # polling and the caller, the woken thread waits for the poll to end.
        if agent.lifecycle.state is RUNNING and pool.hand_off(
                self._serve_then_read, conn, src, header, envelope, buffers, handler, via):
            return _nothing
        if agent._max_queued and pool.num_pending >= agent._max_queued \
                and not header.oneway and not header.flags & _wire.FLAG_ONCE:
            dispatch.refuse(src, header, via)
            return self._to_pool(conn)
        try:
            pool.submit(dispatch.serve, src, header, envelope, buffers, handler, via)
        except ClosedError:
            pass  # stopping; the caller learns from the GOODBYE or the closed connection
        return self._to_pool(conn)

    def _serve_inline(self, conn: Connection, src: WorkerInfo, header: _wire.Header,
                      envelope: bytes, buffers: List[torch.Tensor], handler: Any,
                      via: Optional[Connection]) -> Optional[Callable[[], None]]:
        """Run a request on the reading thread, lending the reading role meanwhile."""
        agent = self._agent
        # _lent is changed with single dict operations, which the GIL makes atomic.
        self._lent[conn] = time.monotonic()
        if not conn.private or conn.many:
            self._served = True
            scheduler = agent.scheduler
            if scheduler.slow:
                scheduler.wake()  # it set slow before it looked at _lent and _served
        _inline.conn = conn
        try:
            agent.dispatch.serve(src, header, envelope, buffers, handler, via)
        except Exception as exc:  # noqa: BLE001 - must not reach a reader that lent its role
            Guard(f"serving a {Kind(header.kind).name} from {src.name} on {agent.name}",
                  limit=None).failed(exc)
        finally:
            _inline.conn = None
            kept = self._lent.pop(conn, None) is not None
        return None if kept else _nothing  # None: read on; else the role is elsewhere

    def _serve_then_read(self, conn: Connection, src: WorkerInfo, header: _wire.Header,
                         envelope: bytes, buffers: List[torch.Tensor], handler: Any,
                         via: Optional[Connection]) -> None:
        """A pool task: run a request that a transport thread read, then hold the reading
        role of its connection, as if this thread had read the request itself."""
        with self._pool.blocking():
            mark_reader_thread()
            work = self._serve_inline(conn, src, header, envelope, buffers, handler, via)
            if work is None:
                work = conn.read_frames()
        if work is not None:
            work()

    def lend_out(self, conn: Optional[Connection] = None) -> None:
        """Give a lent reading role to another thread (this one's, without ``conn``)."""
        if conn is None:
            conn = getattr(_inline, "conn", None)
            if conn is None:
                return
            _inline.conn = None
            mark_reader_thread(False)  # this thread reads no more
        if self._lent.pop(conn, None) is None:
            return  # the request returned, or the role went elsewhere already
        try:
            if not self._pool.hand_off(self._keep_reading, conn):
                self._pool.submit(self._keep_reading, conn)
        except ClosedError:
            pass  # the pool is shut down, and with it the connection

    def check_lent(self, now: float) -> None:
        """Timer: hand on the reading role of requests that run inline for too long."""
        if not self._lent:
            return
        lent = self._lent
        overdue = [c for c in list(lent) if now - lent.get(c, now) > INLINE_LIMIT]
        for conn in overdue:
            self.lend_out(conn)

    def lends_shared(self) -> bool:
        """Whether a shared connection's reading role is lent, or was since the last
        call (the timer then ticks fast, to hand it on in time: see the module docs).
        Counting the roles lent meanwhile keeps a stream of short requests from waking
        the timer at each one: it stays fast until a tick finds none."""
        served, self._served = self._served, False
        return served or any(not c.private or c.many for c in list(self._lent))

    def _to_pool(self, conn: Connection) -> Optional[Callable[[], None]]:
        """On a transport thread: move the reading role into the pool if a thread is idle."""
        if current_pool() is not self._pool and self._pool.hand_off(self._keep_reading, conn):
            return _nothing
        return None

    def _keep_reading(self, conn: Connection) -> None:
        """A pool task: hold the reading role of ``conn`` until it moves on or ends."""
        with self._pool.blocking():
            work = conn.read_frames()
        if work is not None:
            work()


def _nothing() -> None:
    """The work of a reader that handed its role on and has nothing else to do."""
