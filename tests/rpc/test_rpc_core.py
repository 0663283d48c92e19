"""Core RPC over real worker processes: calls, futures, errors, timeouts, concurrency."""

from __future__ import annotations

import io
import logging
import pickle
import socket
import sys
import threading
import time

import pytest
import torch

import torchrpc.rpc as rpc
from torchrpc._transport import handshake
from torchrpc.errors import RpcTimeoutError, SerializationError
from torchrpc.rpc import api

from ..support import helpers

THREADS = 4


pytestmark = pytest.mark.group(3, threads=THREADS, timeout=30.0)


def test_rpc_sync_builtins_and_targets():
    assert torch.equal(rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 3)), torch.full((2,), 4.0))
    assert rpc.rpc_sync(1, min, args=(1, 2)) == 1
    info = rpc.get_worker_info("worker2")
    assert rpc.rpc_sync(info, helpers.whoami) == "worker2"
    assert rpc.rpc_sync("worker1", helpers.add, kwargs={"a": 2, "b": 5}) == 7
    assert rpc.rpc_sync("worker1", helpers.add, args=[1, 1]) == 2  # a list is accepted


def test_call_to_self():
    assert rpc.rpc_sync("worker0", helpers.whoami) == "worker0"
    assert rpc.rpc_async(0, helpers.add, args=(2, 3)).wait() == 5


def test_callable_kinds():
    assert rpc.rpc_sync("worker1", helpers.Counter.static_mul, args=(6, 7)) == 42
    assert rpc.rpc_sync("worker1", helpers.Counter.cls_name, args=("!",)) == "Counter!"
    assert rpc.rpc_sync("worker2", helpers.Counter(10).plus, args=(5,)) == 15
    out = rpc.rpc_sync("worker1", helpers.script_add, args=(torch.ones(2), 3))
    assert torch.equal(out, torch.full((2,), 4.0))


def test_futures_api():
    fut = rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 3))
    assert isinstance(fut, torch.futures.Future)
    chained = fut.then(lambda f: f.wait() * 2)
    assert torch.equal(chained.wait(), torch.full((2,), 8.0))
    seen = []
    done = threading.Event()
    fut2 = rpc.rpc_async("worker2", helpers.add, args=(1, 2))
    fut2.add_done_callback(lambda f: (seen.append(f.value()), done.set()))
    assert done.wait(10) and seen == [3]
    futs = [rpc.rpc_async(f"worker{i % 3}", helpers.add, args=(i, i)) for i in range(30)]
    assert torch.futures.wait_all(futs) == [2 * i for i in range(30)]
    collected = torch.futures.collect_all(futs).wait()
    assert [f.value() for f in collected] == [2 * i for i in range(30)]


def test_wait_all_and_collect_all_end_at_the_first_error():
    # As torch's for its RPC futures: no waiting for the slow call once another failed.
    slow = rpc.rpc_async("worker1", helpers.sleep_then, args=(6.0, "late"))
    plain = torch.futures.Future()  # torch's own futures may be in the list too
    plain.set_result(0)
    start = time.monotonic()
    with pytest.raises(ValueError, match="first to fail"):
        torch.futures.wait_all([slow, rpc.rpc_async("worker2", helpers.raise_value_error,
                                                    args=("first to fail",)), plain])
    combined = torch.futures.collect_all(
        [slow, rpc.rpc_async("worker2", torch.add, args=(torch.ones(2), "x"))])
    with pytest.raises(RuntimeError):
        combined.wait()
    assert time.monotonic() - start < 4.0
    assert slow.wait() == "late"  # the slow call itself goes on to its result


def test_a_torchscript_error_arrives_as_a_runtime_error():
    # torch's RPC runs TorchScript in C++, whose errors reach the caller as RuntimeError.
    with pytest.raises(RuntimeError, match="script says no") as info:
        rpc.rpc_sync("worker1", helpers.script_raise, args=("script says no",))
    assert isinstance(info.value, torch.jit.Error)


def test_returning_a_future_without_async_execution_fails_at_the_caller():
    with pytest.raises(RuntimeError, match="Can not pickle torch.futures.Future"):
        rpc.rpc_sync("worker1", helpers.return_future, timeout=20)
    assert rpc.rpc_sync("worker1", helpers.add, args=(1, 1)) == 2


