"""The table of outstanding requests: pending calls, their deadlines, retries, and
failing them by peer or by connection.

Theory of operation. A request that gets a reply (and a one-way request with a retry
policy) has an entry in the table, by request id, from when it is sent until it is
settled. Whoever pops the entry settles it: the reply that arrives, the timer at the
deadline, a broken connection, a lost peer, shutdown; the others find it gone. The table
has no lock: it changes by single dict operations, which the GIL makes atomic, and is
read by copying its keys (see docs/design.md, "Snapshots of shared tables").

Deadlines wait in a heap that the timer looks at (:meth:`Requests.expire_due`, a tick
hook); an entry whose request is settled early stays in the heap until its deadline, and
the heap is rebuilt when such entries make up most of it.

A request with a retry policy that fails on its connection is put back in the table and
sent again after the policy's backoff, as the same frame under the same deadline; one
marked at most once (FLAG_ONCE) that may have arrived asks the callee first (the agent's
probes). Remote errors and timeouts are never retried, nor are requests to a peer
declared lost.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from .. import _wire
from .._wire import Kind
from ..errors import ConnectionLostError, RpcError, RpcTimeoutError
from .debug import TimeoutReports
from .hooks import describe
from .lifecycle import RUNNING, Lifecycle
from .pending import Pending
from .retry import retryable
from .worker import WorkerInfo

log = logging.getLogger(__name__)


class Requests:
    """One agent's table of outstanding requests (:attr:`pending`) and their deadlines.

    ``name``, ``rank``: the agent's; ``cv``: the timer's condition (a deadline earlier
    than all others wakes it) and ``lock``, its own lock; ``lifecycle``: whether the
    agent runs (a stopping one retries nothing); ``timeout_reports``: what a timeout
    logs; ``declared(rank)``: whether liveness declared worker ``rank`` lost (never
    retried); ``call_later(delay, fn, *args)``: the timer's. The caller's side does the
    sending again: ``transmit(conn, rid, p, kind, flags, env, bufs, keep)`` and
    ``probe_later(dst, rid, delay)`` (Calls.transmit and Probes.later).
    """

    def __init__(self, name: str, rank: int, cv: threading.Condition, lock: Any,
                 lifecycle: Lifecycle, timeout_reports: TimeoutReports,
                 declared: Callable[[int], bool], call_later: Callable[..., None],
                 transmit: Callable[..., bool],
                 probe_later: Callable[[WorkerInfo, int, float], None]) -> None:
        self._name = name
        self._rank = rank
        self._cv = cv  # the timer's: a deadline earlier than all others wakes it
        self._lock = lock  # cv's own lock, taken without the Condition's Python wrapper
        self._lifecycle = lifecycle
        self._timeout_reports = timeout_reports
        self._declared = declared
        self._call_later = call_later
        self._transmit = transmit
        self._probe_later = probe_later
        self.pending: Dict[int, Pending] = {}
        self._heap: List[Tuple[float, int]] = []  # (deadline, request id)

    def add(self, rid: int, p: Pending, deadline: Optional[float]) -> None:
        """Enter request ``rid``; the timer fails it at ``deadline`` (None: never)."""
        self.pending[rid] = p
        if deadline is not None:
            with self._lock:
                heap = self._heap
                heapq.heappush(heap, (deadline, rid))
                if heap[0][1] == rid:
                    self._cv.notify()

    def due(self, now: float) -> Tuple[List[int], Optional[float]]:
        """Under the timer's lock: the ids of requests whose deadline has passed (taken
        off the heap), and the next deadline (None if there is none)."""
        expired = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            expired.append(heapq.heappop(heap)[1])
        pending = self.pending
        if len(heap) > 1024 and len(heap) > 4 * len(pending):
            self._heap = heap = [e for e in heap if e[1] in pending]
            heapq.heapify(heap)
        return expired, (heap[0][0] if heap else None)

    def expire_due(self, now: float, failed: Callable[[BaseException], None]) -> Optional[float]:
        """Timer: fail the requests whose deadline passed by ``now`` (``failed(exc)``
        reports one that could not be failed, and the others still are); return the next
        deadline (None if there is none)."""
        with self._lock:
            expired, deadline = self.due(now)
        for rid in expired:
            try:
                self.expire(rid)
            except Exception as exc:  # noqa: BLE001 - the other deadlines still fire
                failed(exc)
        return deadline

    def expire(self, rid: int) -> None:
        p = self.pending.pop(rid, None)
        if p is not None:
            self.time_out(p)

    def time_out(self, p: Pending) -> None:
        """Fail request ``p`` (already out of the table) with the timeout error."""
        if p.stats is not None:
            p.stats.timeouts += 1
        reports = self._timeout_reports
        if reports.enabled and p.dst.id != self._rank:
            reports.report(p.dst, p.what, p.timeout)
        p.set_exception(RpcTimeoutError(
            f"RPC ran for more than set timeout ({p.timeout * 1000:g} ms) and will now be "
            f"marked with an error: the call to worker {p.dst.name} (rank {p.dst.id}) of "
            f"{describe(p.what)} timed out after {p.timeout:g} s; pass a larger timeout= "
            f"or raise the options' rpc_timeout"))

    def fail(self, rid: int, p: Pending, error: BaseException) -> None:
        """Fail request ``rid`` (already out of the table), or schedule its next attempt."""
        r = p.resend
        if r is not None and retryable(error) and self._lifecycle.state is RUNNING \
                and not self._declared(p.dst.id):
            if r.scheduled:  # failed twice (its reader and its peer's loss): resent once
                self.pending[rid] = p
                return
            if r.attempt < r.policy.max_attempts:
                delay = r.policy.backoff(r.attempt)
                if r.deadline is None or time.monotonic() + delay < r.deadline:
                    r.attempt += 1
                    r.scheduled = True
                    r.probing = False
                    self.pending[rid] = p
                    log.info("%s retries %s to %s in %.3g s (attempt %d of %d): %s",
                             self._name, describe(p.what) if p.what else Kind(r.kind).name,
                             p.dst.name, delay, r.attempt, r.policy.max_attempts, error)
                    if r.sent and r.flags & _wire.FLAG_ONCE:
                        self._probe_later(p.dst, rid, delay)
                    else:
                        self._call_later(delay, self.resend, rid)
                    return
            if r.attempt > 1:
                error = ConnectionLostError(f"{error} (gave up after {r.attempt} attempts)",
                                            worker=getattr(error, "worker", None))
        p.set_exception(error)

    def resend(self, rid: int) -> None:
        """Send the next attempt of request ``rid``, if it still waits for one."""
        p = self.pending.get(rid)
        if p is None or p.resend is None:
            return  # timed out or answered meanwhile
        r = p.resend
        r.scheduled = False
        self._transmit(None, rid, p, r.kind, r.flags, r.env, r.bufs, r.keep)

    def fail_matching(self, match: Callable[[Pending], bool], error: RpcError) -> None:
        """Fail (or retry) the pending requests for which ``match`` is true."""
        pending = self.pending
        for rid in list(pending):  # the keys: one C-level copy, see docs/design.md
            p = pending.get(rid)
            if p is not None and match(p) and pending.pop(rid, None) is not None:
                self.fail(rid, p, error)

    def fail_peer(self, rank: int, error: RpcError) -> None:
        """Fail (or retry) every request pending on worker ``rank``."""
        self.fail_matching(lambda p: p.dst.id == rank, error)

    def fail_all(self, error_of: Callable[[Pending], BaseException]) -> None:
        """Fail every pending request, with no retry, with ``error_of(request)``."""
        pending = self.pending
        for rid in list(pending):
            p = pending.pop(rid, None)
            if p is not None:
                p.set_exception(error_of(p))
