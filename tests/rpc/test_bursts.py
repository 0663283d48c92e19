"""Bursts of ``rpc_async`` calls (``torchrpc._agent.bursts``) over real worker processes:
one thread's calls to a worker ride one private connection whose replies that thread
reads; callbacks still run on pool threads, a timeout or a large message disturbs no
other call, and a worker killed in the middle of a burst fails its calls naming it.

One group of three serves the module; worker2 is SIGKILLed by the last test.
"""

from __future__ import annotations

import gc
import signal
import threading
import time
from typing import Any, Callable, List

import pytest
import torch

import torchrpc.rpc as rpc
from torchrpc._agent.current import current_agent
from torchrpc.errors import ConnectionLostError

from ..support import helpers
from ..support.group import serving_group, wait_for

_done = torch._C.Future.done  # without asking the future to be read


@pytest.fixture(scope="module", autouse=True)
def group():
    # Workers serve until told to stop: one of them dies in the last test.
    with serving_group(3, {1: 0, 2: -signal.SIGKILL}, timeout=20.0) as g:
        yield g


def _burst(dst: str) -> Any:
    """This thread's burst to ``dst`` (None if it has none)."""
    bursts = current_agent().lanes.bursts
    rank = rpc.get_worker_info(dst).id
    return getattr(bursts._mine, "by_rank", {}).get(rank)


def test_a_threads_burst_rides_one_connection_and_returns_every_value():
    futs = [rpc.rpc_async("worker1", helpers.add, args=(i, i)) for i in range(3000)]
    burst = _burst("worker1")
    assert burst is not None and not burst.conn.closed
    assert torch.futures.wait_all(futs) == [2 * i for i in range(3000)]
    assert not burst.out  # every reply read
    # The next burst goes out on the same connection; a tensor call works the same.
    again = [rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), i)) for i in range(100)]
    assert _burst("worker1") is burst
    assert all(torch.equal(f.wait(), torch.full((2,), 1.0 + i)) for i, f in enumerate(again))


def test_callbacks_of_a_burst_run_on_pool_threads_never_on_the_callers():
    me = threading.current_thread().name
    adding = threading.local()  # set while this thread adds a callback
    ran_here: List[int] = []  # callbacks run on this thread but not while adding them
    ran: List[int] = []

    def note(i: int) -> Callable[[Any], Any]:
        def callback(fut: Any) -> Any:
            # One added to a future that is done by then runs at once, as torch's do.
            if threading.current_thread().name == me and not getattr(adding, "on", False):
                ran_here.append(i)
            ran.append(i)
            return fut.value() * 10
        return callback

    # This thread reads the replies of its calls as it makes more; every callback added
    # while it calls runs on a pool thread.
    futs, thens = [], []
    for i in range(1000):
        fut = rpc.rpc_async("worker1", helpers.add, args=(i % 500, 1))
        if i % 20 == 0:
            adding.on = True
            fut.add_done_callback(note(i))
            thens.append((i, fut.then(note(-i - 1))))
            adding.on = False
        futs.append(fut)
    assert [f.wait() for f in futs] == [i + 1 for i in range(500)] * 2
    assert all(then.wait() == (i % 500 + 1) * 10 for i, then in thens)
    wait_for("every callback ran", lambda: len(ran) == 100, 10, state=lambda: len(ran))
    assert ran_here == []


def test_callbacks_of_one_future_run_in_the_order_they_were_added():
    # As torch's: callbacks added before the future completes run in that order, so the
    # first one's sleep holds the others back, then() included, even though a reader
    # thread completes the future and hands the callbacks to the pool. (One added after
    # it completed runs at once, in torch as here: the callee's sleep keeps the reply
    # from coming before the three are added.)
    for _ in range(10):
        order: List[str] = []
        fut = rpc.rpc_async("worker1", helpers.sleep_then, args=(0.2, 2))
        fut.add_done_callback(lambda f: (time.sleep(0.01), order.append("first")))
        fut.add_done_callback(lambda f: order.append("second"))
        then = fut.then(lambda f: list(order))
        assert then.wait() == ["first", "second"]
        assert fut.wait() == 2


def test_a_future_of_a_burst_waited_on_another_thread_and_polled_with_done():
    futs = [rpc.rpc_async("worker1", helpers.add, args=(i, 2)) for i in range(300)]
    got: List[Any] = []
    other = threading.Thread(target=lambda: got.append(futs[150].wait()))
    other.start()
    other.join(10)
    assert got == [152]
    last = futs[-1]
    deadline = time.monotonic() + 10
    while not last.done():  # done() has the pool read the burst
        assert time.monotonic() < deadline, "done() never became true"
        time.sleep(0.001)
    assert last.wait() == 301
    assert torch.futures.wait_all(futs) == [i + 2 for i in range(300)]


def test_replies_nobody_waits_for_are_read_within_a_few_ticks():
    futs = [rpc.rpc_async("worker1", helpers.add, args=(i, 3)) for i in range(200)]
    wait_for("the pool read the replies", lambda: all(_done(f) for f in futs), 5)
    assert [f.value() for f in futs] == [i + 3 for i in range(200)]


