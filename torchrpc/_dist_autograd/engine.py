"""The distributed autograd engine of one agent: recording hooks, FAST-mode backward, release.

Theory of operation.

*Forward.* The engine is a call hook of the agent (:mod:`.recording`). When a thread
with a current context sends a request, the request's metadata carries ``(context id,
message id)`` and a :class:`~torchrpc._dist_autograd.records.SendRecorder` sees every
tensor that requires grad. The callee joins the context (creating it under the same id
if needed), records what it receives, runs the handler with the context current on its
thread, and records the tensors of its reply under a message id that the reply's
metadata carries back.

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
termination detection, :mod:`.passes`): the pass starts with credit 1 at the root; a
worker splits the credit it received among the requests it sends on, and a worker that
sends nothing on returns its credit to the root in an ``AUTOGRAD_DONE``. Credit is
never created, so the pass is over exactly when all of it is back, whatever order the
reports arrive in; a chain A -> B -> A costs two reports. A failure anywhere (in the
local engine, or a request that could not be delivered, seen by its sender) returns the
credit involved together with the error, which names the worker; the root raises the
first error once all the credit is back. The root sets one deadline from the agent's
RPC timeout when ``backward`` is entered, and every hop of the pass gets the time left
until it (:mod:`.driver`), so a pass never hangs on a dead or stuck worker and no hop
outlasts the root.

*Release* (:mod:`.contexts`). Leaving ``with context()`` drops the context here and owes
an ``AUTOGRAD_RELEASE`` to every worker a message of the context went to; each of them
drops its copy and passes the release on to the workers it sent to. A training loop pays
no message for them: the releases owed to a worker ride along with the next request of a
context sent to it (the next step's forward, typically), which drops them before it
runs, so each step frees the memory of the step before and the allocator reuses it
(freeing several steps' worth at once makes glibc hand it back to the kernel, and the
next steps fault it in again). Releases not carried within a timer tick go in batches,
one message per worker at each tick of the agent's timer and at shutdown; while
releases are queued the timer ticks every few tens of milliseconds, since the other
workers hold the contexts' memory until they hear. A request that fails on the sender's
side puts the releases it carried back in the queue (a second release of a context is a
no-op).

The parts: :mod:`.contexts` and :mod:`.passes` keep the books and do no I/O;
:mod:`.recording` is the call hook; :mod:`.driver` sends and serves the messages of
backward passes; this module joins them on an agent and sends the releases.
"""

from __future__ import annotations

import logging
import time
from fractions import Fraction
from typing import Any, Dict, Optional, Sequence

import torch

from .._agent import Agent, Slot, WorkerInfo
from .._agent import devices
from .._rref import RREF_LAYER
from .._threads import Guard
from .._wire import Kind
from ..errors import ClosedError, ConnectionLostError, RpcError
from .checks import check_arguments, check_roots
from .contexts import ContextTable
from .driver import PassDriver, send_control
from .messages import ReleaseRequest
from .passes import PassBook
from .records import NODE_PREFIX, DistAutogradContext, context_creator
from .recording import Recorder

log = logging.getLogger(__name__)

_profiling = torch.autograd._profiler_enabled
_record_function = torch.autograd.profiler.record_function


