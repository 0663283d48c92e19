"""The caller's side of requests (``Calls``, held as ``agent.calls``).

Every request takes one path, :meth:`Calls.start`: a lane is picked for it (lanes.py),
it is encoded once under the call hooks of the layers above (which add their metadata
and see the tensors that cross), entered in the pending table (requests.py), and the
lane sends it (:meth:`Calls.transmit`, for every lane and every attempt of a retry).
Its reply, read by whichever thread the lane has read it, completes the future here
(:meth:`Calls.on_reply`). The caller's side of at-most-once, asking the callee before
sending a request again, is :class:`~torchrpc._agent.probes.Probes`'.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import _wire
from .._transport import Connection
from .._wire import Kind
from ..errors import ConnectionLostError, NotInitializedError, RpcError, SerializationError
from .dispatch import ONCE_ACKS
from .futures import RpcFuture, SyncFuture, fresh_error, new_future
from .hooks import MessageContext, combine, describe
from .lanes import Expect, Lanes
from .probes import Probes
from .remote_error import rebuild_error
from .pending import Pending, Resend
from .retry import RetryPolicy
from .stats import nbytes
from .worker import WorkerInfo

if TYPE_CHECKING:
    from .agent import Agent

log = logging.getLogger(__name__)


def inline_max_to(agent: "Agent", rank: int) -> int:
    """The most tensor bytes a message to ``rank`` carries inside its envelope (see
    ``Transport.inline_max``)."""
    transport = agent._transport
    if transport is None:
        return _wire.INLINE_MAX
    return transport.inline_max.get(rank, _wire.INLINE_MAX)


class Calls:
    """Encoding, sending and completing the requests of one agent."""

    def __init__(self, agent: "Agent") -> None:
        self._agent = agent
        self._rid = itertools.count(1)
        self.probes = Probes(agent, self)
        self.lanes = Lanes(agent, self)
        self._max_pending = agent.settings.max_pending_requests
        # Callee rank -> ids of at-most-once requests to it whose replies arrived here: the
        # next such request tells the callee, which then lets go of the replies it kept.
        self._acks: Dict[int, List[int]] = {}

    def start(self, dst: WorkerInfo, kind: int, payload: Any, timeout: float,
              what: Any = None, oneway: bool = False, retry: Optional[RetryPolicy] = None,
              expect: int = Expect.ANY, after: Any = None,
              on_done: Optional[Callable[[Any], None]] = None) -> Any:
        """The one path of a request (see :meth:`Agent.request`): pick its lane, encode
        and enter it, send it; its future."""
        route = self.lanes.pick(dst, expect, retry, timeout, after) if expect else \
            self.lanes.shared.route
        try:
            rid, p, flags, env, bufs, keep = self.new_request(
                dst, kind, payload, timeout, what, oneway, retry, route.conn, sync=route.sync,
                on_done=on_done if route.inline else None)
        except BaseException:
            route.lane.release(route, dst)
            raise
        route.lane.send(route, rid, p, kind, flags, env, bufs, keep)
        if on_done is not None and not route.inline:
            p.future.add_done_callback(on_done)
        return p.future

    def request_many(self, dsts: Sequence[WorkerInfo], kind: int, payload: Any, timeout: float,
                     what: Any = None, retry: Optional[RetryPolicy] = None) -> List[RpcFuture]:
        """See :meth:`Agent.request_many`."""
        futures: List[RpcFuture] = []
        shared: List[Tuple[bytes, Any, Any, int]] = []
        for i, dst in enumerate(dsts):
            try:
                rid, p, flags, env, bufs, keep = self.new_request(
                    dst, kind, payload, timeout, what, retry=retry,
                    encoded=shared[0] if shared else None, share=shared if i == 0 else None)
            except BaseException as exc:  # noqa: BLE001 - the first raises, others fail alone
                if i == 0:
                    raise
                failed = new_future(self._agent.pool)
                failed.set_exception(fresh_error(exc))
                futures.append(failed)
                continue
            self.transmit(None, rid, p, kind, flags, env, bufs, keep)
            futures.append(p.future)
        return futures

    def new_request(self, dst: WorkerInfo, kind: int, payload: Any, timeout: float, what: Any,
                    oneway: bool = False, retry: Optional[RetryPolicy] = None,
                    private: Optional[Connection] = None,
                    encoded: Optional[Tuple[bytes, Any, Any, int]] = None,
                    share: Optional[List[Tuple[bytes, Any, Any, int]]] = None,
                    sync: bool = False,
                    on_done: Optional[Callable[[Any], None]] = None) -> Tuple[Any, ...]:
        """Encode a request and enter it in the pending table (unless one-way).

        With ``sync`` (a caller that waits at once and hands out no future), its future
        is a :class:`~torchrpc._agent.futures.SyncFuture`. ``on_done`` is called with the
        future, inline, where it completes.
        ``encoded``: an encoding of ``payload`` made for another destination (and the
        inline bound it was made with), used unless a call hook has something to add for
        this one or this one's inline bound differs. ``share``: a list that gets this
        encoding if it depends on nothing of ``dst`` (see :meth:`request_many`).
        """
        agent = self._agent
        # The protocols' at-most-once messages are not refused: losing them would lose state.
        once = retry is not None and retry.max_attempts > 1 and kind != Kind.CALL
        waiting = len(agent.requests.pending)
        if self._max_pending and waiting >= self._max_pending and not oneway and not once:
            raise RpcError(
                f"too many outstanding RPCs: {waiting} requests of {agent.name} wait "
                f"for replies (max_pending_requests is {self._max_pending}); wait for some "
                f"of them before sending {describe(what)} to {dst.name}, or raise the option")
        meta = send_hook = states = None
        if agent._hooks:
            meta, send_hook, states = self._outgoing(dst, kind)
        if once and self._acks:
            acks = self._acks.pop(dst.id, None)
            if acks:
                meta = dict(meta) if meta else {}
                meta[ONCE_ACKS] = tuple(acks)
        ctx = MessageContext(agent, dst, kind, replied=not oneway)
        inline = inline_max_to(agent, dst.id)
        if encoded is not None and meta is None and send_hook is None and states is None \
                and encoded[3] == inline:
            env, bufs, keep = encoded[:3]
        else:
            try:
                env, bufs, keep = _wire.encode(payload, ctx, send_hook, meta,
                                               _wire.PAYLOAD_NAMES.get(kind, "payload"), inline)
            except BaseException:
                if states is not None:
                    self._request_failed(dst, states)
                raise
            if share is not None and meta is None and send_hook is None and states is None \
                    and not ctx.per_peer and not ctx.on_settled and ctx.gates is None:
                share.append((env, bufs, keep, inline))
        rid = next(self._rid)
        flags = _wire.FLAG_ONEWAY if oneway else 0
        now = time.monotonic()
        stats = agent._peer_stats.get(dst.id) or agent.new_stats(dst.id)
        stats.calls_out += 1
        stats.bytes_out += len(env) + nbytes(bufs) if bufs else len(env)
        p = Pending(SyncFuture() if sync else new_future(agent.pool), dst, what, timeout, states,
                    stats, now)
        if states is not None:
            p.on_failure = functools.partial(self._request_failed, dst, states)
        # Inline, wherever the future completes: these are short bookkeeping steps.
        if ctx.on_settled:
            _inline_callback(p.future, functools.partial(_run_all, ctx.on_settled))
        if on_done is not None:
            _inline_callback(p.future, on_done)
        p.private = private
        p.kind = kind
        deadline = now + timeout if timeout > 0 else None
        if retry is not None and retry.max_attempts > 1:
            if once:  # internal: the callee runs it once; @idempotent may rerun
                flags |= _wire.FLAG_ONCE
            p.resend = Resend(retry, deadline, kind, flags, env, bufs, keep)
        if not oneway or p.resend is not None:
            agent.requests.add(rid, p, deadline)
        return rid, p, flags, env, bufs, keep

    def transmit(self, conn: Optional[Connection], rid: int, p: Pending, kind: int,
                 flags: int, env: bytes, bufs: Any, keep: Any) -> bool:
        """Send (again) request ``rid`` on ``conn``, a lane's, or on the shared connection
        to its callee (None); whether it went. If not, it is failed, or its retry is
        scheduled (on the shared connection)."""
        agent = self._agent
        r = p.resend
        was_sent = r is not None and r.sent
        if r is not None:
            r.sent = True  # from here the frame may arrive, even if the connection breaks
        try:
            if conn is None:
                conn = p.conn = agent.connections.to(p.dst)
            conn.send(kind, flags, rid, env, bufs, keep)
        except RpcError as exc:  # raised before the frame was queued: it did not go
            if r is not None:
                r.sent = was_sent
            p.private = None  # nobody reads a lane's connection for it: a retry goes shared
            if flags & _wire.FLAG_ONEWAY and p.resend is None:
                p.set_exception(self.lost_error(p.dst, exc))
            else:
                self.send_failed(kind, rid, p.dst, exc)
            return False
        if flags & _wire.FLAG_ONEWAY and (p.resend is None
                                          or agent.requests.pending.pop(rid, None)):
            p.future.set_result(None)
        return True

    def send_failed(self, kind: int, rid: int, dst: WorkerInfo, exc: BaseException) -> None:
        """A frame for ``dst`` could not be sent: retry or fail its request, log a reply."""
        if kind in (Kind.RESPONSE, Kind.ERROR):
            log.warning("%s could not reply to %s: %s", self._agent.name, dst.name, exc)
            return
        self.request_lost(rid, dst, exc)

    def request_lost(self, rid: int, dst: WorkerInfo, exc: BaseException) -> None:
        """Request ``rid`` to ``dst`` may never be answered (its connection failed):
        retry or fail it, unless it is settled already."""
        requests = self._agent.requests
        p = requests.pending.pop(rid, None)
        if p is not None:
            requests.fail(rid, p, self.lost_error(dst, exc))

    def lost_error(self, dst: WorkerInfo, exc: BaseException) -> RpcError:
        """The error of a request to ``dst`` whose connection failed with ``exc``."""
        if isinstance(exc, (ConnectionLostError, NotInitializedError)) \
                and getattr(exc, "worker", None):
            return exc
        if dst.id in self._agent.registry.left:
            return self._agent.left_error(dst)
        return ConnectionLostError(f"RPC to worker {dst.name} (rank {dst.id}) failed: {exc}",
                                   worker=dst.name)

    def on_reply(self, conn: Connection, header: _wire.Header, envelope: bytes,
                 buffers: List[torch.Tensor]) -> None:
        """A reply (``RESPONSE`` or ``ERROR``) came on ``conn``: complete its request."""
        agent = self._agent
        pending = agent.requests.pending
        p = pending.get(header.request_id)
        if p is None:
            return  # expired or failed already
        if p.dst.id != conn.peer_rank:
            # Only the callee answers a call: a reply from anyone else is dropped.
            log.warning("%s dropped a reply from rank %d to request %d, which was "
                        "sent to rank %d", agent.name, conn.peer_rank, header.request_id,
                        p.dst.id)
            return
        if pending.pop(header.request_id, None) is not p:
            return  # failed meanwhile
        now = time.monotonic()
        if p.timeout > 0 and now - p.sent > p.timeout:
            # Past its deadline, before the timer got to it (a loaded machine): the
            # deadline holds all the same, as the caller was promised.
            agent.requests.time_out(p)
            return
        resend = p.resend
        if resend is not None:
            if resend.probing:
                self.probes.answered(resend)  # the reply came before the probe's answer
            if resend.flags & _wire.FLAG_ONCE:
                self._acks.setdefault(p.dst.id, []).append(header.request_id)
        stats = p.stats
        if stats is not None:
            stats.latency(now - p.sent)
            stats.bytes_in += len(envelope) + nbytes(buffers) if buffers else len(envelope)
            if header.kind == Kind.ERROR:
                stats.errors_out += 1
        ctx = MessageContext(agent, p.dst, header.kind)
        recv_hook = None
        if p.states is not None:
            recv_hook = lambda meta: self._response_hook(p, meta)  # noqa: E731
        try:
            _, value = _wire.decode(envelope, buffers, ctx, recv_hook)
        except Exception as exc:  # noqa: BLE001 - the caller gets the error
            if stats is not None and header.kind != Kind.ERROR:
                stats.errors_out += 1
            p.future.set_exception(SerializationError(
                f"cannot unpickle the reply of {p.dst.name} to {describe(p.what)}: {exc}"))
            return
        if header.kind == Kind.ERROR:
            p.future.set_exception(rebuild_error(value))
        else:
            p.future.set_result(value)

    def _outgoing(self, dst: WorkerInfo, kind: int) -> Tuple[Any, Any, Any]:
        found = None  # made only when a hook has something for this request (rarely)
        for hook in self._agent._hooks:
            out = hook.outgoing_request(dst, kind)
            if out is not None:
                if found is None:
                    found = ({}, [], {})
                found[0][hook.key], h, found[2][hook.key] = out
                found[1].append(h)
        if found is None:
            return None, None, None
        return found[0], combine(found[1]), found[2]

    def _request_failed(self, dst: WorkerInfo, states: Dict[str, Any]) -> None:
        for hook in self._agent._hooks:
            if hook.key in states:
                try:
                    hook.request_failed(dst, states[hook.key])
                except Exception:  # noqa: BLE001 - the caller's error matters more
                    log.exception("%s: call hook %r failed", self._agent.name, hook.key)

    def _response_hook(self, p: Pending, meta: Any) -> Optional[Any]:
        hooks = []
        for hook in self._agent._hooks:
            if hook.key in p.states:
                hooks.append(hook.incoming_response(p.dst, p.states[hook.key],
                                                    (meta or {}).get(hook.key)))
        return combine(hooks)


def _inline_callback(fut: Any, callback: Callable[[Any], None]) -> None:
    """Have ``callback(fut)`` run on the thread that completes ``fut`` (a SyncFuture's
    own way; a torch future's, bypassing RpcFuture's hand-over to the pool)."""
    if type(fut) is SyncFuture:
        fut.add_done_callback(callback)
    else:
        torch.futures.Future.add_done_callback(fut, callback)


def _run_all(actions: List[Any], _fut: Any) -> None:
    for action in actions:
        try:
            action()
        except Exception:  # noqa: BLE001 - one must not keep the others from running
            log.exception("an action after a request settled failed")
