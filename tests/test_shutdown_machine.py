"""The agent's lifecycle as a state machine, and the shutdown protocol driven by messages
alone: no sockets, no threads of the agent, no other process. The transport's part is
played by fake connections that record the frames sent on them; the store is an
in-memory one."""

from __future__ import annotations

import itertools
from typing import Any, List, Optional, Tuple

import pytest
import torch.distributed as dist

from torchrpc import _wire
from torchrpc._agent import Agent
from torchrpc._agent.futures import mark_reader_thread, new_future
from torchrpc._agent.requests import Pending
from torchrpc._agent.shutdown import (NEW, RUNNING, STOPPED, STOPPING, TRANSITIONS, State,
                                      advance)
from torchrpc._wire import Kind
from torchrpc.errors import (LifecycleError, NotInitializedError, RpcError, ShutdownError,
                             WorkerLeftError)
from torchrpc.rpc.options import TensorPipeRpcBackendOptions

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


# -- the protocol, with fake connections ---------------------------------------------------------


class FakeConn:
    """The transport's connection, as the agent sees it: records what is sent on it."""

    def __init__(self, peer_rank: int, fail: bool = False) -> None:
        self.peer_rank = peer_rank
        self.private = False
        self.outbound = True
        self.closed = False
        self.fail = fail
        self.sent: List[Tuple[int, int, int]] = []  # kind, flags, request id

    def send(self, kind: int, flags: int, rid: int, env: bytes, bufs: Any,
             keep: Any = None) -> None:
        if self.fail:
            raise RpcError("broken")
        self.sent.append((kind, flags, rid))

    def close(self, reason: Optional[BaseException] = None) -> None:
        self.closed = True

    def goodbyes(self) -> int:
        return sum(1 for kind, flags, _ in self.sent
                   if kind == Kind.GOODBYE and flags & _wire.FLAG_ONEWAY)


def _info(name: str, rank: int) -> dict:
    return {"name": name, "host": "127.0.0.1", "port": 1 + rank, "hostid": "h"}


@pytest.fixture
def make_agent():
    """Agents built as a backend builds them, never started: they own no socket."""
    made: List[Agent] = []

    def make(world_size: int = 1, store: Any = None) -> Agent:
        options = TensorPipeRpcBackendOptions(num_worker_threads=2, rpc_timeout=5)
        agent = Agent(store if store is not None else dist.HashStore(), "worker0", 0,
                      world_size, options)
        for rank in range(world_size):
            agent._add_worker(rank, _info(f"worker{rank}", rank))
        made.append(agent)
        return agent

    yield make
    mark_reader_thread(False)  # _on_frame marks the thread that delivers a frame
    for agent in made:
        if agent._state is RUNNING:
            agent.shutdown(graceful=False)


def _running(agent: Agent) -> Agent:
    agent.shutdown_protocol.enter(RUNNING)  # what start() does after the rendezvous
    agent.mark_ready()
    return agent


def _pending_to(agent: Agent, rank: int, rid: int = 7) -> Pending:
    p = Pending(new_future(agent.pool), agent._workers[rank], "f", 0, None)
    agent.requests.add(rid, p, None)
    return p


def _frame(agent: Agent, conn: FakeConn, kind: int) -> None:
    envelope = _wire.encode(None)[0]
    header = _wire.Header(kind, _wire.FLAG_ONEWAY, 0, len(envelope), 0)
    agent._on_frame(conn, header, envelope, [])


def test_a_new_agent_has_nothing_to_shut_down(make_agent):
    agent = make_agent()
    agent.shutdown()
    agent.shutdown(graceful=False)
    assert agent._state is NEW
    with pytest.raises(NotInitializedError, match="is new; call init_rpc"):
        agent._check_running()


def test_a_connection_made_while_starting_is_not_told_goodbye(make_agent):
    agent = make_agent(2)
    conn = FakeConn(1)
    agent._on_connect(conn)  # a peer that finished the rendezvous first
    assert conn.goodbyes() == 0


