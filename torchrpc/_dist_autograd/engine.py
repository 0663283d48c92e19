"""The distributed autograd engine of one agent: recording hooks, FAST-mode backward, release.

Theory of operation.

*Forward.* The engine is a call hook of the agent. When a thread with a current
context sends a request, the request's metadata carries ``(context id, message
id)`` and a :class:`~torchrpc._dist_autograd.records.SendRecorder` sees every
tensor that requires grad. The callee joins the context (creating it under the
same id if needed), records what it receives, runs the handler with the context
current on its thread, and records the tensors of its reply under a message id
that the reply's metadata carries back.

*Backward* (FAST mode of the design note; every send is assumed to take part).
``backward(context_id, roots)`` runs torch's autograd engine from the roots on
this worker (:func:`~torchrpc._dist_autograd.records.local_pass`): gradients of
ordinary leaves accumulate in the context, gradients of received tensors go back
to their senders in one ``AUTOGRAD_BACKWARD`` request per sender. A worker that
gets such a request runs its engine from the send records it names, does the
same with what it reaches, and replies only when every request it made has been
answered. So the reply to the root's requests means the whole pass is over, and
an error anywhere travels back up the chain of replies with the name of the
worker where it was raised. Every request has the agent's deadline, so a pass
never hangs on a dead or stuck worker. Because backprop is linear, running the
engine once per incoming request and summing gives the gradients of one run over
the whole graph; the local graph is therefore retained until the context is
released, whatever ``retain_graph`` says.

*Release.* Leaving ``with context()`` drops the context here and sends
``AUTOGRAD_RELEASE`` to every worker a message of the context went to; each of
them drops its copy and passes the release on to the workers it sent to, so the
release follows the same tree the context spread along. Released ids are
remembered for a while, so that a request of the context that arrives after its
release does not bring it back.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .._agent import Agent, AsyncResult, CallHook, CallScope, RpcFuture, WorkerInfo
from .._agent.futures import new_future
from .._wire import Kind
from ..errors import NotInitializedError, RpcError, WorkerLeftError
from .records import (DistAutogradContext, MessageKey, RecvRecorder, SendRecorder, local_pass,
                      make_context_id)
from .messages import BackwardRequest, ReleaseRequest

log = logging.getLogger("torchrpc")

EXTENSION_KEY = "autograd"
"""The engine's name in ``Agent.extensions``."""

_OWN_KINDS = frozenset((int(Kind.AUTOGRAD_BACKWARD), int(Kind.AUTOGRAD_RELEASE)))
_TOMBSTONES = 16384


class _CalleeScope(CallScope):
    """Around one incoming request of a context: record, and make the context current."""

    def __init__(self, engine: "DistAutogradEngine", ctx: DistAutogradContext, src: int,
                 msg: int, reply_msg: int) -> None:
        self._engine = engine
        self._ctx = ctx
        self._reply_msg = reply_msg
        self._prev: Optional[DistAutogradContext] = None
        self.recv_hook = RecvRecorder(ctx, src, msg)
        self.send_hook = SendRecorder(ctx, reply_msg)

    def __enter__(self) -> "_CalleeScope":
        local = self._engine._local
        self._prev = getattr(local, "ctx", None)
        local.ctx = self._ctx
        return self

    def __exit__(self, *exc: Any) -> None:
        self._engine._local.ctx = self._prev
        self._prev = None

    def response_meta(self) -> Any:
        return self._reply_msg


