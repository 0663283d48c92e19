"""Graceful shutdown runs torch's steps by name (programs replace them), reports leaked
RRefs when asked to, and a worker whose step fails stops without hanging the others."""

from __future__ import annotations

import time

import pytest
import torch

import torchrpc.rpc as rpc
import torchrpc.rpc.api as api
from torchrpc._agent.current import current_agent
from torchrpc.errors import ShutdownError
from tests.support import helpers
from tests.support.group import Group, free_port, wait_for


def test_rref_leak_is_reported_when_asked_and_the_group_still_stops():
    group = Group(2, threads=2, timeout=30.0)
    try:
        group.init_self()
        rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
        assert torch.equal(rref.to_here(), torch.full((2,), 2.0))
        original = api._delete_all_user_and_unforked_owner_rrefs
        api._ignore_rref_leak = False
        api._delete_all_user_and_unforked_owner_rrefs = lambda *a, **k: None
        try:
            with pytest.raises(RuntimeError, match=r"Leaking RRef GloballyUniqueId\(created_on=0"):
                rpc.shutdown(graceful=True)
        finally:
            api._delete_all_user_and_unforked_owner_rrefs = original
            api._ignore_rref_leak = True
        assert not rpc.api._is_current_rpc_agent_set()
    finally:
        codes = group.abandon(30)
    assert codes == {1: 0}, codes  # worker1's graceful shutdown completed


def test_no_leak_reported_when_rrefs_were_released():
    group = Group(2, threads=2, timeout=30.0)
    try:
        group.init_self()
        rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
        rref.to_here()
        api._ignore_rref_leak = False
        try:
            rpc.shutdown(graceful=True)  # the release step deletes the user RRef: no leak
        finally:
            api._ignore_rref_leak = True
    finally:
        codes = group.abandon(30)
    assert codes == {1: 0}, codes


def test_a_failing_step_stops_this_worker_and_the_others_are_told():
    group = Group(2, threads=2, timeout=30.0)
    try:
        group.init_self()
        assert rpc.rpc_sync("worker1", helpers.whoami) == "worker1"

        def fail(*args, **kwargs):
            raise ValueError("release step failed")
        original = api._delete_all_user_and_unforked_owner_rrefs
        api._delete_all_user_and_unforked_owner_rrefs = fail
        try:
            with pytest.raises(ValueError, match="release step failed"):
                rpc.shutdown(graceful=True)
        finally:
            api._delete_all_user_and_unforked_owner_rrefs = original
        assert not rpc.api._is_current_rpc_agent_set()
        start = time.monotonic()
        codes = group.wait(30)
        # worker1 waited for worker0 at the next barrier: it learns that worker0 stopped.
        assert codes == {1: 1}, codes
        assert time.monotonic() - start < 15
    finally:
        group.abandon(30)


def test_a_shutdown_that_waits_for_requests_says_which_and_its_deadline_names_them(
        monkeypatch, caplog):
    from torchrpc._agent import shutdown as protocol
    monkeypatch.setattr(protocol, "REPORT_WAIT", 0.3)
    group = Group(2, threads=2, timeout=30.0)
    try:
        group.init_self()
        fut = rpc.rpc_async("worker1", helpers.sleep_then, args=(3.0, 7), timeout=20)
        with caplog.at_level("WARNING", logger="torchrpc"):
            with pytest.raises(ShutdownError,
                               match=r"1 RPCs still outstanding at shutdown: "
                                     r"tests\.support\.helpers\.sleep_then to worker1 "
                                     r"\(sent 1\.\d s ago, timeout 20 s\)"):
                rpc.shutdown(graceful=True, timeout=1.5)
        said = [r.getMessage() for r in caplog.records
                if "waits for 1 outstanding" in r.getMessage()]
        assert said and "tests.support.helpers.sleep_then to worker1 (sent 0." in said[0], said
        assert fut.done() and not rpc.api._is_current_rpc_agent_set()
    finally:
        group.abandon(30)


def _at_first_barrier(rank: int) -> bool:
    """Whether worker ``rank`` has reached graceful shutdown's first store barrier."""
    return current_agent().store.check([f"shutdown/1/{rank}"])


def test_all_gather_names_a_worker_that_died_after_sending():
    # worker2 is killed at shutdown's first barrier: the others name it instead of
    # hanging, whether it was counted there (then the leader of the gather that follows
    # misses its part) or not, and worker1's shutdown fails too.
    group = Group(3, threads=2, timeout=30.0)
    try:
        group.init_self()
        assert rpc.rpc_sync("worker2", helpers.whoami) == "worker2"
        wait_for("worker2 waits in shutdown's first step", lambda: _at_first_barrier(2), 10)
        group.kill(2)
        start = time.monotonic()
        with pytest.raises(ShutdownError, match="worker2"):
            rpc.shutdown(graceful=True)
        assert time.monotonic() - start < 10
    finally:
        codes = group.abandon(30)
    assert codes[1] == 1, codes


