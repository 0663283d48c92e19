"""The future returned by ``rpc_async``: a ``torch.futures.Future`` that knows the agent.

A few things differ from a plain torch future. Waiting on it from a pool thread
tells the pool the thread is blocked, so nested blocking calls never starve the
pool. A future whose reply waits unread on a private connection (a parked reply, see
lanes.py) has it read by the thread that waits on it, with no reader thread woken;
asking whether it is done, or adding a callback, has a pool thread read it at once. Callbacks (``then`` / ``add_done_callback``) never run on a transport
reader thread: if the future completes there, they are handed to the pool, so a
callback that itself makes a blocking RPC cannot stall the connection whose
reply it waits for. And ``await fut`` works in any running event loop: the loop
is told of the completion with ``call_soon_threadsafe`` and never blocks on it.

``torch.futures.collect_all`` and ``wait_all`` over these futures: see collect.py.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import threading
from typing import Any, Callable, Generator, List, Optional, TypeVar

import torch

from ..errors import ClosedError, as_runtime_error
from .pool import WorkerPool, current_pool

log = logging.getLogger(__name__)
T = TypeVar("T")
S = TypeVar("S")

_reader = threading.local()
_RAN = ("ran",)  # RpcFuture._callbacks once they were handed to be run
_future_init = torch._C.Future.__init__  # without torch's Python __init__ (its devices)
_NO_DEVICES = ()


def mark_reader_thread(active: bool = True) -> None:
    """Called by a thread of the agent when it takes (or leaves) a reading role."""
    _reader.active = active


def on_reader_thread() -> bool:
    return getattr(_reader, "active", False)


class ManyClaim:
    """A future's ``_claim`` that reads the replies of several futures at once (a burst,
    see bursts.py): :func:`wait_all` and :func:`collect_all` read once for all the
    futures of one :attr:`group`. ``claim(future, later)`` reads until ``future`` is
    done, on the calling thread or with ``later`` on the pool."""

    __slots__ = ()

    @property
    def group(self) -> Any:
        """What the futures claimed alike share (one reading serves them all)."""
        raise NotImplementedError

    def events(self) -> int:
        """A count that grows with every error reply read, and every quiet wait."""
        raise NotImplementedError

    def read_until(self, finished: Callable[[], bool]) -> None:
        """Read on this thread until ``finished()``."""
        raise NotImplementedError

    def read_later(self, finished: Callable[[], bool]) -> None:
        """Read on the pool until ``finished()``."""
        raise NotImplementedError

    def __call__(self, future: Any, later: bool) -> None:
        raise NotImplementedError


class RpcFuture(torch.futures.Future):
    """A :class:`torch.futures.Future` completed by the RPC agent."""

    # Slots, so that no attribute dict is made: an outstanding call's future is the
    # one object of its own that a caller keeps, and the cycle collector visits each.
    __slots__ = ("_pool", "_claim", "_callbacks")

    def __init__(self, pool: Optional[WorkerPool] = None) -> None:
        _future_init(self, _NO_DEVICES)
        self._pool = pool
        # Reads a reply that waits unread for whoever waits on the future (see lanes.py):
        # ``claim(self, False)`` on the calling thread, ``claim(self, True)`` on the
        # pool; None once claimed, or for a reply read elsewhere.
        self._claim: Optional[Callable[[RpcFuture, bool], None]] = None
        # The callbacks waiting for it to complete; _RAN once they were handed to be run.
        self._callbacks: Any = None

    def wait(self) -> Any:
        claim = self._claim
        if claim is not None:
            self._claim = None
            claim(self, False)
        pool = current_pool()
        try:
            if pool is not None and not torch.futures.Future.done(self):
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

    def done(self) -> bool:
        _claim_later(self)
        return torch.futures.Future.done(self)

    def add_done_callback(self, callback: Callable[["RpcFuture"], None]) -> None:
        _claim_later(self)
        pool = self._pool
        if pool is None:  # completed where it was made: torch runs them in order
            super().add_done_callback(lambda fut: _run_logged(callback, self))
            return
        # The callbacks added before it completes run in the order they were added, one
        # after the other, as torch's do: all of them in one task of the pool when a
        # reader thread completes it. One added later runs at once, here.
        with pool.callbacks_lock:
            callbacks = self._callbacks
            if callbacks is not None and callbacks is not _RAN:
                callbacks.append(callback)
                return
            if callbacks is None:
                self._callbacks = [callback]
        if callbacks is _RAN:
            _run_logged(callback, self)
        else:
            super().add_done_callback(self._run_callbacks)

    def _run_callbacks(self, fut: Any) -> None:
        pool = self._pool
        with pool.callbacks_lock:
            callbacks, self._callbacks = self._callbacks, _RAN
        if on_reader_thread():
            pool.submit(_run_all_logged, callbacks, self)
        else:
            _run_all_logged(callbacks, self)

    def then(self, callback: Callable[["RpcFuture"], S]) -> "RpcFuture":
        if not callable(callback):
            raise TypeError(f"then(): incompatible function arguments. The callback must be "
                            f"a callable taking this future, got {callback!r}")
        child = RpcFuture(self._pool)

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

    def __await__(self) -> Generator[Any, None, Any]:
        """``await fut``: the value, or the error, without blocking the running loop.

        Cancelling the awaiting task leaves the RPC alone: it still completes, and
        its result (or error) is dropped with the future.
        """
        if not self.done():  # done() has the pool read a parked reply
            loop = asyncio.get_running_loop()
            waiter = loop.create_future()
            # Inline, on whichever thread completes it: handing over to the loop is quick.
            torch.futures.Future.add_done_callback(self, functools.partial(_wake, loop, waiter))
            yield from waiter.__await__()
        return self.wait()


class SyncFuture:
    """The future of a request whose caller waits for it at once and hands no future out
    (``rpc_sync``, :meth:`Agent.request_sync`): a value or an error, and a lock that is
    released once it has one. It costs a small part of a torch future's making, setting
    and waiting, which a blocking call would pay for nothing."""

    __slots__ = ("_ready", "_value", "_error", "_callbacks", "_claim")

    def __init__(self) -> None:
        self._ready = _new_lock()
        self._ready.acquire()
        self._value: Any = None
        self._error: Optional[BaseException] = None
        self._callbacks: Optional[List[Callable[[Any], None]]] = None
        # Reads its reply on the waiting thread, as RpcFuture's (see lanes.py).
        self._claim: Optional[Callable[[Any, bool], None]] = None

    def set_result(self, value: Any) -> None:
        self._value = value
        self._settle()

    def set_exception(self, error: BaseException) -> None:
        self._error = error
        self._settle()

    def _settle(self) -> None:
        # Callbacks first, so the caller wakes to a call whose bookkeeping is done; a
        # second settling raises ("release unlocked lock"), as a torch future's does.
        try:
            for callback in self._callbacks or ():
                callback(self)
        finally:
            self._ready.release()

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        """Run ``callback(self)`` where the future completes (before it does)."""
        if self._callbacks is None:
            self._callbacks = []
        self._callbacks.append(callback)

    def done(self) -> bool:
        return not self._ready.locked()

    def error(self) -> Optional[BaseException]:
        """The error it completed with, None with a value: once done, or in a callback."""
        return self._error

    def wait(self) -> Any:
        """The value, or a copy of the error raised; blocks (as a blocked pool thread)
        until there is one."""
        claim = self._claim
        if claim is not None:
            self._claim = None
            claim(self, False)
        ready = self._ready
        if not ready.acquire(False):
            pool = current_pool()
            if pool is None:
                ready.acquire()
            else:
                with pool.blocking():
                    ready.acquire()
        ready.release()  # it stays done
        if self._error is None:
            return self._value
        error = fresh_error(self._error)
        try:
            raise error
        finally:
            del error  # the frame must not hold the exception whose traceback holds it


_new_lock = threading.Lock


def error_of(fut: Any) -> Optional[BaseException]:
    """The error a completed future (torch's or a :class:`SyncFuture`) holds, None for a
    value; without raising it."""
    if type(fut) is SyncFuture:
        return fut.error()
    try:
        fut.wait()
    except BaseException as exc:  # noqa: BLE001 - returned
        return exc
    return None


def torch_future_of(sync: SyncFuture, pool: WorkerPool) -> RpcFuture:
    """A torch future that completes as ``sync`` does: at once if it is done, else from a
    thread of ``pool`` that waits for it (a callback added now might come too late)."""
    out = new_future(pool)

    def relay() -> None:
        try:
            value = sync.wait()
        except BaseException as exc:  # noqa: BLE001 - delivered through the future
            out.set_exception(exc)
        else:
            out.set_result(value)

    if sync.done():
        relay()
    else:
        try:
            pool.submit(relay)
        except ClosedError:  # shutting down: every request is failed, this one too
            relay()
    return out


def _claim_later(fut: RpcFuture) -> None:
    """Have a pool thread read ``fut``'s parked reply now, if nobody has claimed it."""
    claim = fut._claim
    if claim is not None:
        fut._claim = None
        claim(fut, True)


def _wake(loop: asyncio.AbstractEventLoop, waiter: "asyncio.Future[None]", _fut: Any) -> None:
    try:
        loop.call_soon_threadsafe(_resolve, waiter)
    except RuntimeError:  # the loop is closed: nobody awaits any more
        pass


def _resolve(waiter: "asyncio.Future[None]") -> None:
    if not waiter.done():  # a cancelled await leaves a cancelled waiter
        waiter.set_result(None)


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


def _run_all_logged(callbacks: List[Callable[[Any], None]], fut: Any) -> None:
    for callback in callbacks:
        _run_logged(callback, fut)


def new_future(pool: Optional[WorkerPool]) -> RpcFuture:
    return RpcFuture(pool)
