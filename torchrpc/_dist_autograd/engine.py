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
gets such a request runs its engine from the send records it names and does the
same with what it reaches. Because backprop is linear, running the engine once per
incoming request and summing gives the gradients of one run over the whole graph;
the local graph is therefore retained until the context is released, whatever
``retain_graph`` says.

The root learns that the pass is over by *credit recovery* (weight-throwing
termination detection): the pass starts with credit 1 at the root; a worker splits
the credit it received among the requests it sends on, and a worker that sends
nothing on returns its credit to the root in an ``AUTOGRAD_DONE``. Credit
is never created, so the pass is over exactly when all of it is back, whatever
order the reports arrive in; a chain A -> B -> A costs two reports. A report (like a
release, below) is a request with a small reply, not a one-way message: one lost with
a connection that broke between two live workers is asked about and sent again (the
agent's at-most-once probes), where a one-way one would leave the root waiting for
its credit until the RPC timeout, or forever without one.
A failure anywhere (in the local engine, or a request that could not be
delivered, seen by its sender) returns the credit involved together with the
error, which names the worker; the root raises the first error once all the
credit is back. The root waits at most the agent's RPC timeout, so a pass never
hangs on a dead or stuck worker.

*Release.* Leaving ``with context()`` drops the context here and owes an
``AUTOGRAD_RELEASE`` to every worker a message of the context went to; each of
them drops its copy and passes the release on to the workers it sent to, so the
release follows the same tree the context spread along. A training loop pays no
message for them: the releases owed to a worker ride along with the next request of
a context sent to it (the next step's forward, typically), which drops them before
it runs, so each step frees the memory of the step before and the allocator reuses
it (freeing several steps' worth at once makes glibc hand it back to the kernel,
and the next steps fault it in again). Releases not carried within a timer tick go
in batches, one message per worker at each tick of the agent's timer and at
shutdown; while releases are queued the timer ticks every few tens of milliseconds,
since the other workers hold the contexts' memory until they hear. A request that
fails on the sender's side puts the releases it carried back in the queue (a second
release of a context is a no-op). Released ids are remembered for a while, so that
a request of the context that arrives after its release does not bring it back.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import logging
import threading
import time
from fractions import Fraction
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .._agent import Agent, CallHook, CallScope, WorkerInfo, current_pool
from .._agent.remote_error import capture, rebuild_error
from .._agent.retry import RetryPolicy
from .._threads import Guard
from .._wire import Kind
from ..errors import (ClosedError, ConnectionLostError, RpcError, RpcTimeoutError,
                      SerializationError, as_runtime_error)
from .messages import BackwardReply, BackwardRequest, DoneReport, PassId, ReleaseRequest
from .records import (CONTEXT_ID_BITS, NODE_PREFIX, DistAutogradContext, MessageKey,
                      RecvRecorder, SendRecorder, context_creator, local_pass, make_context_id)

log = logging.getLogger(__name__)

EXTENSION_KEY = "autograd"
"""The engine's name in ``Agent.extensions``."""

_OWN_KINDS = frozenset((int(Kind.AUTOGRAD_BACKWARD), int(Kind.AUTOGRAD_RELEASE),
                        int(Kind.AUTOGRAD_DONE)))
_ALL_CREDIT = Fraction(1)
# Control messages are resent only when sending them failed (they did not arrive), as the
# design note prescribes for internal messages.
_CONTROL_RETRY = RetryPolicy(max_attempts=5, initial_backoff=0.05, max_backoff=1.0)
_CONTROL_TIMEOUT = 60.0  # seconds for a report or a release when the RPC timeout is none
_TOMBSTONES = 16384
_BACKWARD = "distributed autograd backward"
_profiling = torch.autograd._profiler_enabled
_record_function = torch.autograd.profiler.record_function


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


class _Piggyback:
    """The call-hook state of a request that also carries releases owed to its callee."""

    __slots__ = ("ctx", "release_ids")

    def __init__(self, ctx: DistAutogradContext, release_ids: Tuple[int, ...]) -> None:
        self.ctx = ctx
        self.release_ids = release_ids


class _PassState:
    """What the root of one backward pass waits for: all the credit back.

    Between two workers the root's own thread gets all the credit back before it would
    wait, so the event to wait on is only made when some credit is still out then.
    """

    __slots__ = ("done", "error", "sends", "context_id", "_event", "_returned", "_lock")

    def __init__(self, context_id: int = 0) -> None:
        self.context_id = context_id
        self.done = False
        self.error: Optional[BaseException] = None
        self.sends: set = set()  # message ids of the root's send records that got gradients
        self._event: Optional[threading.Event] = None
        self._returned = Fraction(0)
        self._lock = threading.Lock()

    def add(self, credit: Fraction, error: Optional[BaseException]) -> None:
        with self._lock:
            if error is not None and self.error is None:
                self.error = error
            self._returned += credit
            # A lost worker's credit never comes back: the pass is over (failed) at once.
            if self._returned >= _ALL_CREDIT or isinstance(error, ConnectionLostError):
                self.done = True
                if self._event is not None:
                    self._event.set()

    def wait(self, timeout: Optional[float]) -> bool:
        """Wait until all the credit is back (at most ``timeout`` s); whether it is."""
        with self._lock:
            if self.done:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)

    def missing(self) -> Fraction:
        with self._lock:
            return _ALL_CREDIT - self._returned