class DistAutogradEngine(CallHook):
    """Distributed autograd on one agent. Thread-safe; see the module docs."""

    key = EXTENSION_KEY

    def __init__(self, agent: Agent) -> None:
        self._agent = agent
        self._rank = agent.rank
        self._lock = threading.Lock()
        self._contexts: Dict[int, DistAutogradContext] = {}
        self._released: "collections.OrderedDict[int, None]" = collections.OrderedDict()
        self._next_context = itertools.count(1)
        self._next_message = itertools.count(1)
        self._local = threading.local()
        self._passes = 0

    # -- contexts --------------------------------------------------------------------------------

    def current(self) -> Optional[DistAutogradContext]:
        """The context current on the calling thread, or None."""
        return getattr(self._local, "ctx", None)

    def new_context(self) -> DistAutogradContext:
        """Create a context and make it current on the calling thread."""
        current = self.current()
        if current is not None:
            raise RuntimeError(
                f"Already have an autograd context id for this thread ({current.id}); "
                f"dist_autograd.context() blocks cannot be nested in one thread")
        ctx = DistAutogradContext(make_context_id(self._rank, next(self._next_context)))
        with self._lock:
            self._contexts[ctx.id] = ctx
        self._local.ctx = ctx
        return ctx

    def exit_context(self, context_id: int) -> None:
        """Leave a context made by :meth:`new_context` and release it on every worker."""
        current = self.current()
        if current is not None and current.id == context_id:
            self._local.ctx = None
        self.release(context_id, None)

    def retrieve(self, context_id: int) -> DistAutogradContext:
        """The context ``context_id``; a RuntimeError naming it when this worker has none."""
        if isinstance(context_id, bool) or not isinstance(context_id, int):
            raise TypeError(f"context_id must be an int, got {type(context_id).__name__}")
        ctx = self._contexts.get(context_id)
        if ctx is None:
            raise RuntimeError(
                f"Could not find autograd context with id: {context_id} on worker "
                f"{self._agent.name}. A context exists from the start of its "
                f"`with dist_autograd.context()` block until the block exits; use the id "
                f"inside the block")
        return ctx

    def _join(self, context_id: int) -> Optional[DistAutogradContext]:
        ctx = self._contexts.get(context_id)
        if ctx is not None:
            return ctx
        with self._lock:
            ctx = self._contexts.get(context_id)
            if ctx is None and context_id not in self._released:
                ctx = self._contexts[context_id] = DistAutogradContext(context_id)
        return ctx

    def release(self, context_id: int, notified_by: Optional[int]) -> None:
        """Drop ``context_id`` here and pass the release on to the workers it went to."""
        with self._lock:
            ctx = self._contexts.pop(context_id, None)
            self._released[context_id] = None
            if len(self._released) > _TOMBSTONES:
                self._released.popitem(last=False)
        if ctx is None:
            return
        for rank in ctx.known_workers():
            if rank != self._rank and rank != notified_by:
                self._send_release(rank, context_id)

    def _send_release(self, rank: int, context_id: int) -> None:
        agent = self._agent
        try:
            fut = agent.request(agent.resolve(rank), Kind.AUTOGRAD_RELEASE,
                                ReleaseRequest(context_id), agent.default_timeout,
                                what="distributed autograd context release")
        except (RpcError, ValueError) as exc:
            log.debug("torchrpc: %s could not release autograd context %d on rank %d: %s",
                      agent.name, context_id, rank, exc)
            return
        fut.add_done_callback(_log_release_failure)

    def gradients(self, context_id: int) -> Dict[torch.Tensor, torch.Tensor]:
        return self.retrieve(context_id).gradients()

    def debug_info(self) -> Dict[str, Any]:
        return {"num_autograd_contexts": len(self._contexts),
                "num_current_backward_passes": self._passes}

    # -- call hook (forward recording) -----------------------------------------------------------

    def outgoing_request(self, dst: WorkerInfo, kind: int
                         ) -> Optional[Tuple[Any, Optional[Callable], Any]]:
        ctx = getattr(self._local, "ctx", None)
        if ctx is None or kind in _OWN_KINDS:
            return None
        msg = next(self._next_message)
        ctx.add_known_worker(dst.id)
        return (ctx.id, msg), SendRecorder(ctx, msg), ctx

    def incoming_request(self, src: WorkerInfo, kind: int, meta: Any) -> Optional[CallScope]:
        context_id, msg = _parse_meta(meta)
        ctx = self._join(context_id)
        if ctx is None:
            return None  # arrived after the context was released: run it outside
        return _CalleeScope(self, ctx, src.id, msg, next(self._next_message))

    def incoming_response(self, src: WorkerInfo, state: Any, meta: Any
                          ) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
        if not isinstance(meta, int) or isinstance(meta, bool):
            return None
        return RecvRecorder(state, src.id, meta)

    # -- backward ----------------------------------------------------------------------------------

    def backward(self, context_id: int, roots: Sequence[torch.Tensor],
                 retain_graph: bool = False) -> None:
        """Run the distributed backward pass from ``roots``; block until it is done everywhere."""
        ctx = self.retrieve(context_id)
        roots = _check_roots(roots)
        if not isinstance(retain_graph, bool):
            raise TypeError(f"retain_graph must be a bool, got {type(retain_graph).__name__}")
        grads = [torch.ones_like(r, memory_format=torch.contiguous_format) for r in roots]
        self._propagate(ctx, list(roots), grads).wait()

    def _on_backward(self, src: WorkerInfo, req: Any) -> Any:
        if not isinstance(req, BackwardRequest):
            raise RpcError(f"malformed distributed autograd backward request from {src.name}: "
                           f"{type(req).__name__}")
        ctx = self.retrieve(req.context_id)
        edges = [ctx.send_edge(key) for key, _ in req.grads]
        done = self._propagate(ctx, edges, [g for _, g in req.grads])
        if done.done():
            done.wait()  # raises the error of a failed pass
            return None
        return AsyncResult(done)

    def _propagate(self, ctx: DistAutogradContext, outputs: List[Any],
                   grads: List[torch.Tensor]) -> RpcFuture:
        """Run the local part from ``outputs``, send what is due; a future of everything."""
        with self._counting():
            routed = local_pass(ctx, outputs, grads)
        futs = [self._request_backward(rank, BackwardRequest(ctx.id, tuple(items)))
                for rank, items in routed.items()]
        return self._gather(futs)

    def _request_backward(self, rank: int, req: BackwardRequest) -> torch.futures.Future:
        agent = self._agent
        try:
            return agent.request(agent.resolve(rank), Kind.AUTOGRAD_BACKWARD, req,
                                 agent.default_timeout, what="distributed autograd backward")
        except BaseException as exc:  # noqa: BLE001 - reported through the pass's future
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_exception(exc)
            return fut

    def _gather(self, futs: List[torch.futures.Future]) -> RpcFuture:
        """A future that completes when all of ``futs`` have, failing with the first error."""
        out = new_future(self._agent.pool)
        if not futs:
            out.set_result(None)
            return out
        lock = threading.Lock()
        state = {"left": len(futs), "error": None}

        def one_done(fut: torch.futures.Future) -> None:
            try:
                fut.value()
            except BaseException as exc:  # noqa: BLE001
                error = exc
            else:
                error = None
            with lock:
                if error is not None and state["error"] is None:
                    state["error"] = error
                state["left"] -= 1
                last = state["left"] == 0
            if last:
                if state["error"] is not None:
                    out.set_exception(state["error"])
                else:
                    out.set_result(None)

        for fut in futs:
            fut.add_done_callback(one_done)
        return out

    @contextlib.contextmanager
    def _counting(self) -> Iterator[None]:
        with self._lock:
            self._passes += 1
        try:
            yield
        finally:
            with self._lock:
                self._passes -= 1

    # -- handlers ----------------------------------------------------------------------------------

    def _on_release(self, src: WorkerInfo, req: Any) -> None:
        if not isinstance(req, ReleaseRequest):
            raise RpcError(f"malformed distributed autograd release request from {src.name}: "
                           f"{type(req).__name__}")
        self.release(req.context_id, src.id)


