"""The agent's timer: one thread that runs every part's periodic duties, and callbacks
due later.

Theory of operation. Every part of the agent, and every layer above it, that must act
when nothing else happens registers a *tick hook* (:meth:`Scheduler.add_tick_hook`): the
agent's own (expiring the deadlines of requests, handing on reading roles lent too long,
reading parked replies nobody claimed, the pool's progress check and the transport's
housekeeping, the liveness check) first, then the RRef layer's and distributed autograd's.
Each round of the timer thread runs the callbacks that :meth:`Scheduler.call_later` made
due (on the worker pool, never on the timer), then every hook in the order they were
registered, on the timer thread: a hook must be quick and must not block. A hook that
raises spares the others; so does a callback that cannot be submitted.

A round comes every ``TICK`` (100 ms), and every ``LENT_TICK`` (20 ms) while some hook's
``pending()`` says it has work queued (a request runs long on a shared connection's
reading thread, releases or deletions wait to go out): on a small machine every wake-up
of a helper thread takes a CPU from the computation (docs/design.md, "A timer that
sleeps"). A round comes sooner for a callback due sooner, or for a hook that returned
the time it needs its next round by (the earliest deadline of a request); a new earliest
deadline or callback wakes the timer at once. The check of ``pending()`` races with work
that starts right after it: so the timer sets :attr:`Scheduler.slow` before it looks, and
work that starts on a shared connection's reading thread wakes it (:meth:`wake`) if the
flag is still set, to tick fast again.

Every hook of a round sees the one time the round started at (:attr:`Scheduler.now`).
:meth:`stop` ends the thread and drops the callbacks not yet due.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from typing import Any, Callable, List, Optional, Tuple

from .. import _threads
from .._threads import Guard
from ..errors import ClosedError
from .futures import mark_reader_thread
from .pool import WorkerPool

TICK = 0.1  # the timer wakes at least this often
LENT_TICK = 0.02  # ... and this often while a tick hook has work queued (see above)

# A tick hook returns None, or the time.monotonic() by which it needs the next round.
TickHook = Callable[[], Optional[float]]


class Scheduler:
    """One agent's timer thread, its tick hooks and its callbacks due later."""

    def __init__(self, pool: WorkerPool) -> None:
        self._pool = pool
        # Guards the callbacks' heap and the decision to sleep; the requests' deadline
        # heap shares it, so that a new earliest deadline wakes the timer.
        self.lock = threading.RLock()
        self.cv = threading.Condition(self.lock)
        self._hooks: List[TickHook] = []
        self._pending: List[Callable[[], bool]] = []
        # callbacks due later, run on the pool: (when, seq, fn, args)
        self._later: List[Tuple[float, int, Callable[..., None], Tuple[Any, ...]]] = []
        self._later_seq = itertools.count()
        # Set by the timer before it sleeps a whole TICK; work that starts on a shared
        # connection's reading thread then wakes it (see the module docs).
        self.slow = False
        # When the current (or last) round started; before the first, when this was made.
        self.now = time.monotonic()
        self._guard: Optional[Guard] = None
        self._stopped = False
        self.thread: Optional[threading.Thread] = None

    def add_tick_hook(self, hook: TickHook, pending: Optional[Callable[[], bool]] = None) -> None:
        """``hook()`` runs on the timer thread at every tick; it must be quick and not
        block, and may return the time by which it needs the next round. Ticks come
        ``TICK`` apart, and ``LENT_TICK`` apart while ``pending()`` (if given) says the
        hook has work queued."""
        self._hooks.append(hook)
        if pending is not None:
            self._pending.append(pending)

    def call_later(self, delay: float, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the worker pool in ``delay`` seconds; dropped at :meth:`stop`."""
        with self.cv:
            heapq.heappush(self._later, (time.monotonic() + delay, next(self._later_seq), fn, args))
            self.cv.notify()

    def wake(self) -> None:
        """Start the next round now, and tick fast until a round finds nothing pending."""
        with self.cv:
            self.slow = False
            self.cv.notify()

    def failed(self, exc: BaseException) -> None:
        """A hook's step for one item failed with ``exc``: report it as a failure of this
        round, and go on with the other items (see ``_threads.Guard.failed``)."""
        guard = self._guard
        if guard is None:
            raise exc
        guard.failed(exc)

    # -- the thread ----------------------------------------------------------------------------

    def start(self, start_thread: Callable[[str, Callable[[Guard], None]], threading.Thread]
              ) -> None:
        """Start the timer thread with ``start_thread(role, loop)`` (the agent's, which
        names the thread and fails the agent if it cannot go on)."""
        self.thread = start_thread("timer", self._loop)

    def stop(self) -> None:
        """End the timer thread after its current round; drop the callbacks not yet due."""
        with self.cv:
            self._stopped = True
            self._later.clear()
            self.cv.notify()

    def join(self, timeout: float) -> List[str]:
        """Wait ``timeout`` seconds at most for the thread to end; its name if it runs on."""
        return _threads.join([self.thread], time.monotonic() + timeout)

    def _loop(self, guard: Guard) -> None:
        mark_reader_thread()  # callbacks of futures failed here go to the pool
        self._guard = guard
        cv = self.cv
        while guard.ok and not self._stopped:
            wait = LENT_TICK  # after a round that failed, the next comes soon
            with guard:
                wait = self._round(guard)
            with cv:
                if self._stopped:
                    return
                if not self.slow:  # woken meanwhile by work that started
                    wait = min(wait, LENT_TICK)
                cv.wait(max(wait, 0.0))

    def _round(self, guard: Guard) -> float:
        """One round: run what is due, then every hook; return how long to sleep. A step
        that fails for one callback or hook spares the others."""
        with self.cv:
            now = self.now = time.monotonic()
            self.slow = True  # before looking at what is pending: see wake()
            tick = TICK
            if any(pending() for pending in self._pending):
                self.slow, tick = False, LENT_TICK
            wait = tick
            due = []
            later = self._later
            while later and later[0][0] <= now:
                due.append(heapq.heappop(later))
            if later:
                wait = min(wait, later[0][0] - now)
        for _, _, fn, args in due:
            try:
                self._pool.submit(fn, *args)
            except ClosedError:
                pass  # the pool is shut down: so is everything a callback would do
            except Exception as exc:  # noqa: BLE001 - the other callbacks still run
                guard.failed(exc)
        for hook in self._hooks:
            try:
                when = hook()
            except Exception as exc:  # noqa: BLE001 - one part must not stop the others
                guard.failed(exc)
                continue
            if when is not None:
                wait = min(wait, when - now)
        return wait
