"""The observer's side: connect to every worker of a running group and take snapshots.

Theory of operation. An :class:`Observer` finds the group's workers where a worker finds
them: in the rendezvous store (``tcp://``, ``env://`` through ``MASTER_ADDR`` and
``MASTER_PORT``, or ``file://``), whose records it reads only if their seals hold under
the job secret, or, in a process that runs a worker, in that worker's own table. It
proves the secret to each worker in the ordinary handshake, as the rank
:data:`~torchrpc._agent.snapshot.OBSERVER_RANK`, which no member has, and asks each for
its snapshot (snapshot.py); the answers are JSON, nothing is unpickled. It writes nothing
to the store and takes no rank, so when it closes, or dies, nothing of it remains.
"""

from __future__ import annotations

import datetime
import itertools
import json
import logging
import os
import socket
import threading
import time
import urllib.parse
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import _wire
from .._rendezvous import membership, rendezvous
from .._rendezvous.group_store import Records
from .._rendezvous.secret import (LOCATOR_KEY, SECRET_ENV, SECRET_FILE_ENV, Source,
                                  launcher_secret, read_local)
from .._transport import Connection, handshake
from .._transport.dial import dial
from .._transport.links import Links
from .._wire import Kind
from ..errors import AuthenticationError, RendezvousError, RpcError
from .current import handle
from .snapshot import OBSERVER_RANK, OBSERVERS

log = logging.getLogger(__name__)

_MEMBERSHIP_KEY = "torchrpc-membership"  # the store's mark of a group (rendezvous.py)
_WORKER_FIELDS = {"name": str, "host": str, "port": int}

_HOW = (f"set {SECRET_ENV} to the job's secret (the value its workers were given), or "
        f"{SECRET_FILE_ENV} to a file of mode 0600 holding it")


class GroupNotFoundError(RendezvousError):
    """The rendezvous store holds no torchrpc group (yet)."""


class Member:
    """Where one worker listens, as the group published it."""

    __slots__ = ("rank", "name", "host", "port", "incarnation")

    def __init__(self, rank: int, name: str, host: str, port: int, incarnation: int = 0) -> None:
        self.rank, self.name, self.host, self.port = rank, name, host, port
        self.incarnation = incarnation


