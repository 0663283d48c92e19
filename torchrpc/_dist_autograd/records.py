"""Distributed autograd contexts: the bookkeeping of one forward/backward pass on one worker.

Theory of operation. A context is created by ``dist_autograd.context()`` on the
worker that starts a pass, with an id unique across the group (the rank in the
high bits, a counter in the low bits). A worker that receives an RPC made in a
context joins it under the same id. While the context is current on a thread,
every tensor that requires grad and crosses an RPC leaves a record on both
sides:

- a *send* record on the sender, keyed by ``(message id, tensor index)``: the
  gradient edge of the tensor as it was sent (the ``send`` function of the
  design note). The message id is chosen by the sender; the index is the
  tensor's position among the recorded tensors of that message.
- a *recv* record on the receiver: the received leaf, the sender's rank and the
  same key. The values handed to user code are the outputs of one
  :class:`RecvRpc` node per received message (torch's ``RecvRpcBackward``),
  applied to that message's leaves, so they are non-leaves like any result of an
  operator and their gradients flow into the leaves (the ``recv`` function of
  the design note).

Both sides count tensors the same way because the wire rebuilds, in pickling
order, exactly the tensors the sender's hook saw (see ``torchrpc._wire.encode``).

The backward pass (FAST mode) uses these records: gradients that reach a recv
leaf go back to the sender (None where the pass reaches the leaf with none: torch's
recv function sends zeros then), which looks up its send record by key and runs
torch's autograd engine from that edge. Gradients that reach any other leaf are
accumulated in the context, never left in ``.grad``: while torch's engine runs,
each such leaf's ``.grad`` holds the context's gradient, so gradient accumulators
and their hooks (DDP's reducer) work on the context (see ``local_pass``).

For introspection the context reports what torch's records would be: one
``SendRpcBackward`` per sent message whose ``next_functions`` are the edges of its
tensors, and the ``RecvRpcBackward`` node of each received message.

Nothing here does I/O; :mod:`torchrpc._dist_autograd.engine` moves the messages.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

MessageKey = Tuple[int, int]
"""``(message id, tensor index)``: names one send/recv pair within a context."""

# Context ids: the rank in the high bits, a per-worker counter in the low bits.
CONTEXT_ID_BITS = 48
MAX_RANK = (1 << (63 - CONTEXT_ID_BITS)) - 1


def make_context_id(rank: int, counter: int) -> int:
    """The id of the ``counter``-th context created by worker ``rank``."""
    if not 0 <= rank <= MAX_RANK:
        raise ValueError(f"distributed autograd supports ranks 0..{MAX_RANK}, got {rank}")
    if not 0 < counter < (1 << CONTEXT_ID_BITS):
        raise RuntimeError(f"worker {rank} ran out of distributed autograd context ids")
    return (rank << CONTEXT_ID_BITS) | counter


def context_creator(context_id: int) -> int:
    """The rank of the worker that created ``context_id``."""
    return context_id >> CONTEXT_ID_BITS


NODE_PREFIX = "torch::distributed::autograd::"
"""The namespace of torch's distributed autograd nodes; ours carry the same names."""


def message_id(rank: int, counter: int) -> int:
    """An autograd message id as torch makes them: the sender's rank in the high bits."""
    return (rank << CONTEXT_ID_BITS) | counter


def _recv_forward(ctx: Any, outputs: List[torch.Tensor], *leaves: torch.Tensor
                  ) -> Tuple[torch.Tensor, ...]:
    ctx.set_materialize_grads(False)  # an output not used: None, which local_pass sends
    return tuple(outputs)


