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
  same key. The value handed to user code is the output of an identity node
  applied to that leaf (``aten::_unsafe_view``, or :class:`RecvRpc`; see
  ``_pick_recv_apply``), so it is a non-leaf like any result of an operator and
  its gradient flows into the leaf (the ``recv`` function of the design note).

Both sides count tensors the same way because the wire rebuilds, in pickling
order, exactly the tensors the sender's hook saw (see ``torchrpc._wire.encode``).

The backward pass (FAST mode) uses these records: gradients that reach a recv
leaf go back to the sender, which looks up its send record by key and runs
torch's autograd engine from that edge. Gradients that reach any other leaf are
accumulated here, in :attr:`DistAutogradContext.gradients`, never in ``.grad``.

Nothing here does I/O; :mod:`torchrpc._dist_autograd.engine` moves the messages.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

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


class RecvRpc(torch.autograd.Function):
    """The receiving end of a send/recv pair: identity forward, gradient flows to the leaf.

    Its output shares memory with the received leaf but is not a view of it, so
    user code may modify it in place, as it may with torch's ``RecvRpcBackward``.
    """

    @staticmethod
    def forward(ctx: object, leaf: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return leaf.detach()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad


def _pick_recv_apply() -> Callable[[torch.Tensor], torch.Tensor]:
    """The cheapest way to apply the receiving end to a leaf.

    ``aten::_unsafe_view`` to the leaf's own shape does exactly what :class:`RecvRpc`
    does (an output on the leaf's memory that autograd does not treat as a view, with an
    identity gradient) in C++ alone, about a third cheaper per tensor than a Python
    Function. :class:`RecvRpc` stays the fallback for a torch without it.
    """
    try:
        op = torch.ops.aten._unsafe_view.default
        leaf = torch.zeros(2, 3, requires_grad=True)
        out = op(leaf, leaf.shape)
        out.mul_(1.0)  # in place is allowed: not a view
        (grad,) = torch.autograd.grad(out.sum(), leaf)
        if out._is_view() or out.is_leaf or not torch.equal(grad, torch.ones(2, 3)):
            raise RuntimeError("unexpected _unsafe_view semantics")
        raw = getattr(op, "_op", op)  # the C++ overload itself, without the Python frame
        return lambda t: raw(t, t.shape)
    except Exception:  # noqa: BLE001 - any difference: the Python Function
        return RecvRpc.apply


_recv_apply = _pick_recv_apply()


class DistAutogradContext:
    """The records and accumulated gradients of one context on one worker. Thread-safe."""

    __slots__ = ("id", "_lock", "_sends", "_recvs", "_grads", "_known")

    def __init__(self, context_id: int) -> None:
        self.id = context_id
        self._lock = threading.Lock()
        self._sends: Dict[MessageKey, GradientEdge] = {}
        # Keyed by id(leaf) (a Tensor's __hash__ is a Python call); the value holds the
        # leaf, so the id cannot be reused while the record exists.
        self._recvs: Dict[int, Tuple[torch.Tensor, int, MessageKey]] = {}
        self._grads: Dict[torch.Tensor, torch.Tensor] = {}
        self._known: set = set()

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

    # The two records below run for every tensor that requires grad and crosses an RPC,
    # so they are kept short: a single dict store is atomic and needs no lock.

    def record_send(self, key: MessageKey, tensor: torch.Tensor) -> None:
        node = tensor.grad_fn
        self._sends[key] = (GradientEdge(node, tensor.output_nr) if node is not None
                            else get_gradient_edge(tensor))

    def record_recv(self, leaf: torch.Tensor, src: int, key: MessageKey) -> torch.Tensor:
        """Record a received leaf; return the tensor user code gets in its place."""
        self._recvs[id(leaf)] = (leaf, src, key)
        if torch.is_grad_enabled():
            return _recv_apply(leaf)
        with torch.enable_grad():
            return _recv_apply(leaf)

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

    def accumulate(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        with self._lock:
            old = self._grads.setdefault(tensor, grad)
            if old is not grad:
                self._grads[tensor] = old + grad

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
            self._ctx.record_send((self._msg, index), t)


class RecvRecorder:
    """The receive hook of one incoming message: records each received leaf."""

    __slots__ = ("_ctx", "_src", "_msg", "_next")

    def __init__(self, ctx: DistAutogradContext, src: int, msg: int) -> None:
        self._ctx = ctx
        self._src = src
        self._msg = msg
        self._next = 0

    def __call__(self, leaf: torch.Tensor) -> torch.Tensor:
        index = self._next
        self._next += 1
        return self._ctx.record_recv(leaf, self._src, (self._msg, index))


_ACCUMULATE_GRAD = type(get_gradient_edge(torch.zeros(1, requires_grad=True)).node)


def _engine_call(outputs: Sequence[Any], grads: Sequence[torch.Tensor],
                 inputs: Sequence[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
    # torch's C++ engine, as torch.autograd.grad calls it (keep_graph, no create_graph,
    # allow_unreachable, no accumulation). Calling it directly skips grad()'s Python
    # checks, which cost ~50 us per pass and import sympy (~1.5 s) on first use; the
    # engine still validates the gradients' shapes.
    return _ENGINE.run_backward(tuple(outputs), tuple(grads), True, False, tuple(inputs),
                                True, False)


def _grad_call(outputs: Sequence[Any], grads: Sequence[torch.Tensor],
               inputs: Sequence[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
    return torch.autograd.grad(outputs, inputs=inputs, grad_outputs=grads,  # type: ignore[arg-type]
                               retain_graph=True, allow_unused=True)


def _pick_engine_call() -> Callable[..., Tuple[Optional[torch.Tensor], ...]]:
    """The direct engine call if this torch has the expected signature, else ``grad``."""
    if _ENGINE is None:
        return _grad_call
    leaf = torch.zeros(2, requires_grad=True)
    try:
        out = _engine_call([get_gradient_edge(leaf * 3)], [torch.ones(2)], [leaf])
        if len(out) == 1 and torch.equal(out[0], torch.full((2,), 3.0)):
            return _engine_call
    except Exception:  # noqa: BLE001 - any mismatch: use the public API
        pass
    return _grad_call


_ENGINE = getattr(torch.autograd.Variable, "_execution_engine", None)
_run_engine = _pick_engine_call()


def reachable_leaves(nodes: List[object]) -> List[torch.Tensor]:
    """The leaf tensors whose gradient accumulators are reachable from ``nodes``."""
    seen = set()
    stack = [n for n in nodes if n is not None]
    leaves = []
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if type(node) is _ACCUMULATE_GRAD:
            leaves.append(node.variable)  # type: ignore[attr-defined]
            continue
        for nxt, _ in node.next_functions:  # type: ignore[attr-defined]
            if nxt is not None and nxt not in seen:
                stack.append(nxt)
    return leaves


def local_pass(ctx: DistAutogradContext, outputs: List[object], grads: List[torch.Tensor]
               ) -> Dict[int, List[Tuple[MessageKey, torch.Tensor]]]:
    """Run torch's autograd engine from ``outputs`` (tensors or gradient edges) on this worker.

    Gradients of ordinary leaves are accumulated in ``ctx``; gradients of received
    leaves are returned, grouped by the rank of their sender, as ``(key, grad)``
    pairs to send back. The graph is always retained: in FAST mode another part of
    this backward pass may still reach the same nodes through a later send record.
    """
    nodes = [o.node if isinstance(o, GradientEdge) else o.grad_fn  # type: ignore[attr-defined]
             for o in outputs]
    leaves = reachable_leaves(nodes)
    if not leaves:
        return {}
    leaf_grads = _run_engine(outputs, grads, leaves)
    routed: Dict[int, List[Tuple[MessageKey, torch.Tensor]]] = {}
    recvs = ctx._recvs
    for leaf, grad in zip(leaves, leaf_grads):
        if grad is None:
            continue
        record = recvs.get(id(leaf))
        if record is None:
            ctx.accumulate(leaf, grad)
        else:
            routed.setdefault(record[1], []).append((record[2], grad))
    return routed
