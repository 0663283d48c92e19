"""Forward recording: the agent's call hook that carries a context across requests.

When a thread with a current context sends a request, the request's metadata carries
``(context id, message id)`` and a :class:`~torchrpc._dist_autograd.records.SendRecorder`
sees every tensor that requires grad. The callee joins the context (creating it under
the same id if needed), records what it receives, runs the handler with the context
current on its thread, and records the tensors of its reply under a message id that the
reply's metadata carries back. The releases owed to the callee ride along as a third
element of the metadata, and go back to the queue if the request fails on this side.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Optional, Tuple

from .._agent.devices import Map

import torch

from .._agent import CallHook, CallScope, WorkerInfo
from .._wire import Kind
from ..errors import RpcError
from .contexts import ContextTable
from .placement import recv_recorder
from .records import DistAutogradContext, SendRecorder

EXTENSION_KEY = "autograd"
"""The key of distributed autograd's part in a message's metadata."""

OWN_KINDS = frozenset((int(Kind.AUTOGRAD_BACKWARD), int(Kind.AUTOGRAD_RELEASE),
                       int(Kind.AUTOGRAD_DONE)))
"""The kinds of distributed autograd's own messages, which carry no context."""

_NO_IDS: Tuple[int, ...] = ()


class _CalleeScope(CallScope):
    """Around one incoming request of a context: record, and make the context current."""

    def __init__(self, table: ContextTable, ctx: DistAutogradContext, src: int,
                 msg: int, reply_msg: int, back: Optional[Map]) -> None:
        self._table = table
        self._ctx = ctx
        self._reply_msg = reply_msg
        self._prev: Optional[DistAutogradContext] = None
        self.recv_hook = recv_recorder(ctx, src, msg, back)
        self.send_hook = SendRecorder(ctx, reply_msg)

    def __enter__(self) -> "_CalleeScope":
        local = self._table.local
        self._prev = getattr(local, "ctx", None)
        local.ctx = self._ctx
        return self

    def __exit__(self, *exc: Any) -> None:
        self._table.local.ctx = self._prev
        self._prev = None

    def response_meta(self) -> Any:
        return self._reply_msg


class _Piggyback:
    """The call-hook state of a request that also carries releases owed to its callee."""

    __slots__ = ("ctx", "release_ids")

    def __init__(self, ctx: DistAutogradContext, release_ids: Tuple[int, ...]) -> None:
        self.ctx = ctx
        self.release_ids = release_ids


class Recorder(CallHook):
    """The call hook of distributed autograd on one agent. ``release(context_id,
    notified_by)`` releases a context whose release rode along with a request;
    ``back_map(peer, reply)`` is the device map that gradients of tensors received from
    ``peer`` (in a reply, or a request) go back through (``devices.back_map``)."""

    key = EXTENSION_KEY

    def __init__(self, table: ContextTable,
                 release: Callable[[int, Optional[int]], None],
                 back_map: Callable[[WorkerInfo, bool], Optional[Map]] = lambda peer, reply: None
                 ) -> None:
        self._table = table
        self._release = release
        self._back_map = back_map
        self._next_message = itertools.count(1)
        self.piggybacked = 0  # requests that arrived carrying releases

    def outgoing_request(self, dst: WorkerInfo, kind: int
                         ) -> Optional[Tuple[Any, Optional[Callable], Any]]:
        ctx = getattr(self._table.local, "ctx", None)
        if ctx is None or kind in OWN_KINDS:
            return None
        msg = next(self._next_message)
        ctx.add_known_worker(dst.id)
        ids = self._table.take_owed_to(dst.id)
        if ids:
            # The releases owed to dst ride along; they come back to the queue if
            # this request fails here (request_failed).
            ids = tuple(ids)
            return (ctx.id, msg, ids), SendRecorder(ctx, msg), _Piggyback(ctx, ids)
        return (ctx.id, msg), SendRecorder(ctx, msg), ctx

    def request_failed(self, dst: WorkerInfo, state: Any) -> None:
        if type(state) is _Piggyback:
            # The request may have reached dst, or not: owe the releases again (a second
            # release of a context is a no-op).
            self._table.owe(dst.id, state.release_ids)

    def incoming_request(self, src: WorkerInfo, kind: int, meta: Any) -> Optional[CallScope]:
        context_id, msg, released = parse_meta(meta)
        if released:
            self.piggybacked += 1
            for old_id in released:
                self._release(old_id, src.id)
        ctx = self._table.join(context_id)
        if ctx is None:
            return None  # arrived after the context was released: run it outside
        return _CalleeScope(self._table, ctx, src.id, msg, next(self._next_message),
                            self._back_map(src, False))

    def incoming_response(self, src: WorkerInfo, state: Any, meta: Any
                          ) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
        if not isinstance(meta, int) or isinstance(meta, bool):
            return None
        if type(state) is _Piggyback:
            state = state.ctx
        return recv_recorder(state, src.id, meta, self._back_map(src, True))


def parse_meta(meta: Any) -> Tuple[int, int, Tuple[int, ...]]:
    """(context id, message id, context ids released) of a request's metadata, which is
    ``(context id, message id)`` or ``(context id, message id, context ids released)``."""
    if type(meta) is tuple and 2 <= len(meta) <= 3 and type(meta[0]) is int \
            and type(meta[1]) is int:
        if len(meta) == 2:
            return meta[0], meta[1], _NO_IDS
        if len(meta) == 3 and type(meta[2]) is tuple \
                and all(type(i) is int for i in meta[2]):
            return meta
    raise RpcError(f"malformed distributed autograd metadata in a request: {meta!r}")
