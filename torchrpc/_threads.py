"""Background threads that survive what they did not expect.

Theory of operation. Each loop of a torchrpc background thread (the agent's timer and
heartbeat, the transport's accept loops and connection readers, the RRef sender, the
membership follower, the autograd releases, a closing connection) runs its rounds under
a :class:`Guard`. An exception that a round did not expect is logged at ERROR, with its
traceback, under the ``torchrpc`` logger, and the loop goes on with its next round: one bad
round must not cost a worker its timer or its heartbeats. A loop whose rounds fail
``limit`` times in a row cannot go on: the guard reports an :class:`ThreadFailedError`
naming the loop and the cause to ``on_fatal`` (the agent then fails every pending call and
the next API call with it) and the loop ends. :func:`start` runs a thread's whole target
under its guard too, so whatever escapes a loop is reported the same way: no thread ever
vanishes silently.

Every thread torchrpc starts, starts through :func:`spawn` (``start``, the worker pool,
the transport), which counts it among this process's threads until it ends.
:func:`at_exit` (an ``atexit`` handler) stops their owners (:func:`on_exit`: the agents
still running, see ``torchrpc._agent.process_exit``) and joins them at the interpreter's
exit, before it finalizes: a daemon thread still running then, once it comes back from
torch's C++ code to Python, is ended by an unwind that aborts the process. After it,
:func:`spawn` refuses to start another.

This module sits below every layer (like ``errors``): it knows nothing but ``logging``.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from typing import Any, Callable, List, Optional

from .errors import ThreadFailedError

log = logging.getLogger(__name__)

IN_A_ROW = 10  # rounds that fail one after the other before a loop gives up
_PAUSE = 0.01  # after the n-th failure in a row a round waits n times this, not to spin

Fatal = Callable[[ThreadFailedError], None]


class Guard:
    """Runs the rounds of one background loop; see the module docs.

    ``with guard:`` runs one round: an ``Exception`` is logged and swallowed. A round may
    also report failures of its own steps with :meth:`failed` and go on. Failures count
    until a round passes without any; ``limit`` None: the loop never gives up.
    """

    __slots__ = ("what", "on_fatal", "limit", "_row", "_entered", "_gave_up")

    def __init__(self, what: str, on_fatal: Optional[Fatal] = None,
                 limit: Optional[int] = IN_A_ROW) -> None:
        self.what = what
        self.on_fatal = on_fatal
        self.limit = limit
        self._row = 0
        self._entered = 0
        self._gave_up = False

    @property
    def ok(self) -> bool:
        """Whether the loop may go on (it has not given up)."""
        return not self._gave_up

    def __enter__(self) -> "Guard":
        self._entered = self._row
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if exc_type is None:
            if self._row == self._entered:
                self._row = 0  # a clean round
            return False
        if not issubclass(exc_type, Exception):
            return False  # SystemExit and the like end the thread: start() reports it
        if self.failed(exc) and self.limit is not None:
            time.sleep(_PAUSE * self._row)
        return True

    def failed(self, exc: BaseException) -> bool:
        """A round raised ``exc``: log it; False once the loop has to give up."""
        self._row += 1
        if self.limit is None:
            log.error("%s raised an unexpected exception; it goes on", self.what,
                      exc_info=exc)
            return True
        log.error("%s raised an unexpected exception (%d in a row; it gives up "
                  "at %d); it goes on", self.what, self._row, self.limit, exc_info=exc)
        if self._row < self.limit:
            return True
        self.fatal(exc)
        return False

    def fatal(self, exc: BaseException) -> None:
        """The loop cannot go on because of ``exc``: log and report it, once."""
        if self._gave_up:
            return
        self._gave_up = True
        error = ThreadFailedError(f"{self.what} cannot go on: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        log.error("%s", error, exc_info=exc)
        if self.on_fatal is not None:
            try:
                self.on_fatal(error)
            except Exception:  # noqa: BLE001 - reporting must not raise in its turn
                log.exception("reporting that %s failed raised", self.what)

    def call(self, target: Callable[..., Any], *args: Any) -> None:
        """Run a thread's whole ``target(*args)``: whatever escapes it is fatal."""
        try:
            target(*args)
        except BaseException as exc:  # noqa: BLE001 - a thread must not vanish silently
            self.fatal(exc)


