"""asyncio and group calls over real worker processes: awaiting futures, ``async def``
targets, ``rpc_async_many``, ``rpc_sync_many``, ``barrier`` and ``all_gather``."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest
import torch

import torchrpc.rpc as rpc
from torchrpc.errors import GroupCallError

from ..support import aio as aio
from ..support import helpers
from ..support.group import running_group

THREADS = 2


@pytest.fixture(scope="module", autouse=True)
def group():
    with running_group(3, threads=THREADS, timeout=30.0) as g:
        yield g
    # Shutdown stopped and joined this worker's event loop thread (it ran coroutines).
    left = [t.name for t in threading.enumerate() if t.name.startswith("torchrpc-asyncio")]
    assert not left, left


class _Errors(logging.Handler):
    """Collects what the ``torchrpc`` logger says at ERROR while installed."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())


def _run(coro):
    """Run ``coro`` in a fresh event loop; also return what the loop reported as unhandled."""
    unhandled: list = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: unhandled.append(ctx))
        return await coro

    return asyncio.run(main()), unhandled


async def _ticking(awaitable, period: float = 0.01):
    """Await ``awaitable`` while another coroutine ticks; the result and the tick count."""
    ticks = [0]
    stop = asyncio.Event()

    async def tick():
        while not stop.is_set():
            ticks[0] += 1
            await asyncio.sleep(period)

    ticker = asyncio.ensure_future(tick())
    try:
        return await awaitable, ticks[0]
    finally:
        stop.set()
        await ticker


# -- awaiting futures --------------------------------------------------------------------------


def test_await_rpc_async_does_not_block_the_loop():
    (value, ticks), unhandled = _run(_ticking(
        rpc.rpc_async("worker1", helpers.sleep_then, args=(0.5, 7))))
    assert value == 7
    assert ticks >= 10, f"the loop ran only {ticks} ticks in 0.5 s: it was blocked"
    assert not unhandled
    # A future already done is awaited at once; many awaited together come back in order.
    async def many():
        done = rpc.rpc_async("worker2", helpers.add, args=(1, 1))
        done.wait()
        first = await done
        rest = await asyncio.gather(*[rpc.rpc_async(f"worker{1 + i % 2}", helpers.add,
                                                    args=(i, i)) for i in range(10)])
        return first, rest
    (first, rest), _ = _run(many())
    assert first == 2 and rest == [2 * i for i in range(10)]


def test_await_errors_and_chained_futures():
    async def main():
        with pytest.raises(ValueError, match="boom-await") as info:
            await rpc.rpc_async("worker1", helpers.raise_value_error, args=("boom-await",))
        chained = rpc.rpc_async("worker2", helpers.add, args=(2, 3)).then(lambda f: f.wait() * 2)
        return str(info.value), await chained
    (text, value), _ = _run(main())
    assert "worker1" in text and value == 10


def test_await_remote_to_here_async_and_proxies():
    async def main():
        rref = rpc.remote("worker1", helpers.sleep_then, args=(0.3, torch.ones(2)))
        value, ticks = await _ticking(rref.to_here_async())
        created = await rref._get_future()
        counter = rpc.remote("worker2", helpers.Counter, args=(10,))
        added = await counter.rpc_async().plus(5)
        local = rpc.RRef(41)
        here = await local.to_here_async()
        return value, ticks, created, added, here, rref.to_here()
    (value, ticks, created, added, here, again), unhandled = _run(main())
    assert torch.equal(value, torch.ones(2)) and torch.equal(again, torch.ones(2))
    assert ticks >= 5 and added == 15 and here == 41
    assert not unhandled
    # Outside a loop, the future blocks as usual.
    assert rpc.remote("worker2", helpers.add, args=(1, 2)).to_here_async(timeout=10).wait() == 3


def test_to_here_async_reports_the_creation_error():
    rref = rpc.remote("worker1", helpers.raise_value_error, args=("no value",))
    with pytest.raises(ValueError, match="no value"):
        rref.to_here_async().wait()

    async def main():
        with pytest.raises(ValueError, match="no value"):
            await rref.to_here_async()
    _run(main())


