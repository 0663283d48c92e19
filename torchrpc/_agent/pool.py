"""The worker thread pool that runs incoming requests.

Theory of operation. ``size`` threads are kept. A thread that blocks waiting on
an RPC future tells the pool (:meth:`WorkerPool.blocking`); while it waits it
does not count against ``size``, so the pool starts another thread when work is
queued. Thus a callee that makes blocking RPCs, even back to its caller, can
never starve the pool (torch's agent deadlocks there). Blocking that the pool
cannot see (a user lock, ``torch.futures.wait_all``) is caught by
:meth:`WorkerPool.check_progress`, which the agent's timer calls: when work is
queued but no task started since the last check, it adds a thread. Threads above
``size`` exit after :data:`IDLE_EXIT` seconds without work. The pool never has
more than :data:`HARD_CAP` threads: beyond it, queued work waits for a thread that
finishes (a program that blocks that many at once is stuck anyway, and each thread
costs a stack). :meth:`close` stops and joins every thread.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from typing import Any, Callable, Iterator, Optional

from .. import _threads
from .._threads import Guard
from ..errors import ClosedError

log = logging.getLogger(__name__)

IDLE_EXIT = 5.0
HARD_CAP = 2048

_current = threading.local()


def current_pool() -> Optional["WorkerPool"]:
    """The pool the calling thread belongs to, if it is a pool thread."""
    return getattr(_current, "pool", None)


class WorkerPool:
    """A growable thread pool with blocking compensation. Thread-safe."""

    def __init__(self, size: int, name: str) -> None:
        if size < 1:
            raise ValueError(f"num_worker_threads must be at least 1, got {size}")
        self._size = size
        self._name = name
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        # Guards the callbacks of the futures this pool runs callbacks for (futures.py).
        self.callbacks_lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._pending = 0
        self._idle = 0
        self._blocked = 0
        self._started = 0
        self._last_started = 0
        self._closed = False
        # Called (no arguments, in the blocking thread) whenever a thread starts blocking.
        self.on_block: Optional[Callable[[], None]] = None

    # -- accounting ----------------------------------------------------------------------------

    @property
    def num_threads(self) -> int:
        return len(self._threads)

    @property
    def num_pending(self) -> int:
        return self._pending

    @property
    def num_idle(self) -> int:
        """Threads waiting for a task."""
        return self._idle

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on a pool thread. Exceptions are logged, never lost silently;
        ClosedError once the pool is closed."""
        with self._lock:
            if self._closed:
                raise ClosedError("the worker pool is shut down")
            self._pending += 1
            spawn = (self._pending > self._idle and len(self._threads) - self._blocked < self._size
                     and len(self._threads) < HARD_CAP)
            if spawn:
                self._spawn_locked()
        self._queue.put((fn, args))

    def hand_off(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Run ``fn(*args)`` on a thread that is idle now, or return False.

        Unlike :meth:`submit`, the task never waits behind others: it is queued only
        while more threads are idle than tasks are queued, so an idle thread takes it
        at once. The agent hands a connection's reading role on this way.
        """
        with self._lock:
            if self._closed or self._idle <= self._pending:
                return False
            self._pending += 1
        self._queue.put((fn, args))
        return True

    @contextlib.contextmanager
    def blocking(self) -> Iterator[None]:
        """Mark the calling pool thread as blocked for the duration of the block."""
        if self.on_block is not None:
            self.on_block()
        with self._lock:
            self._blocked += 1
            if self._pending > self._idle and len(self._threads) - self._blocked < self._size \
                    and len(self._threads) < HARD_CAP and not self._closed:
                self._spawn_locked()
        try:
            yield
        finally:
            with self._lock:
                self._blocked -= 1

    def check_progress(self) -> None:
        """Add a thread when work waits and nothing started since the previous check."""
        with self._lock:
            stalled = (self._pending > self._idle and self._started == self._last_started
                       and not self._closed and len(self._threads) < HARD_CAP)
            self._last_started = self._started
            if stalled:
                log.debug("pool %s stalled with %d queued tasks; adding a thread",
                          self._name, self._pending)
                self._spawn_locked()

    def _spawn_locked(self) -> None:
        name = f"{self._name}-{len(self._threads)}"
        # Tasks cannot kill a thread (see _run); the guard reports whatever else would.
        # Spawned under the pool's lock: the thread cannot leave _threads before it is in.
        try:
            t = _threads.spawn(name, Guard(f"worker thread {name}").call, self._run)
        except RuntimeError as exc:  # out of threads: the ones there take the work
            log.error("pool %s cannot start another thread (%s); its %d threads "
                      "go on", self._name, exc, len(self._threads))
            return
        self._threads.add(t)

    # -- the loop ------------------------------------------------------------------------------

    def _run(self) -> None:
        _current.pool = self
        q = self._queue
        me = threading.current_thread()
        try:
            while True:
                with self._lock:
                    self._idle += 1
                    extra = len(self._threads) > self._size
                try:
                    item = q.get(timeout=IDLE_EXIT) if extra else q.get()
                except queue.Empty:
                    with self._lock:
                        self._idle -= 1
                        if len(self._threads) > self._size and not self._pending:
                            self._threads.discard(me)
                            return
                    continue
                with self._lock:
                    self._idle -= 1
                    if item is None:
                        self._threads.discard(me)
                        return
                    self._pending -= 1
                    self._started += 1
                fn, args = item
                try:
                    fn(*args)
                except BaseException:  # noqa: BLE001 - a task must never kill its thread
                    log.exception("task %r failed in the worker pool", fn)
                del item, fn, args
        finally:
            _current.pool = None

    def close(self, timeout: float = 10.0) -> list[str]:
        """Stop every thread after the queued work, waiting ``timeout`` seconds at most for
        all of them together; return names of threads that did not stop."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._queue.put(None)
        return _threads.join(threads, deadline)
