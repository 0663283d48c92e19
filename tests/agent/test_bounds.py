"""Every queue and table has a bound: outstanding requests, private connections per peer
(dialed and accepted), requests waiting for the pool, bytes waiting in a connection's
outbox (back-pressure), and sends have a deadline.

Rank 0 runs with small bounds; the others with the defaults. worker2 is stopped (SIGSTOP)
to play a peer that does not read, and continued afterwards.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from typing import List

import pytest
import torch

import torchrpc.rpc as rpc
from torchrpc._agent.current import current_agent
from torchrpc.errors import ConnectionLostError, RpcError

from ..support import helpers
from ..support.group import running_group, sigstop, wait_for

SEND_TIMEOUT = 1.5
OUTBOX = 8 << 20
PENDING = 8
PRIVATE = 2
QUEUED = 4
# Sends fail at send_timeout; the loaded 2-core machine gets 3 s more.
SLACK = 3.0


@pytest.fixture(scope="module", autouse=True)
def group():
    # No heartbeat timeout here: the stopped peer must be found by the send deadline.
    mine = {"send_timeout": SEND_TIMEOUT, "max_outbox_bytes": OUTBOX,
            "max_pending_requests": PENDING, "max_private_connections": PRIVATE,
            "max_queued_requests": QUEUED, "heartbeat_timeout": 0.0, "enable_shm": False}
    with running_group(3, threads=4, timeout=30.0, self_options=mine) as g:
        yield g


def test_requests_beyond_the_pool_queue_bound_are_refused_with_a_clear_error():
    # worker1 floods this worker (4 threads, 4 queued) with 40 slow calls at once, first
    # of all: later, a pool thread may hold the connection's reading role, and then it
    # stops reading while every thread is busy (the socket holds what waits).
    ok, errors = rpc.rpc_sync("worker1", helpers.flood, args=("worker0", 40, 0.3), timeout=60)
    assert ok >= 4 and errors and ok + len(errors) == 40, (ok, errors)
    assert all(e.startswith("OverloadedError: worker worker0 is overloaded") and
               "max_queued_requests is 4" in e for e in errors), errors
    assert rpc.rpc_sync("worker1", helpers.flood, args=("worker0", 3, 0.0)) == (3, [])


def test_outstanding_requests_are_bounded():
    futs = [rpc.rpc_async("worker1", helpers.sleep_then, args=(1.0, i)) for i in range(PENDING)]
    with pytest.raises(RpcError, match="max_pending_requests is 8"):
        rpc.rpc_async("worker1", helpers.add, args=(1, 2))
    assert [f.wait() for f in futs] == list(range(PENDING))
    assert rpc.rpc_sync("worker1", helpers.add, args=(1, 2)) == 3


def test_private_connections_per_peer_are_bounded():
    agent = current_agent()
    most = [0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            with agent._lock:
                n = sum(1 for c in agent.connections.private.get(1, ()) if c.outbound and not c.closed)
            most[0] = max(most[0], n)
            time.sleep(0.005)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        results: List[int] = []
        errors = helpers.run_in_threads(
            lambda i: results.append(rpc.rpc_sync("worker1", helpers.sleep_then, args=(0.5, i))),
            [(i,) for i in range(6)])
    finally:
        done.set()
        watcher.join()
    assert not errors, errors
    assert sorted(results) == list(range(6))
    assert 1 <= most[0] <= PRIVATE, most


def test_private_connections_a_peer_dials_here_are_bounded():
    # worker1 (default bounds: 32) opens more private connections than this worker takes.
    transport = current_agent()._transport
    most = [0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            n = sum(1 for c in transport.connections()
                    if c.private and not c.outbound and c.peer_rank == 1 and not c.closed)
            most[0] = max(most[0], n)
            time.sleep(0.005)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        # Six blocking calls at once to this worker, all answered (beyond two, on the
        # shared connection).
        rpc.rpc_sync("worker1", helpers.open_private_connections, args=("worker0", 6))
    finally:
        done.set()
        watcher.join()
    assert 1 <= most[0] <= PRIVATE, most


def test_a_peer_that_does_not_read_fails_sends_in_time_and_the_outbox_stays_bounded(group):
    assert rpc.rpc_sync("worker2", helpers.whoami) == "worker2"
    conn = current_agent().connections.shared[2]
    sigstop(group.procs[2].pid)
    try:
        outcomes: List = []
        lock = threading.Lock()

        def send(nbytes: int) -> None:
            start = time.monotonic()
            try:
                rpc.rpc_async("worker2", helpers.echo,
                              args=(torch.zeros(nbytes, dtype=torch.uint8),)).wait()
                outcome: object = "replied"
            except RpcError as exc:
                outcome = exc
            with lock:
                outcomes.append((nbytes, time.monotonic() - start, outcome))
        # The first send fills the socket and blocks; the next ones queue or wait for room.
        first = threading.Thread(target=send, args=(64 << 20,))
        first.start()
        time.sleep(0.3)
        others = [threading.Thread(target=send, args=(4 << 20,)) for _ in range(4)]
        for t in others:
            t.start()
        most = 0
        while any(t.is_alive() for t in [first] + others) and len(outcomes) < 5:
            most = max(most, conn.outbox_bytes)
            time.sleep(0.002)
        for t in [first] + others:
            t.join(SEND_TIMEOUT + SLACK + 10)
        times = sorted(round(d, 2) for _, d, _ in outcomes)
        print(f"stopped reader: sends failed after {times} s; at most {most} bytes queued",
              file=sys.stderr)
        assert len(outcomes) == 5 and all(isinstance(o, RpcError) for *_, o in outcomes), outcomes
        assert all("worker2" in str(o) or "rank 2" in str(o) for *_, o in outcomes), outcomes
        assert max(d for _, d, _ in outcomes) < SEND_TIMEOUT + SLACK, outcomes
        assert any("send_timeout" in str(o) for *_, o in outcomes), outcomes
        # The others waited for room. An empty outbox takes any one frame: the 64 MB one
        # too, when it found another frame being written (a heartbeat, say).
        assert 0 < most <= max(OUTBOX, (64 << 20) + 4096), most
        assert conn.closed
    finally:
        group.procs[2].send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 30
    while True:  # it works again once continued
        try:
            assert rpc.rpc_sync("worker2", helpers.add, args=(2, 3), timeout=10) == 5
            break
        except ConnectionLostError:
            assert time.monotonic() < deadline
            time.sleep(0.2)


def test_the_pool_never_grows_past_its_hard_cap(monkeypatch):
    from torchrpc._agent import pool as pool_module
    monkeypatch.setattr(pool_module, "HARD_CAP", 6)
    pool = pool_module.WorkerPool(2, "capped")
    release = threading.Event()
    ran: List[int] = []

    def task(i: int) -> None:
        with pool.blocking():  # each blocks, asking for a thread to replace it
            release.wait(10)
        ran.append(i)
    try:
        for i in range(20):
            pool.submit(task, i)
        time.sleep(0.5)
        assert pool.num_threads == 6
        release.set()
        wait_for("the queued work runs", lambda: len(ran) >= 20, 10, state=lambda: sorted(ran))
        assert sorted(ran) == list(range(20))  # the queued work ran on the capped threads
    finally:
        release.set()
        assert pool.close() == []
