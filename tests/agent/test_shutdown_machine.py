"""The agent's lifecycle as a state machine, and the shutdown protocol driven by messages
alone: no sockets, no threads of the agent, no other process (see tests/support/agent.py)."""

from __future__ import annotations

import itertools
import threading
import time
from typing import List

import pytest
import torch.distributed as dist

from torchrpc import _wire
from torchrpc._agent.coroutines import CoroutineRunner
from torchrpc._agent.pool import WorkerPool
from torchrpc._agent.lifecycle import (NEW, RUNNING, STOPPED, STOPPING, TRANSITIONS, Lifecycle,
                                       State, advance)
from torchrpc._agent.shutdown import STOP_WAIT
from torchrpc._transport.tcp import Transport
from torchrpc._wire import Kind
from torchrpc.errors import (ClosedError, LifecycleError, NotInitializedError, ShutdownError,
                             WorkerLeftError)
from tests.support.agent import Agents, FakeConn, NoTransport, deliver, pending_to, running
from tests.support.group import wait_for

ORDER = [NEW, RUNNING, STOPPING, STOPPED]


# -- the table ---------------------------------------------------------------------------------


def test_the_states_say_what_debug_info_reports():
    assert [s.value for s in ORDER] == ["new", "running", "stopping", "stopped"]
    assert set(TRANSITIONS) == set(State)


@pytest.mark.parametrize("current, target", list(zip(ORDER, ORDER[1:])))
def test_each_state_leads_to_the_next(current, target):
    assert advance(current, target) is target


@pytest.mark.parametrize("current, target", [
    (a, b) for a, b in itertools.product(ORDER, ORDER)
    if ORDER.index(b) != ORDER.index(a) + 1])
def test_every_other_transition_is_refused(current, target):
    with pytest.raises(LifecycleError, match=f"is {current.value} cannot become {target.value}"):
        advance(current, target)


def test_stopped_is_final():
    assert TRANSITIONS[STOPPED] == frozenset()
    with pytest.raises(LifecycleError, match=r"may become: none"):
        advance(STOPPED, NEW)


def test_a_lifecycle_enters_only_what_the_table_allows():
    lifecycle = Lifecycle()
    assert lifecycle.state is NEW and not lifecycle.running
    lifecycle.enter(RUNNING)
    assert lifecycle.state is RUNNING and lifecycle.running
    with pytest.raises(LifecycleError, match="is running cannot become stopped"):
        lifecycle.enter(STOPPED)
    assert lifecycle.state is RUNNING  # a refused transition changes nothing
    lifecycle.enter(STOPPING)
    lifecycle.enter(STOPPED)
    assert lifecycle.state is STOPPED and repr(lifecycle) == "Lifecycle(stopped)"


# -- the protocol, with fake connections ---------------------------------------------------------


@pytest.fixture
def make_agent():
    agents = Agents()
    yield agents
    agents.close()


def test_a_new_agent_has_nothing_to_shut_down(make_agent):
    agent = make_agent()
    agent.shutdown()
    agent.shutdown(graceful=False)
    assert agent.lifecycle.state is NEW
    with pytest.raises(NotInitializedError, match="is new; call init_rpc"):
        agent.check_running()


def test_a_connection_made_while_starting_is_not_told_goodbye(make_agent):
    agent = make_agent(2)
    conn = FakeConn(1)
    agent.connections.on_connect(conn)  # a peer that finished the rendezvous first
    assert conn.goodbyes() == 0


def test_stop_hooks_get_the_shutdowns_deadline(make_agent):
    agent = running(make_agent(2))
    untils: List[float] = []
    agent.add_stop_hook(untils.append)
    start = time.monotonic()
    agent.shutdown_protocol.stop(start + 0.5)
    assert len(untils) == 1 and start < untils[0] <= start + 0.5
    other = running(make_agent(2))
    other.add_stop_hook(untils.append)
    start = time.monotonic()
    other.shutdown(graceful=False)  # no deadline: the stop's own bound, STOP_WAIT
    assert start < untils[1] <= time.monotonic() + STOP_WAIT