class DistAutogradEngine(CallHook):
    """Distributed autograd on one agent. Thread-safe; see the module docs."""

    key = EXTENSION_KEY

    def __init__(self, agent: Agent) -> None:
        self._agent = agent
        self._rank = agent.rank
        self._lock = threading.Lock()
        self._contexts: Dict[int, DistAutogradContext] = {}
        # Released context ids, with the loss of a worker that released one (see _worker_lost).
        self._released: "collections.OrderedDict[int, Optional[ConnectionLostError]]" = \
            collections.OrderedDict()
        self._next_context = itertools.count(1)
        self._next_message = itertools.count(1)
        self._next_pass = itertools.count(1)
        self._roots: Dict[PassId, _PassState] = {}
        self._local = threading.local()
        self._running = 0
        # Releases owed to other workers (rank -> context ids), sent in batches at the
        # agent timer's tick and at shutdown (see release).
        self._releases: Dict[int, List[int]] = {}
        self._flushing = False
        self._release_messages = 0
        self._piggybacked = 0
        # context id -> number of parts of backward passes in progress here
        self._active: Dict[int, int] = {}
        # context id -> the passes rooted elsewhere that ran a part here (see _worker_lost)
        self._passes: Dict[int, set] = {}

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
        ctx = DistAutogradContext(make_context_id(self._rank, next(self._next_context)),
                                  self._rank)
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

    def current_or_raise(self) -> DistAutogradContext:
        """The context current on the calling thread; torch's RuntimeError when none."""
        ctx = self.current()
        if ctx is None:
            raise RuntimeError(
                "Current thread doesn't have a valid autograd context. Please wrap your "
                "code using: `with torch.distributed.autograd.context() as context_id` "
                "to generate a valid context")
        return ctx

    def is_valid(self, context_id: int) -> bool:
        """Whether this worker holds context ``context_id``."""
        return context_id in self._contexts

    def max_id(self) -> int:
        """The largest context id this worker can create."""
        return make_context_id(self._rank, (1 << CONTEXT_ID_BITS) - 1)

    def release_context(self, context_id: int) -> None:
        """Release ``context_id`` here and on every worker it went to; it must exist here."""
        self.retrieve(context_id)
        current = self.current()
        if current is not None and current.id == context_id:
            self._local.ctx = None
        self.release(context_id, None)

    def _join(self, context_id: int) -> Optional[DistAutogradContext]:
        ctx = self._contexts.get(context_id)
        if ctx is not None:
            return ctx
        with self._lock:
            ctx = self._contexts.get(context_id)
            if ctx is None and context_id not in self._released:
                ctx = self._contexts[context_id] = DistAutogradContext(context_id, self._rank)
        return ctx

    def release(self, context_id: int, notified_by: Optional[int],
                lost: Optional[ConnectionLostError] = None) -> None:
        """Drop ``context_id`` here and pass the release on to the workers it went to;
        ``lost``: the loss of a worker that released it, which a later part of a backward
        pass of the context fails with."""
        with self._lock:
            ctx = self._contexts.pop(context_id, None)
            self._passes.pop(context_id, None)
            if lost is not None or context_id not in self._released:
                self._released[context_id] = lost
            if len(self._released) > _TOMBSTONES:
                self._released.popitem(last=False)
        if ctx is None:
            return
        ranks = [r for r in ctx.known_workers() if r != self._rank and r != notified_by]
        if ranks:
            with self._lock:
                for rank in ranks:
                    self._releases.setdefault(rank, []).append(context_id)

    def _tick(self) -> None:
        # Timer thread: releases go out in batches, from the pool (sending may block).
        if self._releases and not self._flushing:
            self._flushing = True
            try:
                self._agent.pool.submit(self._flush_releases)
            except ClosedError:
                self._flushing = False  # shutting down

    def _flush_releases(self, deadline: Optional[float] = None) -> None:
        """Send the releases due to other workers: one message per worker."""
        with self._lock:
            releases, self._releases = self._releases, {}
            self._flushing = False
        agent = self._agent
        guard = Guard(f"sending autograd context releases from {agent.name}", limit=None)
        for rank, ids in releases.items():
            # Nothing here waits for the reply; a later shutdown of this worker does.
            with guard:  # an unexpected failure for one worker spares the others
                try:
                    self._control(agent.resolve(rank), Kind.AUTOGRAD_RELEASE,
                                  ReleaseRequest(tuple(ids)),
                                  "distributed autograd context release", logging.DEBUG)
                except (RpcError, ValueError) as exc:
                    log.debug("%s could not release autograd contexts %s on rank "
                              "%d: %s", agent.name, ids, rank, exc)

    def _control(self, dst: WorkerInfo, kind: int, payload: Any, what: str,
                 level: int) -> None:
        """Send a message of the protocol that must arrive (a report, a release), with
        retries under the RPC timeout; a failure is logged at ``level``."""
        agent = self._agent
        fut = agent.request(dst, kind, payload, agent.default_timeout or _CONTROL_TIMEOUT,
                            what=what, retry=_CONTROL_RETRY)

        def settled(f: torch.futures.Future) -> None:
            try:
                f.wait()
            except Exception as exc:  # noqa: BLE001 - nothing else waits for it
                log.log(level, "%s: %s to %s failed: %s", agent.name, what, dst.name, exc)
        fut.add_done_callback(settled)

    def gradients(self, context_id: int) -> Dict[torch.Tensor, torch.Tensor]:
        return self.retrieve(context_id).gradients()

    def torch_debug_info(self) -> Dict[str, str]:
        """What torch's ``dist_autograd._get_debug_info()`` reports, with its keys."""
        return {"num_current_backward_passes": str(len(self._active)),
                "num_autograd_contexts": str(len(self._contexts))}

    def debug_info(self) -> Dict[str, Any]:
        return {"num_autograd_contexts": len(self._contexts),
                "num_release_messages_received": self._release_messages,
                "num_piggybacked_releases_received": self._piggybacked,
                "num_current_backward_passes": len(self._roots),
                "num_running_local_backward_passes": self._running}

    # -- call hook (forward recording) -----------------------------------------------------------

    def outgoing_request(self, dst: WorkerInfo, kind: int
                         ) -> Optional[Tuple[Any, Optional[Callable], Any]]:
        ctx = getattr(self._local, "ctx", None)
        if ctx is None or kind in _OWN_KINDS:
            return None
        msg = next(self._next_message)
        ctx.add_known_worker(dst.id)
        if self._releases:
            with self._lock:
                ids = self._releases.pop(dst.id, None)
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
            with self._lock:
                self._releases.setdefault(dst.id, []).extend(state.release_ids)

    def incoming_request(self, src: WorkerInfo, kind: int, meta: Any) -> Optional[CallScope]:
        context_id, msg, released = _parse_meta(meta)
        if released:
            self._piggybacked += 1
            for old_id in released:
                self.release(old_id, src.id)
        ctx = self._join(context_id)
        if ctx is None:
            return None  # arrived after the context was released: run it outside
        return _CalleeScope(self, ctx, src.id, msg, next(self._next_message))

    def incoming_response(self, src: WorkerInfo, state: Any, meta: Any
                          ) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
        if not isinstance(meta, int) or isinstance(meta, bool):
            return None
        if type(state) is _Piggyback:
            state = state.ctx
        return RecvRecorder(state, src.id, meta)

    # -- backward ----------------------------------------------------------------------------------

    def backward(self, context_id: int, roots: Sequence[torch.Tensor],
                 retain_graph: bool = False) -> None:
        """Run the distributed backward pass from ``roots``; block until it is done everywhere."""
        _check_arguments(context_id, roots, retain_graph)
        ctx = self.retrieve(context_id)
        roots = _check_roots(roots)
        if _profiling():
            with _record_function(NODE_PREFIX + "backward"):
                self._backward(ctx, roots)
        else:
            self._backward(ctx, roots)

    def _backward(self, ctx: DistAutogradContext, roots: List[torch.Tensor]) -> None:
        context_id = ctx.id
        grads = [torch.ones_like(r, memory_format=torch.contiguous_format) for r in roots]
        pass_id = (self._rank, next(self._next_pass))
        state = _PassState(context_id)
        self._roots[pass_id] = state
        timeout = self._agent.default_timeout
        deadline = time.monotonic() + timeout
        self._enter_part(context_id)
        try:
            try:
                routed = self._local_pass(ctx, roots, grads)
            except Exception as exc:
                raise _runtime_error(_on_node(exc, self._rank)) from None
            self._forward(context_id, pass_id, routed, _ALL_CREDIT)
            # Between two workers the pass is usually over here: this thread drove it.
            finished = state.done or self._wait_pass(state, deadline, timeout)
            unused = _unused_sends(ctx, state) if finished and state.error is None else None
            if unused:
                # FAST mode waits for every send function of the context, as torch's does:
                # one whose result never entered the roots holds the pass until the timeout.
                finished = self._wait_pass(_PassState(), deadline, timeout)
        finally:
            self._roots.pop(pass_id, None)
            self._exit_part(context_id)
        if unused:
            raise RpcTimeoutError(
                f"distributed backward pass of autograd context {context_id} timed out after "
                f"{timeout:g} s (the RPC timeout) waiting for gradients of {len(unused)} "
                f"send function(s) of this worker: in FAST mode every RPC made in the "
                f"context with tensors that require grad must take part in the backward "
                f"pass, and the result of one of them did not reach the roots")
        if not finished:
            raise RpcTimeoutError(
                f"distributed backward pass of autograd context {context_id} timed out after "
                f"{timeout:g} s (the RPC timeout) with {state.missing()} of its work not "
                f"reported back; a worker may have died or be stuck")
        if state.error is not None:
            raise _runtime_error(state.error)

    def _enter_part(self, context_id: int) -> None:
        with self._lock:
            self._active[context_id] = self._active.get(context_id, 0) + 1

    def _exit_part(self, context_id: int) -> None:
        with self._lock:
            n = self._active.pop(context_id, 1) - 1
            if n:
                self._active[context_id] = n

    @staticmethod
    def _wait_pass(state: _PassState, deadline: float, timeout: float) -> bool:
        pool = current_pool()
        with pool.blocking() if pool is not None else contextlib.nullcontext():
            return state.wait(max(deadline - time.monotonic(), 0.0) if timeout > 0 else None)

    def _local_pass(self, ctx: DistAutogradContext, outputs: List[Any],
                    grads: List[torch.Tensor]) -> Dict[int, List[Tuple[MessageKey, torch.Tensor]]]:
        """:func:`local_pass`, counted in ``num_running_local_backward_passes``."""
        with self._lock:
            self._running += 1
        try:
            return local_pass(ctx, outputs, grads)
        finally:
            with self._lock:
                self._running -= 1

    def _forward(self, context_id: int, pass_id: PassId,
                 routed: Dict[int, List[Tuple[MessageKey, torch.Tensor]]], credit: Fraction,
                 reply_to: Optional[int] = None) -> Optional[BackwardReply]:
        """Send the gradients due to other workers, splitting ``credit`` among them.

        The gradients due to ``reply_to`` (the sender of the request being served) are
        returned as the request's reply instead, with their share of the credit. The
        last request goes out blocking: this thread reads its reply and goes on with the
        gradients it carries, so a pass between two workers is one round trip that the
        root's own thread drives.
        """
        back = routed.pop(reply_to, None) if reply_to is not None else None
        if not routed and not back:
            self._report(pass_id, credit, None)
            return None
        agent = self._agent
        parts = len(routed) + (1 if back else 0)
        share = credit / parts if parts > 1 else credit
        last = len(routed) - 1
        for i, (rank, items) in enumerate(routed.items()):
            req = BackwardRequest(context_id, pass_id, share, tuple(items))
            try:
                dst = agent.resolve(rank)
                if i == last:
                    reply = agent.request_sync(dst, Kind.AUTOGRAD_BACKWARD, req,
                                               agent.default_timeout, what=_BACKWARD,
                                               retry=_CONTROL_RETRY)
                else:
                    fut = agent.request(dst, Kind.AUTOGRAD_BACKWARD, req,
                                        agent.default_timeout, what=_BACKWARD,
                                        retry=_CONTROL_RETRY)
            except BaseException as exc:  # noqa: BLE001 - returned to the root with the credit
                self._report(pass_id, share, exc)
                continue
            if i == last:
                self._on_reply(context_id, pass_id, reply)
            else:
                fut.add_done_callback(functools.partial(self._hop_done, context_id, pass_id,
                                                        share))
        return BackwardReply(share, tuple(back)) if back else None

    def _hop_done(self, context_id: int, pass_id: PassId, share: Fraction,
                  fut: torch.futures.Future) -> None:
        try:
            reply = fut.value()
        except BaseException as exc:  # noqa: BLE001 - undelivered: return its credit
            self._report(pass_id, share, exc)
            return
        self._on_reply(context_id, pass_id, reply)

    def _on_reply(self, context_id: int, pass_id: PassId, reply: Any) -> None:
        """The reply to a backward request: go on with the gradients it brings back."""
        if isinstance(reply, BackwardReply):
            self._run_part(context_id, pass_id, reply.credit, reply.grads, None)

    def _run_part(self, context_id: int, pass_id: PassId, credit: Fraction,
                  grads: Sequence[Tuple[MessageKey, torch.Tensor]],
                  reply_to: Optional[int]) -> Optional[BackwardReply]:
        """Run this worker's engine from the send records ``grads`` name, then forward."""
        if pass_id[0] == self._rank:
            state = self._roots.get(pass_id)
            if state is not None:
                state.sends.update(key[0] for key, _ in grads)
        elif context_id in self._contexts:
            self._passes.setdefault(context_id, set()).add(pass_id)
        self._enter_part(context_id)
        try:
            ctx = self._contexts.get(context_id) or self._retrieve_for_pass(context_id)
            edges = [ctx.send_edge(key) for key, _ in grads]
            try:
                if _profiling():
                    with _record_function(NODE_PREFIX + "SendRpcBackward"):
                        routed = self._local_pass(ctx, edges, [g for _, g in grads])
                else:
                    routed = self._local_pass(ctx, edges, [g for _, g in grads])
            except Exception as exc:
                raise _on_node(exc, self._rank) from None
        except BaseException as exc:  # noqa: BLE001 - goes to the root with the credit
            self._report(pass_id, credit, exc)
            return None
        finally:
            self._exit_part(context_id)
        return self._forward(context_id, pass_id, routed, credit, reply_to)

    def _retrieve_for_pass(self, context_id: int) -> DistAutogradContext:
        """The context a part of a backward pass needs, gone from here: an error naming the
        lost worker that released it, else :meth:`retrieve`'s."""
        lost = self._released.get(context_id)
        if lost is not None and context_id not in self._contexts:
            raise ConnectionLostError(f"{lost} (worker {self._agent.name} released the "
                                      f"context then)", worker=lost.worker)
        return self.retrieve(context_id)

    def _report(self, pass_id: PassId, credit: Fraction, error: Optional[BaseException]) -> None:
        """Return ``credit`` of ``pass_id`` (and the error that ended it here) to its root."""
        root = pass_id[0]
        if root == self._rank:
            self._credit_back(pass_id, credit, error)
            return
        agent = self._agent
        info = capture(error, agent.name) if error is not None else None
        try:
            report = DoneReport(pass_id, credit, info)
            try:
                self._control(agent.resolve(root), Kind.AUTOGRAD_DONE, report,
                              "distributed autograd report", logging.WARNING)
            except SerializationError:
                if info is None:
                    raise
                # the error's type does not pickle: send its text as an RpcError
                info.exc_type, info.original = RpcError, None
                self._control(agent.resolve(root), Kind.AUTOGRAD_DONE, report,
                              "distributed autograd report", logging.WARNING)
        except BaseException as exc:  # noqa: BLE001 - the root times out and says so
            log.warning("%s could not report to the root of distributed backward "
                        "pass %s: %s", agent.name, pass_id, exc)

    def _credit_back(self, pass_id: PassId, credit: Fraction,
                     error: Optional[BaseException]) -> None:
        state = self._roots.get(pass_id)
        if state is not None:
            state.add(credit, error)

    # -- lost workers ----------------------------------------------------------------------------
    #
    # A worker that is lost takes the credit it held with it, so a pass that reached it
    # would wait for the RPC timeout (forever with timeout 0). Passes rooted here whose
    # context reached it fail at once; for passes rooted elsewhere that ran a part here,
    # the root is told (a report with no credit and an error naming the lost worker,
    # which ends the pass there as well). Contexts that reached it are released here,
    # except those made here, which their `with` block owns; no release is owed to it.

    def _worker_lost(self, worker: WorkerInfo, error: RpcError) -> None:
        rank = worker.id
        with self._lock:
            self._releases.pop(rank, None)
            contexts = [c for c in self._contexts.values() if _reached(c, rank)]
        lost = ConnectionLostError(
            f"distributed autograd: worker {worker.name} (rank {rank}), which this "
            f"context reached, was lost: {error}", worker=worker.name)
        ids = {c.id for c in contexts}
        for pass_id, state in list(self._roots.items()):
            if state.context_id in ids:
                state.add(Fraction(0), lost)
        for ctx in contexts:
            for pass_id in list(self._passes.get(ctx.id, ())):
                if pass_id[0] != rank:
                    self._report(pass_id, Fraction(0), lost)
            if context_creator(ctx.id) == self._rank:
                ctx.forget_worker(rank)
            else:
                self.release(ctx.id, rank, lost)
        if contexts:
            log.info("%s: %d autograd contexts reached lost worker %s", self._agent.name,
                     len(contexts), worker.name)

    # -- handlers ----------------------------------------------------------------------------------

    def _on_backward(self, src: WorkerInfo, req: Any) -> Optional[BackwardReply]:
        if not isinstance(req, BackwardRequest):
            raise RpcError(f"malformed distributed autograd backward request from {src.name}: "
                           f"{type(req).__name__}")
        return self._run_part(req.context_id, req.pass_id, req.credit, req.grads, src.id)

    def _on_done(self, src: WorkerInfo, report: Any) -> None:
        if not isinstance(report, DoneReport):
            raise RpcError(f"malformed distributed autograd report from {src.name}: "
                           f"{type(report).__name__}")
        error = rebuild_error(report.error) if report.error is not None else None
        self._credit_back(report.pass_id, report.credit, error)

    def _on_release(self, src: WorkerInfo, req: Any) -> None:
        if not isinstance(req, ReleaseRequest):
            raise RpcError(f"malformed distributed autograd release request from {src.name}: "
                           f"{type(req).__name__}")
        self._release_messages += 1
        for context_id in req.context_ids:
            self.release(context_id, src.id)


