"""The lanes (``torchrpc._agent.lanes``) driven by messages alone: private connections
that a fake transport opens, and replies that the test puts on them."""

from __future__ import annotations

import operator
import socket
import threading
import time
from collections import deque
from types import SimpleNamespace
from typing import Any, Deque, Dict, List, Tuple

import pytest
import torch

from torchrpc import _wire
from torchrpc._agent import Agent, Expect
from torchrpc._wire import Kind
from torchrpc.errors import ProtocolError, RpcError
from tests.support.agent import Agents, FakeConn, running
from tests.support.group import wait_for


class FakePrivate(FakeConn):
    """A private connection: the caller reads what the test (or ``auto``) queued on it."""

    def __init__(self, peer_rank: int, auto: bool) -> None:
        super().__init__(peer_rank)
        self.private = True
        self.auto = auto  # answer every call with the sum of its arguments, at once
        self.inbox: Deque[Tuple[_wire.Header, bytes, List[Any]]] = deque()
        self.reads = 0
        # A burst's reader asks whether a frame is there: the inbox, or a socket that the
        # test never writes to.
        self.sock, self._peer = socket.socketpair()

    @property
    def rx_buffered(self) -> int:
        return len(self.inbox)

    def close(self, reason: Any = None) -> None:
        super().close(reason)
        self.sock.close()
        self._peer.close()

    def send(self, kind: int, flags: int, rid: int, env: bytes, bufs: Any,
             keep: Any = None) -> None:
        super().send(kind, flags, rid, env, bufs, keep)
        if self.auto:
            self.answer(rid, sum(_wire.decode(env, bufs)[1][1]))

    def answer(self, rid: int, value: Any) -> None:
        envelope = _wire.encode(value)[0]
        self.inbox.append((_wire.Header(Kind.RESPONSE, 0, rid, len(envelope), 0),
                           bytes(envelope), []))

    def read_frame(self) -> Tuple[_wire.Header, bytes, List[Any]]:
        self.reads += 1
        if self.closed or not self.inbox:
            raise RpcError("closed")
        return self.inbox.popleft()


class PrivateTransport:
    """Opens a :class:`FakePrivate` for every private connection asked for."""

    secure = False

    def __init__(self, agent: Agent, auto: bool = True) -> None:
        self.agent = agent
        self.auto = auto
        self.opened: List[FakePrivate] = []
        self.inline_max: Dict[int, int] = {}  # no peer with a bound of its own

    def connect(self, rank: int, host: str, port: int, timeout: float, local: bool = False,
                private: bool = False, incarnation: int = 0) -> Any:
        assert private, "the shared connection is in the table already"
        conn = FakePrivate(rank, self.auto)
        self.opened.append(conn)
        self.agent.connections.on_connect(conn)
        return conn

    def connections(self) -> List[Any]:
        return []

    def close(self) -> None:
        pass


@pytest.fixture
def agents():
    made = Agents()
    yield made
    made.close()


def _agent(agents: Agents, auto: bool = True) -> Tuple[Agent, FakeConn, PrivateTransport]:
    agent = running(agents(world_size=2))
    transport = PrivateTransport(agent, auto)
    agent._adopt(transport)  # as start() hands it over: the lanes open connections with it
    shared = FakeConn(1)
    agent.connections.on_connect(shared)
    return agent, shared, transport


def _dst(agent: Agent) -> Any:
    return agent.registry.workers[1]


def test_a_blocking_call_reads_its_reply_on_a_private_connection_and_keeps_it(agents):
    agent, shared, transport = _agent(agents)
    assert agent.request_sync(_dst(agent), Kind.CALL, (operator.add, (2, 3), {}), 5) == 5
    (conn,) = transport.opened
    assert [kind for kind, _, _ in conn.sent] == [Kind.CALL] and not shared.sent
    assert agent.lanes.private.idle_to(1) == [conn]  # back in the free list for the next call
    assert conn.poll is agent.lanes.poll  # readers poll as the agent's policy says
    assert agent.request_sync(_dst(agent), Kind.CALL, (operator.add, (1, 1), {}), 5) == 2
    assert transport.opened == [conn]  # reused, not opened again