def test_stopping_says_goodbye_once_on_every_connection_and_fails_what_is_pending(make_agent):
    agent = running(make_agent(3))
    conns = [FakeConn(1), FakeConn(2), FakeConn(2), FakeConn(1, fail=True)]
    for conn in conns:
        agent.connections.on_connect(conn)
    p = pending_to(agent, 1)
    states = []
    agent.add_stop_hook(lambda until: states.append(agent.lifecycle.state))
    agent.shutdown(graceful=False)
    assert [c.goodbyes() for c in conns] == [1, 1, 1, 0]  # the broken one: closing anyway
    assert states == [STOPPING]
    assert agent.lifecycle.state is STOPPED and agent.store is None
    assert agent.debug_info()["agent.state"] == "stopped"
    assert agent.shutdown_protocol.final_debug_info["agent.state"] == "stopping"
    with pytest.raises(NotInitializedError, match="shut down before the reply from worker1"):
        p.future.wait()
    agent.shutdown()  # once stopped, shutting down again does nothing
    with pytest.raises(LifecycleError, match="is stopped cannot become running"):
        agent.shutdown_protocol.enter(RUNNING)


def test_a_connection_made_while_stopping_is_told_goodbye_at_once(make_agent):
    agent = running(make_agent(2))
    late = FakeConn(1)
    agent.add_stop_hook(lambda until: agent.connections.on_connect(late))  # after the GOODBYEs went out
    agent.shutdown(graceful=False)
    assert late.goodbyes() == 1


def test_graceful_shutdown_meets_the_group_in_order(make_agent):
    agent = running(make_agent(1))
    conn = FakeConn(0)
    agent.connections.on_connect(conn)
    steps = []
    agent.add_shutdown_hook(lambda deadline: steps.append(("finish", agent.lifecycle.state)))
    agent.add_stop_hook(lambda until: steps.append(("stop", agent.lifecycle.state)))
    agent.shutdown(graceful=True, timeout=10,
                   meet=lambda: steps.append(("meet", agent.lifecycle.state)))
    assert steps == [("finish", RUNNING), ("meet", RUNNING), ("finish", RUNNING),
                     ("stop", STOPPING)]
    assert agent.lifecycle.state is STOPPED and conn.goodbyes() == 1


def test_an_error_of_meet_stops_the_agent_and_is_raised_as_it_is(make_agent):
    agent = running(make_agent(1))

    def meet() -> None:
        raise ValueError("a step failed")
    with pytest.raises(ValueError, match="a step failed"):
        agent.shutdown(graceful=True, meet=meet)
    assert agent.lifecycle.state is STOPPED


def test_goodbye_fails_the_peers_calls_and_a_barrier_it_never_reaches(make_agent):
    store = dist.HashStore()
    agent = running(make_agent(2, store))
    conn = FakeConn(1)
    agent.connections.on_connect(conn)
    p = pending_to(agent, 1)
    deliver(agent, conn, Kind.GOODBYE)  # worker1 stopped without a graceful shutdown
    assert agent.has_left(1)
    with pytest.raises(WorkerLeftError, match="worker1 .* has shut down"):
        p.future.wait()
    with pytest.raises(ShutdownError, match=r"worker1 \(rank 1\) stopped before reaching it"):
        agent.shutdown(graceful=True, timeout=10)
    assert agent.lifecycle.state is STOPPED
    assert store.check(["shutdown/1/0"])  # it arrived, and named the one that never will


def test_a_worker_lost_elsewhere_is_named_through_the_store(make_agent):
    store = dist.HashStore()
    agent = running(make_agent(3, store))
    # Worker 2 found worker 1 gone and told the store; worker 1 cannot be reached here
    # either (its address is a fake one, and the transport is not even started).
    agent.store.put("lost/1", {"rank": 1, "why": "worker2 lost it: reset"})
    store.add("lost", 1)
    agent._transport = NoTransport()
    with pytest.raises(ShutdownError, match=r"worker\(s\) worker1 \(rank 1\) left the group "
                                            r"without shutting down"):
        agent.check_peers()
    assert agent.connections.lost[1] == "worker2 lost it: reset"



# -- the one deadline bounds every wait ---------------------------------------------------------


def test_a_shutdown_deadline_bounds_the_wait_for_a_busy_worker_thread(make_agent):
    agent = running(make_agent(1))
    release, busy = threading.Event(), threading.Event()
    agent.pool.submit(lambda: (busy.set(), release.wait(30)))
    assert busy.wait(10)
    try:
        start = time.monotonic()
        agent.shutdown(graceful=True, timeout=0.5)
        assert time.monotonic() - start < 3  # not the 10 s a join of a pool thread allows
        assert agent.lifecycle.state is STOPPED
    finally:
        release.set()


