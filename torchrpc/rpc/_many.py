"""Calls to many workers at once and collectives among them (beyond torch's API).

``rpc_async_many`` pickles its arguments once and sends the same message to every
worker; ``barrier`` and ``all_gather`` run on RPC messages among a set of workers
(``_gather.py``), with no rendezvous store.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .. import _profiler
from .._agent import Agent, WorkerInfo, describe
from .._agent.current import current_agent
from .._agent.futures import new_future
from .._wire import Kind
from ..errors import GroupCallError, InvalidArgumentError, WrongTypeError
from . import constants, functions
from ._calls import WorkerLike, _invoke, _prepare, _thread_local_var


def _resolve_many(agent: Agent, to: Any, what: str) -> List[WorkerInfo]:
    """The WorkerInfos of a list of destinations (names, ranks or WorkerInfos)."""
    if isinstance(to, (str, bytes, int, WorkerInfo)) or not isinstance(to, (list, tuple)):
        raise WrongTypeError(f"{what}() takes a list of workers (names, ranks or WorkerInfos) "
                             f"as 'to', got {type(to).__name__} {to!r}; for one worker, "
                             f"pass [{to!r}] or use the single-worker call")
    if not to:
        raise InvalidArgumentError(f"{what}() got an empty list of workers as 'to'; pass at "
                                   f"least one worker name, rank or WorkerInfo")
    return [agent.resolve(w) for w in to]


def rpc_async_many(to: List[WorkerLike], func: Callable[..., Any],
                   args: Optional[Tuple[Any, ...]] = None,
                   kwargs: Optional[Dict[str, Any]] = None,
                   timeout: float = constants.UNSET_RPC_TIMEOUT) -> torch.futures.Future:
    r"""Run ``func`` on every worker of ``to`` at once; one future of all the results.

    The arguments are pickled once and the same message goes to every worker (unless
    they hold something made for one peer, such as an RRef). Not in
    ``torch.distributed.rpc``: there, a loop of :func:`rpc_async` and
    :func:`torch.futures.wait_all` does the same.

    Args:
        to (list of str or WorkerInfo or int): the destination workers; a worker may
            appear more than once (it runs ``func`` once per appearance).
        func (Callable): a callable, as for :func:`rpc_async`.
        args (tuple): the argument tuple for every ``func`` invocation.
        kwargs (dict): keyword arguments for every ``func`` invocation.
        timeout (float, optional): seconds each call may take, as for :func:`rpc_async`.

    Returns:
        A :class:`torch.futures.Future` (``await`` works on it) of the list of results,
        in the order of ``to``. If some calls fail, it fails with a
        :class:`~torchrpc.errors.GroupCallError` that names every failed worker; its
        ``errors`` dict holds each one's error and its ``results`` list the results of
        the others (None where a call failed).

    Example::
        >>> futs = rpc.rpc_async_many(["worker1", "worker2"], torch.add, args=(t, 1))
        >>> a, b = futs.wait()
    """
    agent = current_agent()
    dsts = _resolve_many(agent, to, "rpc_async_many")
    agent, _, args, kwargs, timeout = _prepare(dsts[0], func, args, kwargs, timeout)
    if _profiler.enabled():  # one profiler event per call, as rpc_async records
        futures = [_invoke("async", dst, func, args, kwargs, timeout) for dst in dsts]
    else:
        futures = agent.request_many(dsts, Kind.CALL, (func, args, kwargs), timeout, what=func,
                                     retry=functions.retry_policy(func))
    fut = _combine_results(agent, dsts, futures, func)
    pending = getattr(_thread_local_var, "future_list", None)
    if pending is not None:
        pending.append(fut)
    return fut


def _combine_results(agent: Agent, dsts: List[WorkerInfo], futures: List[torch.futures.Future],
                     func: Any) -> torch.futures.Future:
    """One future of the results of ``futures`` (one per worker of ``dsts``)."""
    out = new_future(agent.pool)
    results: List[Any] = [None] * len(futures)
    failures: List[Optional[BaseException]] = [None] * len(futures)
    left = [len(futures)]
    lock = threading.Lock()

    def done(i: int, f: torch.futures.Future) -> None:
        try:
            results[i] = f.wait()
        except BaseException as exc:  # noqa: BLE001 - collected into the group's error
            # Without frames: ``out`` keeps it, and a C++ future in a cycle is never freed.
            failures[i] = exc.with_traceback(None)
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if not last:
            return
        errors: Dict[str, BaseException] = {}  # in the order of ``to``
        for dst, error in zip(dsts, failures):
            if error is not None:
                errors.setdefault(dst.name, error)
        if errors:
            failed = sum(1 for error in failures if error is not None)
            out.set_exception(GroupCallError(
                f"rpc_async_many of {describe(func)}: {failed} of {len(futures)} calls "
                f"failed, on {', '.join(errors)}: "
                + "; ".join(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                            if str(e) else f"{name}: {type(e).__name__}"
                            for name, e in errors.items()), results, errors))
        else:
            out.set_result(results)

    for i, f in enumerate(futures):
        torch.futures.Future.add_done_callback(f, functools.partial(done, i))
    return out


def rpc_sync_many(to: List[WorkerLike], func: Callable[..., Any],
                  args: Optional[Tuple[Any, ...]] = None,
                  kwargs: Optional[Dict[str, Any]] = None,
                  timeout: float = constants.UNSET_RPC_TIMEOUT) -> List[Any]:
    r"""Run ``func`` on every worker of ``to`` at once and wait: the list of results.

    Takes the same arguments as :func:`rpc_async_many`; raises its
    :class:`~torchrpc.errors.GroupCallError` if some calls fail. Not in
    ``torch.distributed.rpc``.
    """
    return rpc_async_many(to, func, args, kwargs, timeout).wait()


def _gather_names(agent: Agent, workers: Optional[List[WorkerLike]], what: str
                  ) -> Optional[List[str]]:
    if workers is None:
        return None
    return [w.name for w in _resolve_many(agent, workers, what)]


def _collective_timeout(timeout: float) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, got {timeout!r}")
    if timeout != constants.UNSET_RPC_TIMEOUT and timeout < 0:
        raise ValueError(f"timeout must be >= 0 seconds (0: no timeout), got {timeout}")
    return float(timeout)
