"""What a worker serves now, for snapshots (snapshot.py): the requests its threads run,
the ``@async_execution`` ones that wait for their futures, and which of them each
outgoing call was made for.

Theory of operation. Serving a request costs what it must on the hot path and no more,
so it keeps no table of requests: each thread that serves keeps a *stack* of the
requests it serves (:class:`ThreadStack`, in the per-thread :data:`this_thread`; a
stack, since a thread waiting for a reply may read and serve another request before it
returns), and :meth:`Dispatch.serve <torchrpc._agent.dispatch.Dispatch.serve>` pushes an
*entry* (a list: see :data:`OWNER` and the indexes after it) and pops it when the handler
returns. A thread's stack is made, and registered here, the first time it serves; it
goes when the thread ends (the registry holds it weakly). A request whose handler gave
an :class:`~torchrpc._agent.hooks.AsyncResult` moves to :attr:`ServingTable.waiting`
before its thread lets it go, and leaves once its reply is sent.

Ages are computed when a snapshot asks. An entry is stamped with the time of the agent's
timer round under way (``Scheduler.now``, read from an attribute, not from the clock),
which starts before the request does and is at most one round (``scheduler.TICK``, more
only while the process is starved of CPU) older than it. So a snapshot's age of a request
is never less than the time it has been served, and at most one round more.

An outgoing call is linked to the request it serves by the thread that makes it: the
calling side reads the top of this thread's stack (``this_thread.stack``, one read of
a thread-local for a thread that serves nothing) and keeps that entry with the call
(``Pending.serving``). So the link is exact however many requests a worker serves at
once. Calls made elsewhere on a request's behalf (in a callback of an ``@async_execution``
function's future, or in an ``async def`` target, which runs on the event loop's thread)
are not linked: they show as calls of their own.

The registry and :attr:`ServingTable.waiting` change by single dict operations (the
registry under a lock, taken once per thread and by snapshots), and a snapshot copies a
stack with ``list(stack)``, one C call.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, List, Optional, Protocol, Tuple

# An entry: [OWNER, CALLER, RID, KIND, WHAT, STARTED]: the ServingTable it belongs to, the
# caller's WorkerInfo, the request id, the message kind, the function once the request is
# decoded (else None), and Scheduler.now when its serving began.
OWNER, CALLER, RID, KIND, WHAT, STARTED = range(6)


class Clock(Protocol):
    """What entries are stamped from: the agent's timer (``Scheduler``), whose ``now`` is
    the time.monotonic() its round under way started at."""

    now: float


class ThreadStack(list):
    """The entries a thread serves, innermost last."""

    __slots__ = ("__weakref__",)


class _ThisThread(threading.local):
    stack: Optional[ThreadStack] = None  # a thread that never served has none


# The stack of the requests the calling thread serves (None until its first).
this_thread = _ThisThread()

# Thread ident -> its stack, for every thread of this process that has served (weakly:
# a thread's stack goes when it ends).
_stacks: "weakref.WeakValueDictionary[int, ThreadStack]" = weakref.WeakValueDictionary()
_stacks_lock = threading.Lock()


class ServingTable:
    """One agent's requests served now (see the module docs), written by its
    :class:`~torchrpc._agent.dispatch.Dispatch`, read by snapshots (:meth:`entries`)."""

    def __init__(self) -> None:
        # id(entry) -> entry: the requests whose handlers returned an AsyncResult, until
        # their reply (or error) is sent.
        self.waiting: Dict[int, List[Any]] = {}

    @staticmethod
    def thread_stack() -> ThreadStack:
        """The calling thread's stack, made and registered on its first request."""
        stack = this_thread.stack
        if stack is None:
            stack = this_thread.stack = ThreadStack()
            with _stacks_lock:
                _stacks[threading.get_ident()] = stack
        return stack

    def entries(self) -> List[Tuple[List[Any], Optional[int]]]:
        """What this agent serves now: (entry, the ident of the thread serving it), the
        ident None for a request that waits for its future; innermost last per thread."""
        with _stacks_lock:
            stacks = list(_stacks.items())
        out = []
        for ident, stack in stacks:
            out.extend((e, ident) for e in list(stack) if e[OWNER] is self)
        seen = {id(e) for e, _ in out}  # one moving to ``waiting`` may show in both
        out.extend((e, None) for e in list(self.waiting.values()) if id(e) not in seen)
        return out

    def key_of(self, entry: Any) -> Optional[Tuple[int, int]]:
        """(caller rank, request id) of ``entry`` if it is one of this agent's, else None."""
        if entry is None or entry[OWNER] is not self:
            return None
        return entry[CALLER].id, entry[RID]