class DistAutogradEngine:
    """Distributed autograd on one agent. Thread-safe; see the module docs."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent
        self._rank = agent.rank
        self.contexts = ContextTable(agent.rank, agent.name)
        self.passes = PassBook(agent.rank)
        self.recorder = Recorder(self.contexts, self.release,
                                 lambda peer, reply: devices.back_map(agent.registry, peer, reply))
        self.driver = PassDriver(agent, self.contexts, self.passes)
        self._flushing = False
        self._release_messages = 0

    # -- contexts --------------------------------------------------------------------------------

    def current(self) -> Optional[DistAutogradContext]:
        """The context current on the calling thread, or None."""
        return self.contexts.current()

    def new_context(self) -> DistAutogradContext:
        """Create a context and make it current on the calling thread."""
        return self.contexts.new_context()

    def exit_context(self, context_id: int) -> None:
        """Leave a context made by :meth:`new_context` and release it on every worker."""
        self.contexts.clear_current(context_id)
        self.release(context_id, None)

    def retrieve(self, context_id: int) -> DistAutogradContext:
        """The context ``context_id``; a RuntimeError naming it when this worker has none."""
        return self.contexts.retrieve(context_id)

    def current_or_raise(self) -> DistAutogradContext:
        """The context current on the calling thread; torch's RuntimeError when none."""
        return self.contexts.current_or_raise()

    def is_valid(self, context_id: int) -> bool:
        """Whether this worker holds context ``context_id``."""
        return self.contexts.is_valid(context_id)

    def max_id(self) -> int:
        """The largest context id this worker can create."""
        return self.contexts.max_id()

    def release_context(self, context_id: int) -> None:
        """Release ``context_id`` here and on every worker it went to; it must exist here."""
        self.contexts.retrieve(context_id)
        self.contexts.clear_current(context_id)
        self.release(context_id, None)

    def release(self, context_id: int, notified_by: Optional[int],
                lost: Optional[ConnectionLostError] = None) -> None:
        """Drop ``context_id`` here and pass the release on to the workers it went to;
        ``lost``: the loss of a worker that released it, which a later part of a backward
        pass of the context fails with."""
        self.passes.released(context_id)
        self.contexts.release(context_id, notified_by, lost)

    def gradients(self, context_id: int) -> Dict[torch.Tensor, torch.Tensor]:
        """The gradients accumulated in context ``context_id`` here."""
        return self.contexts.retrieve(context_id).gradients()

    # -- sending releases ------------------------------------------------------------------------

    def _tick(self) -> None:
        # Timer thread: releases go out in batches, from the pool (sending may block).
        if self.contexts.owed and not self._flushing:
            self._flushing = True
            try:
                self._agent.pool.submit(self._flush_releases)
            except ClosedError:
                self._flushing = False  # shutting down

    def _flush_releases(self, deadline: Optional[float] = None) -> None:
        """Send the releases due to other workers: one message per worker."""
        releases = self.contexts.take_owed()
        self._flushing = False
        agent = self._agent
        guard = Guard(f"sending autograd context releases from {agent.name}", limit=None)
        for rank, ids in releases.items():
            # Nothing here waits for the reply; a later shutdown of this worker does.
            with guard:  # an unexpected failure for one worker spares the others
                try:
                    send_control(agent, agent.resolve(rank), Kind.AUTOGRAD_RELEASE,
                                 ReleaseRequest(tuple(ids)),
                                 "distributed autograd context release", logging.DEBUG)
                except (RpcError, ValueError) as exc:
                    log.debug("%s could not release autograd contexts %s on rank "
                              "%d: %s", agent.name, ids, rank, exc)

    def _on_release(self, src: WorkerInfo, req: Any) -> None:
        if not isinstance(req, ReleaseRequest):
            raise RpcError(f"malformed distributed autograd release request from {src.name}: "
                           f"{type(req).__name__}")
        self._release_messages += 1
        for context_id in req.context_ids:
            self.release(context_id, src.id)

    # -- introspection -----------------------------------------------------------------------------

    def torch_debug_info(self) -> Dict[str, str]:
        """What torch's ``dist_autograd._get_debug_info()`` reports, with its keys."""
        return {"num_current_backward_passes": str(len(self.passes.active)),
                "num_autograd_contexts": str(len(self.contexts.contexts))}

    def debug_info(self) -> Dict[str, Any]:
        """torchrpc's counters of distributed autograd on this worker."""
        return {"num_autograd_contexts": len(self.contexts.contexts),
                "num_release_messages_received": self._release_messages,
                "num_piggybacked_releases_received": self.recorder.piggybacked,
                "num_current_backward_passes": len(self.passes.roots),
                "num_running_local_backward_passes": self.passes.running}

    # -- backward ----------------------------------------------------------------------------------

    def backward(self, context_id: int, roots: Sequence[torch.Tensor],
                 retain_graph: bool = False) -> None:
        """Run the distributed backward pass from ``roots``; block until it is done everywhere
        or the RPC timeout, counted from here, has passed."""
        timeout = self._agent.default_timeout
        deadline = time.monotonic() + timeout if timeout > 0 else None
        check_arguments(context_id, roots, retain_graph)
        ctx = self.contexts.retrieve(context_id)
        roots = check_roots(roots)
        if _profiling():
            with _record_function(NODE_PREFIX + "backward"):
                self.driver.run_root(ctx, roots, deadline, timeout)
        else:
            self.driver.run_root(ctx, roots, deadline, timeout)

    # -- lost workers ----------------------------------------------------------------------------
    #
    # A worker that is lost takes the credit it held with it, so a pass that reached it
    # would wait for the deadline (forever with timeout 0). Passes rooted here whose
    # context reached it fail at once; for passes rooted elsewhere that ran a part here,
    # the root is told (a report with no credit and an error naming the lost worker,
    # which ends the pass there as well). Contexts that reached it are released here,
    # except those made here, which their `with` block owns; no release is owed to it.

    def _worker_lost(self, worker: WorkerInfo, error: RpcError) -> None:
        rank = worker.id
        contexts = self.contexts.worker_lost(rank)
        lost = ConnectionLostError(
            f"distributed autograd: worker {worker.name} (rank {rank}), which this "
            f"context reached, was lost: {error}", worker=worker.name)
        for pass_id in self.passes.worker_lost(rank, {c.id for c in contexts}, lost):
            self.driver.report(pass_id, Fraction(0), lost)
        for ctx in contexts:
            if context_creator(ctx.id) == self._rank:
                ctx.forget_worker(rank)
            else:
                self.release(ctx.id, rank, lost)
        if contexts:
            log.info("%s: %d autograd contexts reached lost worker %s", self._agent.name,
                     len(contexts), worker.name)


ENGINE: "Slot[DistAutogradEngine]" = Slot("autograd")
"""Where an agent keeps its distributed autograd engine."""


def install(agent: Agent) -> DistAutogradEngine:
    """Put distributed autograd on ``agent`` (called by ``init_rpc`` for every new agent)."""
    engine = DistAutogradEngine(agent)
    agent.extensions.install(ENGINE, engine)
    rrefs = agent.extensions.get(RREF_LAYER)
    if rrefs is not None:  # RRef.backward of a tensor runs this engine's pass
        rrefs.backward = engine.backward
    agent.add_call_hook(engine.recorder)
    agent.register_handler(Kind.AUTOGRAD_BACKWARD, engine.driver.on_backward)
    agent.register_handler(Kind.AUTOGRAD_RELEASE, engine._on_release)
    agent.register_handler(Kind.AUTOGRAD_DONE, engine.driver.on_done)
    agent.add_debug_source("autograd", engine.debug_info)
    agent.add_loss_hook(engine._worker_lost)
    # While releases are queued the timer ticks fast: the workers that took part hold
    # the contexts' memory until they hear.
    agent.add_tick_hook(engine._tick, pending=lambda: bool(engine.contexts.owed))
    agent.add_shutdown_hook(engine._flush_releases)
    return engine


def engine_of(agent: Agent) -> DistAutogradEngine:
    """The engine installed on ``agent``."""
    engine = agent.extensions.get(ENGINE)
    if engine is None:
        raise RuntimeError("distributed autograd is not installed on this RPC agent")
    return engine
