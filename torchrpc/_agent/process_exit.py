"""What the interpreter's exit does to the agents still running.

Theory of operation. torchrpc's threads are daemon threads, so that a program that never
shuts its agent down still exits. But the interpreter ends the daemon threads still
running when it finalizes: one that then comes back from torch's C++ code to Python (a
future's callback, a tensor handed to Python, the OpenMP region of an op) is ended by
a forced unwind through C++ frames that may not be unwound, and the process aborts
(``terminate called without an active exception``, SIGABRT) after the program's work is
done. So no thread of torchrpc may run when the interpreter finalizes.

``shutdown()``, graceful or not, joins the threads of its agent (shutdown.py). For the
rest, ``_threads.at_exit`` runs from an ``atexit`` handler, before the interpreter
finalizes, ``_threads.EXIT_WAIT`` seconds at most for all of it:

1. :func:`stop_agents` stops every agent still running, as ``shutdown(graceful=False)``
   does: a program that never called ``shutdown()`` (or exits on an exception, or from a
   signal's handler, with calls outstanding) has its pending calls failed, their futures
   completed and their callbacks run there, on the exiting thread;
2. every thread torchrpc started is joined, and none starts after;
3. a thread that still runs then (a request's function that does not return) is named at
   WARNING, and the exit goes on with the code the program chose.

An ``atexit`` handler, not ``threading._register_atexit``: the latter runs before the
interpreter joins the program's own (non-daemon) threads, which may still be making
calls; ``atexit`` handlers run after those joins, and still before finalization, while
daemon threads run normally. Handlers registered after torchrpc was imported run before
this one (the order is last in, first out), so they may still make calls.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Protocol

from .. import _threads
from .lifecycle import RUNNING, Lifecycle

log = logging.getLogger(__name__)


class Stoppable(Protocol):
    """What the exit needs of an agent."""

    name: str
    lifecycle: Lifecycle

    def shutdown(self, graceful: bool = True, timeout: float = 0) -> None: ...


_agents: "weakref.WeakSet[Stoppable]" = weakref.WeakSet()


def track(agent: Stoppable) -> None:
    """Count ``agent`` among those :func:`stop_agents` stops if they still run."""
    _agents.add(agent)


def stop_agents(until: float) -> None:
    """At exit: stop every agent that still runs, as ``shutdown(graceful=False)`` does,
    waiting no later than ``until`` (a ``time.monotonic()``)."""
    for agent in list(_agents):
        if agent.lifecycle.state is not RUNNING:  # stopped, or another thread stops it: joined after
            continue
        try:
            agent.shutdown(graceful=False, timeout=max(until - time.monotonic(), 0.001))
        except Exception as exc:  # noqa: BLE001 - a failed agent raises why, once stopped
            log.debug("the RPC agent of %s stopped at exit: %s", agent.name, exc)


_threads.on_exit(stop_agents)
