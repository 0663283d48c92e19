"""The one path of every RPC call: its arguments checked, the call made.

``_prepare`` checks a call's arguments and finds its agent and destination; ``_invoke``
makes the call, under the profiler when it runs, and is the whole of ``rpc_async`` and
``rpc_sync``: ``rpc_sync`` waits on the future it returns, having told the agent that it
will (its thread may then read the reply itself). ``_wait_all`` collects the
``rpc_async`` futures a thread makes inside a ``with`` block.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Dict, List, Tuple, Union

import torch

from .. import _profiler
from .._agent import Agent, Expect, WorkerInfo
from .._agent.current import current_agent
from . import constants, functions

WorkerLike = Union[str, int, WorkerInfo]


# Per thread: ``future_list``, the futures rpc_async made inside ``with _wait_all()``.
_thread_local_var = threading.local()


@contextlib.contextmanager
def _wait_all():
    """Wait, on leaving the block, for every ``rpc_async`` future this thread made in it;
    raise the first error among them."""
    futures: List[torch.futures.Future] = []
    _thread_local_var.future_list = futures
    try:
        yield
    finally:
        del _thread_local_var.future_list
        if futures:
            torch.futures.wait_all(futures)


def _prepare(to: WorkerLike, func: Any, args: Any, kwargs: Any, timeout: float
             ) -> Tuple[Agent, WorkerInfo, Tuple[Any, ...], Dict[str, Any], float]:
    agent = current_agent()
    dst = agent.resolve(to)
    if not callable(func):
        raise TypeError(f"func must be callable, got {type(func).__name__}")
    if args is None:
        args = ()
    elif not isinstance(args, tuple):
        if not isinstance(args, list):
            raise TypeError(f"args must be a tuple, got {type(args).__name__}")
        args = tuple(args)
    if kwargs is None:
        kwargs = {}
    elif not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict, got {type(kwargs).__name__}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, got {timeout!r}")
    if timeout == constants.UNSET_RPC_TIMEOUT:
        timeout = agent.default_timeout
    elif timeout < 0:
        raise ValueError(f"timeout must be >= 0 seconds (0: no timeout), got {timeout}")
    return agent, dst, args, kwargs, float(timeout)


def _invoke(mode: str, to: WorkerLike, func: Callable[..., Any], args: Any, kwargs: Any,
            timeout: float) -> torch.futures.Future:
    """The one path of rpc_async and rpc_sync (``mode`` "async" or "sync", as in their
    profiling keys): a future of ``func``'s result on ``to``. With "sync", the caller
    waits on it at once and hands it to nobody."""
    agent, dst, args, kwargs, timeout = _prepare(to, func, args, kwargs, timeout)
    retry = functions.retry_policy(func)
    if _profiler.enabled():
        fut = _profiler.profiled(mode, agent, dst, func, lambda: agent.call(
            dst, func, args, kwargs, timeout, retry=retry))
    else:
        fut = agent.call(dst, func, args, kwargs, timeout, retry=retry,
                         expect=Expect.FUTURE if mode == "async" else Expect.WAIT)
    if mode == "async":
        futures = getattr(_thread_local_var, "future_list", None)
        if futures is not None:
            futures.append(fut)
    return fut
