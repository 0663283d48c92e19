"""Which thread reads a connection, and how that moves between threads (``ReadingRole``,
held as ``agent.inbound.role``).

Reading is a role, not a thread: whichever thread runs a connection's ``read_frames``
holds it (``_transport/reader.py``). The frame callback returns None to read on, or a
callable once the role has gone to another thread; the reader then stops, touches no
read state of the connection and runs the callable. :data:`HANDED` is that callable when
the thread has nothing else to do. All the moves of the role are :class:`ReadingRole`'s.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Set

from .._threads import Guard
from .._transport import Connection
from .._wire import Kind
from ..errors import ClosedError
from .futures import mark_reader_thread
from .pool import WorkerPool, current_pool

if TYPE_CHECKING:
    from .scheduler import Scheduler

# A request running on its reading thread for longer than this hands the reading role on.
INLINE_LIMIT = 0.01
_inline = threading.local()  # .conn: the connection whose reading role this thread lends


def HANDED() -> None:
    """The work of a reader that handed its role on and has nothing else to do."""


class ReadingRole:
    """The reading roles of one agent's connections, and their hand-offs.

    The rules:

    1. The transport's own thread reads first; as soon as the pool has an idle thread,
       the role moves into the pool (:meth:`to_pool`), where a reading thread counts as
       blocked (it waits for the network, not for work).
    2. A pool thread that reads a request runs it itself, at once (no other thread is
       woken: a wake-up and the GIL hand-over that follows cost more than a small request
       does). Meanwhile the role is *lent* (:meth:`run_inline`).
    3. A lent role goes to another pool thread the moment the request blocks on an RPC
       (the pool's ``on_block`` calls :meth:`lend_out`), so a nested call, even back to
       the caller over this very connection, never waits for itself;
    4. and the timer hands it on (:meth:`check_lent`) when the request runs for longer
       than ``INLINE_LIMIT`` without returning (blocked on a lock, sleeping, computing),
       so one slow request holds the frames behind it up for INLINE_LIMIT plus a tick at
       most. Only shared connections, and private ones that carry a caller's burst
       (:meth:`carries_many`), need that: on any other private connection the caller
       waits for this very reply. So the timer ticks fast (LENT_TICK) only while such a
       role is lent, or was since its last tick (:meth:`lends_shared`).
    5. A reader whose role went elsewhere stops reading when its request returns.
    """

    def __init__(self, name: str, pool: WorkerPool, scheduler: "Scheduler") -> None:
        self._name = name  # the agent's, for the error of a request that failed inline
        self._pool = pool
        self._scheduler = scheduler
        self._lent: Dict[Connection, float] = {}  # roles lent to inline requests, since
        # Whether a request was served inline on a shared connection (or a burst's) since
        # the timer last asked: it keeps ticking fast meanwhile (see lends_shared).
        self._served = False
        # Callee side: the private connections whose caller has several requests on them
        # at once (FLAG_MANY, the caller's bursts), served as shared ones. A plain set,
        # which every request served looks in; the timer drops the closed ones.
        self._many: Set[Connection] = set()
        pool.on_block = self.lend_out  # rule 3

    def carries_many(self, conn: Connection) -> None:
        """Private connection ``conn`` carries a burst (its caller said so)."""
        self._many.add(conn)

    def _watched(self, conn: Connection) -> bool:
        return not conn.private or conn in self._many

    def run_inline(self, conn: Connection, serve: Callable[..., None], src: Any,
                   header: Any, *args: Any) -> Optional[Callable[[], None]]:
        """This thread, which holds ``conn``'s role, runs ``serve(src, header, *args)``,
        a request it read, lending the role meanwhile (rule 2); then None if it holds
        the role still (it reads on), else :data:`HANDED` (rule 5). An error of
        ``serve`` is logged: it must not reach a reader that lent its role."""
        lent = self._lent
        # _lent is changed with single dict operations, which the GIL makes atomic.
        lent[conn] = time.monotonic()
        if not conn.private or conn in self._many:  # _watched
            self._served = True
            scheduler = self._scheduler
            if scheduler.slow:
                scheduler.wake()  # it set slow before it looked at _lent and _served
        _inline.conn = conn
        try:
            serve(src, header, *args)
        except Exception as exc:  # noqa: BLE001 - logged, see above
            Guard(f"serving a {Kind(header.kind).name} from {src.name} on {self._name}",
                  limit=None).failed(exc)
        finally:
            _inline.conn = None
            kept = lent.pop(conn, None) is not None
        return None if kept else HANDED

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
            if not self._pool.hand_off(self.keep_reading, conn):
                self._pool.submit(self.keep_reading, conn)
        except ClosedError:
            pass  # the pool is shut down, and with it the connection

    def check_lent(self, now: float) -> None:
        """Timer: hand on the reading role of requests that run inline for too long;
        forget the burst connections that closed."""
        many = self._many
        if many:
            for conn in list(many):  # a C-level copy: the set changes on other threads
                if conn.closed:
                    many.discard(conn)
        if not self._lent:
            return
        lent = self._lent
        overdue = [c for c in list(lent) if now - lent.get(c, now) > INLINE_LIMIT]
        for conn in overdue:
            self.lend_out(conn)

    def lends_shared(self) -> bool:
        """Whether a shared connection's reading role is lent, or was since the last
        call (the timer then ticks fast, to hand it on in time). Counting the roles lent
        meanwhile keeps a stream of short requests from waking the timer at each one: it
        stays fast until a tick finds none."""
        served, self._served = self._served, False
        return served or any(self._watched(c) for c in list(self._lent))

    def to_pool(self, conn: Connection) -> Optional[Callable[[], None]]:
        """On a transport thread: move the reading role into the pool if a thread is
        idle (rule 1); what the frame callback returns."""
        if current_pool() is not self._pool and self._pool.hand_off(self.keep_reading, conn):
            return HANDED
        return None

    def keep_reading(self, conn: Connection) -> None:
        """A pool task: hold the reading role of ``conn`` until it moves on or ends."""
        with self._pool.blocking():
            work = conn.read_frames()
        if work is not None:
            work()
