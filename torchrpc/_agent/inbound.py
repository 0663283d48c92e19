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

from typing import TYPE_CHECKING, Any, Callable, List, Optional

import torch

from .. import _wire
from .._threads import Guard
from .._transport import Connection
from .._wire import Kind
from ..errors import ClosedError, ConnectionLostError
from .futures import mark_reader_thread
from .pool import current_pool
from .role import HANDED, ReadingRole
from .lifecycle import RUNNING
from .stats import nbytes
from .worker import WorkerInfo

if TYPE_CHECKING:
    from .agent import Agent

class Inbound:
    """The frame callback of one agent's connections."""

    def __init__(self, agent: "Agent") -> None:
        self._agent = agent
        self._pool = agent.pool
        self.role = ReadingRole(agent.pool, agent.scheduler)

    def on_frame(self, conn: Connection, header: _wire.Header, envelope: bytes,
                 buffers: List[torch.Tensor]) -> Optional[Callable[[], None]]:
        """A frame arrived on ``conn``: complete a reply, note a control message, or serve
        a request; return work for this thread if its reading role went elsewhere (see
        :class:`~torchrpc._agent.role.ReadingRole`)."""
        mark_reader_thread()
        agent = self._agent
        if not agent.ready:
            # A peer may finish rendezvous and call us before init_rpc here has returned.
            agent._ready.wait(120.0)
        kind = header.kind
        to_pool = self.role.to_pool
        if kind == Kind.RESPONSE or kind == Kind.ERROR:
            agent.calls.on_reply(conn, header, envelope, buffers)
            return to_pool(conn)
        registry = agent.registry
        src = registry.workers.get(conn.peer_rank)
        if src is None and agent.elastic:
            registry.refresh()  # a new member may call before we saw it join
            src = registry.workers.get(conn.peer_rank)
        if src is None:
            raise ConnectionLostError(f"frame from unknown rank {conn.peer_rank}")
        if kind == Kind.GOODBYE:
            registry.left.add(src.id)
            agent.requests.fail_peer(src.id, agent.left_error(src))
            return None
        if kind == Kind.HEARTBEAT:
            agent.liveness.beating.add(src.id)
            return to_pool(conn)
        if kind == Kind.ONCE_PROBE:
            agent.dispatch.answer_probe(conn, src, envelope)
            return to_pool(conn)
        if kind == Kind.ONCE_STATUS:
            agent.calls.probes.on_status(conn, envelope)
            return to_pool(conn)
        stats = agent._peer_stats.get(src.id) or agent.new_stats(src.id)
        stats.calls_in += 1
        stats.bytes_in += len(envelope) + nbytes(buffers) if buffers else len(envelope)
        dispatch = agent.dispatch
        handler = dispatch.handlers.get(kind)
        via = conn  # the reply goes back on it: the caller watches that connection for it
        if header.flags & _wire.FLAG_MANY:
            self.role.carries_many(conn)
        if header.flags & _wire.FLAG_ONCE and not dispatch.first_time(src, header.request_id, via):
            return to_pool(conn)
        pool = self._pool
        if current_pool() is pool and agent.lifecycle.state is RUNNING:
            return self._serve_inline(conn, src, header, envelope, buffers, handler, via)
        # A transport thread. With a pool thread idle, it takes the request and the
        # reading role with it, and serves what comes next as it comes, inline. Otherwise
        # (and until then) this thread reads on and passes each request to the pool,
        # which costs a wake-up per request: where both CPUs are taken by this thread
        # polling and the caller, the woken thread waits for the poll to end.
        if agent.lifecycle.state is RUNNING and pool.hand_off(
                self._serve_then_read, conn, src, header, envelope, buffers, handler, via):
            return HANDED
        if agent._max_queued and pool.num_pending >= agent._max_queued \
                and not header.oneway and not header.flags & _wire.FLAG_ONCE:
            dispatch.refuse(src, header, via)
            return to_pool(conn)
        try:
            pool.submit(dispatch.serve, src, header, envelope, buffers, handler, via)
        except ClosedError:
            pass  # stopping; the caller learns from the GOODBYE or the closed connection
        return to_pool(conn)

    def _serve_inline(self, conn: Connection, src: WorkerInfo, header: _wire.Header,
                      envelope: bytes, buffers: List[torch.Tensor], handler: Any,
                      via: Optional[Connection]) -> Optional[Callable[[], None]]:
        """Run a request on the reading thread, lending the reading role meanwhile."""
        agent = self._agent
        role = self.role
        role.lend(conn)
        try:
            agent.dispatch.serve(src, header, envelope, buffers, handler, via)
        except Exception as exc:  # noqa: BLE001 - must not reach a reader that lent its role
            Guard(f"serving a {Kind(header.kind).name} from {src.name} on {agent.name}",
                  limit=None).failed(exc)
        finally:
            work = role.returned(conn)
        return work  # None: read on; else the role is elsewhere

    def _serve_then_read(self, conn: Connection, src: WorkerInfo, header: _wire.Header,
                         envelope: bytes, buffers: List[torch.Tensor], handler: Any,
                         via: Optional[Connection]) -> None:
        """A pool task: run a request that a transport thread read, then hold the reading
        role of its connection, as if this thread had read the request itself."""
        with self._pool.blocking():
            mark_reader_thread()
            work = self._serve_inline(conn, src, header, envelope, buffers, handler, via)
            if work is None:
                work = conn.read_frames()
        if work is not None:
            work()