def test_rpc_async_parks_only_on_an_idle_connection(agents):
    agent, shared, transport = _agent(agents)
    fut = agent.call(_dst(agent), operator.add, (1, 2), {}, 5, expect=Expect.FUTURE)
    assert not transport.opened and [k for k, _, _ in shared.sent] == [Kind.CALL]
    agent.lanes.private.close_idle(1, RpcError("unused"))  # nothing idle: nothing closes
    assert agent.request_sync(_dst(agent), Kind.CALL, (operator.add, (0, 0), {}), 5) == 0
    (conn,) = transport.opened
    parked = agent.call(_dst(agent), operator.add, (2, 2), {}, 5, expect=Expect.FUTURE)
    assert [k for k, _, _ in conn.sent] == [Kind.CALL, Kind.CALL] and conn.reads == 1
    assert parked.wait() == 4 and conn.reads == 2
    assert not fut.done()  # its reply is for the shared connection's reader


def test_another_threads_async_call_to_a_worker_with_a_parked_reply_goes_the_shared_way(
        agents):
    agent, shared, transport = _agent(agents)
    agent.request_sync(_dst(agent), Kind.CALL, (operator.add, (0, 0), {}), 5)
    first = agent.call(_dst(agent), operator.add, (1, 1), {}, 5, expect=Expect.FUTURE)
    out: List[Any] = []
    other = threading.Thread(target=lambda: out.append(
        agent.call(_dst(agent), operator.add, (2, 2), {}, 5, expect=Expect.FUTURE)))
    other.start()
    other.join()
    assert len(transport.opened[0].sent) == 2 and len(shared.sent) == 1
    assert first.wait() == 2 and not torch.futures.Future.done(out[0])


def test_a_threads_second_async_call_to_a_worker_makes_its_parked_connection_a_burst(agents):
    agent, shared, transport = _agent(agents)
    agent.request_sync(_dst(agent), Kind.CALL, (operator.add, (0, 0), {}), 5)
    first = agent.call(_dst(agent), operator.add, (1, 1), {}, 5, expect=Expect.FUTURE)
    rest = [agent.call(_dst(agent), operator.add, (i, i), {}, 5, expect=Expect.FUTURE)
            for i in range(2, 40)]
    (conn,) = transport.opened
    assert len(conn.sent) == 40 and not shared.sent  # one connection carries them all
    assert all(flags & _wire.FLAG_MANY for _, flags, _ in conn.sent[2:])
    assert torch.futures.wait_all([first] + rest) == [2 * i for i in range(1, 40)]
    assert agent.lanes.num_parked == 0


def test_a_callback_has_the_pool_read_a_parked_reply_at_once(agents):
    agent, shared, transport = _agent(agents)
    agent.request_sync(_dst(agent), Kind.CALL, (operator.add, (0, 0), {}), 5)
    fut = agent.call(_dst(agent), operator.add, (3, 4), {}, 5, expect=Expect.FUTURE)
    seen: List[Any] = []
    fut.add_done_callback(lambda f: seen.append(f.wait()))
    wait_for("the callback sees the reply", lambda: seen == [7], 5, state=lambda: seen)
    assert agent.lanes.num_parked == 0


def test_an_unclaimed_parked_reply_is_read_on_the_pool_after_a_tick(agents):
    agent, shared, transport = _agent(agents, auto=False)
    fut = agent.request(_dst(agent), Kind.CALL, (operator.add, (1, 2), {}), 5,
                        expect=Expect.FOLLOWED)
    parked = fut._claim
    assert parked is not None and agent.lanes.num_parked == 1
    conn = transport.opened[0]
    conn.answer(parked.rid, 3)
    agent.lanes.private_lane.drain_parked(time.monotonic())  # too young: left for its owner
    assert conn.reads == 0
    agent.lanes.private_lane.drain_parked(time.monotonic() + 1.0)
    wait_for("the pool reads the parked reply", fut.done, 5)
    assert fut.wait() == 3
    wait_for("no reply parked", lambda: agent.lanes.num_parked == 0, 5)
    assert agent.lanes.private.idle_to(1) == [conn]


