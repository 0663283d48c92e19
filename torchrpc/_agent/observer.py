"""The observer's side: connect to every worker of a running group and take snapshots.

Theory of operation. An :class:`Observer` finds the group's workers where a worker finds
them: in the rendezvous store (``tcp://``, ``env://`` through ``MASTER_ADDR`` and
``MASTER_PORT``, or ``file://``), whose records it reads only if their seals hold under
the job secret, or, in a process that runs a worker, in that worker's own table. It
proves the secret to each worker in the ordinary handshake, as the rank
:data:`~torchrpc._agent.snapshot.OBSERVER_RANK`, which no member has, and asks each for
its snapshot (snapshot.py); the answers are JSON, nothing is unpickled. It writes nothing
to the store and takes no rank, so when it closes, or dies, nothing of it remains.

A group whose links run over TLS takes the observer's links over TLS too, with what a
worker is given (``tls_certfile``, ``tls_keyfile``, ``tls_cafile``, ``tls_identity``) and
the same checks both ways: its certificate must chain to the job's CA and carry the job
identity or name the observer's address. Without them, the first worker that turns out
to speak TLS ends the snapshot with :class:`TlsRequiredError`, which says what to give.
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
from .._rendezvous.secret import (SECRET_ENV, SECRET_FILE_ENV, VIA_STORE_ENV, Source,
                                  launcher_secret, shared_secret)
from .._transport import Connection, handshake, tls
from .._transport.dial import dial
from .._transport.links import Links
from .._wire import Kind
from ..errors import AuthenticationError, RendezvousError, RpcError
from .chains import wait_chains
from .current import handle
from .snapshot import OBSERVER_RANK, OBSERVERS

log = logging.getLogger(__name__)

_MEMBERSHIP_KEY = "torchrpc-membership"  # the store's mark of a group (rendezvous.py)
_WORKER_FIELDS = {"name": str, "host": str, "port": int}

_HOW = (f"set {SECRET_ENV} to the job's secret (the value its workers were given), or "
        f"{SECRET_FILE_ENV} to a file of mode 0600 holding it")


class GroupNotFoundError(RendezvousError):
    """The rendezvous store holds no torchrpc group (yet)."""


class TlsRequiredError(AuthenticationError):
    """The group's links run over TLS and the observer was given no TLS material."""


TLS_HOW = ("give the observer what a worker of the job is given: a certificate and key "
           "signed by the job's CA (tls_certfile, tls_keyfile; the certificate must carry "
           "the job identity, or name this host's address), the CA (tls_cafile) and, if "
           "the workers set one, tls_identity; on the command line --tls-certfile, "
           "--tls-keyfile, --tls-cafile and --tls-identity")