def test_cancelling_the_awaiting_task_leaves_the_rpc_alone():
    watch = _Errors()
    logging.getLogger("torchrpc").addHandler(watch)
    try:
        fut = rpc.rpc_async("worker1", helpers.sleep_then, args=(0.4, "still done"))

        async def main():
            task = asyncio.ensure_future(_await(fut))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # The loop goes on, and later awaits on the same worker work.
            return await rpc.rpc_async("worker1", helpers.add, args=(1, 2))
        value, unhandled = _run(main())
        assert value == 3 and not unhandled
        assert fut.wait() == "still done"  # the RPC itself completed
        # A cancelled await whose RPC fails afterwards: the error stays in the future.
        failing = rpc.rpc_async("worker1", aio.async_raise, args=("late failure",))

        async def cancel_at_once():
            task = asyncio.ensure_future(_await(failing))
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        _, unhandled = _run(cancel_at_once())
        with pytest.raises(ValueError, match="late failure"):
            failing.wait()
        time.sleep(0.1)  # completions after the loop closed must be dropped quietly
        assert not unhandled
        assert not watch.records, watch.records
    finally:
        logging.getLogger("torchrpc").removeHandler(watch)


async def _await(fut):
    return await fut


# -- async def targets -------------------------------------------------------------------------


def test_async_target_via_rpc_sync_rpc_async_and_remote():
    assert rpc.rpc_sync("worker1", aio.async_add, args=(2, 3)) == 5
    assert rpc.rpc_async("worker2", aio.async_add, args=(torch.ones(2), 1)).wait().tolist() == [2, 2]
    assert rpc.remote("worker1", aio.async_add, args=("a", "b")).to_here() == "ab"
    assert rpc.rpc_sync("worker0", aio.async_add, args=(1, 1)) == 2  # to itself
    assert rpc.remote("worker0", aio.async_add, args=(2, 2)).to_here() == 4
    assert rpc.rpc_sync("worker2", aio.async_execution_coroutine, args=(21,)) == 42
    # A task left running does not keep shutdown from stopping the loop (see the fixture).
    assert rpc.rpc_sync_many(["worker0", "worker1"], aio.leave_a_task_running) == [True, True]
    # Coroutines run on the callee's own loop thread, not on a pool thread.
    assert rpc.rpc_sync("worker1", aio.loop_thread_of_async_target) == "torchrpc-asyncio-worker1"


def test_async_target_holds_no_pool_thread_while_it_awaits():
    n, seconds = 12, 1.0
    before = rpc.rpc_sync("worker2", aio.pool_threads)
    start = time.monotonic()
    futs = [rpc.rpc_async("worker2", aio.async_sleep_then, args=(seconds, i)) for i in range(n)]
    assert torch.futures.wait_all(futs) == list(range(n))
    elapsed = time.monotonic() - start
    # With a pool thread held per call, 12 calls on 2 threads would take 6 s.
    assert elapsed < 3 * seconds, f"{n} awaiting coroutines took {elapsed:.1f} s"
    # Held threads would have made the pool grow (it adds threads while work waits).
    assert rpc.rpc_sync("worker2", aio.pool_threads) <= max(before, THREADS) + 2


def test_async_target_nested_await():
    assert rpc.rpc_sync("worker1", aio.async_nested, args=("worker2", 5)) == 7
    assert rpc.rpc_sync("worker1", aio.async_nested, args=("worker0", 1)) == 3  # back to us
    assert rpc.remote("worker2", aio.async_nested, args=("worker1", 10)).to_here() == 12


def test_async_target_raises_like_a_sync_one():
    with pytest.raises(ValueError) as info:
        rpc.rpc_sync("worker1", aio.async_raise, args=("async-boom",))
    text = str(info.value)
    assert "async-boom" in text and "worker1" in text and "async_raise" in text
    assert "remote traceback" in text
    with pytest.raises(ValueError, match="async-boom"):
        rpc.rpc_async("worker2", aio.async_raise, args=("async-boom",)).wait()
    with pytest.raises(ValueError, match="async-boom"):
        rpc.remote("worker2", aio.async_raise, args=("async-boom",)).to_here()
    assert rpc.rpc_sync("worker1", helpers.add, args=(1, 1)) == 2  # the worker is fine


def test_rref_proxies_with_async_methods():
    counter = rpc.remote("worker1", aio.AsyncCounter, args=(10,))
    assert counter.rpc_sync().add(5) == 15
    assert counter.rpc_async().add(1).wait() == 16
    assert counter.remote().add(1).to_here() == 17

    async def main():
        return await counter.rpc_async().add(3)
    value, _ = _run(main())
    assert value == 20
    with pytest.raises(KeyError, match="no such counter"):
        counter.rpc_sync().fail()


# -- group calls -------------------------------------------------------------------------------


def test_rpc_async_many_in_order_and_awaitable():
    workers = ["worker2", "worker0", 1, rpc.get_worker_info("worker2")]
    fut = rpc.rpc_async_many(workers, helpers.whoami)
    assert isinstance(fut, torch.futures.Future)
    assert fut.wait() == ["worker2", "worker0", "worker1", "worker2"]
    assert rpc.rpc_sync_many(["worker1", "worker2"], helpers.add, args=(torch.ones(2), 1),
                             timeout=10)[1].tolist() == [2, 2]
    assert rpc.rpc_sync_many(["worker1"], helpers.add, kwargs={"a": 1, "b": 2}) == [3]

    async def main():
        return await rpc.rpc_async_many(["worker1", "worker2"], aio.async_add, args=(1, 2))
    value, _ = _run(main())
    assert value == [3, 3]


