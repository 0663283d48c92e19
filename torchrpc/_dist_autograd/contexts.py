"""The contexts one worker holds, from creation or joining to release; no I/O.

Theory of operation. A context is made by ``with dist_autograd.context()`` on its creator
(and is current on that thread), or joined by a worker when a request of the context
arrives (created there under the same id). Leaving the block drops it on the creator
and owes a release to every worker a message of the context went to; each of them drops
its copy and owes the release on to the workers it sent to, so the release follows the
tree the context spread along. This table only keeps the owed releases (rank -> context
ids): the engine sends them, riding along with the next request of a context to that
worker or in batches at the agent timer's tick and at shutdown. Released ids are
remembered for a while (*tombstones*), so that a request of the context that arrives
after its release does not bring it back; the tombstone of a context released because
a worker it reached was lost keeps that loss, which a later part of a backward pass of
the context fails with.
"""

from __future__ import annotations

import collections
import itertools
import threading
from typing import Dict, List, Optional, Sequence

from ..errors import ConnectionLostError
from .records import CONTEXT_ID_BITS, DistAutogradContext, context_creator, make_context_id

TOMBSTONES = 16384
"""How many released context ids a worker remembers."""


class ContextTable:
    """The contexts of one worker, the thread's current one and the releases owed.
    Thread-safe."""

    def __init__(self, rank: int, name: str) -> None:
        self.rank = rank
        self.name = name
        self.lock = threading.Lock()
        self.contexts: Dict[int, DistAutogradContext] = {}
        # Released context ids, with the loss of a worker that released one (see release).
        self._released: "collections.OrderedDict[int, Optional[ConnectionLostError]]" = \
            collections.OrderedDict()
        self._next_context = itertools.count(1)
        self.local = threading.local()
        # Releases owed to other workers: rank -> context ids.
        self.owed: Dict[int, List[int]] = {}

    # -- the current context ---------------------------------------------------------------------

    def current(self) -> Optional[DistAutogradContext]:
        """The context current on the calling thread, or None."""
        return getattr(self.local, "ctx", None)

    def current_or_raise(self) -> DistAutogradContext:
        """The context current on the calling thread; torch's RuntimeError when none."""
        ctx = self.current()
        if ctx is None:
            raise RuntimeError(
                "Current thread doesn't have a valid autograd context. Please wrap your "
                "code using: `with torch.distributed.autograd.context() as context_id` "
                "to generate a valid context")
        return ctx

    def clear_current(self, context_id: int) -> None:
        """Make no context current on the calling thread if ``context_id`` is."""
        current = self.current()
        if current is not None and current.id == context_id:
            self.local.ctx = None

    # -- making, finding, joining ----------------------------------------------------------------

    def new_context(self) -> DistAutogradContext:
        """Create a context and make it current on the calling thread."""
        current = self.current()
        if current is not None:
            raise RuntimeError(
                f"Already have an autograd context id for this thread ({current.id}); "
                f"dist_autograd.context() blocks cannot be nested in one thread")
        ctx = DistAutogradContext(make_context_id(self.rank, next(self._next_context)),
                                  self.rank)
        with self.lock:
            self.contexts[ctx.id] = ctx
        self.local.ctx = ctx
        return ctx

    def retrieve(self, context_id: int) -> DistAutogradContext:
        """The context ``context_id``; a RuntimeError naming it when this worker has none."""
        if isinstance(context_id, bool) or not isinstance(context_id, int):
            raise TypeError(f"context_id must be an int, got {type(context_id).__name__}")
        ctx = self.contexts.get(context_id)
        if ctx is None:
            raise RuntimeError(
                f"Could not find autograd context with id: {context_id} on worker "
                f"{self.name}. A context exists from the start of its "
                f"`with dist_autograd.context()` block until the block exits; use the id "
                f"inside the block")
        return ctx

    def retrieve_for_pass(self, context_id: int) -> DistAutogradContext:
        """The context a part of a backward pass needs; gone from here: an error naming the
        lost worker that released it, else :meth:`retrieve`'s."""
        ctx = self.contexts.get(context_id)
        if ctx is not None:
            return ctx
        lost = self._released.get(context_id)
        if lost is not None:
            raise ConnectionLostError(f"{lost} (worker {self.name} released the "
                                      f"context then)", worker=lost.worker)
        return self.retrieve(context_id)

    def is_valid(self, context_id: int) -> bool:
        """Whether this worker holds context ``context_id``."""
        return context_id in self.contexts

    def max_id(self) -> int:
        """The largest context id this worker can create."""
        return make_context_id(self.rank, (1 << CONTEXT_ID_BITS) - 1)

    def join(self, context_id: int) -> Optional[DistAutogradContext]:
        """The context a request of ``context_id`` runs in, created here if needed; None
        once it was released here."""
        ctx = self.contexts.get(context_id)
        if ctx is not None:
            return ctx
        with self.lock:
            ctx = self.contexts.get(context_id)
            if ctx is None and context_id not in self._released:
                ctx = self.contexts[context_id] = DistAutogradContext(context_id, self.rank)
        return ctx

    # -- release ---------------------------------------------------------------------------------

    def release(self, context_id: int, notified_by: Optional[int],
                lost: Optional[ConnectionLostError] = None) -> Optional[DistAutogradContext]:
        """Drop ``context_id`` here and owe its release to the workers it went to, but
        ``notified_by``; ``lost``: the loss of a worker that released it. The context
        dropped, or None if this worker did not hold it."""
        with self.lock:
            ctx = self.contexts.pop(context_id, None)
            if lost is not None or context_id not in self._released:
                self._released[context_id] = lost
            if len(self._released) > TOMBSTONES:
                self._released.popitem(last=False)
        if ctx is None:
            return None
        ranks = [r for r in ctx.known_workers() if r != self.rank and r != notified_by]
        if ranks:
            with self.lock:
                for rank in ranks:
                    self.owed.setdefault(rank, []).append(context_id)
        return ctx

    def take_owed(self) -> Dict[int, List[int]]:
        """All the releases owed (rank -> context ids), which the caller sends now."""
        with self.lock:
            owed, self.owed = self.owed, {}
        return owed

    def take_owed_to(self, rank: int) -> Optional[List[int]]:
        """The releases owed to ``rank``, which ride along with a request to it."""
        if not self.owed:
            return None
        with self.lock:
            return self.owed.pop(rank, None)

    def owe(self, rank: int, context_ids: Sequence[int]) -> None:
        """Owe the releases of ``context_ids`` to ``rank`` (again: a second release of a
        context is a no-op)."""
        with self.lock:
            self.owed.setdefault(rank, []).extend(context_ids)

    # -- lost workers ----------------------------------------------------------------------------

    def worker_lost(self, rank: int) -> List[DistAutogradContext]:
        """Forget the releases owed to lost worker ``rank``; the contexts that reached it."""
        with self.lock:
            self.owed.pop(rank, None)
            return [c for c in self.contexts.values() if reached(c, rank)]


def reached(ctx: DistAutogradContext, rank: int) -> bool:
    """Whether context ``ctx`` reached worker ``rank``: made there, sent there, or
    received tensors from there."""
    return (context_creator(ctx.id) == rank or rank in ctx.known_workers()
            or rank in ctx.sources())