def default_init_method() -> str:
    """``tcp://MASTER_ADDR:MASTER_PORT`` from the environment, as torchrun sets them."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        raise ValueError("no rendezvous given: set MASTER_ADDR and MASTER_PORT as the job's "
                         "workers have them, or pass --init-method tcp://HOST:PORT or "
                         "file:///PATH")
    return f"tcp://{host}:{port}"


def open_store(init_method: str, timeout: float) -> Tuple[Any, str]:
    """A client of the rendezvous store of ``init_method`` (no rank, nothing written);
    (the store, how to name it)."""
    url = urllib.parse.urlparse(init_method)
    if url.scheme == "env":
        return open_store(default_init_method(), timeout)
    if url.scheme == "tcp":
        if not url.hostname or not url.port:
            raise ValueError(f"init_method {init_method!r} names no host and port; use "
                             f"tcp://HOST:PORT")
        where = f"{url.hostname}:{url.port}"
        try:
            # A quick look first: torch's client retries a refused address until the timeout.
            socket.create_connection((url.hostname, url.port), timeout).close()
            store = dist.TCPStore(url.hostname, url.port, None, False,
                                  datetime.timedelta(seconds=timeout), wait_for_workers=False)
        except (RuntimeError, OSError) as exc:
            raise RendezvousError(
                f"no rendezvous store reachable at {where} within {timeout:g} s "
                f"({str(exc).rstrip('.')}); "
                f"check the address (the job's MASTER_ADDR and MASTER_PORT) and that the "
                f"job runs (its rank 0 hosts the store)") from exc
        return store, f"tcp://{where}"
    if url.scheme == "file":
        if not url.path or not os.path.exists(url.path):
            raise GroupNotFoundError(f"no rendezvous file at {url.path!r}: no group was "
                                     f"started with init_method {init_method!r} (yet)")
        store = dist.FileStore(url.path, -1)
        store.set_timeout(datetime.timedelta(seconds=timeout))
        return store, f"file://{url.path}"
    raise ValueError(f"init_method must be tcp://HOST:PORT, file:///PATH or env://, got "
                     f"{init_method!r}")


def find_secret(store: Any, given: Optional[bytes] = None) -> bytes:
    """The job secret: ``given``, else ``TORCHRPC_SECRET``, ``TORCHRPC_SECRET_FILE``, else
    the file the group's locator names on this host (a dynamic group keeps it while it
    runs)."""
    value = given
    if value is None and os.environ.get(SECRET_ENV):
        value = os.environ[SECRET_ENV].encode()
    secret = launcher_secret(Source(value=value, path=os.environ.get(SECRET_FILE_ENV)))
    if secret is not None:
        return secret
    if store.check([LOCATOR_KEY]):
        try:
            return read_local(store.get(LOCATOR_KEY).decode(errors="replace"),
                              rendezvous.host_identity())
        except RendezvousError as exc:
            raise AuthenticationError(f"no job secret: {exc}; {_HOW}") from exc
    raise AuthenticationError(
        f"no job secret: {_HOW}. (A group of one host started without them keeps its "
        f"secret in a file that a static group removes once every worker joined; start "
        f"the job with {SECRET_FILE_ENV} to inspect it.)")


def discover(init_method: str, secret: Optional[bytes], timeout: float
             ) -> Tuple[List[Member], bytes, Any]:
    """The members of the group at ``init_method``, the job secret, and the store (to
    close)."""
    store, where = open_store(init_method, timeout)
    if not store.check([_MEMBERSHIP_KEY]):
        raise GroupNotFoundError(f"no torchrpc group at {where}: the rendezvous store holds "
                                 f"none (yet); start the job first, or check the address")
    kind = store.get(_MEMBERSHIP_KEY).decode(errors="replace")
    dynamic = kind == "dynamic"
    base = dist.PrefixStore(membership.PREFIX if dynamic else rendezvous.PREFIX, store)
    secret = find_secret(base, secret)
    records = Records(base, secret, membership.PREFIX if dynamic else rendezvous.PREFIX)
    members: List[Member] = []
    if dynamic:
        events = membership.EventLog(records)
        events.poll(wait=min(timeout, 2.0))
        for rank, info in sorted(events.current.items()):
            members.append(Member(rank, info["name"], info["host"], info["port"],
                                  int(info.get("incarnation") or 0)))
        unsealed = not members and int(records.add("events", 0)) > 0
    else:
        rank = 0
        unsealed = False
        while base.check([f"worker/{rank}"]):
            info = records.read(f"worker/{rank}", _WORKER_FIELDS)
            if info is None:
                unsealed = True
                break
            members.append(Member(rank, info["name"], info["host"], info["port"]))
            rank += 1
    if unsealed:
        raise AuthenticationError(f"the group's records at {where} fail their check under "
                                  f"this secret: it is not the job's secret; {_HOW}")
    if not members:
        raise GroupNotFoundError(f"the group at {where} has no worker listening yet (it is "
                                 f"still starting); try again in a moment")
    return members, secret, store


class Observer:
    """Connects to every worker of a group as an observer (see the module docs).

    Args:
        init_method: the group's rendezvous (``tcp://HOST:PORT``, ``file:///PATH``,
            ``env://``); by default, the worker running in this process, else
            ``MASTER_ADDR``/``MASTER_PORT``.
        secret: the job secret; by default ``TORCHRPC_SECRET``, ``TORCHRPC_SECRET_FILE``
            (or, in a worker's process, that worker's).
        timeout: seconds to reach the store and each worker.
    """

    def __init__(self, init_method: Optional[str] = None, secret: Optional[bytes] = None,
                 timeout: float = 10.0) -> None:
        self._init_method = init_method
        self._secret = secret
        self._timeout = timeout
        self._store: Any = None
        self._agent = handle.agent if init_method is None else None
        self.members: List[Member] = []
        self._links: Optional[Links] = None
        self._conns: Dict[int, Connection] = {}  # rank -> its connection
        self._replies: Dict[int, Tuple[threading.Event, List[Any]]] = {}
        self._rids = itertools.count(1)
        self._lock = threading.Lock()
        self._refresh()

    def _refresh(self) -> None:
        """Learn the members (a dynamic group's change)."""
        agent = self._agent
        if agent is not None and agent.extensions.get(OBSERVERS) is not None:
            registry = agent.registry
            secret = agent.extensions.get(OBSERVERS).secret
            self.members = [Member(r, w.name, *registry.addresses[r],
                                   registry.incarnations.get(r, 0))
                            for r, w in sorted(registry.workers.items())
                            if r in registry.addresses]
        else:
            try:
                members, secret, self._store = discover(
                    self._init_method or default_init_method(), self._secret, self._timeout)
            except RpcError as exc:
                if not self.members:
                    raise
                # The store is gone (its host, rank 0, stopped): ask the workers known.
                log.info("the group's members cannot be read again (%s); asking those "
                         "known", exc)
                return
            self.members = members
        if self._links is None:
            self._links = Links(OBSERVER_RANK, secret, _wire.Limits(),
                                handshake.FEATURE_FRAME_MAC | handshake.FEATURE_TENSOR_MAC
                                | handshake.FEATURE_SEAL_TRAILER,
                                lambda conn: None, self._on_frame, self._on_close)

    def _on_frame(self, conn: Connection, header: _wire.Header, envelope: bytes,
                  buffers: List[torch.Tensor]) -> None:
        waiting = self._replies.pop(header.request_id, None)
        if waiting is not None:
            waiting[1].append((header.kind, bytes(envelope)))
            waiting[0].set()

    def _on_close(self, conn: Connection, reason: Optional[BaseException]) -> None:
        with self._lock:
            if self._conns.get(conn.peer_rank) is conn:
                del self._conns[conn.peer_rank]

    def _connect(self, m: Member, deadline: float) -> Connection:
        conn = self._conns.get(m.rank)
        if conn is not None and not conn.closed:
            return conn
        assert self._links is not None
        conn = dial(self._links, m.rank, m.host, m.port,
                    max(deadline - time.monotonic(), 0.5), incarnation=m.incarnation)
        with self._lock:
            self._conns[m.rank] = conn
        return conn

    def snapshot(self, workers: Optional[Iterable[Any]] = None, stacks: bool = False,
                 timeout: Optional[float] = None) -> Dict[str, Any]:
        """Ask each worker (``workers``: names or ranks; default all) for its snapshot;
        the JSON document ``{"workers": [...], "chains": [...], "taken_at": ...}``. A
        worker that does not answer within ``timeout`` seconds has ``"answered": False``
        and ``"error"``."""
        self._refresh()
        timeout = self._timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        chosen = self._chosen(workers)
        body = json.dumps({"stacks": bool(stacks)}).encode()
        asked: Dict[int, Tuple[Member, threading.Event, List[Any]]] = {}
        docs: Dict[int, Dict[str, Any]] = {}
        for m in chosen:
            rid = next(self._rids)
            event, box = threading.Event(), []
            self._replies[rid] = (event, box)
            try:
                self._connect(m, deadline).send(Kind.SNAPSHOT, 0, rid, body, [], None)
            except (RpcError, OSError) as exc:
                self._replies.pop(rid, None)
                docs[m.rank] = _unanswered(m, f"cannot reach it at {m.host}:{m.port}: {exc}")
                continue
            asked[m.rank] = (m, event, box)
        for rank, (m, event, box) in asked.items():
            if not event.wait(max(deadline - time.monotonic(), 0)) or not box:
                docs[rank] = _unanswered(m, f"no answer within {timeout:g} s")
                continue
            kind, envelope = box[0]
            answer = json.loads(envelope.decode("utf-8"))
            if kind != Kind.RESPONSE:
                docs[rank] = _unanswered(m, f"its snapshot failed: {answer.get('error')}")
                continue
            answer["answered"] = True
            docs[rank] = answer
        doc = {"workers": [docs[m.rank] for m in chosen], "taken_at": time.time()}
        doc["chains"] = wait_chains(doc["workers"])
        return doc

    def _chosen(self, workers: Optional[Iterable[Any]]) -> List[Member]:
        if workers is None:
            return list(self.members)
        by_name = {m.name: m for m in self.members}
        by_rank = {m.rank: m for m in self.members}
        out = []
        for w in workers:
            key = getattr(w, "name", w)
            m = by_rank.get(key) if isinstance(key, int) else by_name.get(key)
            if m is None:
                raise ValueError(f"no worker {w!r} in the group; its workers are "
                                 f"{sorted(by_name)}")
            out.append(m)
        return out

    def close(self) -> None:
        """Close every connection to the workers (they forget the observer)."""
        links, self._links = self._links, None
        if links is not None:
            links.close([], 5.0)
        self._conns.clear()
        self._store = None

    def __enter__(self) -> "Observer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _unanswered(m: Member, why: str) -> Dict[str, Any]:
    return {"name": m.name, "rank": m.rank, "host": m.host, "state": "no answer",
            "answered": False, "error": why, "pending": [], "serving": []}


def wait_chains(workers: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The wait-for chains of a snapshot: each starts at a call that no request served by
    its caller explains (the caller's own thread made it) and follows it to the worker
    serving it, then on along that worker's calls made since; a chain that comes back
    to a worker on it is a cycle.

    Each chain is ``{"links": [{"worker", "function", "kind", "age_s", "state"}],
    "cycle": bool, "text": str}``; ``state`` of the last link says where it rests:
    ``running`` (its function runs there now), ``not running`` (queued, async, or
    the reply is on its way), ``no answer`` (that worker did not answer) or ``not
    asked`` (that worker was left out of the snapshot)."""
    by_rank = {w["rank"]: w for w in workers}
    serving_of: Dict[Tuple[int, int, int], Dict[str, Any]] = {}
    for w in workers:
        for s in w.get("serving", ()):
            serving_of[(w["rank"], s["from_rank"], s["id"])] = s

    def onward(w: Dict[str, Any], served: Dict[str, Any]) -> List[Dict[str, Any]]:
        # Calls this worker made since it began serving ``served``.
        return [p for p in w.get("pending", ())
                if p.get("age_s") is not None and p["age_s"] <= served["age_s"] + 0.001]

    explained = set()  # calls that a chain from their caller's caller reaches
    for w in workers:
        for s in w.get("serving", ()):
            if not by_rank.get(s["from_rank"], {}).get("answered", False):
                continue
            for p in onward(w, s):
                explained.add((w["rank"], p["id"]))
    chains: List[Dict[str, Any]] = []
    seen = set()  # calls some chain went through

    def follow(path: List[Dict[str, Any]], ranks: List[int], caller: Dict[str, Any],
               p: Dict[str, Any]) -> None:
        seen.add((caller["rank"], p["id"]))
        link = {"worker": p["to"], "rank": p["to_rank"], "function": p["function"],
                "kind": p["kind"], "age_s": p["age_s"]}
        path = path + [link]
        if p["to_rank"] in ranks:
            link["state"] = "cycle"
            chains.append(_chain(path, True))
            return
        callee = by_rank.get(p["to_rank"])
        if callee is None or not callee.get("answered", False):
            link["state"] = "not asked" if callee is None else "no answer"
            chains.append(_chain(path, False))
            return
        served = serving_of.get((p["to_rank"], caller["rank"], p["id"]))
        if served is None:
            link["state"] = "not running"
            chains.append(_chain(path, False))
            return
        link["state"] = "running"
        link["thread"] = served["thread"]
        nxt = onward(callee, served)
        if not nxt:
            chains.append(_chain(path, False))
            return
        for q in nxt:
            follow(path, ranks + [p["to_rank"]], callee, q)

    for w in workers:
        for p in w.get("pending", ()):
            if (w["rank"], p["id"]) in explained:
                continue
            follow([{"worker": w["name"], "rank": w["rank"]}], [w["rank"]], w, p)
    # Calls that every chain above missed wait in a cycle of workers serving each other.
    for w in workers:
        for p in w.get("pending", ()):
            if (w["rank"], p["id"]) not in seen:
                follow([{"worker": w["name"], "rank": w["rank"]}], [w["rank"]], w, p)
    chains.sort(key=lambda c: -(c["links"][1]["age_s"] or 0))
    return chains


def _chain(links: List[Dict[str, Any]], cycle: bool) -> Dict[str, Any]:
    parts = [links[0]["worker"]]
    for link in links[1:]:
        age = link["age_s"]
        note = "" if link["state"] in ("running", "cycle") else f", {link['state']}"
        parts.append(f"{link['worker']} ({short_name(link['function'])}, {age_text(age)}"
                     f"{note})")
    text = " -> ".join(parts) + ("  CYCLE" if cycle else "")
    return {"links": links, "cycle": cycle, "text": text}


def age_text(age: Optional[float]) -> str:
    """An age in seconds as a person reads it."""
    if age is None:
        return "?"
    if age >= 3600:
        return f"{age / 3600:.1f} h"
    if age >= 60:
        return f"{age / 60:.1f} min"
    return f"{age:.1f} s"


def short_name(function: str) -> str:
    """``module.qualname`` -> ``qualname`` (what a chain's text names)."""
    if " " in function or "<" in function:
        return function
    return function.rsplit(".", 1)[-1]


def snapshot(workers: Optional[Iterable[Any]] = None, stacks: bool = False,
             timeout: float = 10.0, init_method: Optional[str] = None,
             secret: Optional[bytes] = None) -> Dict[str, Any]:
    """A snapshot of every worker of a running group, as an observer.

    Args:
        workers: names or ranks of the workers to ask (default: all).
        stacks: include the Python stack of every thread of each worker.
        timeout: seconds to wait for the answers (and to reach the store and workers).
        init_method: the group's rendezvous; by default the group of the worker running
            in this process, else ``MASTER_ADDR``/``MASTER_PORT``.
        secret: the job secret; by default ``TORCHRPC_SECRET`` or
            ``TORCHRPC_SECRET_FILE`` (in a worker's process, that worker's).

    Returns:
        ``{"workers": [...], "chains": [...], "taken_at": ...}``: per worker its name,
        rank, state, ``pending`` calls (``to``, ``function``, ``kind``, ``age_s``), the
        requests it is ``serving`` (``from``, ``function``, ``kind``, ``age_s``,
        ``thread``), RRefs, autograd contexts, lost peers and, with ``stacks``, its
        threads' stacks; ``chains`` are the wait-for chains (see docs/guide.md).
    """
    with Observer(init_method, secret, timeout) as observer:
        return observer.snapshot(workers, stacks, timeout)