_NO_IDS: Tuple[int, ...] = ()


def _reached(ctx: DistAutogradContext, rank: int) -> bool:
    """Whether context ``ctx`` reached worker ``rank``: made there, sent there, or
    received tensors from there."""
    return (context_creator(ctx.id) == rank or rank in ctx.known_workers()
            or rank in ctx.sources())


def _parse_meta(meta: Any) -> Tuple[int, int, Tuple[int, ...]]:
    # (context id, message id) or (context id, message id, context ids released).
    if type(meta) is tuple and 2 <= len(meta) <= 3 and type(meta[0]) is int \
            and type(meta[1]) is int:
        if len(meta) == 2:
            return meta[0], meta[1], _NO_IDS
        if len(meta) == 3 and type(meta[2]) is tuple \
                and all(type(i) is int for i in meta[2]):
            return meta
    raise RpcError(f"malformed distributed autograd metadata in a request: {meta!r}")


def _on_node(exc: Exception, rank: int) -> Exception:
    """``exc`` as torch's distributed engine reports it: "Error on Node <rank>: <message>",
    of the same type where the type can be rebuilt from a message."""
    message = f"Error on Node {rank}: {exc}"
    try:
        wrapped = type(exc)(message)
        if str(wrapped) != message:
            raise TypeError("constructor changed the message")
    except Exception:  # noqa: BLE001 - types with other constructors: torch's RuntimeError
        wrapped = RuntimeError(message)
    wrapped.__cause__ = exc.__cause__
    return wrapped.with_traceback(exc.__traceback__)


