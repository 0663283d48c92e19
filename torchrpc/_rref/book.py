"""RRef bookkeeping of one worker: owner entries, forks and confirmations (sans I/O).

Theory of operation (PyTorch's Remote Reference Protocol). Every RRef has a
global ``RRefId``; every user copy of it has its own ``ForkId``. The owner keeps
one entry per RRefId with the value and the set of forks it knows to be alive;
the entry is dropped when that set is empty and the value exists (the owner's own
Python references keep the entry object alive on their own).

* G1 -- the owner hears of every deleted user RRef: a user sends USER_DELETE
  when its copy is garbage collected, but only once the owner has confirmed it.
  Its payload is a tuple of ``(RRefId, ForkId)`` pairs, so deletions to one owner
  travel together (the RRef layer batches them, or adds them to its next
  REMOTE_CALL or FETCH to that owner).
* G2 -- a parent is not deleted before its child is confirmed: forking a user
  RRef parks the parent in ``pending_children`` under the child's ForkId until a
  CHILD_ACCEPT for it arrives. A fork sent to the owner itself in a request that
  gets a reply is accepted by that reply (or the request's failure) instead: the
  owner has unpickled the request before it answers, and sends no CHILD_ACCEPT.
  A parent deleted explicitly (``_delete_all_user_and_unforked_owner_rrefs``, shutdown)
  while a child is parked holds its USER_DELETE until the child is accepted: sent
  earlier, it could let the owner drop the value before the child's FORK_REQUEST
  arrives, and the child's fetch would then wait for a value that never comes.

User copy states::

    unconfirmed --(owner confirms)--> confirmed --(GC)--> deleted (USER_DELETE sent)
    unconfirmed --(GC)--> doomed --(owner confirms)--> deleted (USER_DELETE sent)

A lost worker (:meth:`RRefBook.worker_lost`) takes its part of the tables with it:
the forks it held are removed on the owner as if it had deleted them, the user
copies of RRefs it owned are dropped (their owner cannot confirm or free
anything any more), and so are the children parked for it or for its RRefs. The
owner therefore records which worker holds each fork, and a parked child the
worker it went to.

Every method returns the control messages to send as :class:`Msg` values and
never does I/O, so the protocol is tested on messages alone.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
from typing import Any, Dict, List, Optional, Set, Tuple

import torch

from .._wire import Kind

GloballyUniqueId = Tuple[int, int]  # (creator rank, local counter)
_TOMBSTONES = 100_000


@dataclasses.dataclass(frozen=True)
class Msg:
    """A control message to send: ``kind`` with ``payload`` to rank ``dst``."""

    dst: int
    kind: Kind
    payload: Tuple[Any, ...]


class OwnerEntry:
    """The owner's record of one RRef: the value (a future of it) and the live forks."""

    __slots__ = ("rref_id", "future", "forks", "has_value", "__weakref__")

    def __init__(self, rref_id: GloballyUniqueId) -> None:
        self.rref_id = rref_id
        self.future: torch.futures.Future = torch.futures.Future()
        self.forks: Set[GloballyUniqueId] = set()
        self.has_value = False  # the future holds a value (not an error)

    def set_value(self, value: Any) -> None:
        if not self.future.done():
            self.future.set_result(value)
            self.has_value = True

    def set_error(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


@dataclasses.dataclass
class _UserState:
    rref_id: GloballyUniqueId
    owner: int
    parent: Optional[int]  # rank to send CHILD_ACCEPT to on confirmation
    confirmed: bool
    doomed: bool = False


class RRefBook:
    """The RRef tables of one worker. Thread-safe; every method returns messages to send."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._counter = itertools.count(0)  # torch numbers the ids of each worker from 0
        self._lock = threading.Lock()
        self.owners: Dict[GloballyUniqueId, OwnerEntry] = {}
        self.pending_children: Dict[GloballyUniqueId, Any] = {}
        self.users: Dict[GloballyUniqueId, _UserState] = {}
        # (RRefId, ForkId) -> the rank that holds that fork (owner side).
        self._holders: Dict[Tuple[GloballyUniqueId, GloballyUniqueId], int] = {}
        # child ForkId -> (the rank it was sent to, the owner of the RRef), and the ForkId
        # of its parent where that is a user copy here (G2).
        self._child_ranks: Dict[GloballyUniqueId, Tuple[int, int]] = {}
        self._child_parent: Dict[GloballyUniqueId, GloballyUniqueId] = {}
        # Keyed by the flat (rref rank, rref counter, fork rank, fork counter): a tuple
        # of ints leaves the cycle collector's sight, where a pair of pairs would stay in
        # it and make every full collection visit up to _TOMBSTONES of them.
        self._tombstones: "collections.OrderedDict[Tuple[int, ...], None]" = \
            collections.OrderedDict()

    def new_id(self) -> GloballyUniqueId:
        return (self.rank, next(self._counter))

    # -- owner side ------------------------------------------------------------------------------

    def owner_entry(self, rref_id: GloballyUniqueId) -> OwnerEntry:
        """The entry of ``rref_id``, created (value pending) if this is the first we hear of it."""
        with self._lock:
            entry = self.owners.get(rref_id)
            if entry is None:
                entry = self.owners[rref_id] = OwnerEntry(rref_id)
            return entry

    def adopt(self, entry: OwnerEntry) -> None:
        """Put an entry held by local code back in the table (it is being forked)."""
        with self._lock:
            self.owners.setdefault(entry.rref_id, entry)

    def add_fork(self, rref_id: GloballyUniqueId, fork_id: GloballyUniqueId,
                 holder: Optional[int] = None) -> None:
        """Fork ``fork_id`` of ``rref_id`` exists, held by rank ``holder`` (if known)."""
        with self._lock:
            if rref_id + fork_id in self._tombstones:
                return  # deleted before its creation arrived (out-of-order delivery)
            entry = self.owners.get(rref_id)
            if entry is None:
                entry = self.owners[rref_id] = OwnerEntry(rref_id)
            entry.forks.add(fork_id)
            if holder is not None:
                self._holders[(rref_id, fork_id)] = holder

    def remove_fork(self, rref_id: GloballyUniqueId, fork_id: GloballyUniqueId) -> None:
        """A fork is gone (USER_DELETE, or an owner's self-fork arrived)."""
        with self._lock:
            self._remove_fork(rref_id, fork_id)

    def _remove_fork(self, rref_id: GloballyUniqueId, fork_id: GloballyUniqueId) -> None:
        # Under _lock. A deleted fork never comes back: a late or duplicated (retried)
        # creation or FORK_REQUEST for it must not resurrect it.
        self._holders.pop((rref_id, fork_id), None)
        self._tombstones[rref_id + fork_id] = None
        while len(self._tombstones) > _TOMBSTONES:
            self._tombstones.popitem(last=False)
        entry = self.owners.get(rref_id)
        if entry is None or fork_id not in entry.forks:
            return
        entry.forks.discard(fork_id)
        self._drop_if_unused(entry)

    def value_settled(self, rref_id: GloballyUniqueId) -> None:
        """The value of an entry was set: drop it if no fork holds it."""
        with self._lock:
            entry = self.owners.get(rref_id)
            if entry is not None:
                self._drop_if_unused(entry)

    def _drop_if_unused(self, entry: OwnerEntry) -> None:
        if not entry.forks and entry.future.done():
            self.owners.pop(entry.rref_id, None)

    # -- user side -------------------------------------------------------------------------------

    def fork_child(self, parent: Any, dst: int = -1, owner: int = -1) -> GloballyUniqueId:
        """A user RRef (owned by ``owner``) is being sent to ``dst``: park the parent until
        the child is confirmed (G2)."""
        fork_id = self.new_id()
        parent_fork = getattr(parent, "_fork_id", None)
        with self._lock:
            self.pending_children[fork_id] = parent
            self._child_ranks[fork_id] = (dst, owner)
            if parent_fork is not None:
                self._child_parent[fork_id] = parent_fork
        return fork_id

    def child_accepted(self, fork_id: GloballyUniqueId) -> List[Msg]:
        """The child ``fork_id`` is confirmed: its parent may go (the USER_DELETE of a
        parent deleted meanwhile, now that no child of it is parked)."""
        with self._lock:
            self._drop_child(fork_id)
            return self._release(self._child_parent.pop(fork_id, None))

    def _drop_child(self, fork_id: GloballyUniqueId) -> None:
        self.pending_children.pop(fork_id, None)
        self._child_ranks.pop(fork_id, None)

    def _release(self, parent_fork: Optional[GloballyUniqueId]) -> List[Msg]:
        """Under _lock: the USER_DELETE of ``parent_fork`` if it was deleted, is confirmed
        and parks no child any more (``_child_parent`` holds the parked children only)."""
        state = self.users.get(parent_fork) if parent_fork is not None else None
        if state is None or not state.doomed or not state.confirmed \
                or parent_fork in self._child_parent.values():
            return []
        del self.users[parent_fork]
        return [Msg(state.owner, Kind.RREF_USER_DELETE, ((state.rref_id, parent_fork),))]

    def user_created(self, rref_id: GloballyUniqueId, fork_id: GloballyUniqueId, owner: int,
                     confirmed: bool, parent: Optional[int]) -> List[Msg]:
        """A user copy now exists here. An unconfirmed one asks the owner to confirm it."""
        with self._lock:
            self.users[fork_id] = _UserState(rref_id, owner, parent, confirmed)
        if confirmed or parent is None:
            return []
        return [Msg(owner, Kind.RREF_FORK_REQUEST, (rref_id, fork_id))]

    def user_confirmed(self, fork_id: GloballyUniqueId) -> List[Msg]:
        """The owner knows this copy: accept it to its parent; delete it if GC came first."""
        with self._lock:
            state = self.users.get(fork_id)
            if state is None or state.confirmed:
                return []
            state.confirmed = True
            msgs = []
            if state.parent is not None:
                msgs.append(Msg(state.parent, Kind.RREF_CHILD_ACCEPT, (fork_id,)))
            if state.doomed:
                msgs.extend(self._release(fork_id))
            return msgs

    def user_abandoned(self, fork_id: GloballyUniqueId) -> None:
        """A user copy whose creating request was never sent: the owner never knew it."""
        with self._lock:
            self.users.pop(fork_id, None)

    def user_deleted(self, fork_id: GloballyUniqueId) -> List[Msg]:
        """A user copy was garbage collected (G1): tell the owner once it is confirmed."""
        with self._lock:
            state = self.users.get(fork_id)
            if state is None:
                return []
            state.doomed = True
            return self._release(fork_id)  # once confirmed and no child of it is parked

    def worker_lost(self, rank: int) -> Tuple[List[GloballyUniqueId], List[Msg]]:
        """Worker ``rank`` is gone: drop the forks it held, the children parked for it or
        for its RRefs, and the user copies of RRefs it owned; return the ForkIds of those
        user copies, and the deletions of parents that no child holds back any more."""
        with self._lock:
            for (rref_id, fork_id), holder in list(self._holders.items()):
                if holder == rank:
                    self._remove_fork(rref_id, fork_id)
            parents = []
            for fork_id, ranks in list(self._child_ranks.items()):
                if rank in ranks:
                    self._drop_child(fork_id)
                    parents.append(self._child_parent.pop(fork_id, None))
            orphans = [f for f, state in self.users.items() if state.owner == rank]
            for fork_id in orphans:
                del self.users[fork_id]
            msgs = [m for p in set(parents) for m in self._release(p)]
            return orphans, msgs

    # -- accounting ------------------------------------------------------------------------------

    def counts(self) -> Dict[str, int]:
        with self._lock:
            return {
                "num_owner_rrefs": len(self.owners),
                "num_forks": sum(len(e.forks) for e in self.owners.values()),
                "num_pending_users": sum(1 for s in self.users.values() if not s.confirmed),
                "num_pending_children": len(self.pending_children),
                # Owner values still being computed (torch's pending owner futures).
                "num_pending_futures": sum(1 for e in self.owners.values()
                                           if not e.future.done()),
                "num_user_rrefs": len(self.users),
            }

    def settled(self) -> bool:
        """No control message of ours is still owed or awaited."""
        with self._lock:
            return not self.pending_children and all(s.confirmed for s in self.users.values())

    def live_user_forks(self) -> List[GloballyUniqueId]:
        with self._lock:
            return list(self.users)

    def user_states(self) -> List[Tuple[GloballyUniqueId, "_UserState"]]:
        with self._lock:
            return list(self.users.items())

    def clear(self) -> None:
        with self._lock:
            self.owners.clear()
            self.pending_children.clear()
            self.users.clear()
            self._holders.clear()
            self._child_ranks.clear()
            self._child_parent.clear()
