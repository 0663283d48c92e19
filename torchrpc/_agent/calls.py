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
from typing import (Any, Callable, Collection, Dict, List, Mapping, Optional, Sequence,
                    Tuple)

import torch

from .. import _wire
from .._transport import Connection, Transport
from .._wire import Kind
from ..errors import (ConnectionLostError, NotInitializedError, RpcError, SerializationError,
                      WorkerLeftError)
from .dispatch import ONCE_ACKS
from .futures import RpcFuture, SyncFuture, fresh_error, new_future
from .hooks import CallHook, MessageContext, combine, describe
from .lanes import Expect, Lanes
from .pool import WorkerPool
from .probes import Probes
from .remote_error import rebuild_error
from .pending import Pending, Resend
from .requests import Requests
from .retry import RetryPolicy
from .route import Sender
from .serving import this_thread
from .stats import PeerStats, nbytes
from .worker import WorkerInfo

log = logging.getLogger(__name__)

# Plain ints: looking a member up on the enum class costs more than the comparison.
_CALL, _RESPONSE, _ERROR = int(Kind.CALL), int(Kind.RESPONSE), int(Kind.ERROR)
_FLAG_ONEWAY, _FLAG_ONCE = _wire.FLAG_ONEWAY, _wire.FLAG_ONCE


