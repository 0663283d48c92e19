"""The profiler's state in this process, kept on the current-agent handle.

torch's profilers are process state: a profile may span agents, and its records are
parsed when it ends, which may be after the agent that made its RPCs stopped. So what
waits for that parse (finished RPCs, Kineto replays), the server profiles entered, and
what each thread is doing for the profiler live in one :class:`ProfilerState`, made at
the first use and held under :data:`PROFILER_STATE` in the handle's ``process`` slots,
not in module globals.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Deque, Dict, List, Tuple

from .._agent import Slot
from .._agent.current import handle

MAX_COMPLETED = 4096  # finished RPCs (and Kineto replays) kept for a parse; the oldest go first

# A Kineto replay not yet parsed: (event name, wall ns before, wall ns after, callee
# duration in us, callee rank).
Replay = Tuple[str, int, int, float, int]


class ProfilerState:
    """What the profiler integration of this process keeps between calls."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # Finished RPCs of legacy profiles (events.Call), by event name, and in the order
        # they finished. The modules that make them import this one, not the reverse.
        self.completed: Dict[str, List[Any]] = {}
        self.order: Deque[Any] = collections.deque()
        self.replayed: Deque[Replay] = collections.deque(maxlen=MAX_COMPLETED)
        self.server_profiles: List[Any] = []  # callee.ServerProfile: entered, innermost last
        # Per thread: .pending, the Call whose request is being sent; .options, the
        # Options of the legacy profile running on the thread.
        self.thread = threading.local()


PROFILER_STATE: "Slot[ProfilerState]" = Slot("profiler state")
"""Where the handle keeps the profiler's state."""


def state() -> ProfilerState:
    """This process's profiler state, made at the first call."""
    return handle.process.setdefault(PROFILER_STATE, ProfilerState)
