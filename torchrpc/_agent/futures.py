"""The future returned by ``rpc_async``: a ``torch.futures.Future`` that knows the agent.

Two things differ from a plain torch future. Waiting on it from a pool thread
tells the pool the thread is blocked, so nested blocking calls never starve the
pool. Callbacks (``then`` / ``add_done_callback``) never run on a transport
reader thread: if the future completes there, they are handed to the pool, so a
callback that itself makes a blocking RPC cannot stall the connection whose
reply it waits for.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Optional, TypeVar

import torch

from .pool import WorkerPool, current_pool

log = logging.getLogger("torchrpc")
T = TypeVar("T")
S = TypeVar("S")

_reader = threading.local()


def mark_reader_thread() -> None:
    """Called once by each transport reader thread of the agent."""
    _reader.active = True


def on_reader_thread() -> bool:
    return getattr(_reader, "active", False)


class RpcFuture(torch.futures.Future):
    """A :class:`torch.futures.Future` completed by the RPC agent."""

    _pool: Optional[WorkerPool] = None

    def wait(self) -> Any:
        pool = current_pool()
        if pool is not None and not self.done():
            with pool.blocking():
                return super().wait()
        return super().wait()

    def add_done_callback(self, callback: Callable[["RpcFuture"], None]) -> None:
        pool = self._pool

        def run(fut: Any) -> None:
            if pool is not None and on_reader_thread():
                pool.submit(_run_logged, callback, self)
            else:
                _run_logged(callback, self)

        super().add_done_callback(run)

    def then(self, callback: Callable[["RpcFuture"], S]) -> "RpcFuture":
        child = RpcFuture()
        child._pool = self._pool

        def chain(fut: "RpcFuture") -> None:
            try:
                value = callback(fut)
            except BaseException as exc:  # noqa: BLE001 - delivered through the child future
                child.set_exception(exc)
            else:
                child.set_result(value)

        self.add_done_callback(chain)
        return child


def _run_logged(callback: Callable[[Any], None], fut: Any) -> None:
    try:
        callback(fut)
    except Exception:
        log.exception("torchrpc: a future callback raised; the error is ignored as in torch")


def new_future(pool: Optional[WorkerPool]) -> RpcFuture:
    fut = RpcFuture()
    fut._pool = pool
    return fut
