"""Elastic membership through the rendezvous store (``init_rpc(..., world_size=None)``).

Theory of operation. The group is an append-only log of events in the store:
``events`` counts them and ``event/<n>`` holds the n-th, ``{"op": "join" | "leave",
"rank", "name", "incarnation", "host", "port", "hostid"}``. The store is untrusted, so
every event and claim is a sealed record (records.py): a joiner first gets the job
secret, then reads the log, claims its rank and name with compare-and-set of a sealed
claim (a clash is refused with an error naming the holder; the running worker is
untouched), publishes a join event and learns the members from the log. Every member
follows the log (:class:`EventLog`) to learn of later joins and departures; a bad
record in it is skipped and logged once, a counted slot that stays empty is skipped
after :data:`GAP_WAIT`. Leaving releases the rank and name so they can be reused, then
appends a leave event. The worker hosting the store (rank 0) must stay for the life of
the group, as with torch.

A claim binds while its process is a member, or, while it joins, until the claim
expires (the joiner's rendezvous timeout after it was made): one that failed releases
its claims, and one that died before it joined blocks the rank and name no longer than
that. Anything else at a claim's key (a released claim, an outsider's junk, a claim
moved from another key, a replayed claim of a process that left) is taken over.

A member that dies cannot leave: the first survivor that declares it lost
(:func:`remove_lost`) releases its claims and appends a leave event marked ``lost``
for it, so a new process may join under its name and rank. Every claim and event
carries the member's *incarnation*, a random number drawn at each ``init_rpc``:
claims are released only by compare-and-set on the claim of the incarnation that made
them (to a token unique to that release, so that exactly one releaser wins), and a
leave event removes a member only if its incarnation matches, so a late or repeated
removal never touches the process that took the name since, and a removed process
that comes back (a stopped one continued) recognises the leave event of its own
incarnation and knows it is out of the group.
"""

from __future__ import annotations

import datetime
import os
import secrets
import time
import urllib.parse
from typing import Any, Dict, List, Optional, Set, Tuple, Union

import torch.distributed as dist

from ..errors import RendezvousError
from .rendezvous import (Plan, Records, claim_membership, host_identity, process_identity,
                         take_claim)

PREFIX = "torchrpc-elastic"  # a dynamic group's store prefix: the job its records are sealed for