class Calls:
    """Encoding, sending and completing the requests of one agent.

    ``name``: the agent's (for errors and logs); ``max_pending``: the
    ``max_pending_requests`` option; ``pool``: where futures run their callbacks;
    ``requests``: the request table; ``shared_to(dst)``: the shared connection to ``dst``
    (Connections.to); ``left``: the ranks that said GOODBYE, and ``left_error(dst)`` the
    error of a call to one; ``hooks``: the upper layers' call hooks (the agent adds to
    the list); ``peer_stats``: the traffic counters by rank, read here, and
    ``new_stats(rank)``, which makes a peer's; ``new_context(peer, kind, replied=...)``:
    a message's :class:`~torchrpc._agent.hooks.MessageContext`; ``lanes(calls)`` and
    ``probes(calls)`` make the lanes and the probes, which are handed this object. The
    transport is adopted once started (:meth:`adopt`).
    """

    def __init__(self, name: str, max_pending: int, pool: WorkerPool, requests: Requests,
                 shared_to: Callable[[WorkerInfo], Connection], left: Collection[int],
                 left_error: Callable[[WorkerInfo], WorkerLeftError],
                 hooks: Sequence[CallHook], peer_stats: Mapping[int, PeerStats],
                 new_stats: Callable[[int], PeerStats],
                 new_context: Callable[..., MessageContext],
                 lanes: Callable[[Sender], Lanes], probes: Callable[[Sender], Probes]) -> None:
        self._name = name
        self._max_pending = max_pending
        self._pool = pool
        self._requests = requests
        self._pending = requests.pending
        self._shared_to = shared_to
        self._left = left
        self._left_error = left_error
        self._hooks = hooks
        self._peer_stats = peer_stats
        self._new_stats = new_stats
        self._new_context = new_context
        # rank -> the most tensor bytes a message to it carries inside its envelope (the
        # transport's, once adopted; ``Transport.inline_max``)
        self._inline_max: Mapping[int, int] = {}
        self._rid = itertools.count(1)
        self.probes = probes(self)
        self.lanes = lanes(self)
        self._pick = self.lanes.pick
        self._shared = self.lanes.shared.route
        # Callee rank -> ids of at-most-once requests to it whose replies arrived here: the
        # next such request tells the callee, which then lets go of the replies it kept.
        self._acks: Dict[int, List[int]] = {}

    def adopt(self, transport: Transport) -> None:
        """The agent has started ``transport``: encode for its peers' inline bounds."""
        self._inline_max = transport.inline_max

    def start(self, dst: WorkerInfo, kind: int, payload: Any, timeout: float,
              what: Any = None, oneway: bool = False, retry: Optional[RetryPolicy] = None,
              expect: int = Expect.ANY, after: Any = None,
              on_done: Optional[Callable[[Any], None]] = None) -> Any:
        """The one path of a request (see :meth:`Agent.request`): pick its lane, encode
        and enter it, send it; its future."""
        route = self._pick(dst, expect, retry, timeout, after) if expect else self._shared
        try:
            rid, p, flags, env, bufs, keep = self.new_request(
                dst, kind, payload, timeout, what, oneway, retry, route.conn, None, None,
                route.sync, on_done if route.inline else None)
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
                failed = new_future(self._pool)
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
        # The protocols' at-most-once messages are not refused: losing them would lose state.
        once = retry is not None and retry.max_attempts > 1 and kind != _CALL
        waiting = len(self._pending)
        if self._max_pending and waiting >= self._max_pending and not oneway and not once:
            raise RpcError(
                f"too many outstanding RPCs: {waiting} requests of {self._name} wait "
                f"for replies (max_pending_requests is {self._max_pending}); wait for some "
                f"of them before sending {describe(what)} to {dst.name}, or raise the option")
        meta = send_hook = states = None
        if self._hooks:  # metadata only where a hook has some for this request (rarely)
            send_hooks = []
            for hook in self._hooks:
                out = hook.outgoing_request(dst, kind)
                if out is not None:
                    if meta is None:
                        meta, states = {}, {}
                    meta[hook.key], h, states[hook.key] = out
                    send_hooks.append(h)
            if meta is not None:
                send_hook = combine(send_hooks)
        if once and self._acks:
            acks = self._acks.pop(dst.id, None)
            if acks:
                meta = dict(meta) if meta else {}
                meta[ONCE_ACKS] = tuple(acks)
        ctx = self._new_context(dst, kind, not oneway)
        inline = self._inline_max.get(dst.id, _wire.INLINE_MAX)
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
        flags = _FLAG_ONEWAY if oneway else 0
        now = time.monotonic()
        stats = self._peer_stats.get(dst.id) or self._new_stats(dst.id)
        stats.calls_out += 1
        stats.bytes_out += len(env) + nbytes(bufs) if bufs else len(env)
        p = Pending(SyncFuture() if sync else RpcFuture(self._pool), dst, what, timeout, states,
                    stats, now, private, kind)
        if states is not None:
            p.on_failure = functools.partial(self._request_failed, dst, states)
        # Inline, wherever the future completes: these are short bookkeeping steps.
        if ctx.on_settled:
            _inline_callback(p.future, functools.partial(_run_all, ctx.on_settled))
        if on_done is not None:
            _inline_callback(p.future, on_done)
        serving = this_thread.stack  # what this thread serves, if anything (serving.py)
        if serving:
            p.serving = serving[-1]
        deadline = now + timeout if timeout > 0 else None
        if retry is not None and retry.max_attempts > 1:
            if once:  # internal: the callee runs it once; @idempotent may rerun
                flags |= _FLAG_ONCE
            p.resend = Resend(retry, deadline, kind, flags, env, bufs, keep)
        if not oneway or p.resend is not None:
            self._requests.add(rid, p, deadline)
        return rid, p, flags, env, bufs, keep

    def transmit(self, conn: Optional[Connection], rid: int, p: Pending, kind: int,
                 flags: int, env: bytes, bufs: Any, keep: Any) -> bool:
        """Send (again) request ``rid`` on ``conn``, a lane's, or on the shared connection
        to its callee (None); whether it went. If not, it is failed, or its retry is
        scheduled (on the shared connection)."""
        r = p.resend
        was_sent = r is not None and r.sent
        if r is not None:
            r.sent = True  # from here the frame may arrive, even if the connection breaks
        try:
            if conn is None:
                conn = p.conn = self._shared_to(p.dst)
            conn.send(kind, flags, rid, env, bufs, keep)
        except RpcError as exc:  # raised before the frame was queued: it did not go
            if r is not None:
                r.sent = was_sent
            p.private = None  # nobody reads a lane's connection for it: a retry goes shared
            if flags & _FLAG_ONEWAY and p.resend is None:
                p.set_exception(self.lost_error(p.dst, exc))
            else:
                self.send_failed(kind, rid, p.dst, exc)
            return False
        if flags & _FLAG_ONEWAY and (p.resend is None
                                          or self._pending.pop(rid, None)):
            p.future.set_result(None)
        return True

    def send_failed(self, kind: int, rid: int, dst: WorkerInfo, exc: BaseException) -> None:
        """A frame for ``dst`` could not be sent: retry or fail its request, log a reply."""
        if kind == _RESPONSE or kind == _ERROR:
            log.warning("%s could not reply to %s: %s", self._name, dst.name, exc)
            return
        self.request_lost(rid, dst, exc)

    def request_lost(self, rid: int, dst: WorkerInfo, exc: BaseException) -> None:
        """Request ``rid`` to ``dst`` may never be answered (its connection failed):
        retry or fail it, unless it is settled already."""
        p = self._pending.pop(rid, None)
        if p is not None:
            self._requests.fail(rid, p, self.lost_error(dst, exc))

    def lost_error(self, dst: WorkerInfo, exc: BaseException) -> RpcError:
        """The error of a request to ``dst`` whose connection failed with ``exc``."""
        if isinstance(exc, (ConnectionLostError, NotInitializedError)) \
                and getattr(exc, "worker", None):
            return exc
        if dst.id in self._left:
            return self._left_error(dst)
        return ConnectionLostError(f"RPC to worker {dst.name} (rank {dst.id}) failed: {exc}",
                                   worker=dst.name)

    def on_reply(self, conn: Connection, header: _wire.Header, envelope: bytes,
                 buffers: List[torch.Tensor]) -> None:
        """A reply (``RESPONSE`` or ``ERROR``) came on ``conn``: complete its request."""
        pending = self._pending
        p = pending.get(header.request_id)
        if p is None:
            return  # expired or failed already
        if p.dst.id != conn.peer_rank:
            # Only the callee answers a call: a reply from anyone else is dropped.
            log.warning("%s dropped a reply from rank %d to request %d, which was "
                        "sent to rank %d", self._name, conn.peer_rank, header.request_id,
                        p.dst.id)
            return
        if pending.pop(header.request_id, None) is not p:
            return  # failed meanwhile
        now = time.monotonic()
        if p.timeout > 0 and now - p.sent > p.timeout:
            # Past its deadline, before the timer got to it (a loaded machine): the
            # deadline holds all the same, as the caller was promised.
            self._requests.time_out(p)
            return
        resend = p.resend
        if resend is not None:
            if resend.probing:
                self.probes.answered(resend)  # the reply came before the probe's answer
            if resend.flags & _FLAG_ONCE:
                self._acks.setdefault(p.dst.id, []).append(header.request_id)
        stats = p.stats
        if stats is not None:
            stats.latency(now - p.sent)
            stats.bytes_in += len(envelope) + nbytes(buffers) if buffers else len(envelope)
            if header.kind == _ERROR:
                stats.errors_out += 1
        ctx = self._new_context(p.dst, header.kind)
        recv_hook = None
        if p.states is not None:
            recv_hook = lambda meta: self._response_hook(p, meta)  # noqa: E731
        try:
            _, value = _wire.decode(envelope, buffers, ctx, recv_hook)
        except Exception as exc:  # noqa: BLE001 - the caller gets the error
            if stats is not None and header.kind != _ERROR:
                stats.errors_out += 1
            p.future.set_exception(SerializationError(
                f"cannot unpickle the reply of {p.dst.name} to {describe(p.what)}: {exc}"))
            return
        if header.kind == _ERROR:
            p.future.set_exception(rebuild_error(value))
        else:
            p.future.set_result(value)

    def _request_failed(self, dst: WorkerInfo, states: Dict[str, Any]) -> None:
        for hook in self._hooks:
            if hook.key in states:
                try:
                    hook.request_failed(dst, states[hook.key])
                except Exception:  # noqa: BLE001 - the caller's error matters more
                    log.exception("%s: call hook %r failed", self._name, hook.key)

    def _response_hook(self, p: Pending, meta: Any) -> Optional[Any]:
        hooks = []
        for hook in self._hooks:
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
