"""The bookkeeping of backward passes: credit, parts, deadlines; messages in, messages out.

Theory of operation. The root of a pass holds credit 1 when it starts. A worker that
runs a part of the pass and has gradients for other workers splits the credit it holds
among the requests it sends on (:func:`plan_forward`); one that sends nothing on returns
its credit to the root in a :class:`~torchrpc._dist_autograd.messages.DoneReport`. Credit
is never created, so the pass is over exactly when all of it is back at the root
(:class:`RootPass`), whatever order the reports arrive in. A failure returns the credit
involved together with the error; a worker lost with a part of the pass takes its credit
with it, so the report of its loss (no credit, an error naming it) ends the pass at once.

The root sets one deadline when ``backward`` is entered; every request of the pass
carries the time left until it, measured when the request is built, and the worker that
gets it counts its own deadline from when it arrives. So every hop, however far from the
root, gives up when the root does, whatever the clocks of the workers say; a part whose
time is up before it sends on returns its credit with an :class:`RpcTimeoutError`.

Nothing here sends, waits for a message or starts a thread: the engine does, with what
these functions return.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from fractions import Fraction
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch

from ..errors import ConnectionLostError, RpcTimeoutError
from .messages import BackwardReply, BackwardRequest, PassId
from .records import DistAutogradContext, MessageKey

ALL_CREDIT = Fraction(1)

Routed = Dict[int, List[Tuple[MessageKey, Optional[torch.Tensor]]]]
"""The gradients a local pass produced for other workers: rank -> (send record, gradient);
a gradient is None where the pass reached a received tensor without one."""

Grads = Sequence[Tuple[MessageKey, Optional[torch.Tensor]]]
"""Gradients for send records, as a part of a pass gets them (None: reached, with none)."""


class _Held:
    """A part of a pass waiting for the gradients of sibling send records (see
    :meth:`PassBook.gather`): the keys it needs, those it has, its gradients and credit."""

    __slots__ = ("needed", "got", "grads", "credit")

    def __init__(self, needed: Set[MessageKey], got: Set[MessageKey], grads: List[Any],
                 credit: Fraction) -> None:
        self.needed = needed
        self.got = got
        self.grads = grads
        self.credit = credit


class RootPass:
    """What the root of one backward pass waits for: all the credit back.

    Between two workers the root's own thread gets all the credit back before it would
    wait, so the event to wait on is only made when some credit is still out then.
    """

    __slots__ = ("done", "error", "sends", "context_id", "deadline", "_event", "_returned",
                 "_lock")

    def __init__(self, context_id: int = 0, deadline: Optional[float] = None) -> None:
        self.context_id = context_id
        self.deadline = deadline  # time.monotonic() when the root gives up; None: never
        self.done = False
        self.error: Optional[BaseException] = None
        self.sends: Set[int] = set()  # message ids of the root's send records that got gradients
        self._event: Optional[threading.Event] = None
        self._returned = Fraction(0)
        self._lock = threading.Lock()

    def add(self, credit: Fraction, error: Optional[BaseException]) -> bool:
        """Take back ``credit`` and the error that came with it; whether this ended the
        pass (True once only: later reports change nothing but the sum)."""
        with self._lock:
            if self.done:
                self._returned += credit
                return False
            if error is not None and self.error is None:
                self.error = error
            self._returned += credit
            # A lost worker's credit never comes back: the pass is over (failed) at once.
            if self._returned >= ALL_CREDIT or isinstance(error, ConnectionLostError):
                self.done = True
                if self._event is not None:
                    self._event.set()
                return True
            return False

    def wait(self, timeout: Optional[float]) -> bool:
        """Wait until all the credit is back (at most ``timeout`` s); whether it is."""
        with self._lock:
            if self.done:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)

    def missing(self) -> Fraction:
        """The credit not back yet."""
        with self._lock:
            return ALL_CREDIT - self._returned


@dataclasses.dataclass
class Plan:
    """What a part of a pass does once its local pass is over: the requests to send
    (rank, request), the reply to the request it serves, and the credit it returns to
    the root with the error that goes with it (expired: time ran out)."""

    requests: List[Tuple[int, BackwardRequest]]
    reply: Optional[BackwardReply]
    reports: List[Tuple[Fraction, Optional[BaseException]]]


def time_left(deadline: Optional[float], now: float) -> Optional[float]:
    """Seconds from ``now`` until ``deadline`` (at least 0); None without a deadline."""
    return None if deadline is None else max(deadline - now, 0.0)


def deadline_of(left: Optional[float], now: float) -> Optional[float]:
    """The local deadline of a request that arrived at ``now`` with ``left`` seconds."""
    return None if left is None else now + left


def plan_forward(context_id: int, pass_id: PassId, routed: Routed, credit: Fraction,
                 reply_to: Optional[int], deadline: Optional[float], now: float,
                 where: str = "") -> Plan:
    """Split ``credit`` among the requests for the workers in ``routed``.

    The gradients due to ``reply_to`` (the sender of the request being served) go into
    the reply instead, with their share of the credit. With nothing to send, all the
    credit goes back to the root. A request whose time is up (``deadline`` before
    ``now``) is not made: its share goes back with an :class:`RpcTimeoutError`.
    """
    routed = dict(routed)
    back = routed.pop(reply_to, None) if reply_to is not None else None
    if not routed and not back:
        return Plan([], None, [(credit, None)])
    parts = len(routed) + (1 if back else 0)
    share = credit / parts if parts > 1 else credit
    left = time_left(deadline, now)
    requests: List[Tuple[int, BackwardRequest]] = []
    reports: List[Tuple[Fraction, Optional[BaseException]]] = []
    for rank, items in routed.items():
        if left is not None and left <= 0:
            reports.append((share, RpcTimeoutError(
                f"distributed backward pass {pass_id} of autograd context {context_id} ran "
                f"out of time on {where or 'a worker'} before sending gradients to rank "
                f"{rank}: the root's deadline passed")))
            continue
        requests.append((rank, BackwardRequest(context_id, pass_id, share, tuple(items), left)))
    return Plan(requests, BackwardReply(share, tuple(back)) if back else None, reports)


class PassBook:
    """The passes this worker takes part in: those rooted here, the parts running here,
    and the passes rooted elsewhere that ran a part here. Thread-safe."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._next_pass = itertools.count(1)
        self.roots: Dict[PassId, RootPass] = {}
        # context id -> number of parts of backward passes in progress here
        self.active: Dict[int, int] = {}
        # context id -> the passes rooted elsewhere that ran a part here (see worker_lost)
        self.visited: Dict[int, Set[PassId]] = {}
        self.running = 0  # local passes of torch's engine running now
        # context id -> pass id -> the parts waiting for their siblings (see gather), the
        # keys with siblings that have run in the pass, and the (sender, key) of the
        # received tensors that gradients went to (see routed_once)
        self._parts: Dict[int, Dict[PassId, Tuple[List[_Held], Set[MessageKey],
                                                  Set[Tuple[int, MessageKey]]]]] = {}

    def start(self, context_id: int, deadline: Optional[float]) -> Tuple[PassId, RootPass]:
        """A pass rooted here: its id and what its root waits on."""
        pass_id = (self.rank, next(self._next_pass))
        state = self.roots[pass_id] = RootPass(context_id, deadline)
        return pass_id, state

    def finish(self, pass_id: PassId) -> None:
        """The root is done with ``pass_id``: later reports of it are dropped."""
        self.roots.pop(pass_id, None)

    def credit_back(self, pass_id: PassId, credit: Fraction,
                    error: Optional[BaseException]) -> bool:
        """A report for a pass rooted here; whether it ended the pass. A report of a pass
        that is over (late, or sent twice) changes nothing."""
        state = self.roots.get(pass_id)
        return state.add(credit, error) if state is not None else False

    def part_starts(self, context_id: int, pass_id: PassId, keys: Iterable[MessageKey],
                    held: bool) -> None:
        """A part of ``pass_id`` starts here from the send records ``keys`` of a context
        (``held``: this worker holds it)."""
        if pass_id[0] == self.rank:
            state = self.roots.get(pass_id)
            if state is not None:
                state.sends.update(key[0] for key in keys)
        elif held:
            self.visited.setdefault(context_id, set()).add(pass_id)
        self.enter(context_id)

    def enter(self, context_id: int) -> None:
        with self._lock:
            self.active[context_id] = self.active.get(context_id, 0) + 1

    def exit(self, context_id: int) -> None:
        with self._lock:
            n = self.active.pop(context_id, 1) - 1
            if n:
                self.active[context_id] = n

    def local_pass_starts(self) -> None:
        with self._lock:
            self.running += 1

    def local_pass_ends(self) -> None:
        with self._lock:
            self.running -= 1

    def released(self, context_id: int) -> None:
        """Context ``context_id`` is released here: forget the passes that visited it."""
        self.visited.pop(context_id, None)
        with self._lock:
            self._parts.pop(context_id, None)

    def gather(self, context_id: int, pass_id: PassId, grads: Grads, credit: Fraction,
               needed: Set[MessageKey]) -> Optional[Tuple[List[Any], Fraction]]:
        """A part of ``pass_id`` with gradients ``grads`` and ``credit`` whose send records
        have siblings: it must run together with the parts that bring the gradients of
        all of ``needed`` (see ``parts.siblings``). Returns the gradients and
        credit of the parts to run as one once all are here; None while some are missing
        (this part's are kept, credit included, until they come or the context is
        released: in FAST mode every send record gets its gradient, as in torch, whose
        engine runs a node once all of its gradients are in). A sibling that ran in the
        pass already (see :meth:`ran`) is not waited for again."""
        grads = list(grads)
        got = set(keys_of(grads))
        with self._lock:
            held, ran, _ = self._of(context_id, pass_id)
            for h in [h for h in held if h.needed & needed]:
                held.remove(h)
                needed |= h.needed
                got |= h.got
                grads = h.grads + grads
                credit += h.credit
            if needed - got - ran:
                held.append(_Held(needed, got, grads, credit))
                return None
            ran |= got
        return grads, credit

    def ran(self, context_id: int, pass_id: PassId, grads: Grads) -> None:
        """The send records of ``grads`` have run in ``pass_id`` here: a part that waits
        for them as siblings (see gather) waits no more."""
        with self._lock:
            self._of(context_id, pass_id)[1].update(keys_of(grads))

    def _of(self, context_id: int, pass_id: PassId
            ) -> Tuple[List[_Held], Set[MessageKey], Set[Tuple[int, MessageKey]]]:
        """Under _lock: the parts' state of ``pass_id`` here, made on first use."""
        return self._parts.setdefault(context_id, {}).setdefault(pass_id, ([], set(), set()))

    def routed_once(self, context_id: int, pass_id: PassId, routed: Routed) -> Routed:
        """``routed`` without the None gradients for received tensors that a gradient of
        the pass went to already from here: torch's receiving end of a message runs once
        in a pass, so what a later part finds reaches it with none adds nothing."""
        with self._lock:
            sent = self._of(context_id, pass_id)[2]
            out: Routed = {}
            for rank, items in routed.items():
                kept = [(key, g) for key, g in items
                        if g is not None or (rank, key) not in sent]
                sent.update((rank, key) for key, _ in kept)
                if kept:
                    out[rank] = kept
        return out

    def worker_lost(self, rank: int, context_ids: Set[int], lost: ConnectionLostError
                    ) -> List[PassId]:
        """Worker ``rank``, which contexts ``context_ids`` reached, is lost: end the passes
        rooted here in those contexts with ``lost``; the passes rooted elsewhere whose
        roots must hear of it (a report with no credit and the error)."""
        for state in list(self.roots.values()):
            if state.context_id in context_ids:
                state.add(Fraction(0), lost)
        return [pass_id for context_id in context_ids
                for pass_id in list(self.visited.get(context_id, ()))
                if pass_id[0] != rank]


def unused_sends(ctx: DistAutogradContext, state: RootPass) -> List[int]:
    """The message ids of the root's send records that got no gradient in this pass."""
    sends = ctx._sends
    if not sends:
        return []
    return sorted({key[0] for key in list(sends)} - state.sends)


def keys_of(grads: Grads) -> List[MessageKey]:
    """The send records a list of gradients names."""
    return [key for key, _ in grads]
