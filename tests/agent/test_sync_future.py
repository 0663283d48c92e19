"""SyncFuture: the future of a call whose caller waits at once (rpc_sync, request_sync)."""

import threading
import time

import pytest

from torchrpc._agent.futures import SyncFuture
from torchrpc.errors import RpcTimeoutError


def test_a_value_is_returned_to_every_wait():
    fut = SyncFuture()
    assert not fut.done()
    fut.set_result([1, 2])
    assert fut.done()
    assert fut.wait() == [1, 2] and fut.wait() == [1, 2]


def test_an_error_is_raised_as_a_fresh_copy_each_time():
    fut = SyncFuture()
    error = RpcTimeoutError("RPC ran for more than set timeout (5 ms)")
    fut.set_exception(error)
    raised = []
    for _ in range(2):
        with pytest.raises(RpcTimeoutError, match="set timeout") as info:
            fut.wait()
        raised.append(info.value)
    assert raised[0] is not error and raised[1] is not raised[0]
    assert error.__traceback__ is None  # the stored error never holds the waiter's frames


def test_a_waiter_blocks_until_another_thread_settles_it():
    fut = SyncFuture()
    got = []
    waiter = threading.Thread(target=lambda: got.append(fut.wait()))
    waiter.start()
    time.sleep(0.05)
    assert waiter.is_alive() and not got
    fut.set_result("late")
    waiter.join(5)
    assert got == ["late"]


def test_callbacks_run_before_the_waiter_wakes_and_a_failing_one_still_settles():
    fut = SyncFuture()
    order = []
    fut.add_done_callback(lambda f: order.append(("callback", f.done())))

    def broken(_f):
        raise ValueError("a broken callback")

    fut.add_done_callback(broken)
    with pytest.raises(ValueError, match="broken"):
        fut.set_result(7)
    assert order == [("callback", False)]
    assert fut.done() and fut.wait() == 7


def test_settling_twice_raises():
    fut = SyncFuture()
    fut.set_result(1)
    with pytest.raises(RuntimeError):
        fut.set_exception(ValueError("again"))
