"""Elastic membership through the rendezvous store (``init_rpc(..., world_size=None)``).

Theory of operation. The group is an append-only log of events in the store:
``events`` counts them and ``event/<n>`` holds the n-th, ``{"op": "join" | "leave",
"rank", "name", "incarnation", "host", "port", "hostid"}``. A joiner claims its rank
and name with compare-and-set (a clash is refused with an error naming the holder; the
running worker is untouched), publishes a join event and replays the log to
learn the members. Every member follows the log (:class:`EventLog`) to learn of
later joins and departures. Leaving releases the rank and name so they can be
reused, then appends a leave event. The worker hosting the store (rank 0) must stay
for the life of the group, as with torch.

A member that dies cannot leave: the first survivor that declares it lost
(:func:`remove_lost`) releases its claims and appends a leave event marked ``lost``
for it, so a new process may join under its name and rank. Every claim and event
carries the member's *incarnation*, a random number drawn at each ``init_rpc``:
claims are released only by compare-and-set on the incarnation that made them (to a
token unique to that release, so that exactly one releaser wins), and a leave event
removes a member only if its incarnation matches, so a late or repeated
removal never touches the process that took the name since, and a removed process
that comes back (a stopped one continued) recognises the leave event of its own
incarnation and knows it is out of the group.
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
import time
import urllib.parse
from typing import Any, Dict, List, Optional, Tuple, Union

import torch.distributed as dist

from ..errors import RendezvousError
from .rendezvous import Plan, claim_membership, host_identity, job_secret, process_identity


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
        return dist.PrefixStore("torchrpc-elastic", store)
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
    return dist.PrefixStore("torchrpc-elastic", store)


def _append(store: Any, event: Dict[str, Any]) -> int:
    n = int(store.add("events", 1))
    store.set(f"event/{n}", json.dumps(event))
    return n


def new_incarnation() -> int:
    """A number that tells this process's membership from any other under the same rank."""
    return secrets.randbits(62) + 1


_FREE = "free"  # a released claim holds "free <token>", a token unique to the release


def _claim(value: str, incarnation: int) -> str:
    return f"{value} {incarnation}"


def _holder(claim: str) -> str:
    """The rank or name a claim's value holds (without its incarnation)."""
    return claim.split(" ", 1)[0]


def _take(store: Any, key: str, mine: str) -> str:
    """Claim ``key`` with ``mine`` if it is free (never set, or released); what it holds."""
    current = ""
    for _ in range(100):
        held = store.compare_set(key, current, mine).decode()
        if held == mine or not held.startswith(_FREE + " ") or held == current:
            return held
        current = held  # released: claim it from what it holds now
    return held


def _release(store: Any, key: str, value: str, incarnation: int) -> bool:
    """Release claim ``key`` if ``incarnation`` still holds it; whether this call did."""
    freed = f"{_FREE} {secrets.token_hex(8)}"
    return store.compare_set(key, _claim(value, incarnation), freed).decode() == freed


def join(store: Any, name: str, rank: int, timeout: Union[float, Plan], keep_secret: bool = False,
         incarnation: int = 0) -> bytes:
    """Claim ``rank`` and ``name`` for ``incarnation``; return the job secret. Refuses
    clashes by name.

    With ``keep_secret`` (a store that outlives rank 0), a secret file this worker makes
    stays after it leaves, for members that join later.
    """
    mine = _claim(name, incarnation)
    holder = _take(store, f"rank/{rank}", mine)
    if holder != mine:
        raise RendezvousError(f"rank {rank} is already used by worker {_holder(holder)!r}; "
                              f"pick a free rank for {name!r}")
    mine = _claim(str(rank), incarnation)
    owner = _take(store, f"name/{name}", mine)
    if owner != mine:
        _release(store, f"rank/{rank}", name, incarnation)
        raise RendezvousError(f"worker name {name!r} is already in use by rank "
                              f"{_holder(owner)} of the running group; pick another name")
    return job_secret(store, rank, timeout, keep=keep_secret)


def announce(store: Any, name: str, rank: int, address: Tuple[str, int],
             extra: Optional[Dict[str, Any]] = None, incarnation: int = 0) -> None:
    _append(store, {"op": "join", "rank": rank, "name": name, "incarnation": incarnation,
                    "host": address[0], "port": address[1], "hostid": host_identity(),
                    **process_identity(), **(extra or {})})


def leave(store: Any, name: str, rank: int, incarnation: int = 0) -> None:
    """Release the rank and the name, and announce the departure (in this order: a
    survivor that takes the departing member for lost meanwhile finds its claims gone
    and announces nothing)."""
    _release(store, f"rank/{rank}", name, incarnation)
    _release(store, f"name/{name}", str(rank), incarnation)
    _append(store, {"op": "leave", "rank": rank, "name": name, "incarnation": incarnation})


def remove_lost(store: Any, name: str, rank: int, incarnation: int, reason: str) -> bool:
    """A survivor declared member ``incarnation`` of ``rank`` lost: release its claims and
    announce its removal, once for the group (whoever releases its rank does the rest);
    whether this call did."""
    if not _release(store, f"rank/{rank}", name, incarnation):
        return False  # removed by another survivor already, or it left
    _release(store, f"name/{name}", str(rank), incarnation)
    _append(store, {"op": "leave", "rank": rank, "name": name, "incarnation": incarnation,
                    "lost": reason})
    return True


def outlives_rank0(init_method: str) -> bool:
    """Whether the group's store stays when rank 0 leaves (a file; a TCPStore is rank 0's),
    so members may join and leave in any order, as with torch."""
    return urllib.parse.urlparse(init_method).scheme == "file"


class EventLog:
    """Follows the membership log; :meth:`poll` returns the new events in order."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._seen = 0

    def poll(self, wait: float = 5.0) -> List[Dict[str, Any]]:
        count = int(self._store.add("events", 0))
        events = []
        deadline = time.monotonic() + wait
        while self._seen < count:
            key = f"event/{self._seen + 1}"
            if not self._store.check([key]):  # the writer counted it but has not set it yet
                if time.monotonic() > deadline:
                    break
                time.sleep(0.005)
                continue
            events.append(json.loads(self._store.get(key)))
            self._seen += 1
        return events

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