def test_rank_0_waits_at_the_last_barrier_until_the_deadline_only(make_agent):
    store = dist.HashStore()
    agent = running(make_agent(2, store))
    for barrier in ("shutdown/1", "shutdown/2"):  # worker1 got that far, and no further
        agent.store.put(f"{barrier}/1", {"rank": 1})
        store.add(barrier, 1)
    start = time.monotonic()
    with pytest.raises(ShutdownError, match="timed out at the shutdown barrier"):
        agent.shutdown(graceful=True, timeout=1.0)
    assert time.monotonic() - start < 4  # not the 30 s rank 0 gives the others otherwise
    assert agent.lifecycle.state is STOPPED


def test_closing_the_pool_waits_for_all_its_threads_together():
    pool = WorkerPool(3, "test-close")
    release = threading.Event()
    started = threading.Semaphore(0)
    for _ in range(3):
        pool.submit(lambda: (started.release(), release.wait(30)))
    for _ in range(3):
        assert started.acquire(timeout=10)
    try:
        start = time.monotonic()
        stuck = pool.close(0.3)
        assert time.monotonic() - start < 0.9  # not 0.3 s for each thread
        assert len(stuck) == 3
    finally:
        release.set()


def test_closing_the_coroutine_loop_waits_at_most_its_timeout():
    pool = WorkerPool(1, "test-loop")
    loop = CoroutineRunner("worker0", pool)
    blocked = threading.Event()

    async def hog() -> None:
        blocked.set()
        time.sleep(1.5)  # holds the loop's thread: nothing can cancel it
    fut = loop.submit(hog())
    assert blocked.wait(10)
    start = time.monotonic()
    loop.close(0.2)
    assert time.monotonic() - start < 1.0
    fut.wait()
    pool.close()


def test_closing_the_transport_waits_for_all_its_threads_together():
    transport = Transport(0, b"s" * 32, _wire.Limits(), lambda conn: None, lambda *a: None,
                          lambda conn, why: None, "127.0.0.1")
    release = threading.Event()
    stuck = [threading.Thread(target=release.wait, args=(30,), daemon=True) for _ in range(3)]
    for t in stuck:
        t.start()
    links = transport._links
    with links._lock:
        links._threads.update(stuck)  # threads that do not end when their socket closes
    try:
        start = time.monotonic()
        left = transport.close(0.3)
        assert time.monotonic() - start < 0.9  # not 0.3 s for each thread
        assert sorted(left) == sorted(t.name for t in stuck)  # named, for the WARNING
    finally:
        release.set()


def test_no_thread_starts_on_a_closed_transport_or_pool():
    # What close() joined is all there is: a reader that would start after it is refused
    # (the dial that wanted it fails), and a pool thread that blocks adds none.
    transport = Transport(0, b"s" * 32, _wire.Limits(), lambda conn: None, lambda *a: None,
                          lambda conn, why: None, "127.0.0.1")
    assert transport.close(1) == []
    with pytest.raises(ClosedError, match="the transport is shut down"):
        transport._links.spawn(time.sleep, "torchrpc-test-late", 0.01)
    pool = WorkerPool(1, "torchrpc-test-closed")
    entered, go, seen = threading.Event(), threading.Event(), []

    def block() -> None:
        entered.set()
        go.wait(10)
        with pool.blocking():  # work is queued: an open pool would add a thread here
            seen.append(pool.num_threads)
    pool.submit(block)
    assert entered.wait(10)
    pool.submit(lambda: None)  # queued behind it
    closing = threading.Thread(target=pool.close, args=(10,))
    closing.start()
    wait_for("the pool closed", lambda: pool._closed, 10)
    go.set()
    closing.join(10)
    assert seen == [1]
    assert pool.num_threads == 0


def test_closing_the_transport_as_a_thread_is_being_started_joins_it(monkeypatch):
    transport = Transport(0, b"s" * 32, _wire.Limits(), lambda conn: None, lambda *a: None,
                          lambda conn, why: None, "127.0.0.1")
    links = transport._links
    registered, closed = threading.Event(), threading.Event()
    start = threading.Thread.start

    def slow_start(thread: threading.Thread) -> None:
        registered.set()  # in the table, not started yet: close() comes now
        closed.wait(0.5)
        start(thread)
    spawned: List[threading.Thread] = []
    monkeypatch.setattr(threading.Thread, "start", slow_start)
    spawner = threading.Thread(target=lambda: spawned.append(
        links.spawn(time.sleep, "torchrpc-test-late", 0.05)))
    start(spawner)
    assert registered.wait(10)
    monkeypatch.setattr(threading.Thread, "start", start)
    try:
        transport.close(5)  # does not try to join a thread that has not started
    finally:
        closed.set()
        spawner.join(10)
    assert spawned and not spawned[0].is_alive()
