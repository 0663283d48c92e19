"""The callee's event loop: where ``async def`` RPC targets run.

Theory of operation. An agent owns one :class:`CoroutineRunner`. Its event loop
runs on a thread of its own, started by the first coroutine a request brings (a
worker that never serves one never starts it). A pool thread calls the target,
gets a coroutine, hands it to the loop with ``call_soon_threadsafe`` and returns:
no pool thread is held while the coroutine awaits, so any number of them can
wait at once (on nested ``await rpc.rpc_async(...)`` calls, timers, I/O).

When a coroutine ends, its future is completed on a pool thread, not on the
loop: completing it runs the callbacks that encode and send the reply, which may
block on a full socket, and the loop must stay free for the other coroutines.
The exception a coroutine raised is stored as a copy without frames, and with the
coroutine's traceback as text, so the caller's error names the remote frames just as a
plain function's does.

:meth:`close` (at shutdown) cancels what still runs, waits a moment for the
cancellations, then stops, closes and joins the loop thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback
from typing import Any, Coroutine, List, Optional

import torch

from .. import _threads
from .._threads import Guard
from ..errors import ClosedError, NotInitializedError
from .futures import fresh_error
from .pool import WorkerPool

log = logging.getLogger(__name__)

_CANCEL_WAIT = 2.0  # seconds shutdown lets cancelled coroutines finish


class CoroutineRunner:
    """One agent's event loop for coroutine targets; see the module docs. Thread-safe."""

    def __init__(self, name: str, pool: WorkerPool) -> None:
        self._name = name
        self._pool = pool
        self._lock = threading.Lock()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    def submit(self, coro: Coroutine[Any, Any, Any]) -> torch.futures.Future:
        """Run ``coro`` on the loop; a future of its result (or of what it raised)."""
        fut: torch.futures.Future = torch.futures.Future()
        loop = None if self._closed else (self._loop or self._start())
        if loop is None:
            coro.close()  # never awaited: close it, or Python warns when it is collected
            fut.set_exception(NotInitializedError(
                f"RPC agent of {self._name} shut down before a coroutine target could run"))
            return fut
        try:
            loop.call_soon_threadsafe(self._begin, coro, fut)
        except RuntimeError:  # closed between the check and the call
            coro.close()
            fut.set_exception(NotInitializedError(
                f"RPC agent of {self._name} shut down before a coroutine target could run"))
        return fut

    def _start(self) -> Optional[asyncio.AbstractEventLoop]:
        with self._lock:
            if self._closed:
                return None
            if self._loop is None:
                loop = asyncio.new_event_loop()
                ready = threading.Event()
                guard = Guard(f"the event loop of {self._name}")
                self._thread = _threads.start(f"torchrpc-asyncio-{self._name}", guard,
                                              self._run, loop, ready)
                ready.wait()
                self._loop = loop
            return self._loop

    @staticmethod
    def _run(loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
        asyncio.set_event_loop(loop)
        loop.call_soon(ready.set)
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(asyncio.sleep(0))  # start the coroutines handed over last
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.wait(tasks, timeout=_CANCEL_WAIT))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def _begin(self, coro: Coroutine[Any, Any, Any], fut: torch.futures.Future) -> None:
        """On the loop: start ``coro`` as a task that completes ``fut`` when it ends."""
        task = asyncio.ensure_future(coro)
        task.add_done_callback(lambda t: self._ended(t, fut))

    def _ended(self, task: "asyncio.Future[Any]", fut: torch.futures.Future) -> None:
        """On the loop: a coroutine ended; complete its future on the pool."""
        try:
            self._pool.submit(_settle, task, fut)
        except ClosedError:  # the pool is closed (shutdown): nothing will block here
            _settle(task, fut)

    def close(self, timeout: float = _CANCEL_WAIT + 10) -> List[str]:
        """Cancel the coroutines still running, stop the loop and join its thread, waiting
        ``timeout`` seconds at most; the loop thread's name if it still runs (it does
        when it closes itself: the interpreter's exit joins it then)."""
        with self._lock:
            self._closed = True
            loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return []
        try:
            loop.call_soon_threadsafe(loop.stop)
        except RuntimeError:
            pass  # closed already
        return _threads.join([thread], time.monotonic() + timeout)


def _settle(task: "asyncio.Future[Any]", fut: torch.futures.Future) -> None:
    """Complete ``fut`` with how ``task`` ended."""
    if task.cancelled():
        fut.set_exception(NotInitializedError(
            "the coroutine target was cancelled: its worker shut down before it ended"))
        return
    exc = task.exception()
    if exc is None:
        fut.set_result(task.result())
        return
    # The future keeps a copy without frames (waiting on it must not make a cycle through
    # the C++ future that gc cannot see), and the coroutine's traceback as text for the reply.
    error = fresh_error(exc)
    try:
        error._torchrpc_traceback = "".join(traceback.format_exception(exc))
    except AttributeError:  # an exception type without attributes: the copy's own then
        pass
    fut.set_exception(error)