def test_a_call_after_a_parked_request_reads_both_replies(agents):
    agent, shared, transport = _agent(agents, auto=False)
    fut = agent.request(_dst(agent), Kind.CALL, (operator.add, (1, 2), {}), 0,
                        expect=Expect.FOLLOWED)
    parked = fut._claim
    conn = transport.opened[0]
    conn.answer(parked.rid, 3)
    conn.auto = True
    assert agent.request_sync(_dst(agent), Kind.CALL, (operator.add, (5, 5), {}), 0,
                              after=fut) == 10
    assert fut.done() and fut.wait() == 3 and conn.reads == 2
    assert agent.lanes.num_parked == 0 and agent.lanes.private.idle_to(1) == [conn]


def test_a_private_connection_that_breaks_fails_its_call(agents):
    agent, shared, transport = _agent(agents, auto=False)
    with pytest.raises(RpcError, match="closed"):
        agent.request_sync(_dst(agent), Kind.CALL, (operator.add, (1, 2), {}), 5)
    assert agent.lanes.num_parked == 0 and not agent.lanes.private.idle_to(1)


class _BrokenChain(FakePrivate):
    """Breaks on its first read with an error caused by an error caused by another (the
    reader's chains: a ConnectionLostError from a ProtocolError from an OSError), each with
    a traceback; the first is raised after its cause was handled (it has no context)."""

    def read_frame(self) -> Tuple[_wire.Header, bytes, List[Any]]:
        def recv() -> None:
            raise OSError("reset")

        def parse() -> None:
            try:
                recv()
            except OSError as exc:
                raise ProtocolError("truncated") from exc

        try:
            parse()
        except ProtocolError as exc:
            cause = exc
        try:
            raise RpcError("broke") from cause
        except RpcError as exc:
            self.chain = [exc, exc.__cause__, exc.__cause__.__cause__]
            assert all(e.__traceback__ is not None for e in self.chain)
            raise


def test_a_broken_private_connections_error_keeps_no_frames_at_any_depth(agents):
    # The error may be kept by whoever fails the requests with it: no error of its chain
    # may keep the reading loop's frames (and the requests they hold) alive.
    agent, shared, transport = _agent(agents, auto=False)
    conn = _BrokenChain(1, auto=False)
    agent.connections.on_connect(conn)
    agent.lanes.private.checkin(_dst(agent), conn)
    with pytest.raises(RpcError, match="broke"):
        agent.request_sync(_dst(agent), Kind.CALL, (operator.add, (1, 2), {}), 5)
    assert len(conn.chain) == 3 and [e.__traceback__ for e in conn.chain] == [None] * 3


def test_without_private_calls_every_call_goes_the_shared_way(agents):
    agent, shared, transport = _agent(agents)
    agent.lanes.private.enabled = False
    fut = agent.call(_dst(agent), operator.add, (1, 2), {}, 5, expect=Expect.FUTURE)
    assert not transport.opened and [k for k, _, _ in shared.sent] == [Kind.CALL]
    assert not fut.done()


def test_the_poll_policy_follows_the_cpus_the_host_leaves_spare(agents):
    agent, _, _ = _agent(agents)
    poll = agent.lanes.poll
    poll.set_spare_cpus(True)
    assert poll.seconds == poll.spare
    poll.set_spare_cpus(False)
    assert poll.seconds == poll.short
    # More workers on the host than CPUs: a poll would take another worker's CPU.
    poll.set_spare_cpus(False, crowded=True)
    assert poll.seconds == poll.crowded == 0.0
    agent.lanes.check_cpus(1)  # one worker on this host: whatever the CPUs say, valid
    assert poll.seconds in (poll.short, poll.spare)


def test_a_crowded_host_stops_the_polls_unless_spin_us_is_set(monkeypatch):
    from torchrpc._agent import lanes
    from torchrpc._transport import PollPolicy

    monkeypatch.setattr(lanes, "_usable_cpus", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    for spin_us, crowded in ((None, 0.0), (50.0, 50e-6)):
        path = SimpleNamespace(poll=PollPolicy.from_option(spin_us))
        lanes.Lanes.check_cpus(path, 2)  # two one-thread workers on two CPUs: spare
        assert path.poll.seconds == path.poll.spare
        lanes.Lanes.check_cpus(path, 3)
        assert path.poll.seconds == crowded