def _runtime_error(exc: BaseException) -> BaseException:
    """``exc`` as a RuntimeError (torch's type for errors of the backward pass), keeping its
    own type where the two combine; a plain RuntimeError with its message otherwise."""
    combined = as_runtime_error(exc)
    if isinstance(combined, RuntimeError) or not isinstance(exc, Exception):
        return combined
    plain = RuntimeError(str(exc))
    plain.__cause__ = exc.__cause__
    return plain.with_traceback(exc.__traceback__)


def _unused_sends(ctx: DistAutogradContext, state: _PassState) -> List[int]:
    """The message ids of the root's send records that got no gradient in this pass."""
    sends = ctx._sends
    if not sends:
        return []
    done = state.sends
    return sorted({key[0] for key in list(sends)} - done)


_SIGNATURE = ("backward(): incompatible function arguments. The following argument types are "
              "supported:\n    1. (context_id: int, roots: list[torch.Tensor], retain_graph: "
              "bool = False) -> None\n\nInvoked with: ")


def _check_arguments(context_id: Any, roots: Any, retain_graph: Any) -> None:
    """torch's TypeError (its binding's wording) for arguments of the wrong types."""
    ok = type(context_id) is int and type(retain_graph) is bool and (
        isinstance(roots, torch.Tensor) or (isinstance(roots, (list, tuple)) and all(
            isinstance(r, torch.Tensor) for r in roots)))
    if not ok:
        raise TypeError(f"{_SIGNATURE}{context_id!r}, {roots!r}"
                        + ("" if retain_graph is False else f", {retain_graph!r}"))


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


def install(agent: Agent) -> DistAutogradEngine:
    """Put distributed autograd on ``agent`` (called by ``init_rpc`` for every new agent)."""
    engine = DistAutogradEngine(agent)
    agent.extensions[EXTENSION_KEY] = engine
    agent.add_call_hook(engine)
    agent.register_handler(Kind.AUTOGRAD_BACKWARD, engine._on_backward)
    agent.register_handler(Kind.AUTOGRAD_RELEASE, engine._on_release)
    agent.register_handler(Kind.AUTOGRAD_DONE, engine._on_done)
    agent.add_debug_source("autograd", engine.debug_info)
    # While releases are queued the timer ticks fast: the workers that took part hold
    # the contexts' memory until they hear.
    agent.add_loss_hook(engine._worker_lost)
    agent.add_tick_hook(engine._tick, pending=lambda: bool(engine._releases))
    agent.add_shutdown_hook(engine._flush_releases)
    return engine


def engine_of(agent: Agent) -> DistAutogradEngine:
    """The engine installed on ``agent``."""
    engine = agent.extensions.get(EXTENSION_KEY)
    if engine is None:
        raise RuntimeError("distributed autograd is not installed on this RPC agent")
    return engine
