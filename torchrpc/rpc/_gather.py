"""Collectives over RPC among a set of workers: ``_all_gather``, ``_barrier``.

Theory of operation. The workers of a set agree on a leader (the smallest name) and
on a sequence number (how many gathers this set has started here), with no message.
Every follower sends its object to the leader, which answers at once; when the
leader has every object it sends the whole dict to each follower. Each gather's
state lives on the agent until its dict is complete, so a follower's object may
arrive before the leader itself has started the gather.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

from .._agent import Agent, Slot
from .._agent.current import current_agent
from ..errors import RpcError, RpcTimeoutError, WorkerLeftError
from . import constants

_GATHERINGS: "Slot[_Gatherings]" = Slot("gatherings")
SequenceId = Tuple[Tuple[str, ...], int]
# How often a waiting gather looks for workers that died meanwhile (seconds).
_PEER_CHECK_S = 0.5


class _Gathering:
    __slots__ = ("objects", "complete", "result")

    def __init__(self) -> None:
        self.objects: Dict[str, Any] = {}
        self.complete = threading.Event()
        self.result: Optional[Dict[str, Any]] = None


class _Gatherings:
    """The gathers of one agent: sequence counters per worker set, and open gathers."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counters: Dict[Tuple[str, ...], int] = collections.defaultdict(int)
        self.open: Dict[SequenceId, _Gathering] = {}

    def next_id(self, names: Tuple[str, ...]) -> SequenceId:
        with self.lock:
            n = self.counters[names]
            self.counters[names] = n + 1
            return names, n

    def get(self, seq: SequenceId) -> _Gathering:
        with self.lock:
            g = self.open.get(seq)
            if g is None:
                g = self.open[seq] = _Gathering()
            return g

    def add(self, seq: SequenceId, name: str, obj: Any) -> None:
        g = self.get(seq)
        with self.lock:
            if name in g.objects:
                raise RuntimeError(f"worker {name} sent its object to gather {seq[1]} of "
                                   f"{list(seq[0])} twice")
            g.objects[name] = obj
            if len(g.objects) == len(seq[0]):
                g.complete.set()

    def finish(self, seq: SequenceId, result: Dict[str, Any]) -> None:
        with self.lock:
            g = self.open.get(seq)
        if g is None:
            return  # this follower gave up (timed out) already: nothing waits for it
        g.result = result
        g.complete.set()

    def close(self, seq: SequenceId) -> None:
        with self.lock:
            self.open.pop(seq, None)


def _gatherings(agent: Agent) -> _Gatherings:
    return agent.extensions.setdefault(_GATHERINGS, _Gatherings)


def _gather_to_leader(seq: SequenceId, name: str, obj: Any) -> None:
    """Runs on the leader: record a follower's object."""
    _gatherings(current_agent()).add(seq, name, obj)


def finish(seq: SequenceId, objects: Dict[str, Any]) -> None:
    """Runs on a follower: the leader's complete dict."""
    _gatherings(current_agent()).finish(seq, objects)


def _wait(agent: Agent, gathering: _Gathering, timeout: Optional[float],
          awaited: Callable[[], Iterable[str]]) -> bool:
    """Wait for ``gathering`` to complete; raise naming an ``awaited`` worker that died or
    shut down meanwhile (it would never send)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return gathering.complete.is_set()
        if gathering.complete.wait(_PEER_CHECK_S if left is None else min(left, _PEER_CHECK_S)):
            return True
        workers = [agent.resolve(name) for name in awaited()]
        # A dead worker first: one that left early may have left because of it.
        agent.probe(w.id for w in workers)
        agent.check_peers()
        for w in workers:
            if agent.has_left(w.id):
                raise WorkerLeftError(f"worker {w.name} (rank {w.id}) shut down before it "
                                      f"took part in _all_gather", worker=w.name)


def all_gather(obj: Any, worker_names: Optional[Iterable[str]] = None,
               timeout: float = constants.UNSET_RPC_TIMEOUT,
               broadcast: Callable[[SequenceId, Dict[str, Any]], None] = finish
               ) -> Dict[str, Any]:
    """Gather ``obj`` from every worker of ``worker_names`` (default: all); a dict by name.

    Every worker of the set must call it, the same number of times. The leader sends the
    result to the followers by calling ``broadcast`` on them (a function that ends in
    :func:`finish`), so the followers run whatever that name means there.
    """
    agent = current_agent()
    names = tuple(sorted(worker_names if worker_names is not None
                         else (w.name for w in agent.worker_infos())))
    if agent.name not in names:
        raise ValueError(f"{agent.name} is not one of the workers to gather from: "
                         f"{list(names)}; call it from those workers only")
    if timeout == constants.UNSET_RPC_TIMEOUT:
        timeout = agent.default_timeout
    book = _gatherings(agent)
    seq = book.next_id(names)
    leader = names[0]
    gathering = book.get(seq)
    wait = timeout if timeout > 0 else None
    try:
        if agent.name == leader:
            book.add(seq, leader, obj)
            if not _wait(agent, gathering, wait,
                         lambda: sorted(set(names) - set(gathering.objects))):
                missing = sorted(set(names) - set(gathering.objects))
                raise RpcTimeoutError(
                    f"RPC _all_gather timed out in _all_gather after {timeout:.2f} seconds. "
                    f"The first {len(gathering.objects)} workers to arrive were "
                    f"{sorted(gathering.objects)}; still missing: {missing}")
            objects = dict(gathering.objects)
            futures = [agent.call(agent.resolve(follower), broadcast, (seq, objects), {},
                                  timeout)
                       for follower in names[1:]]
            errors = []
            for follower, fut in zip(names[1:], futures):
                try:
                    fut.wait()
                except RuntimeError as exc:
                    errors.append((follower, exc))
            if errors:
                raise RpcError(
                    f"Followers {[name for name, _ in errors]} timed out in _all_gather after "
                    f"{timeout:.2f} seconds. The first exception is {errors[0][1]}: the leader "
                    f"{leader} could not hand them the result (they may have failed or left)")
            return objects
        agent.call(agent.resolve(leader), _gather_to_leader, (seq, agent.name, obj), {},
                   timeout).wait()
        if not _wait(agent, gathering, wait, lambda: (leader,)):
            raise RpcTimeoutError(f"RPC _all_gather timed out in _all_gather after "
                                  f"{timeout:.2f} seconds waiting for the leader {leader}")
        assert gathering.result is not None
        return gathering.result
    finally:
        book.close(seq)

