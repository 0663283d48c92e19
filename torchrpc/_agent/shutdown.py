"""The agent's lifecycle and its shutdown protocol.

Theory of operation. An agent goes through four states, each entered once, in order::

    NEW --start()--> RUNNING --+-- graceful: all replies are out --+--> STOPPING --> STOPPED
                               +-- not graceful, failed, elastic --+

- ``NEW``: built; the rendezvous is under way. A peer that finished it first may connect
  already (its frames wait until ``init_rpc`` has installed every layer), but nothing is
  sent from here and the API refuses calls.
- ``RUNNING``: a member of the group: calls go out, requests are served, connections open
  on demand. A graceful shutdown does most of its work in this state, for until every
  worker has passed the first barrier below the others may still be calling this one.
- ``STOPPING``: no new calls (the API raises :class:`NotInitializedError`), but the open
  connections still carry replies and GOODBYEs, and one can still be opened. A broken
  connection is no longer news; a connection made now is told GOODBYE at once, as it may
  have come too late for the GOODBYEs already said.
- ``STOPPED``: closed: every pending call has failed, every thread this agent started is
  joined, the pool is closed, the store is let go. No state follows.

The states, the table of transitions and the object that holds the current state are
in lifecycle.py; :meth:`Shutdown.enter` (which ``startup`` also calls, for ``RUNNING``) is
the one caller of :meth:`Lifecycle.enter`.

Graceful shutdown of a fixed group meets every worker at three store barriers:

1. Finish this worker's work: the upper layers' shutdown hooks settle their control
   messages (the RRef layer's forks and deletions), then the outstanding requests are
   waited for. Barrier ``shutdown/1``: every worker has stopped calling on its own.
2. ``meet()`` runs torch's steps (programs may replace them): wait for all workers, delete
   the user RRefs. Their messages are finished as in 1. Barrier ``shutdown/2``: every
   reply is out, so nobody will send this worker a request again.
3. Enter ``STOPPING``. Barrier ``shutdown/3``: rank 0, which usually hosts the store,
   waits up to 30 s (never past the shutdown's deadline) for every worker to count in
   there before it stops (and takes the store with it); the others count in and go on
   at once.

While it waits (for its requests, or at barriers 1 and 2), a worker checks its peers
(:meth:`Shutdown.check_peers`): a peer whose connection broke without a GOODBYE and that
cannot be reached again is gone, and shutdown fails with a :class:`ShutdownError` naming
it instead of waiting forever. Losses are shared through the store (``lost/<rank>``, a
sealed record like each arrival at a barrier: see barriers.py), the workers missing
from a barrier are probed by connecting to them, and a worker that said
GOODBYE without reaching the barrier (its own shutdown failed, or was not graceful) fails
it at once. A worker that left early has usually found a dead one and said so in the
store first, so a departure makes the others read the store's losses at once, and the
dead worker is named before the one that left.

A dynamic (elastic) group has no barriers, as members come and go: a graceful shutdown
finishes its work twice (the RRef layer settles forks, then deletes user RRefs) and stops;
stopping announces the departure in the membership log.

A shutdown that is not graceful (``graceful=False``, a failed agent, an ``init_rpc`` that
failed after the rendezvous) stops at once; so does a graceful one whose step failed,
which then raises that step's error (an error of ``meet`` as it is, others as a
:class:`ShutdownError`). Every shutdown ends in :meth:`Shutdown.stop`: enter ``STOPPING``,
say GOODBYE on every shared connection (a peer that reads it fails at once, with
:class:`WorkerLeftError`, the calls it has pending here, and sends nothing more), run the
upper layers' stop hooks, enter ``STOPPED`` (the timer's callbacks are dropped), then fail
what is still pending and close the transport, the coroutine loop, the threads and the
pool. The one deadline of a shutdown (its ``timeout``, counted from its start) bounds
every wait: the barriers, the outstanding requests, and the joins of the threads, which
together wait :data:`STOP_WAIT` seconds at most even without a timeout.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional

from .._transport import Transport
from ..errors import (BarrierTimeoutError, NotInitializedError, RpcError,
                      ShutdownError, ThreadFailedError)
from .._rendezvous import barriers
from .._rendezvous.secret import discard_local as discard_local_secret
from .connections import Connections, goodbye
from .coroutines import CoroutineRunner
from .hooks import describe
from .lifecycle import RUNNING, STOPPED, STOPPING, Lifecycle, State
from .liveness import Liveness
from .pool import WorkerPool
from .registry import Registry
from .scheduler import Scheduler

if TYPE_CHECKING:
    from .requests import Requests

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Parts:
    """What the shutdown protocol uses: this worker's place in the group, the parts it
    waits for, checks and stops, and the agent's store and transport, which change (the
    store is sealed at start, and let go of once stopped)."""

    name: str
    rank: int
    world_size: Optional[int]
    elastic: bool
    lock: "threading.Lock"  # the agent's: it guards the tables of peers read here
    registry: Registry
    connections: Connections
    requests: "Requests"
    scheduler: Scheduler
    liveness: Liveness
    coroutines: CoroutineRunner
    pool: WorkerPool
    clear_lanes: Callable[[], None]  # drop the idle private connections and parked calls
    store: Callable[[], Any]  # the agent's store; None once let go of
    drop_store: Callable[[], None]
    transport: Callable[[], Optional[Transport]]
    debug_info: Callable[[], Dict[str, Any]]  # the agent's counters, kept as it stops
    shutdown_hooks: List[Callable[[Optional[float]], None]]  # the upper layers', in order
    stop_hooks: List[Callable[[float], None]]


STOP_WAIT = 15.0
"""The most seconds stopping waits for the agent's threads to end, all of them together."""

