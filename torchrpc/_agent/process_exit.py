"""What the interpreter's exit does to torchrpc's agents and threads.

Theory of operation. torchrpc's threads are daemon threads, so that a program that never
shuts its agent down still exits. But the interpreter ends the daemon threads still
running when it finalizes: one that then comes back from torch's C++ code to Python (a
future's callback, a tensor handed to Python, the OpenMP region of an op) is ended by
a forced unwind through C++ frames that may not be unwound, and the process aborts
(``terminate called without an active exception``, SIGABRT) after the program's work is
done. So no thread of torchrpc may run when the interpreter finalizes.

``shutdown()``, graceful or not, joins the threads of its agent (shutdown.py). For the
rest, :func:`at_exit` runs from an ``atexit`` handler, before the interpreter finalizes:

1. it stops every agent still running, as ``shutdown(graceful=False)`` does: a program
   that never called ``shutdown()`` (or exits on an exception or a signal's handler with
   calls outstanding) has its pending calls failed, their futures completed and their
   callbacks run here, on the exiting thread;
2. it joins every thread torchrpc started (``_threads.join_all``), and none starts after;
3. steps 1 and 2 together wait :data:`EXIT_WAIT` seconds at most; a thread that still
   runs then (a request's function that does not return) is named at WARNING, and the
   exit goes on with the code the program chose.

An ``atexit`` handler, not ``threading._register_atexit``: the latter runs before the
interpreter joins the program's own (non-daemon) threads, which may still be making
calls; ``atexit`` handlers run after those joins, and still before finalization, while
daemon threads run normally. Handlers registered after torchrpc was imported run before
this one (the order is last in, first out), so they may still make calls.
"""

from __future__ import annotations

import atexit
import logging
import time
import weakref
from typing import TYPE_CHECKING, List, Optional

from .. import _threads
from .shutdown import RUNNING

if TYPE_CHECKING:
    from .agent import Agent

log = logging.getLogger(__name__)

EXIT_WAIT = 10.0
"""The most seconds the interpreter's exit waits for torchrpc's agents to stop and its
threads to end, all of them together."""

_agents: "weakref.WeakSet[Agent]" = weakref.WeakSet()


def track(agent: "Agent") -> None:
    """Count ``agent`` among those :func:`at_exit` stops if they still run."""
    _agents.add(agent)


def at_exit(wait: Optional[float] = None) -> List[str]:
    """Stop every running agent, join every torchrpc thread (``wait`` seconds at most,
    by default :data:`EXIT_WAIT`); the names of the threads still running, which it logs
    at WARNING."""
    wait = EXIT_WAIT if wait is None else wait
    until = time.monotonic() + wait
    for agent in list(_agents):
        if agent._state is not RUNNING:  # stopped, or another thread stops it: joined below
            continue
        try:
            agent.shutdown(graceful=False, timeout=max(until - time.monotonic(), 0.001))
        except Exception as exc:  # noqa: BLE001 - a failed agent raises why, once stopped
            log.debug("the RPC agent of %s stopped at exit: %s", agent.name, exc)
    stuck = _threads.join_all(max(until - time.monotonic(), 0.0))
    if stuck:
        log.warning("%d torchrpc threads still run at the interpreter's exit after %.0f s; "
                    "a thread that is inside torch's code when the interpreter finalizes "
                    "may abort the process: %s", len(stuck), wait, ", ".join(stuck))
    return stuck


atexit.register(at_exit)