def test_rpc_async_many_pickles_the_arguments_once():
    aio.PICKLED[0] = 0
    assert rpc.rpc_sync_many(["worker1", "worker2", "worker0"], helpers.add,
                             args=(aio.Counted(5), 1)) == [6, 6, 6]
    assert aio.PICKLED[0] == 1
    aio.PICKLED[0] = 0
    for w in ["worker1", "worker2", "worker0"]:  # one rpc_async each pickles each time
        rpc.rpc_sync(w, helpers.add, args=(aio.Counted(5), 1))
    assert aio.PICKLED[0] == 3
    # Arguments made for one peer (an RRef fork) are pickled per worker, and still work.
    rref = rpc.remote("worker1", helpers.add, args=(20, 1))
    assert rpc.rpc_sync_many(["worker1", "worker2", "worker0"], helpers.rref_to_here,
                             args=(rref,)) == [21, 21, 21]


def test_rpc_async_many_partial_failure_names_every_failed_worker():
    fut = rpc.rpc_async_many(["worker0", "worker1", "worker2"], aio.fail_on,
                             args=(["worker1", "worker2"], 4))
    with pytest.raises(GroupCallError) as info:
        fut.wait()
    err = info.value
    assert isinstance(err, RuntimeError)
    assert "worker1" in str(err) and "worker2" in str(err) and "2 of 3" in str(err)
    assert err.results == [40, None, None]
    assert list(err.errors) == ["worker1", "worker2"] == err.failed_workers  # order of `to`
    assert all(isinstance(e, ValueError) for e in err.errors.values())
    assert "worker1 was told to fail" in str(err.errors["worker1"])
    with pytest.raises(GroupCallError, match="worker2"):
        rpc.rpc_sync_many(["worker1", "worker2"], aio.fail_on, args=(["worker2"], 1))


def test_group_call_bad_arguments():
    with pytest.raises(ValueError, match="empty list") as info:
        rpc.rpc_async_many([], helpers.whoami)
    assert isinstance(info.value, RuntimeError)
    with pytest.raises(ValueError, match="nosuchworker") as info:
        rpc.rpc_async_many(["worker1", "nosuchworker"], helpers.whoami)
    assert isinstance(info.value, RuntimeError)
    with pytest.raises(TypeError, match="callable"):
        rpc.rpc_async_many(["worker1"], 42)
    with pytest.raises(TypeError, match="list of workers") as info:
        rpc.rpc_async_many("worker1", helpers.whoami)
    assert isinstance(info.value, RuntimeError)
    with pytest.raises(TypeError, match="args"):
        rpc.rpc_sync_many(["worker1"], helpers.add, args=5)
    with pytest.raises(ValueError, match="nosuchworker"):
        rpc.barrier(["worker0", "nosuchworker"])
    with pytest.raises(ValueError, match="not one of the workers"):
        rpc.all_gather(1, ["worker1", "worker2"])


def test_barrier_and_all_gather_over_three_workers():
    late = 0.5
    futs = [rpc.rpc_async("worker1", aio.barrier_after, args=(0.0,)),
            rpc.rpc_async("worker2", aio.barrier_after, args=(late,))]
    mine = aio.barrier_after(0.0)
    times = [mine] + [f.wait() for f in futs]
    last_arrival = max(arrived for arrived, _ in times)
    assert all(left >= last_arrival - 0.01 for _, left in times), times
    # A subset meets among itself.
    fut = rpc.rpc_async("worker2", aio.barrier_after, args=(0.0, ["worker0", "worker2"]))
    aio.barrier_after(0.0, ["worker2", "worker0"])
    fut.wait()
    # all_gather: every worker gets every object, keyed by name in rank order.
    futs = [rpc.rpc_async(w, aio.gather_name) for w in ("worker2", "worker1")]
    mine = aio.gather_name()
    expected = {"worker0": "WORKER0", "worker1": "WORKER1", "worker2": "WORKER2"}
    assert mine == expected and list(mine) == list(expected)
    assert all(f.wait() == expected for f in futs)
    fut = rpc.rpc_async("worker1", aio.gather_name, args=([0, 1],))
    assert aio.gather_name(["worker0", "worker1"]) == {"worker0": "WORKER0",
                                                       "worker1": "WORKER1"}
    assert fut.wait() == {"worker0": "WORKER0", "worker1": "WORKER1"}
