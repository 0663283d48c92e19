"""The burst lane: ``rpc_async`` calls whose replies the calling thread reads (``Bursts``,
held as ``agent.lanes.bursts``).

Theory of operation. A thread that makes a second ``rpc_async`` to a worker while the
reply of its first is still parked on a private connection (private_lane.py) turns that
connection into its *burst connection* to the worker: from then on its ``rpc_async``
calls to that worker go out there, and no reader thread on this side waits on it.
Otherwise every reply of a burst wakes a reading thread that then takes the GIL from
the thread making the calls, twice per call; here the replies wait in the socket and
the calling thread reads whatever has come at every ``_DRAIN_EVERY``-th call, in one
pass. Waiting on a future of the burst (``wait``, ``wait_all``) reads the connection
until it is done; asking whether one is done, or adding a callback, has a pool thread
read until it is; the timer has a pool thread read replies that nobody read for a tick.
Whoever reads holds the burst's lock (its reading role) for the frames it reads, and
reads as a reader thread: callbacks of the futures it completes go to the pool.

Requests of a burst are ordinary pending requests: deadlines, lost workers and shutdown
fail them as any other. Unlike a parked request, one that times out leaves the
connection open, since the others of the burst are on it too (a thread waiting for a
reply looks at its future every ``_WAKE`` seconds). A broken connection fails every
request outstanding on it. At most ``_MAX_OUT`` requests are outstanding on a burst
connection, and a request larger than ``_MAX_BYTES`` goes over the shared connection:
between two reads the thread sends at most ``_DRAIN_EVERY`` small requests, which the
sockets hold however large the replies are, so it never blocks in a send while the
callee blocks sending it a reply. Requests carry ``FLAG_MANY``, which tells the callee
that several calls share the connection, so that it hands the reading role on from a
long request as soon as it would on a shared connection (inbound.py).

A burst connection stays its thread's while the thread lives; the timer gives it back
to the idle private connections once its thread has ended and no reply is outstanding.
"""

from __future__ import annotations

import select
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

import torch

from .. import _wire
from .._transport import Connection
from .._wire import Header, Kind
from ..errors import ClosedError, RpcError
from .futures import ManyClaim, RpcFuture, mark_reader_thread, on_reader_thread
from .pool import WorkerPool, current_pool
from .route import IdleConnections, Route, Sender, read_replies
from .scheduler import LENT_TICK
from .stats import nbytes
from .worker import WorkerInfo

if TYPE_CHECKING:
    from .private_lane import PrivateLane
    from .pending import Pending

_DRAIN_EVERY = 64  # the burst's thread reads the replies that came at every this many calls
_MAX_OUT = 512  # requests outstanding on one burst connection at most
_MAX_BYTES = 1024  # a larger request of a burst goes over the shared connection
_OPEN_AFTER = 64  # rpc_async calls to a worker over the shared connection open a private one
_WAKE = 0.05  # seconds between looks at its future of a thread waiting for a reply
_ERROR = int(Kind.ERROR)  # a plain int: looking a member up on the enum class is slow
_done = torch._C.Future.done  # without RpcFuture's claim


class Burst:
    """One thread's burst connection to one worker and the requests outstanding on it."""

    __slots__ = ("conn", "dst", "thread", "out", "lock", "calls", "last", "errors", "quiet",
                 "claim", "route", "__weakref__")

    def __init__(self, bursts: "Bursts", conn: Connection, dst: WorkerInfo) -> None:
        self.conn = conn
        self.dst = dst
        self.thread = threading.current_thread()
        self.out: Dict[int, RpcFuture] = {}  # request id -> future, until its reply is read
        self.lock = threading.Lock()  # the reading role
        self.calls = 0
        self.last = time.monotonic()  # when its replies were last read
        self.errors = 0  # error replies read, and the connection's end (see wait_all)
        self.quiet = 0  # waits for a reply that found none for _WAKE (see wait_all)
        self.claim = _Claim(bursts, self)  # each of its futures' _claim
        self.route = Route(bursts, None, self)  # each of its calls' route

    def ready(self, timeout: float) -> bool:
        """Whether a frame (or the end of the connection) is there to read, waiting at
        most ``timeout`` seconds for one."""
        conn = self.conn
        if conn.rx_buffered or conn.closed:
            return True
        try:
            return bool(select.select([conn.sock], [], [], timeout)[0])
        except (OSError, ValueError):  # closed meanwhile: reading says so
            return True