def open_elastic_store(init_method: str, rank: int, timeout: Union[float, Plan]) -> Any:
    """The store of a group of unknown size: a TCPStore that rank 0 hosts, or, for
    ``file://``, the FileStore that every member opens (as torch does); opened within
    ``timeout`` (seconds, or the rendezvous plan)."""
    timeout = Plan.of(timeout).deadline.left()
    url = urllib.parse.urlparse(init_method)
    if url.scheme == "file":
        if not url.path:
            raise ValueError(f"Error initializing torch.distributed using file:// rendezvous: "
                             f"path missing in {init_method!r}; use file:///path/to/file")
        try:
            store = dist.FileStore(url.path, -1)  # -1: members come and go; never deleted
        except (RuntimeError, OSError) as exc:
            raise RendezvousError(f"cannot open the rendezvous file {url.path!r}: {exc}") from exc
        store.set_timeout(datetime.timedelta(seconds=timeout))
        claim_membership(store, "dynamic")
        return dist.PrefixStore(PREFIX, store)
    if url.scheme == "env":
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port:
            raise ValueError("env:// rendezvous needs MASTER_ADDR and MASTER_PORT")
    elif url.scheme == "tcp":
        host, port = url.hostname, url.port
    else:
        raise ValueError(f"dynamic membership (world_size=None) needs env://, tcp:// or "
                         f"file:// rendezvous, got {init_method!r}")
    try:
        store = dist.TCPStore(host, int(port), None, rank == 0,
                              datetime.timedelta(seconds=timeout), wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        raise RendezvousError(f"cannot reach the rendezvous store at {host}:{port} (rank 0 "
                              f"hosts it): {exc}") from exc
    claim_membership(store, "dynamic")
    return dist.PrefixStore(PREFIX, store)


def _append(store: Records, event: Dict[str, Any]) -> int:
    n = int(store.add("events", 1))
    store.put(f"event/{n}", event)
    return n


def new_incarnation() -> int:
    """A number that tells this process's membership from any other under the same rank."""
    return secrets.randbits(62) + 1


_FREE = b"free "  # a released claim holds "free <token>", a token unique to the release
_RANK_CLAIM = {"name": str, "incarnation": int, "expires": (int, float)}
_NAME_CLAIM = {"rank": int, "incarnation": int, "expires": (int, float)}


def _claim(store: Records, key: str, fields: Dict[str, Any], incarnation: int,
           timeout: float) -> bytes:
    """The sealed claim of ``key`` by ``incarnation``: binding until ``timeout`` seconds
    from now (wall-clock time, as it is compared on other hosts) unless it joins."""
    return store.sealed(key, {**fields, "incarnation": incarnation,
                              "expires": time.time() + timeout})


def _binding(claim: Dict[str, Any], log: "EventLog") -> bool:
    """Whether a good sealed claim still holds its key: its process is a member, or is
    joining and its claim has not expired; not once it left (or was removed)."""
    incarnation = claim["incarnation"]
    if incarnation in log.gone:
        return False
    if any(m.get("incarnation") == incarnation for m in log.current.values()):
        return True
    return time.time() < claim["expires"]


def _take(store: Records, key: str, mine: bytes, required: Dict[str, Any],
          log: "EventLog") -> Optional[Dict[str, Any]]:
    """Claim ``key`` with ``mine`` unless a binding claim holds it (see
    :func:`rendezvous.take_claim`): released claims, values that are no good sealed claims
    (an outsider's, logged once) and claims that no longer bind (see :func:`_binding`)
    are taken over."""
    def holding(held: bytes) -> Optional[Dict[str, Any]]:
        if held.startswith(_FREE):
            return None
        other = store.open(key, held, required, "a claim")
        return other if other is not None and _binding(other, log) else None

    return take_claim(store, key, mine, holding)


def _release(store: Records, key: str, holder: str, value: Any, incarnation: int) -> bool:
    """Release claim ``key`` if ``incarnation`` still holds it with ``value`` (the name or
    rank) in field ``holder``; whether this call did."""
    if not store.check([key]):
        return False
    held = store.get(key)
    if held.startswith(_FREE):
        return False
    claim = store.open(key, held, {holder: type(value), "incarnation": int}, "a claim")
    if claim is None or claim[holder] != value or claim["incarnation"] != incarnation:
        return False
    freed = _FREE + secrets.token_hex(8).encode()
    return store.compare_set(key, held, freed) == freed


def join(store: Records, name: str, rank: int, timeout: Union[float, Plan],
         incarnation: int = 0, log: Optional["EventLog"] = None) -> None:
    """Claim ``rank`` and ``name`` for ``incarnation``, with sealed claims (the job secret
    is known by now). Refuses clashes by name. ``log``: this worker's follower of the
    membership log, read first to tell the claims of members from stale ones.

    A claim binds while its process is a member, or for the rendezvous ``timeout``
    (seconds, or the plan) after it was made while that process joins: a joiner that
    failed, or died, before it joined blocks the rank no longer than that. A failed join
    releases its claims at once (:func:`release`).
    """
    log = log if log is not None else EventLog(store)
    log.poll()
    limit = Plan.of(timeout).deadline.timeout
    key = f"rank/{rank}"
    holder = _take(store, key, _claim(store, key, {"name": name}, incarnation, limit),
                   _RANK_CLAIM, log)
    if holder is not None:
        raise RendezvousError(f"rank {rank} is already used by worker {holder['name']!r}; "
                              f"pick a free rank for {name!r}")
    key = f"name/{name}"
    try:
        owner = _take(store, key, _claim(store, key, {"rank": rank}, incarnation, limit),
                      _NAME_CLAIM, log)
    except BaseException:
        _release(store, f"rank/{rank}", "name", name, incarnation)
        raise
    if owner is not None:
        _release(store, f"rank/{rank}", "name", name, incarnation)
        raise RendezvousError(f"worker name {name!r} is already in use by rank "
                              f"{owner['rank']} of the running group; pick another name")


def release(store: Records, name: str, rank: int, incarnation: int) -> None:
    """Release the claims of a join that failed before it was announced."""
    _release(store, f"rank/{rank}", "name", name, incarnation)
    _release(store, f"name/{name}", "rank", rank, incarnation)


def announce(store: Records, name: str, rank: int, address: Tuple[str, int],
             extra: Optional[Dict[str, Any]] = None, incarnation: int = 0) -> None:
    _append(store, {"op": "join", "rank": rank, "name": name, "incarnation": incarnation,
                    "host": address[0], "port": address[1], "hostid": host_identity(),
                    **process_identity(), **(extra or {})})


def leave(store: Records, name: str, rank: int, incarnation: int = 0) -> None:
    """Release the rank and the name, and announce the departure (in this order: a
    survivor that takes the departing member for lost meanwhile finds its claims gone
    and announces nothing)."""
    release(store, name, rank, incarnation)
    _append(store, {"op": "leave", "rank": rank, "name": name, "incarnation": incarnation})


def remove_lost(store: Records, name: str, rank: int, incarnation: int, reason: str) -> bool:
    """A survivor declared member ``incarnation`` of ``rank`` lost: release its claims and
    announce its removal, once for the group (whoever releases its rank does the rest);
    whether this call did."""
    if not _release(store, f"rank/{rank}", "name", name, incarnation):
        return False  # removed by another survivor already, or it left
    _release(store, f"name/{name}", "rank", rank, incarnation)
    _append(store, {"op": "leave", "rank": rank, "name": name, "incarnation": incarnation,
                    "lost": reason})
    return True


def outlives_rank0(init_method: str) -> bool:
    """Whether the group's store stays when rank 0 leaves (a file; a TCPStore is rank 0's),
    so members may join and leave in any order, as with torch."""
    return urllib.parse.urlparse(init_method).scheme == "file"


_EVENT = {"op": str, "rank": int, "name": str, "incarnation": int}
_JOIN = {**_EVENT, "host": str, "port": int, "hostid": str}

GAP_WAIT = 2.0
"""Seconds a reader waits for a counted event slot to be written before it skips it (the
writer counts, then writes; one that died between, or an outsider's count, leaves a
gap)."""

LATE_WAIT = 60.0
"""Seconds a skipped slot is still looked at, in case its writer was only slow."""

_LATE_MAX = 64  # skipped slots looked at again, at most


class EventLog:
    """Follows the membership log; :meth:`poll` returns the new events in order.

    Only good sealed events count: one that fails its check, does not parse or lacks a
    field is skipped and logged once, and the events after it are read on. A slot that
    was counted but stays empty for :data:`GAP_WAIT` seconds is skipped (and looked at
    again for a while, in case its writer was slow). :attr:`current` holds the members
    after the events read so far, :attr:`gone` the incarnations that left; a join of an
    incarnation that left (read late) is dropped.
    """

    def __init__(self, store: Records) -> None:
        self._store = store
        self._seen = 0
        self._gap: Optional[Tuple[int, float, int]] = None  # first empty slot, since, count then
        self._late: Dict[int, float] = {}  # skipped slot -> when it is given up
        self.current: Dict[int, Dict[str, Any]] = {}
        self.gone: Set[int] = set()

    def poll(self, wait: float = 5.0) -> List[Dict[str, Any]]:
        store = self._store
        count = int(store.add("events", 0))
        events: List[Dict[str, Any]] = []
        deadline = time.monotonic() + wait
        while self._seen < count:
            n = self._seen + 1
            key = f"event/{n}"
            if not store.check([key]):
                now = time.monotonic()
                if self._gap is None or not self._gap[0] <= n <= self._gap[2]:
                    self._gap = (n, now, count)
                if now - self._gap[1] < GAP_WAIT:  # its writer counted it, and writes it now
                    if now > deadline:
                        break
                    time.sleep(0.005)
                    continue
                if len(self._late) < _LATE_MAX:
                    self._late[n] = now + LATE_WAIT
                self._seen = n
                continue
            self._seen = n
            self._take(key, store.get(key), events)
        self._read_late(events)  # after the new ones: a late join of one that left is dropped
        return events

    def _read_late(self, events: List[Dict[str, Any]]) -> None:
        now = time.monotonic()
        for n, until in list(self._late.items()):
            key = f"event/{n}"
            if self._store.check([key]):
                del self._late[n]
                self._take(key, self._store.get(key), events)
            elif now > until:
                del self._late[n]

    def _take(self, key: str, value: bytes, events: List[Dict[str, Any]]) -> None:
        event = self._store.open(key, value, _EVENT, "a membership event")
        if event is None:
            return
        if event["op"] == "join":
            event = self._store.open(key, value, _JOIN, "a membership event")
            if event is None or event["incarnation"] in self.gone:
                return
        elif event["op"] != "leave":
            self._store.report(key, value, f"a membership event of unknown op {event['op']!r}")
            return
        else:
            self.gone.add(event["incarnation"])
        self.current = EventLog.members([event], self.current)
        events.append(event)

    @staticmethod
    def members(events: List[Dict[str, Any]], start: Optional[Dict[int, Dict[str, Any]]] = None
                ) -> Dict[int, Dict[str, Any]]:
        """Apply events to a rank -> info map (pure)."""
        members = dict(start or {})
        for e in events:
            if e["op"] == "join":
                members[e["rank"]] = e
            elif same_member(members.get(e["rank"]), e):
                del members[e["rank"]]
        return members


def same_member(joined: Optional[Dict[str, Any]], event: Dict[str, Any]) -> bool:
    """Whether ``event`` is about the member that ``joined`` announced (same incarnation)."""
    return joined is not None and joined.get("incarnation", 0) == event.get("incarnation", 0)
