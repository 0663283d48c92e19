"""Incoming frames in one place (``Inbound``, held as ``agent.inbound``).

Every frame that a connection's reader reads comes to :meth:`Inbound.on_frame`, the
transport's frame callback, and goes one of three ways: a reply (``RESPONSE``, ``ERROR``)
to the request table (:meth:`Calls.on_reply <torchrpc._agent.calls.Calls.on_reply>`); a
control message (``GOODBYE``, ``HEARTBEAT``, the at-most-once probes) to the peers'
bookkeeping; a request to serving (dispatch.py), which decodes it under the layers'
scopes, runs its handler and replies. Which thread serves a request, and which reads on
meanwhile, is :class:`~torchrpc._agent.role.ReadingRole`'s (its rules are in its
docstring): a pool thread that read a request serves it itself, lending the reading
role meanwhile; a transport thread hands the request, and the role, to an idle pool
thread. (The lanes whose replies a waiting thread reads, lanes.py, read their own
connections and complete their replies through ``Calls.on_reply`` too.)
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional

import torch

from .. import _wire
from .._transport import Connection
from .._wire import Kind
from ..errors import ClosedError, ConnectionLostError, RpcError
from .dispatch import Dispatch
from .futures import mark_reader_thread
from .lifecycle import RUNNING, Lifecycle
from .pool import WorkerPool, current_pool
from .registry import Registry, left_error
from .role import HANDED, ReadingRole
from .scheduler import Scheduler
from .stats import PeerStats, nbytes
from .worker import WorkerInfo

# Plain ints: looking a member up on the enum class costs more than the comparison.
_RESPONSE, _ERROR, _GOODBYE, _HEARTBEAT = (int(Kind.RESPONSE), int(Kind.ERROR),
                                           int(Kind.GOODBYE), int(Kind.HEARTBEAT))
_ONCE_PROBE, _ONCE_STATUS = int(Kind.ONCE_PROBE), int(Kind.ONCE_STATUS)
_FLAG_MANY, _FLAG_ONCE = _wire.FLAG_MANY, _wire.FLAG_ONCE


class Inbound:
    """The frame callback of one agent's connections.

    Handed where each frame goes: ``on_reply(conn, header, envelope, buffers)`` completes
    a reply (the request table's side, ``Calls.on_reply``); ``on_status(conn,
    envelope)`` takes the answer to an at-most-once probe (``Probes.on_status``);
    ``fail_peer(rank, error)`` fails what is pending on a worker that said GOODBYE
    (``Requests.fail_peer``); ``heard_beat(rank)`` notes a heartbeat (liveness); the
    ``registry`` names the sender, and ``dispatch`` serves requests. Serving runs on
    ``pool`` (``scheduler`` times the reading role's loans); ``lifecycle`` says whether
    the agent still runs; ``stats`` and ``new_stats(rank)`` count the traffic by peer;
    ``max_queued`` bounds the requests waiting for a pool thread. Frames wait until
    :meth:`mark_ready`.
    """

    def __init__(self, name: str, pool: WorkerPool, scheduler: Scheduler, lifecycle: Lifecycle,
                 registry: Registry, dispatch: Dispatch,
                 on_reply: Callable[[Connection, _wire.Header, bytes, List[torch.Tensor]], None],
                 on_status: Callable[[Connection, bytes], None],
                 fail_peer: Callable[[int, RpcError], None], heard_beat: Callable[[int], None],
                 stats: Dict[int, PeerStats], new_stats: Callable[[int], PeerStats],
                 max_queued: int) -> None:
        self._name = name
        self._pool = pool
        self._lifecycle = lifecycle
        self._registry = registry
        self._dispatch = dispatch
        self._on_reply = on_reply
        self._on_status = on_status
        self._fail_peer = fail_peer
        self._heard_beat = heard_beat
        self._stats = stats
        self._new_stats = new_stats
        self._max_queued = max_queued
        self.role = ReadingRole(name, pool, scheduler)
        self._ready = threading.Event()
        self.ready = False  # _ready is set: read by every frame, without the Event's method

    def mark_ready(self) -> None:
        """Let frames through (``init_rpc`` has installed every layer)."""
        self._ready.set()
        self.ready = True

    def on_frame(self, conn: Connection, header: _wire.Header, envelope: bytes,
                 buffers: List[torch.Tensor]) -> Optional[Callable[[], None]]:
        """A frame arrived on ``conn``: complete a reply, note a control message, or serve
        a request; return work for this thread if its reading role went elsewhere (see
        :class:`~torchrpc._agent.role.ReadingRole`)."""
        mark_reader_thread()
        if not self.ready:
            # A peer may finish rendezvous and call us before init_rpc here has returned.
            self._ready.wait(120.0)
        kind = header.kind
        to_pool = self.role.to_pool
        if kind == _RESPONSE or kind == _ERROR:
            self._on_reply(conn, header, envelope, buffers)
            return to_pool(conn)
        registry = self._registry
        src = registry.workers.get(conn.peer_rank)
        if src is None and registry.elastic:
            registry.refresh()  # a new member may call before we saw it join
            src = registry.workers.get(conn.peer_rank)
        if src is None:
            raise ConnectionLostError(f"frame from unknown rank {conn.peer_rank}")
        if kind == _GOODBYE:
            registry.said_goodbye(src.id)
            self._fail_peer(src.id, left_error(src))
            return None
        if kind == _HEARTBEAT:
            self._heard_beat(src.id)
            return to_pool(conn)
        if kind == _ONCE_PROBE:
            self._dispatch.answer_probe(conn, src, envelope)
            return to_pool(conn)
        if kind == _ONCE_STATUS:
            self._on_status(conn, envelope)
            return to_pool(conn)
        stats = self._stats.get(src.id) or self._new_stats(src.id)
        stats.calls_in += 1
        stats.bytes_in += len(envelope) + nbytes(buffers) if buffers else len(envelope)
        dispatch = self._dispatch
        handler = dispatch.handlers.get(kind)
        via = conn  # the reply goes back on it: the caller watches that connection for it
        flags = header.flags
        if flags & _FLAG_MANY:
            self.role.carries_many(conn)
        if flags & _FLAG_ONCE and not dispatch.first_time(src, header.request_id, via):
            return to_pool(conn)
        pool = self._pool
        running = self._lifecycle.state is RUNNING
        if current_pool() is pool and running:
            return self.role.run_inline(conn, self._dispatch.serve, src, header, envelope,
                                        buffers, handler, via)
        # A transport thread. With a pool thread idle, it takes the request and the
        # reading role with it, and serves what comes next as it comes, inline. Otherwise
        # (and until then) this thread reads on and passes each request to the pool,
        # which costs a wake-up per request: where both CPUs are taken by this thread
        # polling and the caller, the woken thread waits for the poll to end.
        if running and pool.hand_off(
                self._serve_then_read, conn, src, header, envelope, buffers, handler, via):
            return HANDED
        if self._max_queued and pool.num_pending >= self._max_queued \
                and not header.oneway and not flags & _FLAG_ONCE:
            dispatch.refuse(src, header, via)
            return to_pool(conn)
        try:
            pool.submit(dispatch.serve, src, header, envelope, buffers, handler, via)
        except ClosedError:
            pass  # stopping; the caller learns from the GOODBYE or the closed connection
        return to_pool(conn)

    def _serve_then_read(self, conn: Connection, src: WorkerInfo, header: _wire.Header,
                         envelope: bytes, buffers: List[torch.Tensor], handler: Any,
                         via: Optional[Connection]) -> None:
        """A pool task: run a request that a transport thread read, then hold the reading
        role of its connection, as if this thread had read the request itself."""
        with self._pool.blocking():
            mark_reader_thread()
            work = self.role.run_inline(conn, self._dispatch.serve, src, header, envelope,
                                        buffers, handler, via)
            if work is None:
                work = conn.read_frames()
        if work is not None:
            work()