def _parse_meta(meta: Any) -> Tuple[int, int]:
    if (isinstance(meta, tuple) and len(meta) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in meta)):
        return meta
    raise RpcError(f"malformed distributed autograd metadata in a request: {meta!r}")


def _check_roots(roots: Any) -> List[torch.Tensor]:
    if isinstance(roots, torch.Tensor):
        roots = [roots]
    elif not isinstance(roots, (list, tuple)):
        raise TypeError(f"roots must be a list of tensors, got {type(roots).__name__}")
    if not roots:
        raise RuntimeError("No tensors provided for gradient computation.")
    for i, root in enumerate(roots):
        if not isinstance(root, torch.Tensor):
            raise TypeError(f"roots[{i}] must be a Tensor, got {type(root).__name__}")
        if not root.requires_grad:
            raise RuntimeError(f"requires_grad not set on root roots[{i}]: it is not the result "
                               f"of a computation on tensors that require grad")
        if root.numel() != 1:
            raise RuntimeError(f"roots[{i}] of shape {tuple(root.shape)} is not a scalar, all "
                               f"roots need to be scalar; reduce it first (e.g. loss.sum())")
        if root.grad_fn is None:
            raise RuntimeError(f"roots[{i}] does not have a valid gradient function. A leaf "
                               f"tensor cannot be a root; pass the result of a computation")
    return list(roots)


def _log_release_failure(fut: torch.futures.Future) -> None:
    try:
        fut.value()
    except (WorkerLeftError, NotInitializedError):
        pass  # the worker (or this one) is shutting down: nothing to release any more
    except BaseException as exc:  # noqa: BLE001 - a release is best effort
        log.warning("torchrpc: releasing a distributed autograd context failed: %s", exc)


def install(agent: Agent) -> DistAutogradEngine:
    """Put distributed autograd on ``agent`` (called by ``init_rpc`` for every new agent)."""
    engine = DistAutogradEngine(agent)
    agent.extensions[EXTENSION_KEY] = engine
    agent.add_call_hook(engine)
    agent.register_handler(Kind.AUTOGRAD_BACKWARD, engine._on_backward)
    agent.register_handler(Kind.AUTOGRAD_RELEASE, engine._on_release)
    agent.add_debug_source(engine.debug_info)
    return engine


def engine_of(agent: Agent) -> DistAutogradEngine:
    """The engine installed on ``agent``."""
    engine = agent.extensions.get(EXTENSION_KEY)
    if engine is None:
        raise RuntimeError("distributed autograd is not installed on this RPC agent")
    return engine
