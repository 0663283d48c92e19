"""What a worker tells an observer: a snapshot of its calls, its state and its threads.

Theory of operation. An *observer* (``python -m torchrpc.inspect``, or
``torchrpc.rpc.snapshot``; the client is observer.py) connects to a worker's listener with
the ordinary handshake under the rank :data:`OBSERVER_RANK`, so it proves that it holds
the job secret before one byte of it is read, and its frames carry MACs like any peer's.
It is no member: :class:`Observers` keeps its connections out of the agent's table of
connections (so no GOODBYE, heartbeat or barrier ever waits for it, and it is in no
``get_worker_infos()``), and answers its frames itself. The observer sends one
``SNAPSHOT`` frame per snapshot (a JSON object: ``{"stacks": bool}``); the worker answers
with a ``RESPONSE`` holding the snapshot as JSON. No pickle crosses either way.

The answer is made on the connection's reading thread, which belongs to the transport,
not to the worker pool: a worker whose pool threads are all stuck still answers. It
reads the agent's tables without locks (each is changed by single dict operations, which
the GIL makes atomic) and copies them first (docs/design.md, "Snapshots of shared
tables").

What each thread serves is kept by :class:`~torchrpc._agent.serving.ServingTable`
(``dispatch.serving``; serving.py says what it costs and how ages and chains are made
exact): a request is listed from when a thread begins serving it until its handler
returns, or for an ``@async_execution`` one until its reply is sent. Each outgoing call
names the request it was made for (``for``), by the thread that made it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Protocol

import torch

from .. import _wire
from .._transport import Connection
from .._wire import Kind
from .hooks import Slot, describe
from .serving import CALLER, KIND, RID, STARTED, WHAT

log = logging.getLogger(__name__)

# The rank an observer's HELLO carries: no worker has it, so none mistakes it for a member.
OBSERVER_RANK = -7

# Where an agent keeps its :class:`Observers` (installed when its transport starts).
OBSERVERS: "Slot[Observers]" = Slot("observers")

# How a snapshot names the kind of a request.
KIND_NAMES = {
    Kind.CALL: "call",
    Kind.RREF_REMOTE_CALL: "remote",
    Kind.RREF_FETCH: "to_here",
    Kind.RREF_USER_DELETE: "rref_delete",
    Kind.RREF_FORK_REQUEST: "rref_fork",
    Kind.RREF_CHILD_ACCEPT: "rref_accept",
    Kind.RREF_METHOD_CALL: "rref_method",
    Kind.AUTOGRAD_BACKWARD: "backward",
    Kind.AUTOGRAD_RELEASE: "autograd_release",
    Kind.AUTOGRAD_DONE: "autograd_done",
    Kind.PROFILED_CALL: "profiled_call",
    Kind.SHUTDOWN_SYNC: "shutdown_sync",
}

# Request kinds whose payload starts with the function they run.
FUNCTION_FIRST = frozenset((Kind.RREF_REMOTE_CALL, Kind.PROFILED_CALL))


def kind_name(kind: int) -> str:
    name = KIND_NAMES.get(kind)
    if name is not None:
        return name
    try:
        return Kind(kind).name.lower()
    except ValueError:
        return f"kind{kind}"


def function_name(what: Any) -> str:
    """The function's qualified name, or what the request does."""
    if isinstance(what, int):
        return kind_name(what)
    try:
        return describe(what)
    except Exception as exc:  # noqa: BLE001 - a repr that fails must not fail the snapshot
        return f"<{type(what).__name__}: {exc}>"


class Inspected(Protocol):
    """What a snapshot reads of an agent: its public parts and ``debug_info``."""

    name: str
    rank: int
    pool: Any  # pool.WorkerPool
    requests: Any  # requests.Requests: ``pending``
    dispatch: Any  # dispatch.Dispatch: ``serving`` (serving.ServingTable)
    registry: Any  # registry.Registry: ``workers``, ``left``
    connections: Any  # connections.Connections: ``lost``
    lifecycle: Any  # lifecycle.Lifecycle
    settings: Any  # settings.Settings

    def debug_info(self) -> Dict[str, Any]: ...


