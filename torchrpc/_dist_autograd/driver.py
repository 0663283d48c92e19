"""The part of backward passes that talks to the agent: runs local passes, sends what
:func:`~torchrpc._dist_autograd.passes.plan_forward` plans, serves ``AUTOGRAD_BACKWARD``
and ``AUTOGRAD_DONE``.

Every request of a pass goes out with the time the root has left (see
:mod:`torchrpc._dist_autograd.passes`), as its RPC timeout too, so a hop never waits
longer than the root does. The last request of a part goes out blocking: this thread
reads its reply and goes on with the gradients it carries, so a pass between two
workers is one round trip that the root's own thread drives. A report (like a release)
is a request with a small reply, not a one-way message: one lost with a connection that
broke between two live workers is asked about and sent again (the agent's at-most-once
probes), where a one-way one would leave the root waiting for its credit until its
deadline, or forever without one.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from fractions import Fraction
from typing import Any, List, Optional

import torch

from .._agent import Agent, WorkerInfo, current_pool
from .._agent.remote_error import capture, rebuild_error
from .._agent.retry import RetryPolicy
from .._wire import Kind
from ..errors import RpcError, RpcTimeoutError, SerializationError
from .checks import on_node, runtime_error
from .contexts import ContextTable
from .messages import BackwardReply, BackwardRequest, DoneReport, PassId
from .passes import (ALL_CREDIT, Grads, PassBook, RootPass, Routed, deadline_of, keys_of,
                     plan_forward, unused_sends)
from .parts import materialize, siblings
from .placement import placed
from .records import NODE_PREFIX, DistAutogradContext, local_pass

log = logging.getLogger(__name__)

# Control messages are resent only when sending them failed (they did not arrive), as the
# design note prescribes for internal messages.
CONTROL_RETRY = RetryPolicy(max_attempts=5, initial_backoff=0.05, max_backoff=1.0)
CONTROL_TIMEOUT = 60.0  # seconds for a report or a release when the RPC timeout is none
_BACKWARD = "distributed autograd backward"
_profiling = torch.autograd._profiler_enabled
_record_function = torch.autograd.profiler.record_function


def send_control(agent: Agent, dst: WorkerInfo, kind: int, payload: Any, what: str,
                 level: int) -> None:
    """Send a message of the protocol that must arrive (a report, a release), with
    retries under the RPC timeout; a failure is logged at ``level``."""
    fut = agent.request(dst, kind, payload, agent.default_timeout or CONTROL_TIMEOUT,
                        what=what, retry=CONTROL_RETRY)

    def settled(f: torch.futures.Future) -> None:
        try:
            f.wait()
        except Exception as exc:  # noqa: BLE001 - nothing else waits for it
            log.log(level, "%s: %s to %s failed: %s", agent.name, what, dst.name, exc)
    fut.add_done_callback(settled)


class PassDriver:
    """The backward passes of one agent, as far as they send and receive. Thread-safe."""

    def __init__(self, agent: Agent, table: ContextTable, book: PassBook) -> None:
        self._agent = agent
        self._rank = agent.rank
        self._table = table
        self._book = book

    # -- the root ----------------------------------------------------------------------------------

    def run_root(self, ctx: DistAutogradContext, roots: List[torch.Tensor],
                 deadline: Optional[float], timeout: float) -> None:
        """The pass of ``ctx`` from ``roots``; block until it is over everywhere, at most
        until ``deadline`` (set from ``timeout`` when ``backward`` was entered)."""
        context_id = ctx.id
        book = self._book
        grads = [torch.ones_like(r, memory_format=torch.contiguous_format) for r in roots]
        pass_id, state = book.start(context_id, deadline)
        book.enter(context_id)
        try:
            try:
                routed = self._local_pass(ctx, roots, grads)
            except Exception as exc:
                raise runtime_error(on_node(exc, self._rank)) from None
            routed = book.routed_once(context_id, pass_id, routed)
            self._forward(context_id, pass_id, routed, ALL_CREDIT, None, deadline)
            # Between two workers the pass is usually over here: this thread drove it.
            finished = state.done or _wait(state, deadline)
            unused = unused_sends(ctx, state) if finished and state.error is None else None
            if unused:
                # FAST mode waits for every send function of the context, as torch's does:
                # one whose result never entered the roots holds the pass until the deadline.
                finished = _wait(RootPass(), deadline)
        finally:
            book.finish(pass_id)
            book.exit(context_id)
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
                f"reported back; a worker may have died or be stuck, or waits for the "
                f"gradient of a send that never came (in FAST mode every RPC made in the "
                f"context with tensors that require grad must take part in the pass)")
        if state.error is not None:
            raise runtime_error(state.error)

    def _local_pass(self, ctx: DistAutogradContext, outputs: List[Any],
                    grads: List[torch.Tensor]) -> Routed:
        """:func:`local_pass`, counted in ``num_running_local_backward_passes``."""
        self._book.local_pass_starts()
        try:
            return placed(ctx, local_pass(ctx, outputs, grads))
        finally:
            self._book.local_pass_ends()

    # -- parts -------------------------------------------------------------------------------------

    def _forward(self, context_id: int, pass_id: PassId, routed: Routed, credit: Fraction,
                 reply_to: Optional[int], deadline: Optional[float]) -> Optional[BackwardReply]:
        """Send the requests :func:`plan_forward` plans; the reply to the request served."""
        agent = self._agent
        plan = plan_forward(context_id, pass_id, routed, credit, reply_to, deadline,
                            time.monotonic(), agent.name)
        for share, error in plan.reports:
            self.report(pass_id, share, error)
        last = len(plan.requests) - 1
        for i, (rank, req) in enumerate(plan.requests):
            timeout = req.time_left if req.time_left is not None else 0.0
            try:
                dst = agent.resolve(rank)
                if i == last:
                    reply = agent.request_sync(dst, Kind.AUTOGRAD_BACKWARD, req, timeout,
                                               what=_BACKWARD, retry=CONTROL_RETRY)
                else:
                    fut = agent.request(dst, Kind.AUTOGRAD_BACKWARD, req, timeout,
                                        what=_BACKWARD, retry=CONTROL_RETRY)
            except BaseException as exc:  # noqa: BLE001 - returned to the root with the credit
                self.report(pass_id, req.credit, exc)
                continue
            if i == last:
                self._on_reply(context_id, pass_id, reply, deadline)
            else:
                fut.add_done_callback(functools.partial(self._hop_done, context_id, pass_id,
                                                        req.credit, deadline))
        return plan.reply

    def _hop_done(self, context_id: int, pass_id: PassId, share: Fraction,
                  deadline: Optional[float], fut: torch.futures.Future) -> None:
        try:
            reply = fut.value()
        except BaseException as exc:  # noqa: BLE001 - undelivered: return its credit
            self.report(pass_id, share, exc)
            return
        self._on_reply(context_id, pass_id, reply, deadline)

    def _on_reply(self, context_id: int, pass_id: PassId, reply: Any,
                  deadline: Optional[float]) -> None:
        """The reply to a backward request: go on with the gradients it brings back."""
        if isinstance(reply, BackwardReply):
            self._run_part(context_id, pass_id, reply.credit, reply.grads, None, deadline)

    def _run_part(self, context_id: int, pass_id: PassId, credit: Fraction, grads: Grads,
                  reply_to: Optional[int], deadline: Optional[float]
                  ) -> Optional[BackwardReply]:
        """Run this worker's engine from the send records ``grads`` name, then forward.

        A part whose send records have siblings (records whose graphs share a node with
        theirs) waits for theirs and runs with them (:meth:`PassBook.gather`). A gradient
        that is None (the receiving end was reached with none) runs the engine as zeros,
        as torch's engine runs a node whose gradients are undefined: a Python function's
        backward gets zeros (checkpointing recomputes there, DDP's hooks fire)."""
        table, book = self._table, self._book
        book.part_starts(context_id, pass_id, keys_of(grads), context_id in table.contexts)
        try:
            ctx = table.retrieve_for_pass(context_id)
            needed = siblings(ctx, keys_of(grads))
            if needed is not None:
                gathered = book.gather(context_id, pass_id, grads, credit, needed)
                if gathered is None:
                    return None  # held, with its credit, until its siblings are here
                grads, credit = gathered
            else:
                book.ran(context_id, pass_id, grads)
            edges = [ctx.send_edge(key) for key, _ in grads]
            values = [materialize(edge, g) for edge, (_, g) in zip(edges, grads)]
            try:
                if _profiling():
                    with _record_function(NODE_PREFIX + "SendRpcBackward"):
                        routed = self._local_pass(ctx, edges, values)
                else:
                    routed = self._local_pass(ctx, edges, values)
            except Exception as exc:
                raise on_node(exc, self._rank) from None
        except BaseException as exc:  # noqa: BLE001 - goes to the root with the credit
            self.report(pass_id, credit, exc)
            return None
        finally:
            book.exit(context_id)
        routed = book.routed_once(context_id, pass_id, routed)
        return self._forward(context_id, pass_id, routed, credit, reply_to, deadline)

    def report(self, pass_id: PassId, credit: Fraction, error: Optional[BaseException]) -> None:
        """Return ``credit`` of ``pass_id`` (and the error that ended it here) to its root."""
        root = pass_id[0]
        if root == self._rank:
            self._book.credit_back(pass_id, credit, error)
            return
        agent = self._agent
        info = capture(error, agent.name) if error is not None else None
        try:
            report = DoneReport(pass_id, credit, info)
            try:
                send_control(agent, agent.resolve(root), Kind.AUTOGRAD_DONE, report,
                             "distributed autograd report", logging.WARNING)
            except SerializationError:
                if info is None:
                    raise
                # the error's type does not pickle: send its text as an RpcError
                info.exc_type, info.original = RpcError, None
                send_control(agent, agent.resolve(root), Kind.AUTOGRAD_DONE, report,
                             "distributed autograd report", logging.WARNING)
        except BaseException as exc:  # noqa: BLE001 - the root times out and says so
            log.warning("%s could not report to the root of distributed backward "
                        "pass %s: %s", agent.name, pass_id, exc)

    # -- handlers ----------------------------------------------------------------------------------

    def on_backward(self, src: WorkerInfo, req: Any) -> Optional[BackwardReply]:
        """``AUTOGRAD_BACKWARD``: run a part of a pass; the gradients owed to ``src``."""
        if not isinstance(req, BackwardRequest):
            raise RpcError(f"malformed distributed autograd backward request from {src.name}: "
                           f"{type(req).__name__}")
        deadline = deadline_of(req.time_left, time.monotonic())
        return self._run_part(req.context_id, req.pass_id, req.credit, req.grads, src.id,
                              deadline)

    def on_done(self, src: WorkerInfo, report: Any) -> None:
        """``AUTOGRAD_DONE``: credit of a pass rooted here comes back."""
        if not isinstance(report, DoneReport):
            raise RpcError(f"malformed distributed autograd report from {src.name}: "
                           f"{type(report).__name__}")
        error = rebuild_error(report.error) if report.error is not None else None
        self._book.credit_back(report.pass_id, report.credit, error)


def _wait(state: RootPass, deadline: Optional[float]) -> bool:
    """Wait for ``state`` until ``deadline``, as a blocked thread of the pool."""
    pool = current_pool()
    with pool.blocking() if pool is not None else contextlib.nullcontext():
        return state.wait(max(deadline - time.monotonic(), 0.0) if deadline is not None
                          else None)