def test_one_call_of_a_burst_timing_out_leaves_the_others_alone():
    before = [rpc.rpc_async("worker1", helpers.add, args=(i, 0)) for i in range(50)]
    slow = rpc.rpc_async("worker1", helpers.sleep_then, args=(3.0, "late"), timeout=0.5)
    start = time.monotonic()
    after = [rpc.rpc_async("worker1", helpers.add, args=(i, 0)) for i in range(50)]
    # The callee hands on the reading role from the sleeping call, as on a shared
    # connection: the calls behind it do not wait for it.
    assert torch.futures.wait_all(after) == list(range(50))
    assert time.monotonic() - start < 2.0
    with pytest.raises(RuntimeError, match="timed out|Timeout"):
        slow.wait()
    assert torch.futures.wait_all(before) == list(range(50))
    burst = _burst("worker1")
    assert burst is not None and not burst.conn.closed  # the timeout closed nothing
    assert rpc.rpc_async("worker1", helpers.add, args=(1, 1)).wait() == 2
    time.sleep(3.0)  # the late reply arrives, and is dropped
    assert rpc.rpc_async("worker1", helpers.add, args=(2, 2)).wait() == 4


def test_large_arguments_and_replies_in_a_burst_neither_block_nor_mix_up():
    big = torch.arange(64 * 1024, dtype=torch.float32)  # 256 KiB: over the shared connection
    futs = []
    for i in range(40):
        futs.append(rpc.rpc_async("worker1", torch.full, args=((256 * 1024,), float(i))))
        futs.append(rpc.rpc_async("worker1", torch.add, args=(big, i)))
        futs.append(rpc.rpc_async("worker1", helpers.add, args=(i, i)))
    values = torch.futures.wait_all(futs)
    for i in range(40):
        assert torch.equal(values[3 * i], torch.full((256 * 1024,), float(i)))
        assert torch.equal(values[3 * i + 1], big + i)
        assert values[3 * i + 2] == 2 * i


def test_wait_all_on_a_burst_ends_at_its_first_error():
    slow = rpc.rpc_async("worker1", helpers.sleep_then, args=(4.0, "late"))
    start = time.monotonic()
    futs = [slow] + [rpc.rpc_async("worker1", helpers.add, args=(i, 0)) for i in range(20)]
    futs.append(rpc.rpc_async("worker1", helpers.raise_value_error, args=("burst error",)))
    with pytest.raises(ValueError, match="burst error"):
        torch.futures.wait_all(futs)
    assert time.monotonic() - start < 3.0
    assert slow.wait() == "late"


def test_an_outstanding_call_of_a_burst_keeps_one_object_for_the_cycle_collector():
    # A full collection visits every tracked object: 20,000 outstanding calls that kept
    # four objects each (the future, its attribute dict, its claim, and the arguments
    # the request names in its errors) made one, tens of milliseconds long, happen in
    # every burst of the caller. Now the future and the arguments are left.
    assert torch.futures.wait_all([rpc.rpc_async("worker1", helpers.add, args=(i, 1))
                                   for i in range(100)]) == list(range(1, 101))
    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects())
        futs = [rpc.rpc_async("worker1", helpers.add, args=(i, i)) for i in range(2000)]
        grown = len(gc.get_objects()) - before
    finally:
        gc.enable()
    assert torch.futures.wait_all(futs) == [2 * i for i in range(2000)]
    assert grown < 2.5 * len(futs), f"{grown / len(futs):.2f} objects per call"


def test_a_worker_killed_in_the_middle_of_a_burst_fails_its_calls_naming_it(group):
    # A blocking call leaves a private connection idle, which the calls below make a
    # burst of (without one, they go shared until the pool has opened one).
    assert rpc.rpc_sync("worker2", helpers.add, args=(0, 0)) == 0
    futs = [rpc.rpc_async("worker2", helpers.sleep_then, args=(0.01, i)) for i in range(400)]
    assert _burst("worker2") is not None
    wait_for("some replies", lambda: any(_done(f) for f in futs), 10)
    group.kill(2)
    killed = time.monotonic()
    outcomes = []
    for fut in futs:
        try:
            outcomes.append(fut.wait())
        except ConnectionLostError as exc:
            assert "worker2" in str(exc), exc
            outcomes.append(None)
    took = time.monotonic() - killed
    assert took < 5.0, took
    # Those answered before the kill (the callee serves them on several threads, not
    # in order) hold their own values.
    assert all(v in (i, None) for i, v in enumerate(outcomes)), outcomes
    assert any(v is not None for v in outcomes)
    assert None in outcomes
    with pytest.raises(ConnectionLostError, match="worker2"):
        rpc.rpc_async("worker2", helpers.add, args=(1, 1)).wait()
    assert rpc.rpc_async("worker1", helpers.add, args=(1, 1)).wait() == 2
