"""The agent's lifecycle: its states, the transitions allowed, and the one object that
holds the current state.

An agent goes through four states, each entered once, in order::

    NEW --start()--> RUNNING --> STOPPING --> STOPPED

(what each state allows, and which step of a shutdown enters which, is in shutdown.py).
:data:`TRANSITIONS` is the whole machine as a table: state -> the states it may enter
next. :class:`Lifecycle` holds the current state; the agent makes one and hands it to
every part that needs to know whether the agent runs. Its :meth:`~Lifecycle.enter` is
the only writer, and refuses any transition the table does not list; the shutdown
protocol is the only part that calls it (starting and shutting down are serialized by
the API's lock, so transitions do not race each other).

Readers on the request path read :attr:`Lifecycle.state` as a plain attribute and test
it with ``is`` against the module constants (``lifecycle.state is not RUNNING``: an
attribute, a global and an identity test; ``State.RUNNING`` would be a lookup through the
enum's metaclass on every call).
"""

from __future__ import annotations

import enum
from typing import Dict, FrozenSet

from ..errors import LifecycleError


class State(enum.Enum):
    """The states of an agent; the value is what ``debug_info`` and error messages say."""

    NEW = "new"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


# For hot paths: ``lifecycle.state is RUNNING`` (see the module docs).
NEW = State.NEW
RUNNING = State.RUNNING
STOPPING = State.STOPPING
STOPPED = State.STOPPED

TRANSITIONS: Dict[State, FrozenSet[State]] = {
    NEW: frozenset({RUNNING}),
    RUNNING: frozenset({STOPPING}),
    STOPPING: frozenset({STOPPED}),
    STOPPED: frozenset(),
}
"""The transitions an agent may make: state -> the states it may enter next."""


def advance(current: State, target: State) -> State:
    """``target``, if an agent in state ``current`` may enter it; else raise
    :class:`LifecycleError` naming both and the states ``current`` leads to."""
    if target not in TRANSITIONS[current]:
        allowed = ", ".join(sorted(s.value for s in TRANSITIONS[current])) or "none"
        raise LifecycleError(f"an RPC agent that is {current.value} cannot become "
                             f"{target.value} (it may become: {allowed})")
    return target


class Lifecycle:
    """The current state of one agent (see the module docs)."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state: State = NEW

    def enter(self, target: State) -> None:
        """Move to state ``target``; :class:`LifecycleError` if the table does not allow it."""
        self.state = advance(self.state, target)

    @property
    def running(self) -> bool:
        """Whether the agent runs (calls go out, requests are served)."""
        return self.state is RUNNING

    def __repr__(self) -> str:
        return f"Lifecycle({self.state.value})"