LAST_BARRIER_WAIT = 30.0
"""The most seconds rank 0 waits at the last barrier for the others to count in."""

def _arrived(parts: Parts, barrier: str, rank: int) -> bool:
    """Whether worker ``rank`` reached ``barrier`` of :data:`barriers.SHUTDOWN` or a later
    one."""
    return barriers.arrived(parts.store(), barrier, rank, barriers.after(barrier))


def _meet(parts: Parts, barrier: str, deadline: Optional[float],
          check_peers: Optional[Callable[[str], None]] = None) -> None:
    """Wait at ``barrier`` of :data:`barriers.SHUTDOWN` until the whole group is in (see
    :func:`barriers.barrier`); ``check_peers(barrier)`` may raise to stop waiting."""
    check = None if check_peers is None else (lambda: check_peers(barrier))
    barriers.barrier(parts.store(), barrier, parts.world_size, deadline, check,
                     rank=parts.rank, later=barriers.after(barrier))


REPORT_WAIT = 5.0
"""Seconds a graceful shutdown waits for outstanding requests before it logs which, and
again every as many seconds after."""


def _earlier(when: float, deadline: Optional[float]) -> float:
    """``when``, or ``deadline`` if there is one and it comes first."""
    return when if deadline is None else min(when, deadline)


def _left(until: float) -> float:
    """Seconds from now until ``until`` (a ``time.monotonic()``), at least 0."""
    return max(until - time.monotonic(), 0.0)


def _check_left(parts: Parts, barrier: str) -> None:
    """Raise if a worker stopped (it said GOODBYE) while ``barrier`` is not complete:
    one that never reached it failed its shutdown or did not make it graceful; one
    that reached it left early, so its shutdown failed (a worker it waited for died).
    Either way the count will not complete. :func:`barriers.barrier` reads the count
    again before raising, so a worker that left a complete barrier is not counted."""
    with parts.lock:
        workers = parts.registry.workers
        left = [(r, workers[r]) for r in sorted(parts.registry.left) if r in workers]
    if not left:
        return
    missing = [(r, w) for r, w in left if not _arrived(parts, barrier, r)]
    if missing:
        names = ", ".join(f"{w.name} (rank {r})" for r, w in missing)
        raise ShutdownError(f"graceful shutdown of {parts.name} cannot complete: worker(s) "
                            f"{names} stopped before reaching it (their shutdown failed "
                            f"or was not graceful); shut every worker down the same way")
    names = ", ".join(f"{w.name} (rank {r})" for r, w in left)
    raise ShutdownError(f"graceful shutdown of {parts.name} cannot complete: worker(s) "
                        f"{names} stopped while the group waited at the shutdown "
                        f"barrier, so their shutdown failed, most likely because a worker "
                        f"died; their errors name it")


