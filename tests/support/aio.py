"""Coroutine targets and group-call helpers that tests run remotely (importable on every
worker)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, List

import torchrpc.rpc as rpc

from . import helpers


async def async_add(a: Any, b: Any) -> Any:
    await asyncio.sleep(0)
    return a + b


async def async_sleep_then(seconds: float, value: Any = None) -> Any:
    await asyncio.sleep(seconds)
    return value


async def async_nested(to: str, x: int) -> int:
    """A nested call awaited on the callee's event loop."""
    return await rpc.rpc_async(to, helpers.add, args=(x, 1)) + 1


async def async_raise(msg: str) -> None:
    await asyncio.sleep(0)
    raise ValueError(msg)


@rpc.functions.async_execution
async def async_execution_coroutine(x: int) -> int:
    """Marked @async_execution and a coroutine: runs on the loop like any coroutine."""
    await asyncio.sleep(0)
    return x * 2


async def leave_a_task_running() -> bool:
    """Start a task that never ends on this worker's loop: shutdown must cancel it."""
    asyncio.ensure_future(asyncio.sleep(3600))
    return True


def loop_thread_of_async_target() -> str:
    """Runs a coroutine target here; the name of the thread it ran on."""
    return rpc.rpc_sync(rpc.get_worker_info().name, _thread_name)


async def _thread_name() -> str:
    return threading.current_thread().name


def pool_threads() -> int:
    """How many worker-pool threads this worker has now."""
    return sum(1 for t in threading.enumerate()
               if t.name.startswith(f"torchrpc-{rpc.get_worker_info().name}-"))


class AsyncCounter:
    """A value with ``async def`` methods, for the RRef proxies."""

    def __init__(self, value: int) -> None:
        self.value = value

    async def add(self, n: int) -> int:
        await asyncio.sleep(0.01)
        self.value += n
        return self.value

    async def fail(self) -> None:
        raise KeyError("no such counter")


PICKLED = [0]  # how many times a Counted was pickled in this process


class Counted:
    """Counts its pickling here; arrives on the other side as the int it holds."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __reduce__(self) -> Any:
        PICKLED[0] += 1
        return int, (self.value,)


def fail_on(names: List[str], x: int) -> int:
    """``x`` times 10, or a ValueError on the workers of ``names``."""
    me = rpc.get_worker_info().name
    if me in names:
        raise ValueError(f"{me} was told to fail")
    return x * 10


def barrier_after(delay: float, workers: Any = None) -> List[float]:
    """Sleep ``delay``, then meet at ``rpc.barrier``; the times of arrival and leaving."""
    time.sleep(delay)
    arrived = time.time()
    rpc.barrier(workers)
    return [arrived, time.time()]


def gather_name(workers: Any = None) -> dict:
    return rpc.all_gather(rpc.get_worker_info().name.upper(), workers)
