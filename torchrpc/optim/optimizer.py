"""DistributedOptimizer, written on the public API only (``torchrpc.rpc``, ``torchrpc.autograd``).

One local optimizer is made on each worker that owns some of the parameters, and
an RRef to it is kept. ``step(context_id)`` asks every owner at once to apply the
gradients that context accumulated there, and waits for all of them.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
import torch.optim.optimizer as _torch_optimizer

import torchrpc.autograd as dist_autograd
import torchrpc.rpc as rpc


class _LocalOptimizer:
    """The optimizer of one owner, over its own parameters; lives on that owner."""

    # ``.grad`` is borrowed during a step, under the lock local backward passes also
    # hold while they borrow it (two optimizers may share parameters, too).
    step_lock = dist_autograd._grad_lock

    def __init__(self, optimizer_class: Any, params: List[torch.Tensor], args: Sequence[Any],
                 kwargs: Dict[str, Any]) -> None:
        self._params = params
        self.optim = optimizer_class(params, *args, **kwargs)
        self._step = _unprofiled_step(self.optim)

    def step(self, context_id: int) -> None:
        grads = dist_autograd.get_gradients(context_id)
        with _LocalOptimizer.step_lock:
            saved = [p.grad for p in self._params]
            try:
                # A parameter that no gradient reached in this context gets None, so
                # the optimizer leaves it unchanged.
                for p in self._params:
                    p.grad = grads.get(p)
                self._step()
            finally:
                for p, g in zip(self._params, saved):
                    p.grad = g


def _unprofiled_step(optim: Any) -> Callable[[], Any]:
    """``optim.step``, without torch's profiling wrapper when nothing would see it.

    ``torch.optim.Optimizer`` wraps every ``step`` to open a profiler range and run
    the step hooks; for a small model, opening the range is a large part of the step.
    The returned function calls the unwrapped step while no profiler is running
    and no hook is registered (checked at every call), else the full ``step``.
    """
    step = optim.step
    inner = getattr(type(optim).step, "__wrapped__", None)
    hooks = (getattr(optim, "_optimizer_step_pre_hooks", None),
             getattr(optim, "_optimizer_step_post_hooks", None),
             getattr(_torch_optimizer, "_global_optimizer_pre_hooks", None),
             getattr(_torch_optimizer, "_global_optimizer_post_hooks", None))
    profiler = torch.autograd.profiler
    if inner is None or any(h is None for h in hooks) \
            or not hasattr(profiler, "_is_profiler_enabled"):
        return step

    def unprofiled() -> Any:
        if profiler._is_profiler_enabled or any(hooks):
            return step()
        return inner(optim)
    return unprofiled


# The local optimizers of this worker by number, so that a step names its optimizer with
# an int: passing the RRef itself in every step would cost RRef protocol messages. The
# RRef held by the DistributedOptimizer keeps the optimizer alive; this map does not.
_by_number: "weakref.WeakValueDictionary[int, _LocalOptimizer]" = weakref.WeakValueDictionary()
_numbers = itertools.count(1)


def _new_local_optimizer(optimizer_class: Any, param_rrefs: List[rpc.RRef], args: Sequence[Any],
                         kwargs: Dict[str, Any]) -> Tuple[rpc.RRef, int]:
    params = [rref.local_value() for rref in param_rrefs]
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"DistributedOptimizer: params_rref[{i}] on "
                            f"{rpc.get_worker_info().name} holds a {type(p).__name__}, "
                            f"not a Tensor")
    optimizer = _LocalOptimizer(optimizer_class, params, args, kwargs)
    number = next(_numbers)
    _by_number[number] = optimizer
    return rpc.RRef(optimizer), number


def _local_step(number: int, context_id: int) -> None:
    optimizer = _by_number.get(number)
    if optimizer is None:
        raise RuntimeError(f"DistributedOptimizer: local optimizer {number} no longer exists "
                           f"on {rpc.get_worker_info().name}")
    optimizer.step(context_id)


def _wait_all(waits: List[Callable[[], Any]]) -> List[Any]:
    """Call every wait (``future.wait``, or the work itself); then raise the first error."""
    results, errors = [], []
    for wait in waits:
        try:
            results.append(wait())
        except BaseException as exc:  # noqa: BLE001 - raised after all are done
            errors.append(exc)
    if errors:
        raise errors[0]
    return results


class DistributedOptimizer:
    r"""DistributedOptimizer takes remote references to parameters scattered across workers
    and applies the given optimizer locally for each parameter.

    This class uses :meth:`~torchrpc.autograd.get_gradients` in order to retrieve the
    gradients for specific parameters.

    Concurrent calls to :meth:`step`, either from the same or different clients,
    are serialized on each worker, as each worker's optimizer can only work on one
    set of gradients at a time. However, there is no guarantee that the full
    forward-backward-optimizer sequence will execute for one client at a time. This
    means that the gradients being applied may not correspond to the latest forward
    pass executed on a given worker. Also, there is no guaranteed ordering across
    workers.

    Unlike torch, the local optimizers are plain Python optimizers (no TorchScript).

    Args:
        optimizer_class (optim.Optimizer): the class of optimizer to instantiate on
            each worker.
        params_rref (list[RRef]): list of RRefs to local or remote parameters to
            optimize.
        args: arguments to pass to the optimizer constructor on each worker.
        kwargs: arguments to pass to the optimizer constructor on each worker.

    Example::
        >>> import torchrpc.autograd as dist_autograd
        >>> import torchrpc.rpc as rpc
        >>> from torch import optim
        >>> from torchrpc.optim import DistributedOptimizer
        >>>
        >>> with dist_autograd.context() as context_id:
        >>>   # Forward pass.
        >>>   rref1 = rpc.remote("worker1", torch.add, args=(torch.ones(2), 3))
        >>>   rref2 = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
        >>>   loss = rref1.to_here() + rref2.to_here()
        >>>
        >>>   # Backward pass.
        >>>   dist_autograd.backward(context_id, [loss.sum()])
        >>>
        >>>   # Optimizer.
        >>>   dist_optim = DistributedOptimizer(
        >>>      optim.SGD,
        >>>      [rref1, rref2],
        >>>      lr=0.05,
        >>>   )
        >>>   dist_optim.step(context_id)
    """

    def __init__(self, optimizer_class: Any, params_rref: List[rpc.RRef], *args: Any,
                 **kwargs: Any) -> None:
        if not callable(optimizer_class):
            raise TypeError(f"optimizer_class must be an optimizer class such as "
                            f"torch.optim.SGD, got {optimizer_class!r}")
        if not isinstance(params_rref, (list, tuple)) or not params_rref:
            raise ValueError(f"params_rref must be a non-empty list of RRefs to parameters, "
                             f"got {params_rref!r}")
        per_owner: Dict[Any, List[rpc.RRef]] = {}
        for i, rref in enumerate(params_rref):
            if not isinstance(rref, rpc.RRef):
                raise TypeError(f"params_rref[{i}] must be an RRef, got {type(rref).__name__}; "
                                f"wrap a local parameter p as rpc.RRef(p)")
            per_owner.setdefault(rref.owner(), []).append(rref)
        futures = [rpc.rpc_async(owner, _new_local_optimizer,
                                 args=(optimizer_class, rrefs, args, kwargs))
                   for owner, rrefs in per_owner.items()]
        created = _wait_all([fut.wait for fut in futures])
        self.remote_optimizers: List[rpc.RRef] = [rref for rref, _ in created]
        self._numbers = [number for _, number in created]

    def step(self, context_id: int) -> None:
        r"""Performs a single optimization step.

        This will call :meth:`torch.optim.Optimizer.step` on each worker containing
        parameters to be optimized, and will block until all workers return. The
        provided ``context_id`` will be used to retrieve the corresponding
        :class:`~torchrpc.autograd.context` that contains the gradients that should
        be applied to the parameters. Parameters that no gradient reached in that
        context are left unchanged.

        Args:
            context_id: the autograd context id for which we should run the
                optimizer step.
        """
        if isinstance(context_id, bool) or not isinstance(context_id, int):
            raise TypeError(f"context_id must be an int, got {type(context_id).__name__}")
        # Start the remote steps, then run this worker's own optimizer here meanwhile;
        # then read the remote replies on this thread.
        pairs = list(zip(self.remote_optimizers, self._numbers))
        waits = [rpc.rpc_async(opt.owner(), _local_step, args=(number, context_id)).wait
                 for opt, number in pairs if not opt.is_owner()]
        for opt, number in pairs:
            if opt.is_owner():
                waits.insert(0, functools.partial(_local_step, number, context_id))
        _wait_all(waits)