def _gone_error(parts: Parts, gone: Dict[int, str]) -> ShutdownError:
    """The error naming the workers of ``gone`` (rank -> why), which died."""
    def name(r: int) -> str:
        w = parts.registry.workers.get(r)
        return w.name if w is not None else f"rank{r}"
    names = ", ".join(f"{name(r)} (rank {r})" for r in sorted(gone))
    reasons = "; ".join(f"{name(r)}: {gone[r]}" for r in sorted(gone))
    return ShutdownError(f"graceful shutdown of {parts.name} cannot complete: worker(s) "
                         f"{names} left the group without shutting down; they probably "
                         f"died ({reasons})")


class Shutdown:
    """One agent's lifecycle transitions and shutdown protocol (see the module docs). Its
    tables of peers are guarded by the agent's lock (see :class:`Parts`)."""

    def __init__(self, parts: Parts, lifecycle: Lifecycle) -> None:
        self._parts = parts
        self._lifecycle = lifecycle
        self._lock = parts.lock
        self._shutdown_hooks = parts.shutdown_hooks
        self._stop_hooks = parts.stop_hooks
        # Set when a background thread cannot go on (see fail): every API call raises it.
        self.failure: Optional[ThreadFailedError] = None
        self.final_debug_info: Dict[str, Any] = {}  # the agent's counters as it stopped
        self.gone: Dict[int, str] = {}  # rank -> why: lost, and connecting again failed
        self._shared_lost: set[int] = set()  # ranks this worker told the store it lost
        self._lost_seen = 0  # the store's count of losses when last looked at
        self._left_seen = 0  # how many workers had left when check_peers last looked
        self._next_share = 0.0
        self._next_probe: Optional[float] = None
        self.deadline: Optional[float] = None  # of the graceful shutdown under way

    # -- transitions -------------------------------------------------------------------------------

    def enter(self, target: State) -> None:
        """Move the agent to state ``target``; :class:`LifecycleError` if it may not."""
        self._lifecycle.enter(target)

    # -- graceful shutdown -------------------------------------------------------------------------

    def shutdown(self, graceful: bool = True, timeout: float = 0,
                 meet: Optional[Callable[[], None]] = None) -> None:
        """:meth:`Agent.shutdown`."""
        parts = self._parts
        if self._lifecycle.state is not RUNNING:
            return
        deadline = time.monotonic() + timeout if timeout and timeout > 0 else None
        self.deadline = deadline
        error: Optional[BaseException] = None
        in_meet = False  # an error of ``meet`` is raised as it is
        last = False  # at the last barrier, which ranks other than 0 only count in at
        if graceful and parts.elastic:
            try:
                for _ in range(2):  # the RRef layer settles forks, then deletes user RRefs
                    self._finish_work(deadline)
            except (RpcError, RuntimeError) as exc:
                error = exc
        elif graceful:
            try:
                self._finish_work(deadline)
                _meet(parts, barriers.SHUTDOWN[0], deadline, self.check_peers)
                in_meet = meet is not None
                if meet is not None:
                    meet()
                in_meet = False
                self._finish_work(deadline)
                _meet(parts, barriers.SHUTDOWN[1], deadline, self.check_peers)
                self.enter(STOPPING)
                now, last = time.monotonic(), True
                until = _earlier(now + LAST_BARRIER_WAIT, deadline) if parts.rank == 0 else now
                _meet(parts, barriers.SHUTDOWN[2], until)
            except Exception as exc:  # noqa: BLE001 - the agent stops first, then raises it
                error = exc
        self.stop(deadline)
        if self.failure is not None:
            self.raise_failure()
        if in_meet:
            raise error
        if isinstance(error, ShutdownError):
            raise error
        # Ranks other than 0 do not wait at the last barrier; an earlier timeout is a failure.
        if error is not None and not (last and parts.rank != 0
                                      and isinstance(error, BarrierTimeoutError)):
            raise ShutdownError(f"graceful shutdown of {parts.name} failed: {error}") from error

    def _finish_work(self, deadline: Optional[float]) -> None:
        """Run the upper layers' shutdown hooks, then wait for the outstanding requests.
        Not on a failed agent: the hooks may wait for the very thread that failed (its
        pending requests have failed already), so it only meets the group."""
        if self.failure is not None:
            return
        for hook in self._shutdown_hooks:
            hook(deadline)
        self._wait_pending(deadline)

    def _wait_pending(self, deadline: Optional[float]) -> None:
        delay = 0.001
        pending = self._parts.requests.pending
        report_at = time.monotonic() + REPORT_WAIT
        while pending:
            self.check_peers()
            now = time.monotonic()
            if deadline is not None and now > deadline:
                raise ShutdownError(f"{len(pending)} RPCs still outstanding at shutdown: "
                                    f"{self.outstanding()}")
            if now > report_at:
                log.warning("shutdown of %s waits for %d outstanding RPCs: %s",
                            self._parts.name, len(pending), self.outstanding())
                report_at = now + REPORT_WAIT
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def outstanding(self, limit: int = 3) -> str:
        """The oldest ``limit`` outstanding requests: what, to whom, since when, and their
        timeouts (for the messages of a shutdown that waits for them)."""
        now = time.monotonic()
        oldest = sorted(list(self._parts.requests.pending.values()), key=lambda p: p.sent)
        said = [f"{describe(p.what)} to {p.dst.name} (sent {now - p.sent:.1f} s ago, "
                + (f"timeout {p.timeout:g} s)" if p.timeout > 0 else "no timeout)")
                for p in oldest[:limit]]
        if len(oldest) > limit:
            said.append(f"and {len(oldest) - limit} more")
        return "; ".join(said) or "none"

    # -- peers that are gone -----------------------------------------------------------------------

    def fail(self, error: ThreadFailedError) -> None:
        """:meth:`Agent.fail`: a background thread cannot go on."""
        parts = self._parts
        if self.failure is not None or (self._lifecycle.state is not RUNNING
                                         and self._lifecycle.state is not STOPPING):
            return
        self.failure = ThreadFailedError(
            f"the RPC agent of {parts.name} has failed: {error}; call rpc.shutdown() and "
            f"init_rpc() again")
        self.failure.__cause__ = error.__cause__
        log.error("%s", self.failure)
        parts.requests.fail_all(lambda p: self.failure)

    def raise_failure(self) -> None:
        """Raise a copy of the agent's failure (a copy: raising one object again and
        again would grow its traceback)."""
        failure = self.failure
        error = ThreadFailedError(str(failure))
        raise error from failure.__cause__

    def forget(self, rank: int) -> None:  # under the lock: a new worker took ``rank``
        self.gone.pop(rank, None)

    def check_peers(self, barrier: Optional[str] = None) -> None:
        """Raise :class:`ShutdownError` naming any worker that is gone.

        A worker is gone when its connection broke without a GOODBYE (seen here, or by
        another worker and told through the store) and connecting to it again fails.
        While waiting at the store barrier ``barrier``, the workers that have not
        arrived are probed as well, and one that stopped without arriving is named.
        """
        parts = self._parts
        at_barrier = parts.store() is not None and barrier is not None
        if parts.store() is not None:
            with self._lock:
                left = len(parts.registry.left)
            # A worker that left early told the store which worker it found dead before
            # leaving: on a new departure read that now, so that the dead worker is named
            # rather than it.
            self._share_lost(now=left != self._left_seen)
            self._left_seen = left
            if at_barrier:
                self._probe_absent(barrier)
        self._raise_gone()
        if at_barrier:
            _check_left(parts, barrier)

    def _raise_gone(self) -> None:
        """Raise :class:`ShutdownError` naming the lost workers that cannot be reached
        again (see :meth:`check_peers`)."""
        parts = self._parts
        with self._lock:
            lost = [r for r in parts.connections.lost
                    if r not in parts.registry.left and r not in self.gone]
        for r in lost:
            w = parts.registry.workers.get(r)
            if w is None:
                continue
            try:
                # a live worker reconnects, within the shutdown's deadline
                parts.connections.to(w, patient=True, limit=self._time_left())
            except RpcError as exc:
                with self._lock:
                    self.gone[r] = str(exc)
        with self._lock:
            gone = {r: why for r, why in self.gone.items() if r not in parts.registry.left}
        if gone:
            if parts.store() is not None:
                # Tell the others now: this worker stops after raising, and one that never
                # connected to the lost worker would wait at a barrier for it.
                self._share_lost(now=True)
            raise _gone_error(parts, gone)

    def _share_lost(self, now: bool = False) -> None:
        """Tell the store which workers this one found gone, and learn which the others
        found (at most five times a second, unless ``now``)."""
        parts = self._parts
        t = time.monotonic()
        if t < self._next_share and not now:
            return
        self._next_share = t + 0.2
        store = parts.store()
        with self._lock:
            gone = list(self.gone.items())
        for r, why in gone:
            if r not in self._shared_lost and r not in parts.registry.left:
                self._shared_lost.add(r)
                barriers.mark_lost(store, r, f"{parts.name} lost it: {why}")
        seen = int(store.add("lost", 0))
        if seen == self._lost_seen:
            return
        self._lost_seen = seen
        with self._lock:
            ranks = list(parts.registry.workers)
        for r in ranks:
            why = None
            if r != parts.rank and r not in parts.connections.lost and r not in parts.registry.left:
                why = barriers.lost(store, r)
            if why is not None:
                with self._lock:
                    parts.connections.note_lost(r, why)
                self._shared_lost.add(r)

    def _probe_absent(self, barrier: str) -> None:
        """Probe the workers that have not reached ``barrier`` (after half a second, then
        once a second)."""
        parts = self._parts
        now = time.monotonic()
        if self._next_probe is None:
            self._next_probe = now + 0.5  # most workers arrive quickly: don't probe them
        if now < self._next_probe:
            return
        self._next_probe = now + 1.0
        with self._lock:
            ranks = list(parts.registry.workers)
        self.probe([r for r in ranks
                    if r != parts.rank and not _arrived(parts, barrier, r)])

    def probe(self, ranks: Iterable[int]) -> None:
        """:meth:`Agent.probe`."""
        parts = self._parts
        for r in ranks:
            with self._lock:
                w = parts.registry.workers.get(r)
                if w is None or r == parts.rank or r in parts.registry.left \
                        or r in parts.connections.lost:
                    continue
            try:
                # once connected, EOF and heartbeats watch it
                parts.connections.to(w, limit=self._time_left())
            except RpcError as exc:
                with self._lock:
                    why = self.gone[r] = f"unreachable while the group shuts down: {exc}"
                    parts.connections.note_lost(r, why)
                log.warning("%s: worker %s (rank %d) did not reach shutdown and "
                            "cannot be reached: %s", parts.name, w.name, r, exc)

    # -- stopping ----------------------------------------------------------------------------------

    def _time_left(self) -> Optional[float]:
        """Seconds left to the graceful shutdown under way; None without a deadline."""
        return None if self.deadline is None else _left(self.deadline)

    def stop(self, deadline: Optional[float] = None) -> None:
        """Stop the agent, graceful or not (see the module docs). Waiting for its threads
        to end takes :data:`STOP_WAIT` seconds at most, all of them together, and ends
        at ``deadline`` (a ``time.monotonic()``) if that comes first."""
        parts = self._parts
        until = _earlier(time.monotonic() + STOP_WAIT, deadline)
        if self._lifecycle.state is not STOPPING:  # a graceful shutdown entered it already
            self.enter(STOPPING)
        self.final_debug_info = parts.debug_info()
        if parts.elastic:
            parts.registry.leave(_left(until))  # stop following the membership log, announce it
        # The secret file this process made as rank 0: joiners and inspectors read it while
        # the agent runs (a dynamic group whose store outlives rank 0 keeps it).
        discard_local_secret()
        for conn in parts.connections.every_shared():
            goodbye(conn)
        for hook in self._stop_hooks:
            try:
                hook(until)
            except Exception:  # noqa: BLE001 - one layer must not stop the others' cleanup
                log.exception("a stop hook of %s failed", parts.name)
        self.enter(STOPPED)
        parts.scheduler.stop()  # callbacks not yet due are dropped
        parts.liveness.stop()
        parts.requests.fail_all(lambda p: NotInitializedError(
            f"RPC agent of {parts.name} shut down before the reply from {p.dst.name} "
            f"to {describe(p.what)} arrived"))
        parts.clear_lanes()
        transport = parts.transport()
        stuck = transport.close(_left(until)) if transport is not None else []
        stuck += parts.coroutines.close(_left(until))
        stuck += parts.scheduler.join(_left(until)) + parts.liveness.join(_left(until))
        stuck += parts.pool.close(_left(until))
        if stuck:  # the interpreter's exit joins them (_threads.at_exit)
            log.warning("%d threads of %s still run after shutdown's wait: %s",
                        len(stuck), parts.name, ", ".join(stuck))
        parts.drop_store()