def test_a_user_error_is_written_to_the_callee_stderr(monkeypatch):
    # As torch's agent does, where logging is not configured (pytest's own handlers set aside).
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(logging.root, "handlers", [])
    with pytest.raises(ValueError, match="reported on the callee"):
        rpc.rpc_sync("worker1", helpers.call_raise_on, args=("worker0", "reported on the callee"))
    assert "reported on the callee" in err.getvalue()
    handler = logging.StreamHandler(io.StringIO())  # configured logging: that handler only
    monkeypatch.setattr(logging.root, "handlers", [handler])
    err.truncate(0)
    with pytest.raises(ValueError):
        rpc.rpc_sync("worker1", helpers.call_raise_on, args=("worker0", "once, in the log"))
    assert "once, in the log" in handler.stream.getvalue() and not err.getvalue()


def test_callback_may_block_on_rpc():
    # A then() callback that makes a blocking RPC must not stall the reader thread.
    fut = rpc.rpc_async("worker1", helpers.add, args=(1, 1)).then(
        lambda f: rpc.rpc_sync("worker1", helpers.add, args=(f.wait(), 1)))
    assert fut.wait() == 3


def test_remote_exception_type_and_traceback():
    with pytest.raises(ValueError) as info:
        rpc.rpc_sync("worker1", helpers.raise_value_error, args=("boom-123",))
    text = str(info.value)
    assert "boom-123" in text and "worker1" in text and "raise_value_error" in text
    with pytest.raises(helpers.OddError) as odd:
        rpc.rpc_sync("worker2", helpers.raise_odd, args=(7,))
    assert odd.value.code == 7
    fut = rpc.rpc_async("worker1", helpers.raise_value_error, args=("async",))
    with pytest.raises(ValueError, match="async"):
        fut.wait()


def test_unpicklable_return_value_reports_error():
    with pytest.raises(SerializationError, match="cannot pickle"):
        rpc.rpc_sync("worker1", helpers.return_unpicklable)


def test_timeout_names_callee_function_and_limit():
    start = time.monotonic()
    with pytest.raises(RpcTimeoutError) as info:
        rpc.rpc_sync("worker1", helpers.sleep_then, args=(3.0,), timeout=0.4)
    elapsed = time.monotonic() - start
    text = str(info.value)
    assert "timed out" in text and "worker1" in text and "sleep_then" in text and "0.4" in text
    assert 0.35 < elapsed < 1.5
    assert isinstance(info.value, RuntimeError)
    fut = rpc.rpc_async("worker2", helpers.sleep_then, args=(3.0,), timeout=0.2)
    with pytest.raises(RuntimeError, match="timed out"):
        fut.wait()


def test_a_reply_after_the_deadline_fails_even_when_the_timer_is_late():
    # The timer thread is held up for a second (as on a starved machine); the reply comes
    # at 0.3 s, after the call's 0.1 s deadline but before the timer could expire it.
    agent = api.current_agent()
    held = threading.Event()

    def hold_timer() -> None:
        if not held.is_set():
            held.set()
            time.sleep(1.0)
    agent.add_tick_hook(hold_timer)
    try:
        assert held.wait(5.0)
        for call in (rpc.rpc_sync, lambda *a, **k: rpc.rpc_async(*a, **k).wait()):
            with pytest.raises(RpcTimeoutError, match="ran for more than set timeout"):
                call("worker1", helpers.sleep_then, args=(0.3, 1), timeout=0.1)
            held.clear()
            assert held.wait(5.0)
    finally:
        agent.scheduler._hooks.remove(hold_timer)
    assert rpc.rpc_sync("worker1", helpers.sleep_then, args=(0.0, 2), timeout=5) == 2


def test_zero_timeout_means_none_and_default_timeout():
    assert rpc.rpc_sync("worker1", helpers.sleep_then, args=(0.3, "ok"), timeout=0) == "ok"
    assert rpc.get_rpc_timeout() == 30.0
    api._set_rpc_timeout(0.25)
    try:
        with pytest.raises(RuntimeError, match="timed out"):
            rpc.rpc_sync("worker1", helpers.sleep_then, args=(2.0,))
    finally:
        api._set_rpc_timeout(30.0)
    assert rpc.get_rpc_timeout() == 30.0


def test_many_caller_threads():
    results = {}

    def caller(i: int) -> None:
        for j in range(20):
            results[(i, j)] = rpc.rpc_sync(f"worker{1 + (i + j) % 2}", helpers.add, args=(i, j))

    assert not helpers.run_in_threads(caller, [(i,) for i in range(16)])
    assert all(results[(i, j)] == i + j for i in range(16) for j in range(20))


def test_nested_calls_beyond_pool_size_do_not_deadlock():
    # Each call to worker1 blocks a pool thread on an RPC back to worker0, which itself
    # blocks on worker2: 3x more concurrent nested calls than threads in any pool.
    futs = [rpc.rpc_async("worker1", helpers.nested_call, args=("worker0", 3), timeout=20)
            for _ in range(3 * THREADS)]
    for f in futs:
        assert f.wait() == "worker1>worker0>worker1>worker0"
    futs = [rpc.rpc_async("worker1", helpers.nested_sleep, args=("worker2", 0.3), timeout=20)
            for _ in range(3 * THREADS)]
    start = time.monotonic()
    assert torch.futures.wait_all(futs) == [0.3] * (3 * THREADS)
    assert time.monotonic() - start < 5


