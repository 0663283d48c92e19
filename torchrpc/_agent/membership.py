"""Elastic membership through the rendezvous store (``init_rpc(..., world_size=None)``).

Theory of operation. The group is an append-only log of events in the store:
``events`` counts them and ``event/<n>`` holds the n-th, ``{"op": "join" | "leave",
"rank", "name", "host", "port", "hostid"}``. A joiner claims its rank and name
with compare-and-set (a clash is refused with an error naming the holder; the
running worker is untouched), publishes a join event and replays the log to
learn the members. Every member follows the log (:class:`EventLog`) to learn of
later joins and departures. Leaving appends a leave event and releases the rank
and name so they can be reused. The worker hosting the store (rank 0) must stay
for the life of the group, as with torch.
"""

from __future__ import annotations

import datetime
import json
import os
import time
import urllib.parse
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist

from ..errors import RendezvousError
from .rendezvous import claim_membership, host_identity, job_secret, process_identity


def open_elastic_store(init_method: str, rank: int, timeout: float) -> Any:
    """The store of a group of unknown size: a TCPStore that rank 0 hosts, or, for
    ``file://``, the FileStore that every member opens (as torch does)."""
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


def join(store: Any, name: str, rank: int, timeout: float, keep_secret: bool = False) -> bytes:
    """Claim ``rank`` and ``name``; return the job secret. Refuses clashes by name.

    With ``keep_secret`` (a store that outlives rank 0), a secret file this worker makes
    stays after it leaves, for members that join later.
    """
    holder = store.compare_set(f"rank/{rank}", "", name).decode()
    if holder != name:
        raise RendezvousError(f"rank {rank} is already used by worker {holder!r}; pick a free "
                              f"rank for {name!r}")
    owner = store.compare_set(f"name/{name}", "", str(rank)).decode()
    if owner != str(rank):
        store.delete_key(f"rank/{rank}")
        raise RendezvousError(f"worker name {name!r} is already in use by rank {owner} of the "
                              f"running group; pick another name")
    return job_secret(store, rank, timeout, keep=keep_secret)


def announce(store: Any, name: str, rank: int, address: Tuple[str, int],
             extra: Optional[Dict[str, Any]] = None) -> None:
    _append(store, {"op": "join", "rank": rank, "name": name, "host": address[0],
                    "port": address[1], "hostid": host_identity(), **process_identity(),
                    **(extra or {})})


def leave(store: Any, name: str, rank: int) -> None:
    """Announce the departure and release the rank and the name."""
    _append(store, {"op": "leave", "rank": rank, "name": name})
    store.delete_key(f"name/{name}")
    store.delete_key(f"rank/{rank}")


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
            else:
                members.pop(e["rank"], None)
        return members