class Observers:
    """One agent's observers: keeps their connections out of the agent's tables and
    answers their snapshot requests (see the module docs). The transport's connect and
    close callbacks go through :meth:`on_connect` and :meth:`on_close`."""

    def __init__(self, name: str, snapshot: Callable[[bool, "Observers"], Dict[str, Any]],
                 on_connect: Callable[[Connection], None],
                 on_close: Callable[[Connection, Optional[BaseException]], None],
                 secret: bytes) -> None:
        self._name = name  # the worker's, for the log
        self._snapshot = snapshot  # (stacks, self) -> this worker's snapshot (take)
        self.secret = secret  # an observer in this process proves it (observer.py)
        self._on_connect = on_connect
        self._on_close = on_close
        self.started = time.monotonic()
        self.host = socket.gethostname()
        self.count = 0  # observers connected now
        self._lock = threading.Lock()  # accept threads connect observers at once

    def on_connect(self, conn: Connection) -> None:
        if conn.peer_rank != OBSERVER_RANK:
            self._on_connect(conn)
            return
        with self._lock:
            self.count += 1
        conn.route_frames(self.on_frame)
        log.info("%s: an observer connected", self._name)

    def on_close(self, conn: Connection, reason: Optional[BaseException]) -> None:
        if conn.peer_rank != OBSERVER_RANK:
            self._on_close(conn, reason)
            return
        with self._lock:
            self.count -= 1
        log.info("%s: an observer left", self._name)

    def on_frame(self, conn: Connection, header: _wire.Header, envelope: bytes,
                 buffers: List[torch.Tensor]) -> None:
        """A frame of an observer, on its connection's reading thread: answer a
        ``SNAPSHOT``; nothing else is accepted from an observer."""
        if header.kind != Kind.SNAPSHOT or buffers:
            raise ValueError(f"an observer sent a frame of kind {header.kind} "
                             f"({len(buffers)} buffers); only SNAPSHOT is answered")
        try:
            ask = json.loads(bytes(envelope).decode("utf-8")) if envelope else {}
            doc = self._snapshot(bool(ask.get("stacks")), self)
            kind, body = Kind.RESPONSE, json.dumps(doc, default=str).encode("utf-8")
        except Exception as exc:  # noqa: BLE001 - the observer is told, the worker goes on
            log.warning("%s could not make a snapshot: %r", self._name, exc)
            kind, body = Kind.ERROR, json.dumps({"error": repr(exc)}).encode("utf-8")
        conn.send(kind, 0, header.request_id, body, [], None)


def take(agent: Inspected, stacks: bool = False, observers: Optional[Observers] = None
         ) -> Dict[str, Any]:
    """The snapshot of ``agent`` (one worker of the JSON document; see docs/guide.md)."""
    now = time.monotonic()
    pool = agent.pool
    names = {t.ident: t.name for t in threading.enumerate()}
    table = agent.dispatch.serving
    pending = []
    for rid, p in list(agent.requests.pending.items()):
        made_for = table.key_of(p.serving)
        pending.append({"id": rid, "to": p.dst.name, "to_rank": p.dst.id,
                        "function": function_name(p.what), "kind": kind_name(p.kind),
                        "age_s": round(now - p.sent, 3) if p.sent else None,
                        "for": None if made_for is None
                        else {"from_rank": made_for[0], "id": made_for[1]}})
    pending.sort(key=lambda e: -(e["age_s"] or 0))
    serving = []
    labels: Dict[int, List[str]] = {}
    for entry, ident in table.entries():
        src, kind, what = entry[CALLER], entry[KIND], entry[WHAT]
        function = function_name(what) if what is not None else "(being decoded)"
        # Never less than the time it has been served; at most one timer round more.
        age = round(max(now - entry[STARTED], 0.0), 3)
        thread = None if ident is None else names.get(ident, f"thread {ident}")
        serving.append({"id": entry[RID], "from": src.name, "from_rank": src.id,
                        "function": function, "kind": kind_name(kind), "age_s": age,
                        "thread": thread, "async": ident is None})
        if ident is not None:
            labels.setdefault(ident, []).append(
                f"serving {kind_name(kind)} {function} from {src.name} ({age:g} s)")
    serving.sort(key=lambda e: -e["age_s"])
    registry = agent.registry
    workers = dict(registry.workers)
    lost = {workers[r].name if r in workers else f"rank{r}": why
            for r, why in list(agent.connections.lost.items())}
    try:
        info = agent.debug_info()
    except Exception as exc:  # noqa: BLE001 - a layer's counters must not fail the snapshot
        info = {"error": repr(exc)}
    idle = pool.num_idle
    doc: Dict[str, Any] = {
        "name": agent.name, "rank": agent.rank, "pid": os.getpid(),
        "host": observers.host if observers is not None else socket.gethostname(),
        "state": info.get("agent.state", agent.lifecycle.state.value),
        "uptime_s": round(now - observers.started, 3) if observers is not None else None,
        "threads": {"busy": pool.num_threads - idle, "total": pool.num_threads,
                    "size": agent.settings.num_worker_threads, "queued": pool.num_pending},
        "pending": pending, "serving": serving,
        "rrefs": {"owned": info.get("num_owner_rrefs"), "forks": info.get("num_forks"),
                  "unconfirmed": info.get("num_pending_users")},
        "autograd": {"contexts": info.get("num_autograd_contexts"),
                     "backward_passes": info.get("num_current_backward_passes")},
        "observers": observers.count if observers is not None else 0,
        "members": [w.name for _, w in sorted(workers.items())],
        "lost": lost,
        "left": sorted(workers[r].name for r in list(registry.left) if r in workers),
        "debug_info": {k: v for k, v in info.items() if k != "peers"},
    }
    if stacks:
        doc["stacks"] = _stacks(names, labels)
    return doc


def _stacks(names: Dict[Optional[int], str], labels: Dict[int, List[str]]) -> Dict[str, str]:
    """The Python stack of every thread, by thread name (and, for one serving requests,
    what it serves, innermost last)."""
    out = {}
    me = threading.get_ident()
    for ident, frame in sys._current_frames().items():
        name = names.get(ident, f"thread {ident}")
        if ident == me:
            name += " (answering this snapshot)"
        label = labels.get(ident)
        key = f"{name} [{'; '.join(label)}]" if label else name
        out[key] = "".join(traceback.format_stack(frame))
    return out