def test_async_execution_chain_three_workers():
    ret = rpc.rpc_sync("worker1", helpers.async_add_chained, args=("worker2", torch.ones(2), 1, 1))
    assert torch.equal(ret, torch.full((2,), 3.0))
    ret = rpc.rpc_sync("worker1", helpers.AsyncExecutionClass.static_async_add,
                       args=("worker2", torch.ones(2), 1, 2))
    assert torch.equal(ret, torch.full((2,), 4.0))
    ret = rpc.rpc_sync("worker1", helpers.AsyncExecutionClass.class_async_add,
                       args=("worker2", torch.ones(2), 1, 2))
    assert torch.equal(ret, torch.full((2,), 4.0))
    ret = rpc.rpc_sync("worker1", helpers.AsyncExecutionClass().bound_async_add,
                       args=("worker2", torch.ones(2), 1, 2))
    assert torch.equal(ret, torch.full((2,), 4.0))
    fut = rpc.rpc_async("worker1", helpers.async_add_chained, args=("worker0", torch.ones(2), 2, 3))
    assert torch.equal(fut.then(lambda f: f.wait() + 1).wait(), torch.full((2,), 7.0))
    assert rpc.rpc_sync("worker2", helpers.async_delayed, args=("late", 0.2)) == "late"


def test_async_execution_errors():
    with pytest.raises(ValueError, match="async boom"):
        rpc.rpc_sync("worker1", helpers.async_fails, args=("worker2",))
    with pytest.raises(TypeError, match="must return a torch.futures.Future"):
        rpc.rpc_sync("worker1", helpers.async_not_a_future)


def test_worker_infos():
    me = rpc.get_worker_info()
    assert me.name == "worker0" and me.id == 0
    infos = rpc.get_worker_infos()
    assert [(w.name, w.id) for w in infos] == [("worker0", 0), ("worker1", 1), ("worker2", 2)]
    w1 = rpc.get_worker_info("worker1")
    assert w1 == infos[1] and hash(w1) == hash(infos[1]) and w1 != infos[2]
    assert len({w1, infos[1], infos[2]}) == 2
    assert pickle.loads(pickle.dumps(w1)) == w1
    assert rpc.rpc_sync("worker1", helpers.echo, args=(w1,)) == w1
    assert repr(w1) == "WorkerInfo(id=1, name=worker1)"


def test_bad_arguments():
    with pytest.raises(ValueError, match="nope"):
        rpc.rpc_sync("nope", helpers.add, args=(1, 2))
    with pytest.raises(ValueError, match="17"):
        rpc.rpc_async(17, helpers.add, args=(1, 2))
    with pytest.raises(ValueError, match="name:ghost could not find destination") as info:
        rpc.get_worker_info("ghost")
    assert isinstance(info.value, RuntimeError)  # torch's type too
    with pytest.raises(ValueError, match="Cannot get WorkerInfo"):
        rpc.rpc_sync(1.5, helpers.add, args=(1, 2))
    with pytest.raises(TypeError, match="callable"):
        rpc.rpc_sync("worker1", 42)
    with pytest.raises(TypeError, match="args must be a tuple"):
        rpc.rpc_sync("worker1", helpers.add, args=5)
    with pytest.raises(ValueError, match="timeout"):
        rpc.rpc_sync("worker1", helpers.add, args=(1, 2), timeout=-3)


def test_unpicklable_arguments_fail_before_sending():
    before = rpc.get_debug_info()["agent.num_pending_requests"]
    with pytest.raises(SerializationError, match="cannot pickle"):
        rpc.rpc_async("worker1", helpers.echo, args=(threading.Lock(),))
    with pytest.raises(SerializationError):
        rpc.rpc_async("worker1", lambda: 1)
    assert rpc.get_debug_info()["agent.num_pending_requests"] == before


def _worker_address(rank: int):
    return api.current_agent().registry.addresses[rank]


