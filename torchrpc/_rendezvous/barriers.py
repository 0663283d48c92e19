"""The store barriers of a graceful shutdown, and the group's record of lost workers.

Each worker marks its arrival at a barrier with a sealed record (see :mod:`.records`) and
counts itself in on a counter. The store is untrusted, so the counter only says when to
look: a barrier is complete when every rank's sealed arrival is there. A worker still
waiting marks its arrival again if it was deleted, and an arrival at a later barrier of
the same protocol counts for the earlier ones, so deleting the arrival of a worker that
went on holds no one back.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence, Tuple

from .group_store import Records
from ..errors import BarrierTimeoutError

_ARRIVAL_FIELDS = {"rank": int}

SHUTDOWN = ("shutdown/1", "shutdown/2", "shutdown/3")
"""The barriers of a static group's graceful shutdown, in the order workers pass them; an
arrival at one implies the arrivals at those before it."""


def after(barrier: str) -> Tuple[str, ...]:
    """The barriers of :data:`SHUTDOWN` that follow ``barrier``."""
    return SHUTDOWN[SHUTDOWN.index(barrier) + 1:]


def mark_lost(store: Records, rank: int, why: str) -> None:
    """Tell the group that worker ``rank`` is lost, and why (a sealed record)."""
    store.put(f"lost/{rank}", {"rank": rank, "why": why})
    store.add("lost", 1)


def lost(store: Records, rank: int) -> Optional[str]:
    """Why worker ``rank`` is lost, if a worker said so (sealed: an outsider cannot make a
    worker lost); else None."""
    if not store.check([f"lost/{rank}"]):
        return None
    fields = store.read(f"lost/{rank}", {"rank": int, "why": str}, "a lost worker")
    return fields["why"] if fields is not None and fields["rank"] == rank else None


def arrived(store: Records, key: str, rank: int, later: Sequence[str] = ()) -> bool:
    """Whether worker ``rank`` marked its arrival at barrier ``key``, or at one of the
    ``later`` barriers that only a worker past ``key`` reaches (sealed records)."""
    for at in (key, *later):
        fields = store.read(f"{at}/{rank}", _ARRIVAL_FIELDS, "an arrival at a barrier")
        if fields is not None and fields["rank"] == rank:
            return True
    return False


def _all_arrived(store: Records, key: str, world_size: int, later: Sequence[str]) -> bool:
    if not later and not store.check([f"{key}/{r}" for r in range(world_size)]):
        return False
    return all(arrived(store, key, r, later) for r in range(world_size))


def barrier(store: Records, key: str, world_size: int, deadline: Optional[float],
            check: Any = None, rank: Optional[int] = None, later: Sequence[str] = ()) -> None:
    """Count this worker in at ``key`` and wait for all; ``check()`` may raise to abort.

    Each worker marks its arrival at ``key/rank`` with a sealed record (``rank``: this
    worker's, always given in a group that may be reached by outsiders) and counts
    itself in at ``key``. The counter only says when to look: the barrier is complete
    when every rank's sealed arrival is there, so an outsider that adds to the counter
    cannot let anyone through early. A worker whose ``deadline`` has passed when it
    arrives (one that does not wait) counts in and returns at once, touching the store
    no more: rank 0 may close the store the moment everyone is in.

    ``later``: the barriers that follow ``key`` in the same protocol. An arrival at one of
    them counts as one at ``key``, so an outsider who deletes the arrival of a worker that
    has gone on cannot hold the others here while it waits for them further on.
    """
    if rank is not None:
        store.put(f"{key}/{rank}", {"rank": rank})
    arrived_count = int(store.add(key, 1))
    if deadline is not None and time.monotonic() >= deadline:
        if arrived_count < world_size:
            raise BarrierTimeoutError(
                f"timed out at the shutdown barrier: {arrived_count} of {world_size} "
                f"workers arrived")
        return

    look_at = time.monotonic() + 2.0

    def complete(count: int) -> bool:
        nonlocal look_at
        if rank is None:
            return count >= world_size
        if count < world_size:
            # An outsider may have taken from the counter: look at the arrivals
            # themselves now and then (and mark this worker's again, if it was deleted).
            if time.monotonic() < look_at:
                return False
            look_at = time.monotonic() + 2.0
            if not arrived(store, key, rank):
                store.put(f"{key}/{rank}", {"rank": rank})
        return _all_arrived(store, key, world_size, later)

    delay = 0.002
    start = time.monotonic()
    while not complete(arrived_count):
        if check is not None:
            try:
                check()
            except Exception:
                # A worker that passed the barrier since the count was read may have
                # stopped already: that is a complete barrier, not a lost worker.
                if complete(int(store.add(key, 0))):
                    break
                raise
        if deadline is not None and time.monotonic() > deadline:
            raise BarrierTimeoutError(
                f"timed out at the shutdown barrier: {min(arrived_count, world_size)} of "
                f"{world_size} workers arrived")
        time.sleep(delay)
        # Back off to a few polls a second: a worker may wait here for as long as the
        # others keep working (a callee that has nothing else to do, during the whole
        # job), and each poll wakes this process and the store's host, which compete
        # with the workers for the CPUs. 20 polls a second for the first second, so a
        # group that arrives together leaves together; then 5.
        delay = min(delay * 2, 0.05 if time.monotonic() - start < 1.0 else 0.2)
        arrived_count = int(store.add(key, 0))