def _recv_backward(ctx: Any, *grads: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
    return (None,) + grads


# The receiving end of the tensors of one message: identity from the received leaves
# to tensors made beforehand (detached aliases of the leaves, so user code may modify
# them in place). Its node is named as torch's, "torch::distributed::autograd::
# RecvRpcBackward", since programs and tests compare grad_fn names.
RecvRpc = type(NODE_PREFIX + "RecvRpc", (torch.autograd.Function,), {
    "__module__": __name__, "__qualname__": "RecvRpc",
    "__doc__": "The receiving end of one message: identity, gradients flow to its leaves.",
    "forward": staticmethod(_recv_forward), "backward": staticmethod(_recv_backward)})


class SendRpcBackward:
    """What torch records for one sent message: a node whose ``next_functions`` are the
    gradient edges of the message's tensors that require grad, in message order."""

    __slots__ = ("next_functions",)

    def __init__(self, edges: Sequence[GradientEdge]) -> None:
        self.next_functions = tuple((e.node, e.output_nr) for e in edges)

    def name(self) -> str:
        return NODE_PREFIX + "SendRpcBackward"

    def __repr__(self) -> str:
        return f"<{self.name()} with {len(self.next_functions)} next functions>"


class DistAutogradContext:
    """The records and accumulated gradients of one context on one worker. Thread-safe."""

    __slots__ = ("id", "rank", "_lock", "_sends", "_recvs", "_recv_fns", "_grads", "_known",
                 "_by_node", "_send_order", "_order", "_places")

    def __init__(self, context_id: int, rank: int = 0) -> None:
        self.id = context_id
        self.rank = rank  # of the worker holding this copy
        self._lock = threading.Lock()
        self._sends: Dict[MessageKey, GradientEdge] = {}
        # Keyed by id(leaf) (a Tensor's __hash__ is a Python call); the value holds the
        # leaf, so the id cannot be reused while the record exists: (leaf, sender, key,
        # when it arrived, in _order).
        self._recvs: Dict[int, Tuple[torch.Tensor, int, MessageKey, int]] = {}
        # message id (sender's rank and counter) -> the RecvRpcBackward node of its tensors
        self._recv_fns: Dict[int, Any] = {}
        self._grads: Dict[torch.Tensor, torch.Tensor] = {}
        self._known, self._places = set(), {}  # _places: placement.py, by (sender, key)
        # The order of sends and receipts here (parts.siblings); message id -> its send's.
        self._order = itertools.count(1)
        self._send_order: Dict[int, int] = {}
        # (number of send records, what parts._graphs makes of them)
        self._by_node: Tuple[int, Any] = (0, ({}, {}))

    # -- introspection, as torch's DistAutogradContext ---------------------------------------------

    def _context_id(self) -> int:
        """The id of this context."""
        return self.id

    def _send_functions(self) -> Dict[int, SendRpcBackward]:
        """The send function of each message sent in this context that carried tensors
        requiring grad, by autograd message id, in the order they were sent."""
        by_msg: Dict[int, List[GradientEdge]] = {}
        for (msg, _), edge in list(self._sends.items()):
            by_msg.setdefault(msg, []).append(edge)
        return {message_id(self.rank, msg): SendRpcBackward(edges)
                for msg, edges in by_msg.items()}

    def _recv_functions(self) -> Dict[int, Any]:
        """The ``RecvRpcBackward`` node of each message received in this context that
        carried tensors requiring grad, by autograd message id, in arrival order."""
        return dict(self._recv_fns)

    def _known_worker_ids(self) -> Set[int]:
        """The ranks of the workers that messages of this context were sent to."""
        with self._lock:
            return set(self._known)

    def __repr__(self) -> str:
        return (f"DistAutogradContext(id={self.id}, sends={len(self._sends)}, "
                f"recvs={len(self._recvs)}, gradients={len(self._grads)})")

    # -- recording (forward) ---------------------------------------------------------------------

    def add_known_worker(self, rank: int) -> None:
        """Note that a message of this context went to ``rank`` (it must be released there)."""
        with self._lock:
            self._known.add(rank)

    def known_workers(self) -> List[int]:
        with self._lock:
            return sorted(self._known)

    def forget_worker(self, rank: int) -> None:
        """Worker ``rank`` is lost: no release is owed to it any more."""
        with self._lock:
            self._known.discard(rank)

    def sources(self) -> Set[int]:
        """The ranks that tensors requiring grad of this context were received from."""
        return {rec[1] for rec in list(self._recvs.values())}

    # The two records below run for every tensor that requires grad and crosses an RPC,
    # so they are kept short: a single dict store is atomic and needs no lock.

    def record_send(self, key: MessageKey, tensor: torch.Tensor) -> None:
        node = tensor.grad_fn
        self._sends[key] = (GradientEdge(node, tensor.output_nr) if node is not None
                            else leaf_edge(tensor))

    def send_edge(self, key: MessageKey) -> GradientEdge:
        """The gradient edge recorded when the tensor of ``key`` was sent."""
        edge = self._sends.get(key)
        if edge is None:
            raise RuntimeError(
                f"distributed autograd context {self.id} has no send record for message "
                f"{key[0]} tensor {key[1]}; the forward pass that sent it did not run in "
                f"this context")
        return edge

    # -- gradients -------------------------------------------------------------------------------

    def gradients(self) -> Dict[torch.Tensor, torch.Tensor]:
        """A new dict from each leaf tensor to its gradient accumulated in this context."""
        with self._lock:
            return dict(self._grads)

    @property
    def num_sends(self) -> int:
        return len(self._sends)

    @property
    def num_recvs(self) -> int:
        return len(self._recvs)


def leaf_edge(leaf: torch.Tensor) -> GradientEdge:
    """The gradient edge of a leaf that requires grad: its accumulator.

    torch finds it through a view of the leaf, which sparse layouts lack; a clone's
    node leads to the same accumulator.
    """
    if leaf.layout is torch.strided:
        return get_gradient_edge(leaf)
    with torch.enable_grad():
        return GradientEdge(leaf.clone().grad_fn.next_functions[0][0], 0)  # type: ignore[union-attr]


class SendRecorder:
    """The send hook of one outgoing message: records each tensor that requires grad.

    The wire calls it for exactly the tensors it will rebuild through the receiver's
    hook. It may pickle a message twice (to widen a shared storage range), calling
    the hook again for the same tensors in the same order; a tensor keeps the
    index it got the first time.
    """

    __slots__ = ("_ctx", "_msg", "_index")

    def __init__(self, ctx: DistAutogradContext, msg: int) -> None:
        self._ctx = ctx
        self._msg = msg
        self._index: Dict[int, int] = {}

    def __call__(self, t: torch.Tensor) -> None:
        key = id(t)  # the payload holds t until the message is encoded
        if key not in self._index:
            index = self._index[key] = len(self._index)
            if not index:  # when it is sent, among the context's sends and receipts
                self._ctx._send_order[self._msg] = next(self._ctx._order)
            self._ctx.record_send((self._msg, index), t)


class RecvRecorder:
    """The receive hook of one incoming message: records each received leaf.

    All the message's tensors that require grad share one :class:`RecvRpc` node, as
    in torch. The wire hands them over one at a time, so each new one re-applies the
    node to all the leaves so far; the earlier outputs keep their identity and move to
    the new node (messages carry few such tensors).
    """

    __slots__ = ("_ctx", "_src", "_msg", "_seq", "_leaves", "_outs")

    def __init__(self, ctx: DistAutogradContext, src: int, msg: int) -> None:
        self._ctx = ctx
        self._src = src
        self._msg = msg
        self._seq = next(ctx._order)  # when it arrived, among the context's sends and receipts
        self._leaves: List[torch.Tensor] = []
        self._outs: List[torch.Tensor] = []

    def __call__(self, leaf: torch.Tensor) -> torch.Tensor:
        ctx, leaves, outs = self._ctx, self._leaves, self._outs
        ctx._recvs[id(leaf)] = (leaf, self._src, (self._msg, len(leaves)), self._seq)
        out = leaf.detach()
        leaves.append(leaf)
        outs.append(out)
        if torch.is_grad_enabled():
            RecvRpc.apply(outs, *leaves)
        else:
            with torch.enable_grad():
                RecvRpc.apply(outs, *leaves)
        ctx._recv_fns[message_id(self._src, self._msg)] = out.grad_fn
        return out


_ACCUMULATE_GRAD = type(get_gradient_edge(torch.zeros(1, requires_grad=True)).node)


def _engine_call(outputs: Sequence[Any], grads: Sequence[torch.Tensor],
                 inputs: Sequence[torch.Tensor]) -> None:
    # torch's C++ engine, as torch.autograd.backward(inputs=...) calls it (keep_graph, no
    # create_graph, allow_unreachable, accumulate into .grad). Calling it directly skips
    # backward()'s Python checks, which cost tens of us per pass and import sympy (~1.5 s)
    # on first use; the engine still validates the gradients' shapes.
    _ENGINE.run_backward(tuple(outputs), tuple(grads), True, False, tuple(inputs), True, True)


def _backward_call(outputs: Sequence[Any], grads: Sequence[torch.Tensor],
                   inputs: Sequence[torch.Tensor]) -> None:
    torch.autograd.backward(list(outputs), grad_tensors=list(grads),  # type: ignore[arg-type]
                            retain_graph=True, inputs=list(inputs))


def _pick_engine_call() -> Callable[..., None]:
    """The direct engine call if this torch has the expected signature, else ``backward``."""
    if _ENGINE is None:
        return _backward_call
    leaf = torch.zeros(2, requires_grad=True)
    try:
        _engine_call([get_gradient_edge(leaf * 3)], [torch.ones(2)], [leaf])
        if leaf.grad is not None and torch.equal(leaf.grad, torch.full((2,), 3.0)):
            return _engine_call
    except Exception:  # noqa: BLE001 - any mismatch: use the public API
        pass
    return _backward_call


_ENGINE = getattr(torch.autograd.Variable, "_execution_engine", None)
_run_engine = _pick_engine_call()

# While torch's engine runs a local pass, the ``.grad`` of the leaves it accumulates into
# holds a context's gradients; one pass at a time per process (torch's distributed engine
# also runs all CPU work of its passes on one thread). Everything else that borrows
# ``.grad`` for a context (the distributed optimizer's step) holds it too, or the two would
# see each other's gradients. Reentrant: a backward function may start a nested pass on
# its own thread.
_GRAD_SLOTS = threading.RLock()


def reachable_leaves(nodes: List[object]) -> List[Tuple[torch.Tensor, Any]]:
    """The leaf tensors, with their gradient accumulators, reachable from ``nodes``."""
    seen = set()
    stack = [n for n in nodes if n is not None]
    leaves = []
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if type(node) is _ACCUMULATE_GRAD:
            leaves.append((node.variable, node))  # type: ignore[attr-defined]
            continue
        for nxt, _ in node.next_functions:  # type: ignore[attr-defined]
            if nxt is not None and nxt not in seen:
                stack.append(nxt)
    return leaves


class _SharedGradGuard:
    """A pre-hook on gradient accumulators for one pass: a gradient tensor that reaches
    several leaves is stored as a copy in each, as torch's distributed engine does (it
    holds every captured gradient until the pass ends); the local engine would let the
    last leaf take the tensor itself."""

    __slots__ = ("seen",)

    def __init__(self) -> None:
        # id -> a weak reference to the gradient seen under it. Not a strong one: the
        # accumulator takes a gradient without copying only while nothing else holds it.
        # By id alone, a gradient freed during the pass would make the next one that
        # gets its id look shared (the weight and bias of a layer do), and be copied.
        self.seen: Dict[int, weakref.ref] = {}

    def __call__(self, grads: Tuple[Optional[torch.Tensor], ...]
                 ) -> Optional[Tuple[Optional[torch.Tensor], ...]]:
        g = grads[0]
        if g is None:
            return None
        key = id(g)
        ref = self.seen.get(key)
        if ref is not None and ref() is g:
            return (g.clone(),)
        self.seen[key] = weakref.ref(g)  # every Tensor class takes weak references
        return None


class _NestedGuard:
    """A pre-hook on the accumulator of a leaf whose ``.grad`` holds a context's gradient
    during a local pass: what a nested run of torch's engine brings (a function of the
    pass that runs a backward, as checkpointing's recomputation does) is kept for the
    leaf's own ``.grad``, where torch puts it. The pass's own graph task is noted by its
    first nodes."""

    __slots__ = ("task", "shared", "nested")

    def __init__(self, task: List[int], shared: Optional[_SharedGradGuard]) -> None:
        self.task = task  # [the id of the pass's graph task], once its first node ran
        self.shared = shared  # the leaf's own part: reached by the pass
        self.nested: List[torch.Tensor] = []

    def __call__(self, grads: Tuple[Optional[torch.Tensor], ...]
                 ) -> Optional[Tuple[Optional[torch.Tensor], ...]]:
        if grads[0] is not None and (not self.task
                                     or torch._C._current_graph_task_id() != self.task[0]):
            self.nested.append(grads[0])
            return (None,)
        return self.shared(grads) if self.shared is not None else None


def _first_task(task: List[int]) -> Callable[..., None]:
    """A pre-hook that notes, once, the graph task that runs it."""
    def note(_grads: Any) -> None:
        if not task:
            task.append(torch._C._current_graph_task_id())
    return note


def no_gradient(g: Optional[torch.Tensor]) -> bool:
    """Whether ``g`` adds nothing: None (undefined), or a dense tensor of zeros (torch's
    receiving end sends zeros for an undefined gradient)."""
    return g is None or (g.layout is torch.strided and not bool(g.any()))


def local_pass(ctx: DistAutogradContext, outputs: List[object], grads: List[torch.Tensor]
               ) -> Dict[int, List[Tuple[MessageKey, Optional[torch.Tensor]]]]:
    """Run torch's autograd engine from ``outputs`` (tensors or gradient edges) on this worker.

    The engine accumulates as in a normal backward pass, so accumulators run their
    hooks (DDP's reducer marks gradients ready and queues its end-of-pass callback,
    which runs before the engine returns). During the run the ``.grad`` of each
    ordinary leaf is its gradient in ``ctx`` (None at first), and afterwards the
    result goes to ``ctx`` and ``.grad`` gets back its own value: what torch's
    distributed engine achieves by handing accumulators and hooks the context's
    gradient. Leaves with a gradient in ``ctx`` that this run does not reach take
    part too, since end-of-pass hooks may write them (DDP's reducer writes every
    parameter of a bucket); what a nested backward accumulates goes to ``.grad``, as in
    torch (_NestedGuard). Gradients of received leaves are returned, grouped by the
    rank of their sender, as ``(key, grad)`` pairs to send back; None (zeros) for one
    reached with no gradient (a function returned None for it) or zeros: torch's
    receiving end answers its send with zeros then, which the pass waits for. The graph
    is always retained: in FAST mode another part of this backward pass may still reach
    the same nodes through a later send record.
    """
    nodes = [o.node if isinstance(o, GradientEdge) else o.grad_fn  # type: ignore[attr-defined]
             for o in outputs]
    reached = reachable_leaves(nodes)
    if not reached:
        return {}
    recvs = ctx._recvs
    ctx_grads = ctx._grads
    own: List[torch.Tensor] = []
    received: List[torch.Tensor] = []
    shared = _SharedGradGuard()
    task: List[int] = []
    guards: List[_NestedGuard] = []
    accumulators = []
    for leaf, node in reached:
        if id(leaf) in recvs:
            received.append(leaf)
        else:
            own.append(leaf)
            guards.append(_NestedGuard(task, shared))
            accumulators.append(node)
    slots = own
    if ctx_grads:
        ids = {id(t) for t in own}
        slots = own + [t for t in list(ctx_grads) if id(t) not in ids]
        for t in slots[len(own):]:
            guards.append(_NestedGuard(task, None))
            accumulators.append(leaf_edge(t).node)
    # The hooks go on under the lock: a pass waiting for it must not see this one's run.
    with _GRAD_SLOTS:
        handles = [node.register_prehook(_first_task(task)) for node in set(nodes)]
        handles += [node.register_prehook(guard) for node, guard in zip(accumulators, guards)]
        saved = []
        try:
            for t in slots:
                saved.append(t.grad)
                t.grad = ctx_grads.get(t)
            _run_engine(outputs, grads, [leaf for leaf, _ in reached])
        finally:
            for t, old, guard in zip(slots, saved, guards):
                g = t.grad
                if g is not None:
                    ctx_grads[t] = g
                t.grad = old
                for n in guard.nested:  # where torch's engine puts them
                    if t.grad is None:
                        t.grad = n.detach()
                    else:
                        t.grad.add_(n)
            routed: Dict[int, List[Tuple[MessageKey, Optional[torch.Tensor]]]] = {}
            for t in received:
                g = t.grad
                if g is not None:
                    t.grad = None
                _, src, key, _ = recvs[id(t)]
                routed.setdefault(src, []).append((key, None if no_gradient(g) else g))
            for h in handles:
                h.remove()
    return routed