def test_stopping_says_goodbye_once_on_every_connection_and_fails_what_is_pending(make_agent):
    agent = _running(make_agent(3))
    conns = [FakeConn(1), FakeConn(2), FakeConn(2), FakeConn(1, fail=True)]
    for conn in conns:
        agent._on_connect(conn)
    p = _pending_to(agent, 1)
    states = []
    agent.add_stop_hook(lambda: states.append(agent._state))
    agent.shutdown(graceful=False)
    assert [c.goodbyes() for c in conns] == [1, 1, 1, 0]  # the broken one: closing anyway
    assert states == [STOPPING]
    assert agent._state is STOPPED and agent.store is None
    assert agent.debug_info()["agent.state"] == "stopped"
    assert agent.final_debug_info["agent.state"] == "stopping"
    with pytest.raises(NotInitializedError, match="shut down before the reply from worker1"):
        p.future.wait()
    agent.shutdown()  # once stopped, shutting down again does nothing
    with pytest.raises(LifecycleError, match="is stopped cannot become running"):
        agent.shutdown_protocol.enter(RUNNING)


def test_a_connection_made_while_stopping_is_told_goodbye_at_once(make_agent):
    agent = _running(make_agent(2))
    late = FakeConn(1)
    agent.add_stop_hook(lambda: agent._on_connect(late))  # after the GOODBYEs went out
    agent.shutdown(graceful=False)
    assert late.goodbyes() == 1


def test_graceful_shutdown_meets_the_group_in_order(make_agent):
    agent = _running(make_agent(1))
    conn = FakeConn(0)
    agent._on_connect(conn)
    steps = []
    agent.add_shutdown_hook(lambda deadline: steps.append(("finish", agent._state)))
    agent.add_stop_hook(lambda: steps.append(("stop", agent._state)))
    agent.shutdown(graceful=True, timeout=10,
                   meet=lambda: steps.append(("meet", agent._state)))
    assert steps == [("finish", RUNNING), ("meet", RUNNING), ("finish", RUNNING),
                     ("stop", STOPPING)]
    assert agent._state is STOPPED and conn.goodbyes() == 1


def test_an_error_of_meet_stops_the_agent_and_is_raised_as_it_is(make_agent):
    agent = _running(make_agent(1))

    def meet() -> None:
        raise ValueError("a step failed")
    with pytest.raises(ValueError, match="a step failed"):
        agent.shutdown(graceful=True, meet=meet)
    assert agent._state is STOPPED


def test_goodbye_fails_the_peers_calls_and_a_barrier_it_never_reaches(make_agent):
    store = dist.HashStore()
    agent = _running(make_agent(2, store))
    conn = FakeConn(1)
    agent._on_connect(conn)
    p = _pending_to(agent, 1)
    _frame(agent, conn, Kind.GOODBYE)  # worker1 stopped without a graceful shutdown
    assert agent.has_left(1)
    with pytest.raises(WorkerLeftError, match="worker1 .* has shut down"):
        p.future.wait()
    with pytest.raises(ShutdownError, match=r"worker1 \(rank 1\) stopped before reaching it"):
        agent.shutdown(graceful=True, timeout=10)
    assert agent._state is STOPPED
    assert store.check(["shutdown/1/0"])  # it arrived, and named the one that never will


def test_a_worker_lost_elsewhere_is_named_through_the_store(make_agent):
    store = dist.HashStore()
    agent = _running(make_agent(3, store))
    # Worker 2 found worker 1 gone and told the store; worker 1 cannot be reached here
    # either (its address is a fake one, and the transport is not even started).
    store.set("lost/1", "worker2 lost it: reset")
    store.add("lost", 1)
    agent._transport = _NoTransport()
    with pytest.raises(ShutdownError, match=r"worker\(s\) worker1 \(rank 1\) left the group "
                                            r"without shutting down"):
        agent.check_peers()
    assert agent._lost[1] == "worker2 lost it: reset"
    agent._transport = None


class _NoTransport:
    """A transport that reaches nobody."""

    secure = False

    def connect(self, *args: Any, **kwargs: Any) -> Any:
        raise RpcError("unreachable")

    def connections(self) -> List[Any]:
        return []

    def close(self) -> None:
        pass