def test_a_worker_at_the_barrier_learns_of_a_death_it_cannot_see_itself():
    # worker2 marks its arrival at the first barrier and dies before it is counted:
    # worker1, which never talked to it, must not wait for it. worker0 finds it lost
    # and says so through the store; worker1 names it too, and stops.
    group = Group(3, threads=2, timeout=30.0, extra_env={"TORCHRPC_TEST_SERVE_RANKS": "2"})
    try:
        group.init_self()
        assert rpc.rpc_sync("worker2", helpers.whoami) == "worker2"
        wait_for("worker1 waits in shutdown's first step", lambda: _at_first_barrier(1), 10)
        current_agent().store.put("shutdown/1/2", {"rank": 2})  # arrived, not counted
        group.kill(2)
        with pytest.raises(ShutdownError, match="worker2"):
            rpc.shutdown(graceful=True)
    finally:
        codes = group.abandon(20)
    assert codes == {1: 1, 2: -9}, codes


def _file_options(tmp_path, **kwargs):
    return rpc.TensorPipeRpcBackendOptions(init_method=f"file://{tmp_path}/store",
                                           num_worker_threads=2, **kwargs)


def test_a_registered_backend_wrapping_torchrpc_serves_calls(tmp_path):
    calls = []

    def construct(rpc_timeout, init_method, **kwargs):
        return rpc.TensorPipeRpcBackendOptions(rpc_timeout=rpc_timeout, init_method=init_method)

    def init(store, name, rank, world_size, options):
        calls.append((name, rank, world_size))
        return rpc.backend_registry.init_backend(rpc.BackendType.TENSORPIPE, store, name, rank,
                                                 world_size, options)

    backend = rpc.register_backend("WRAPPED_FOR_TEST", construct, init)
    rpc.init_rpc("solo", backend=backend, rank=0, world_size=1,
                 rpc_backend_options=_file_options(tmp_path))
    try:
        assert rpc.rpc_sync("solo", torch.add, args=(torch.ones(2), 1)).tolist() == [2.0, 2.0]
    finally:
        rpc.shutdown()
    assert calls == [("solo", 0, 1)]


def test_a_third_party_agent_is_started_and_shut_down(tmp_path):
    events = []

    class ForeignAgent:
        def start(self):
            events.append("start")

        def shutdown(self):
            events.append("shutdown")

    backend = rpc.register_backend(
        "FOREIGN_FOR_TEST", lambda rpc_timeout, init_method, **kw: _file_options(tmp_path),
        lambda store, name, rank, world_size, options: ForeignAgent())
    rpc.init_rpc("solo", backend=backend, rank=0, world_size=1,
                 rpc_backend_options=_file_options(tmp_path))
    assert isinstance(rpc._get_current_rpc_agent(), ForeignAgent)
    rpc.shutdown()
    assert events == ["start", "shutdown"]
    assert not rpc.api._is_current_rpc_agent_set()


def test_debug_info_is_the_union_of_torchs_three(tmp_path):
    import torchrpc.autograd as dist_autograd
    rpc.init_rpc("solo", rank=0, world_size=1, rpc_backend_options=_file_options(tmp_path))
    try:
        parts = [rpc._rref_context_get_debug_info(),
                 rpc._get_current_rpc_agent().get_debug_info(), dist_autograd._get_debug_info()]
        assert not (parts[0].keys() & parts[1].keys() & parts[2].keys())
        assert rpc._get_debug_info().keys() == {k for p in parts for k in p}
        assert "num_owner_rrefs" in rpc._get_debug_info()
    finally:
        rpc.shutdown()


def _late_or_short_shutdown(rank: int, port: int, out: "object") -> None:
    import os as _os
    _os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2)
    if rank == 0:
        time.sleep(3.0)  # arrives long after worker 1's shutdown deadline
    try:
        rpc.shutdown(graceful=True, timeout=10.0 if rank == 0 else 0.5)
    except RuntimeError as exc:
        out.put((rank, type(exc).__name__, str(exc)))
    else:
        out.put((rank, None, ""))


def test_a_follower_that_cannot_meet_the_group_in_time_raises():
    # Only the last barrier is one that ranks other than 0 do not wait at; a timeout at
    # an earlier one means the group never met, and shutdown says so, as torch's does.
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_late_or_short_shutdown, args=(r, port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        results = dict((rank, (kind, text)) for rank, kind, text in
                       (out.get(timeout=60) for _ in procs))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    kind, text = results[1]
    assert kind == "ShutdownError" and "timed out at the shutdown barrier" in text, results
    # Worker 0, arriving late, learns that worker 1 left without it.
    assert results[0][0] == "WorkerLeftError" and "w1" in results[0][1], results
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