# Every thread spawn() started that has not ended (weak: an ended thread drops out), and
# what ends it at exit, if anything but its owner's stop does.
_ours: "weakref.WeakKeyDictionary[threading.Thread, Optional[Callable[[], None]]]" = \
    weakref.WeakKeyDictionary()
StartThread = Callable[[str, Callable[[Guard], None]], threading.Thread]
"""How an agent's part starts a background thread: ``start_thread(role, loop)`` runs
``loop(guard)`` on a thread named for ``role``, whose failure fails the agent."""

_lock = threading.Lock()
_exiting = False  # join_all ran: no thread starts after it


def spawn(name: str, target: Callable[..., Any], *args: Any,
          stop: Optional[Callable[[], None]] = None) -> threading.Thread:
    """Start daemon thread ``name`` running ``target(*args)``, counted among the threads
    :func:`join_all` joins (calling ``stop()`` first, if given, to end it);
    RuntimeError once the interpreter exits (join_all ran)."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    # Started under the lock: join_all never misses a thread that starts while it looks.
    with _lock:
        if _exiting:
            raise RuntimeError(f"cannot start thread {name}: the interpreter is exiting")
        _ours[thread] = stop
        try:
            thread.start()
        except BaseException:
            del _ours[thread]
            raise
    return thread


def start(name: str, guard: Guard, target: Callable[..., Any], *args: Any,
          stop: Optional[Callable[[], None]] = None) -> threading.Thread:
    """Start daemon thread ``name`` running ``target(*args)`` under ``guard`` (see
    :func:`spawn` for ``stop``)."""
    return spawn(name, guard.call, target, *args, stop=stop)


def running() -> List[threading.Thread]:
    """The threads torchrpc started that still run."""
    with _lock:
        return [t for t in _ours if t.is_alive()]


def join(threads: List[Optional[threading.Thread]], until: float) -> List[str]:
    """Join each of ``threads`` (but the calling one), no later than ``until`` (a
    ``time.monotonic()``) for all of them together; the names of those still running."""
    me = threading.current_thread()
    stuck = []
    for t in threads:
        if t is None or t is me:
            continue
        t.join(max(until - time.monotonic(), 0.0))
        if t.is_alive():
            stuck.append(t.name)
    return stuck


EXIT_WAIT = 10.0
"""The most seconds the interpreter's exit waits for torchrpc's agents to stop and its
threads to end, all of them together."""

# What stops the threads' owners at exit, before they are joined (process_exit.py).
_stoppers: List[Callable[[float], None]] = []


def on_exit(stop: Callable[[float], None]) -> None:
    """Run ``stop(until)`` at the interpreter's exit before the threads are joined;
    ``until`` (a ``time.monotonic()``) bounds what it waits for."""
    _stoppers.append(stop)


def at_exit(wait: Optional[float] = None) -> List[str]:
    """The interpreter exits (an ``atexit`` handler): run the :func:`on_exit` stoppers,
    then :func:`join_all`, ``wait`` seconds (by default :data:`EXIT_WAIT`) at most for
    all of it; the names of the threads still running, which it logs at WARNING."""
    wait = EXIT_WAIT if wait is None else wait
    until = time.monotonic() + wait
    for stop in list(_stoppers):
        try:
            stop(until)
        except Exception:  # noqa: BLE001 - the threads must still be joined
            log.exception("stopping torchrpc at exit failed")
    stuck = join_all(max(until - time.monotonic(), 0.0))
    if stuck:
        log.warning("%d torchrpc threads still run at the interpreter's exit after %g s; "
                    "a thread that is inside torch's code when the interpreter finalizes "
                    "may abort the process: %s", len(stuck), wait, ", ".join(stuck))
    return stuck


def join_all(timeout: float) -> List[str]:
    """At the interpreter's exit: refuse new threads, stop those started with a ``stop``,
    then join every thread torchrpc started, ``timeout`` seconds at most for all of them
    together; the names of those still running."""
    global _exiting
    until = time.monotonic() + timeout
    with _lock:
        _exiting = True
        ours = list(_ours.items())
    for thread, stop in ours:
        if stop is not None and thread.is_alive():
            try:
                stop()
            except Exception:  # noqa: BLE001 - the others must still be joined
                log.exception("stopping thread %s at exit failed", thread.name)
    return join([t for t, _ in ours], until)


atexit.register(at_exit)