class _Claim(ManyClaim):
    """A burst's claim, each of its futures' ``_claim``: read the burst until the future
    is done, on the calling thread or (``later``) on the pool.
    :func:`~torchrpc._agent.futures.wait_all` reads a burst for all its futures at once
    through ``read_until``."""

    __slots__ = ("bursts", "burst")

    def __init__(self, bursts: "Bursts", burst: Burst) -> None:
        self.bursts = bursts
        self.burst = burst

    @property
    def group(self) -> Burst:
        return self.burst

    def events(self) -> int:
        return self.burst.errors + self.burst.quiet

    def __call__(self, future: RpcFuture, later: bool) -> None:
        if later:
            self.read_later(lambda: _done(future))
        else:
            self.read_until(lambda: _done(future))

    def read_until(self, finished: Callable[[], bool]) -> None:
        """Read the burst until ``finished()`` or nothing is outstanding on it."""
        self.bursts.read_until(self.burst, finished)

    def read_later(self, finished: Callable[[], bool]) -> None:
        """:meth:`read_until` on a pool thread."""
        try:
            self.bursts.pool.submit(self.bursts.read_until, self.burst, finished)
        except ClosedError:
            pass  # shutting down: every request is failed


class Bursts:
    """The burst lane: the burst connections of one agent's threads."""

    def __init__(self, calls: Sender, private: IdleConnections,
                 private_lane: "PrivateLane", pending: Dict[int, "Pending"], pool: WorkerPool,
                 running: Callable[[], bool]) -> None:
        self._calls = calls
        self._private_lane = private_lane
        self._private = private
        self._pending = pending  # the request table's (requests.py)
        self._running = running  # whether the agent runs
        self.pool = pool
        self._mine = threading.local()  # .by_rank: this thread's bursts by worker rank
        self._all: List[Burst] = []  # every burst, for the timer (changed under _lock)
        self._shared: Dict[int, int] = {}  # rank -> rpc_async calls to it that went shared
        self._lock = threading.Lock()

    def of(self, dst: WorkerInfo) -> Optional[Burst]:
        """This thread's open burst to ``dst``: the one it has, or one made of its parked
        rpc_async to ``dst`` (:meth:`from_parked`); else None."""
        by_rank = getattr(self._mine, "by_rank", None)
        burst = by_rank.get(dst.id) if by_rank else None
        if burst is not None and burst.conn.closed:
            del by_rank[dst.id]
            burst = None
        return burst or self.from_parked(dst)

    def from_parked(self, dst: WorkerInfo) -> Optional[Burst]:
        """This thread's rpc_async to ``dst`` parked and unclaimed: make its connection
        this thread's burst connection to ``dst``; else None."""
        mine = self._private_lane.take_parked(dst.id)
        if mine is None:
            return None
        pending = self._pending.get(mine.rid)
        if pending is not None:
            pending.private = None  # its timeout must not close the burst's connection
        return self._start(mine.conn, dst, mine.rid, mine.future)

    def went_shared(self, dst: WorkerInfo) -> None:
        """An rpc_async to ``dst`` went over the shared connection, no private one being
        idle: after ``_OPEN_AFTER`` such calls, open one on the pool, so that the calls
        that follow can park and make a burst. Workers that call each other now and then
        open none."""
        n = self._shared.get(dst.id, 0) + 1
        self._shared[dst.id] = n
        if n % _OPEN_AFTER == 0 and self._private.usable(dst):
            try:
                self.pool.submit(self._open_idle, dst)
            except ClosedError:
                pass

    def _open_idle(self, dst: WorkerInfo) -> None:
        private = self._private
        if private.has_idle(dst.id) or not self._running():
            return
        try:
            conn = private.checkout(dst)
        except RpcError:
            return  # the calls over the shared connection report what is wrong
        if conn is not None:
            private.checkin(dst, conn)

    def _start(self, conn: Connection, dst: WorkerInfo, rid: int, future: RpcFuture) -> Burst:
        """Make private connection ``conn``, which carries request ``rid`` (its reply
        parked, unclaimed), this thread's burst connection to ``dst``."""
        burst = Burst(self, conn, dst)
        burst.out[rid] = future
        future._claim = burst.claim
        by_rank = getattr(self._mine, "by_rank", None)
        if by_rank is None:
            by_rank = self._mine.by_rank = {}
        by_rank[dst.id] = burst
        with self._lock:
            self._all.append(burst)
        return burst

    def route(self, burst: Burst) -> Route:
        """The route of a call on ``burst`` (room made for it first)."""
        if len(burst.out) >= _MAX_OUT:
            self._make_room(burst)
        return burst.route

    def send(self, route: Route, rid: int, p: "Pending", kind: int, flags: int, env: bytes,
             bufs: Any, keep: Any) -> None:
        """Send request ``rid`` on the route's burst; its reply is read as the module docs
        say."""
        burst = route.held
        future = p.future
        calls = self._calls
        if len(env) > _MAX_BYTES or bufs and len(env) + nbytes(bufs) > _MAX_BYTES:
            # Large: over the shared connection, whose reader takes the reply, so that
            # this thread never blocks in a send while the callee blocks in one to it.
            calls.transmit(None, rid, p, kind, flags, env, bufs, keep)
            return
        burst.out[rid] = future
        if not calls.transmit(burst.conn, rid, p, kind, flags | _wire.FLAG_MANY, env, bufs,
                              keep):
            burst.out.pop(rid, None)
            return
        future._claim = burst.claim
        burst.calls += 1
        if burst.calls % _DRAIN_EVERY == 0:
            self.drain(burst)

    def release(self, route: Route, dst: WorkerInfo) -> None:
        pass  # the burst keeps its connection

    def drain(self, burst: Burst) -> None:
        """Read the replies that have come on ``burst``, unless another thread reads it."""
        if not burst.lock.acquire(False):
            return
        try:
            self._read(burst, lambda: burst.ready(0.0))
        finally:
            burst.lock.release()

    def read_until(self, burst: Burst, finished: Callable[[], bool]) -> None:
        """Read ``burst`` until ``finished()`` or nothing is outstanding on it (a thread
        of the pool counts as blocked meanwhile)."""
        pool = current_pool()
        if pool is None:
            self._read_until(burst, finished)
        else:
            with pool.blocking():
                self._read_until(burst, finished)

    def _read_until(self, burst: Burst, finished: Callable[[], bool]) -> None:
        def more() -> bool:
            if finished() or not burst.out:
                return False
            if burst.ready(_WAKE):
                return True
            burst.quiet += 1
            return False

        while not finished():
            _prune(burst)
            if not burst.out:
                return
            if burst.lock.acquire(timeout=_WAKE):
                try:
                    self._read(burst, more)
                finally:
                    burst.lock.release()

    def _make_room(self, burst: Burst) -> None:
        half = _MAX_OUT // 2
        self.read_until(burst, lambda: len(burst.out) < half)

    def _read(self, burst: Burst, more: Callable[[], bool]) -> None:
        """Holding ``burst``'s lock: read and settle frames while ``more()``, as a reader
        thread (callbacks of the futures it completes go to the pool)."""
        out = burst.out

        def took(header: Header) -> None:
            burst.last = time.monotonic()
            out.pop(header.request_id, None)

        def settled(header: Header) -> None:
            if header.kind == _ERROR:
                burst.errors += 1

        was_reader = on_reader_thread()
        mark_reader_thread()
        try:
            error = read_replies(burst.conn, self._calls, None, None, more, took, settled)
            if error is not None:
                self._lost(burst, error)
        finally:
            mark_reader_thread(was_reader)

    def _lost(self, burst: Burst, exc: BaseException) -> None:
        burst.errors += 1
        calls = self._calls
        for rid in list(burst.out):
            burst.out.pop(rid, None)
            calls.request_lost(rid, burst.dst, exc)
        self._forget(burst)

    def _forget(self, burst: Burst) -> None:
        with self._lock:
            try:
                self._all.remove(burst)
            except ValueError:
                pass

    def tick(self, now: float) -> None:
        """Timer: have the pool read replies nobody read for a tick; give back the
        connections of threads that have ended."""
        if not self._all:
            return
        with self._lock:
            bursts = list(self._all)
        for burst in bursts:
            if burst.conn.closed:
                self._forget(burst)
            elif burst.out:
                _prune(burst)
                if burst.out and now - burst.last > LENT_TICK and not burst.lock.locked():
                    burst.last = now
                    snapshot = list(burst.out.values())
                    try:
                        self.pool.submit(self.read_until, burst,
                                         lambda s=snapshot: all(_done(f) for f in s))
                    except ClosedError:
                        return
            elif not burst.thread.is_alive():
                self._forget(burst)
                self._private.checkin(burst.dst, burst.conn)

    def clear(self) -> None:
        """The agent stops: forget every burst (shutdown fails their requests)."""
        with self._lock:
            self._all.clear()


def _prune(burst: Burst) -> None:
    """Forget the requests of ``burst`` that are settled without their reply (timed out,
    failed): their replies may never come."""
    out = burst.out
    for rid, fut in list(out.items()):
        if _done(fut):
            out.pop(rid, None)