def _tls_contexts(certfile: Optional[str], keyfile: Optional[str], cafile: Optional[str],
                  identity: Optional[str]) -> Optional[tls.TlsContexts]:
    """The observer's TLS contexts from a worker's TLS options (None without a
    certificate); ValueError naming a bad or missing one."""
    if not certfile:
        if cafile or keyfile or identity:
            raise ValueError(f"tls_certfile is required with tls_cafile, tls_keyfile or "
                             f"tls_identity: {TLS_HOW}")
        return None
    return tls.make_contexts(certfile, keyfile, cafile, True, identity)


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
    """The job secret, found the way a worker that is not rank 0 finds it: ``given``, else
    ``TORCHRPC_SECRET``, ``TORCHRPC_SECRET_FILE``, else what rank 0 shares on this host:
    its secret file, which it keeps while it runs, or, with
    ``TORCHRPC_INSECURE_SECRET_IN_STORE=1``, the secret in the store."""
    value = given
    if value is None and os.environ.get(SECRET_ENV):
        value = os.environ[SECRET_ENV].encode()
    source = Source(value=value, path=os.environ.get(SECRET_FILE_ENV) or None,
                    via_store=os.environ.get(VIA_STORE_ENV, "") not in ("", "0"))
    secret = launcher_secret(source)
    if secret is not None:
        return secret
    try:
        return shared_secret(store, rendezvous.host_identity(), source)
    except RendezvousError as exc:
        raise AuthenticationError(
            f"no job secret: {getattr(exc, 'reason', exc)}. To inspect a job, {_HOW}; "
            f"without either, the secret file of its rank 0 is read, by the job's user on "
            f"that host") from exc


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
        secret: the job secret; by default found as a worker finds it (:func:`find_secret`)
            (or, in a worker's process, that worker's).
        timeout: seconds to reach the store and each worker.
        tls_certfile, tls_keyfile, tls_cafile, tls_identity: for a group whose links
            run over TLS, as a worker's backend options of those names (in a worker's
            process, by default that worker's).
    """

    def __init__(self, init_method: Optional[str] = None, secret: Optional[bytes] = None,
                 timeout: float = 10.0, tls_certfile: Optional[str] = None,
                 tls_keyfile: Optional[str] = None, tls_cafile: Optional[str] = None,
                 tls_identity: Optional[str] = None) -> None:
        self._init_method = init_method
        self._secret = secret
        self._timeout = timeout
        self._store: Any = None
        self._reader: Optional[threading.Thread] = None  # reads the store (_discover)
        self._agent = handle.agent if init_method is None else None
        self._tls = _tls_contexts(tls_certfile, tls_keyfile, tls_cafile, tls_identity)
        settings = getattr(self._agent, "settings", None)
        if self._tls is None and settings is not None and settings.tls_certfile:
            self._tls = _tls_contexts(settings.tls_certfile, settings.tls_keyfile,
                                      settings.tls_cafile, settings.tls_identity)
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
                members, secret, self._store = self._discover()
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
                                lambda conn: None, self._on_frame, self._on_close,
                                tls_contexts=self._tls)

    def _discover(self) -> Tuple[List[Member], bytes, Any]:
        """:func:`discover`, run on a thread of its own while this one waits for it: twice
        the timeout at most, one to reach the store and one for its answers.

        torch's store client can block in C++ beyond its own timeout: it opens a store
        whose host accepts the connection and never answers (the job's rank 0 stopped,
        its kernel still accepting), and waits for the answer. A thread blocked there sees
        no signal, so the caller waits here instead, where a Ctrl-C raises
        :class:`KeyboardInterrupt` at once and the wait has its end. The reading thread
        ends when the client returns: when the store's host answers, or the connection
        breaks; until then no other read starts (:class:`RendezvousError` at once).
        """
        init_method = self._init_method or default_init_method()
        if self._reader is not None and self._reader.is_alive():
            raise RendezvousError(f"the rendezvous store at {init_method} has not answered "
                                  f"an earlier read yet")
        done = threading.Event()
        box: List[Any] = []

        def read() -> None:
            try:
                box.append(discover(init_method, self._secret, self._timeout))
            except BaseException as exc:  # the caller raises it
                box.append(exc)
            finally:
                done.set()

        self._reader = threading.Thread(target=read, name="torchrpc-observer-store",
                                        daemon=True)
        self._reader.start()
        if not done.wait(2 * self._timeout):
            raise RendezvousError(f"the rendezvous store at {init_method} did not answer "
                                  f"within {2 * self._timeout:g} s; check that the job runs "
                                  f"and is not stopped (its rank 0 hosts the store), and the "
                                  f"address (the job's MASTER_ADDR and MASTER_PORT)")
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

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
        try:
            conn = dial(self._links, m.rank, m.host, m.port,
                        max(deadline - time.monotonic(), 0.5), incarnation=m.incarnation)
        except RpcError:
            # A TLS worker closes on the plain handshake's first bytes: find out whether
            # that is why, and if so say what the observer needs.
            if self._links.tls is None and tls.speaks_tls(
                    m.host, m.port, max(deadline - time.monotonic(), 0.5)):
                raise TlsRequiredError(f"the group's links run over TLS ({m.name} at "
                                       f"{m.host}:{m.port} speaks TLS), and this observer "
                                       f"has no TLS material: {TLS_HOW}") from None
            raise
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
            except TlsRequiredError:
                self._replies.pop(rid, None)
                raise
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


def snapshot(workers: Optional[Iterable[Any]] = None, stacks: bool = False,
             timeout: float = 10.0, init_method: Optional[str] = None,
             secret: Optional[bytes] = None, tls_certfile: Optional[str] = None,
             tls_keyfile: Optional[str] = None, tls_cafile: Optional[str] = None,
             tls_identity: Optional[str] = None) -> Dict[str, Any]:
    """A snapshot of every worker of a running group, as an observer.

    Args:
        workers: names or ranks of the workers to ask (default: all).
        stacks: include the Python stack of every thread of each worker.
        timeout: seconds to wait for the answers (and to reach the store and workers).
        init_method: the group's rendezvous; by default the group of the worker running
            in this process, else ``MASTER_ADDR``/``MASTER_PORT``.
        secret: the job secret; by default ``TORCHRPC_SECRET``, ``TORCHRPC_SECRET_FILE``,
            or rank 0's secret file on its host (in a worker's process, that worker's).
        tls_certfile, tls_keyfile, tls_cafile, tls_identity: for a group whose links
            run over TLS: what a worker's backend options of those names hold (in a
            worker's process, by default that worker's). Without them such a group
            raises :class:`TlsRequiredError`, which says what to give.

    Returns:
        ``{"workers": [...], "chains": [...], "taken_at": ...}``: per worker its name,
        rank, state, ``pending`` calls (``to``, ``function``, ``kind``, ``age_s``, and
        ``for``: the request served that it was made for), the requests it is
        ``serving`` (``from``, ``function``, ``kind``, ``age_s``, ``thread``, ``async``),
        RRefs, autograd contexts, lost peers and, with ``stacks``, its
        threads' stacks; ``chains`` are the wait-for chains (see docs/guide.md).
    """
    with Observer(init_method, secret, timeout, tls_certfile, tls_keyfile, tls_cafile,
                  tls_identity) as observer:
        return observer.snapshot(workers, stacks, timeout)
