"""The functions behind ``torchrpc.autograd``, on the engine of the current agent."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from .._agent.current import current_agent
from .engine import DistAutogradEngine, engine_of
from .records import DistAutogradContext


def _engine() -> DistAutogradEngine:
    return engine_of(current_agent())


class context:
    r"""Context object to wrap forward and backward passes when using distributed autograd.

    The ``context_id`` generated in the ``with`` statement is required to uniquely
    identify a distributed backward pass on all workers. Each worker stores
    metadata associated with this ``context_id``, which is required to correctly
    execute a distributed autograd pass. Leaving the ``with`` block releases the
    context on every worker that took part. Each thread has at most one current
    context; blocks cannot be nested in one thread.

    Example::
        >>> import torchrpc.autograd as dist_autograd
        >>> with dist_autograd.context() as context_id:
        >>>     t1 = torch.rand((3, 3), requires_grad=True)
        >>>     t2 = torch.rand((3, 3), requires_grad=True)
        >>>     loss = rpc.rpc_sync("worker1", torch.add, args=(t1, t2)).sum()
        >>>     dist_autograd.backward(context_id, [loss])
    """

    def __init__(self) -> None:
        self._engine: Optional[DistAutogradEngine] = None
        self._context_id: Optional[int] = None

    def __enter__(self) -> int:
        engine = _engine()
        ctx = engine.new_context()
        self._engine = engine
        self._context_id = ctx.id
        return ctx.id

    def __exit__(self, *exc: Any) -> None:
        engine, context_id = self._engine, self._context_id
        self._engine = self._context_id = None
        if engine is not None and context_id is not None:
            engine.exit_context(context_id)


def backward(context_id: int, roots: List[torch.Tensor], retain_graph: bool = False) -> None:
    r"""Kicks off the distributed backward pass using the provided roots.

    This implements the FAST mode algorithm, which assumes all RPC messages sent in
    the same distributed autograd context across workers are part of the autograd
    graph during the backward pass. The roots are used to discover the autograd
    graph and its dependencies; the call blocks until the entire autograd
    computation is done on every worker.

    The gradients are accumulated in the :class:`context` identified by
    ``context_id`` on each of the nodes, never in ``.grad``; retrieve them with
    :func:`get_gradients`. An error raised on any worker during the pass is raised
    here, with its message and the name of that worker.

    Args:
        context_id (int): the autograd context id for which the gradients should be
            computed. A RuntimeError is raised when no such context exists here.
        roots (list): tensors which represent the roots of the autograd computation.
            All the tensors should be scalars.
        retain_graph (bool, optional): if ``False``, the graph used to compute the
            grad may be freed once the context is released. Set it to ``True`` to run
            backward several times in one context.

    Example::
        >>> import torchrpc.autograd as dist_autograd
        >>> with dist_autograd.context() as context_id:
        >>>     pred = model.forward()
        >>>     loss = loss_func(pred, loss)
        >>>     dist_autograd.backward(context_id, [loss])
    """
    _engine().backward(context_id, roots, retain_graph)


def get_gradients(context_id: int) -> Dict[torch.Tensor, torch.Tensor]:
    r"""Retrieves a map from Tensor to the appropriate gradient for that Tensor.

    The gradients are those accumulated in the context ``context_id`` on this
    worker by distributed backward passes.

    Args:
        context_id (int): the autograd context id for which the gradients should be
            retrieved.

    Returns:
        A new dict where the key is the Tensor and the value is the associated
        gradient for that Tensor.

    Example::
        >>> import torchrpc.autograd as dist_autograd
        >>> with dist_autograd.context() as context_id:
        >>>     t1 = torch.rand((3, 3), requires_grad=True)
        >>>     t2 = torch.rand((3, 3), requires_grad=True)
        >>>     loss = t1 + t2
        >>>     dist_autograd.backward(context_id, [loss.sum()])
        >>>     grads = dist_autograd.get_gradients(context_id)
        >>>     print(grads[t1])
        >>>     print(grads[t2])
    """
    return _engine().gradients(context_id)


def is_available() -> bool:
    """Distributed autograd is always available in torchrpc."""
    return True


def _init(worker_id: int) -> None:
    """torch's set-up of distributed autograd for worker ``worker_id``. torchrpc installs
    distributed autograd on each agent in ``init_rpc``, so this only checks the id."""
    if isinstance(worker_id, bool) or not isinstance(worker_id, int) or worker_id < 0:
        raise TypeError(f"_init(): worker_id must be an int >= 0, got {worker_id!r}")


def _current_context() -> DistAutogradContext:
    r"""The distributed autograd context current on the calling thread.

    Inside ``with dist_autograd.context()``, and on a worker while it runs an RPC
    made in a context, this is that context; a RuntimeError is raised when the
    thread has none.
    """
    return _engine().current_or_raise()


def _retrieve_context(context_id: int) -> DistAutogradContext:
    r"""The context with id ``context_id`` on this worker.

    Raises a RuntimeError ("Could not find autograd context with id: ...") when this
    worker has no such context (never had it, or it was released).
    """
    return _engine().retrieve(context_id)


def _is_valid_context(context_id: int) -> bool:
    r"""Whether this worker currently holds the context with id ``context_id``."""
    return _engine().is_valid(context_id)


def _new_context() -> DistAutogradContext:
    r"""Creates a new context and makes it current on the calling thread.

    Unlike :class:`context` nothing releases it automatically; call
    :func:`_release_context` when done. Raises a RuntimeError when the thread
    already has a context.
    """
    return _engine().new_context()


def _release_context(context_id: int) -> None:
    r"""Releases the context ``context_id`` on this worker and on every worker that
    messages of the context went to; the calling thread's current context is cleared
    if it is this one. Raises a RuntimeError when this worker has no such context.
    """
    _engine().release_context(context_id)


def _get_max_id() -> int:
    r"""The largest context id this worker can create: its rank in the high 16 bits,
    all ones in the low 48."""
    return _engine().max_id()


def _get_debug_info() -> Dict[str, str]:
    r"""Debug information of distributed autograd on this worker, as torch reports it:
    ``num_current_backward_passes`` (contexts with a backward pass in progress here) and
    ``num_autograd_contexts`` (contexts held here), as strings."""
    return _engine().torch_debug_info()


def backward_rref(value: Any, context_id: int = -1, retain_graph: bool = False) -> None:
    """The work of ``RRef.backward`` on the owner, given the RRef's local value.

    With ``context_id == -1`` this is a local ``value.backward()`` (gradients go to
    ``.grad``); otherwise a distributed backward pass from ``value`` in that context.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"RRef.backward() needs an RRef to a scalar Tensor, but its value is "
                        f"a {type(value).__name__}")
    if context_id == -1:
        value.backward(retain_graph=retain_graph)
    else:
        _engine().backward(context_id, [value], retain_graph)
