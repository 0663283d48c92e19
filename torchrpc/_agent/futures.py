"""The future returned by ``rpc_async``: a ``torch.futures.Future`` that knows the agent.

Two things differ from a plain torch future. Waiting on it from a pool thread
tells the pool the thread is blocked, so nested blocking calls never starve the
pool. Callbacks (``then`` / ``add_done_callback``) never run on a transport
reader thread: if the future completes there, they are handed to the pool, so a
callback that itself makes a blocking RPC cannot stall the connection whose
reply it waits for.
"""

from __future__ import annotations

import copy
import logging
import threading
from typing import Any, Callable, Optional, TypeVar

import torch

from ..errors import as_runtime_error
from .pool import WorkerPool, current_pool

log = logging.getLogger(__name__)
T = TypeVar("T")
S = TypeVar("S")

_reader = threading.local()


def mark_reader_thread(active: bool = True) -> None:
    """Called by a thread of the agent when it takes (or leaves) a reading role."""
    _reader.active = active


def on_reader_thread() -> bool:
    return getattr(_reader, "active", False)


class RpcFuture(torch.futures.Future):
    """A :class:`torch.futures.Future` completed by the RPC agent."""

    _pool: Optional[WorkerPool] = None

    def wait(self) -> Any:
        pool = current_pool()
        try:
            if pool is not None and not self.done():
                with pool.blocking():
                    return torch.futures.Future.wait(self)
            return torch.futures.Future.wait(self)
        except BaseException as exc:  # noqa: BLE001 - re-raised as a fresh copy below
            # The C++ future is invisible to Python's cycle collector, so the stored
            # exception must never hold frames (which hold this future): clear its
            # traceback, and the exception it was raised in the middle of handling
            # (raising it here sets that as its context), and raise a copy.
            exc.__traceback__ = None
            exc.__context__ = exc.__cause__ = None
            error = fresh_error(exc)
        del self
        try:
            raise error
        finally:
            del error  # the frame must not hold the exception whose traceback holds it

    def add_done_callback(self, callback: Callable[["RpcFuture"], None]) -> None:
        pool = self._pool

        def run(fut: Any) -> None:
            if pool is not None and on_reader_thread():
                pool.submit(_run_logged, callback, self)
            else:
                _run_logged(callback, self)

        super().add_done_callback(run)

    def then(self, callback: Callable[["RpcFuture"], S]) -> "RpcFuture":
        if not callable(callback):
            raise TypeError(f"then(): incompatible function arguments. The callback must be "
                            f"a callable taking this future, got {callback!r}")
        child = RpcFuture()
        child._pool = self._pool

        def chain(fut: "RpcFuture") -> None:
            try:
                value = callback(fut)
            except BaseException as exc:  # noqa: BLE001 - delivered through the child future
                # torch reports a callback's error as a RuntimeError; ours is both.
                child.set_exception(as_runtime_error(exc.with_traceback(None)))
            else:
                child.set_result(value)

        self.add_done_callback(chain)
        return child


def fresh_error(exc: BaseException) -> BaseException:
    """A copy of ``exc`` (same type, args and attributes, no traceback) that can be
    stored or raised freely: it holds no frames, so it never keeps their locals alive."""
    try:
        clone = copy.copy(exc)
    except Exception:  # noqa: BLE001 - an exception that won't copy is raised as is
        return exc
    return clone if type(clone) is type(exc) else exc


def _run_logged(callback: Callable[[Any], None], fut: Any) -> None:
    try:
        callback(fut)
    except Exception:
        log.exception("a future callback raised; the error is ignored as in torch")


def new_future(pool: Optional[WorkerPool]) -> RpcFuture:
    fut = RpcFuture()
    fut._pool = pool
    return fut