def test_garbage_connection_is_dropped_and_worker_keeps_serving():
    host, port = _worker_address(1)
    for payload in (b"GET / HTTP/1.1\r\n\r\n" * 10, b"\x00" * 4096, bytes(range(256)) * 64):
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(payload)
            s.settimeout(5)
            try:
                while s.recv(4096):
                    pass
            except OSError:
                pass
    # A well-formed HELLO followed by a wrong proof is refused too.
    with socket.create_connection((host, port), timeout=5) as s:
        hello, _ = handshake.make_hello(0, 0)
        s.sendall(hello)
        s.recv(handshake.CHALLENGE.size)
        s.sendall(b"\x00" * handshake.PROOF.size)
        s.settimeout(5)
        assert s.recv(1) == b""
    # A silent client does not block others.
    idle = socket.create_connection((host, port), timeout=5)
    try:
        assert rpc.rpc_sync("worker1", helpers.add, args=(20, 22)) == 42
        assert rpc.rpc_sync("worker2", helpers.nested_call, args=("worker1", 1)) == "worker2>worker1"
    finally:
        idle.close()


def test_tensors_round_trip():
    x = torch.arange(12.0).reshape(3, 4)
    out = rpc.rpc_sync("worker1", helpers.echo, args=({"x": x, "t": x.t(), "v": x[1]},))
    assert torch.equal(out["x"], x) and torch.equal(out["t"], x.t()) and torch.equal(out["v"], x[1])
    big = torch.randn(1 << 20)
    assert torch.equal(rpc.rpc_sync("worker2", helpers.echo, args=(big,)), big)


def test_debug_info_counters():
    info = rpc.get_debug_info()
    assert info["agent.num_pending_requests"] == 0
    assert info["agent.thread_pool_size"] >= 1
    remote = rpc.rpc_sync("worker1", helpers.debug_info)
    assert remote["agent.state"] == "running"


def test_a_slow_request_does_not_hold_up_the_next_on_a_shared_connection():
    # rpc_async goes over the shared connection; the first request sleeps on the thread
    # that read it, so the timer must hand the connection's reading role on (it ticks
    # every 100 ms when idle and is woken for this).
    for _ in range(2):  # the second time the timer has been idle a while
        time.sleep(0.3)
        slow = rpc.rpc_async("worker2", helpers.sleep_then, args=(1.5, "slow"))
        time.sleep(0.05)
        start = time.monotonic()
        assert rpc.rpc_async("worker2", helpers.add, args=(1, 2)).wait() == 3
        assert time.monotonic() - start < 0.6  # not behind the 1.5 s sleep
        assert slow.wait() == "slow"


def test_blocking_calls_read_their_reply_on_private_connections():
    agent = api.current_agent()
    assert rpc.rpc_sync("worker1", helpers.add, args=(2, 3)) == 5
    idle = agent.lanes.private.idle_to(1)
    assert idle and all(c.private and not c.closed for c in idle)
    # Same host: a Unix socket, polled a moment before blocking; not in the registry
    # that heartbeats and liveness go by, on either side.
    assert idle[0].sock.family == socket.AF_UNIX and idle[0].spin
    assert helpers.connection_census()["registered_private"] == 0
    callee = rpc.rpc_sync("worker1", helpers.connection_census)
    assert callee["private"] >= 1 and callee["registered_private"] == 0
    # A call that times out closes its private connection (waking its caller at once);
    # the next call gets a fresh one and the late reply never reaches anybody.
    used = idle[-1]
    start = time.monotonic()
    with pytest.raises(RpcTimeoutError, match="timed out"):
        rpc.rpc_sync("worker1", helpers.sleep_then, args=(1.0, "late"), timeout=0.2)
    assert time.monotonic() - start < 0.9
    assert used.closed and used not in agent.lanes.private.idle_to(1)
    assert rpc.rpc_sync("worker1", helpers.add, args=(1, 1)) == 2
    time.sleep(1.0)
    assert rpc.rpc_sync("worker1", helpers.echo, args=("after",)) == "after"
    # A remote error comes back on the private connection, which stays usable.
    with pytest.raises(ValueError, match="bad"):
        rpc.rpc_sync("worker1", helpers.raise_value_error, args=("bad",))
    assert rpc.rpc_sync("worker1", helpers.add, args=(4, 4)) == 8
    assert api.get_debug_info()["agent.num_private_connections"] >= 1
    assert api.get_debug_info()["agent.num_pending_requests"] == 0


def test_a_new_private_connection_is_read_and_served_by_one_pool_thread():
    # A call while another is running from this process goes out on a new private
    # connection, which the callee's transport thread reads first. Once it has moved the
    # request and the reading role into the pool, each request is served on the thread
    # that read it, with no wake-up of another thread: at once, when a pool thread is
    # idle then; else from the next request on.
    slow = threading.Thread(target=rpc.rpc_sync, args=("worker2", helpers.sleep_then, (1.0,)))
    slow.start()
    time.sleep(0.2)
    try:
        inline = [rpc.rpc_sync("worker2", helpers.served_by_reader) for _ in range(30)]
    finally:
        slow.join()
    assert sum(inline) >= 28, inline

