"""Serving requests, one message at a time: no sockets, no reading thread, no other process.
A request is handed to the dispatcher as the agent's reader would hand it, and the reply
is read off the fake connection it came on (see tests/support/agent.py)."""

from __future__ import annotations

import operator
from typing import Any, Tuple

import pytest

from torchrpc import _wire
from torchrpc._agent import MessageContext
from torchrpc._agent.dispatch import ONCE_ACKS
from torchrpc._agent.remote_error import rebuild_error
from torchrpc._wire import Kind
from torchrpc._wire.probe import MISSING, REPLIED, RUNNING
from torchrpc.errors import RpcError
from tests.support.agent import Agents, FakeConn, running


@pytest.fixture
def agent():
    agents = Agents()
    yield running(agents(2))
    agents.close()


def _request(agent: Any, kind: int, payload: Any, rid: int, flags: int = 0,
             meta: Any = None) -> Tuple[Any, ...]:
    """What the reader hands on for a request of worker1: its sender, header and payload."""
    src = agent.registry.workers[1]
    env, bufs, _ = _wire.encode(payload, MessageContext(agent, src, kind), meta=meta)
    header = _wire.Header(kind, flags, rid, len(env), len(bufs))
    return src, header, env, list(bufs)


def _serve(agent: Any, conn: FakeConn, kind: int, payload: Any, rid: int,
           flags: int = 0, meta: Any = None) -> None:
    src, header, env, bufs = _request(agent, kind, payload, rid, flags, meta)
    agent.dispatch.serve(src, header, env, bufs, agent.dispatch.handlers.get(kind), conn)


def _reply(agent: Any, conn: FakeConn, i: int = -1) -> Tuple[int, int, Any]:
    """The ``i``-th frame sent on ``conn``: its kind, request id and value (an ERROR's
    value is the error it stands for)."""
    kind, _, rid = conn.sent[i]
    env, bufs = conn.payloads[i]
    _, value = _wire.decode(env, bufs, MessageContext(agent, agent.registry.workers[1], kind))
    return kind, rid, rebuild_error(value) if kind == Kind.ERROR else value


def _fails(x: int) -> int:
    raise ValueError(f"bad {x}")


def test_a_call_is_answered_on_the_connection_it_came_on(agent):
    conn = FakeConn(1)
    _serve(agent, conn, Kind.CALL, (operator.add, (2, 3), {}), rid=5)
    assert _reply(agent, conn) == (Kind.RESPONSE, 5, 5)


def test_a_failing_call_is_answered_with_its_error(agent):
    conn = FakeConn(1)
    _serve(agent, conn, Kind.CALL, (_fails, (7,), {}), rid=6)
    kind, rid, error = _reply(agent, conn)
    assert (kind, rid) == (Kind.ERROR, 6)
    assert isinstance(error, ValueError) and "bad 7" in str(error)


def test_a_kind_nobody_handles_is_answered_with_an_error(agent):
    conn = FakeConn(1)
    _serve(agent, conn, Kind.RREF_FETCH, None, rid=7)
    kind, _, error = _reply(agent, conn)
    assert kind == Kind.ERROR and "has no handler for message kind RREF_FETCH" in str(error)


def test_a_one_way_request_gets_no_reply_even_when_it_fails(agent):
    conn = FakeConn(1)
    _serve(agent, conn, Kind.CALL, (_fails, (1,), {}), rid=8, flags=_wire.FLAG_ONEWAY)
    assert conn.sent == []


def test_a_handler_registered_for_a_kind_serves_it(agent):
    conn = FakeConn(1)
    agent.register_handler(Kind.RREF_FETCH, lambda src, payload: (src.name, payload))
    _serve(agent, conn, Kind.RREF_FETCH, "x", rid=9)
    assert _reply(agent, conn) == (Kind.RESPONSE, 9, ("worker1", "x"))


def test_a_request_that_may_arrive_twice_runs_once_and_its_reply_goes_again(agent):
    dispatch, src = agent.dispatch, agent.registry.workers[1]
    conn, again = FakeConn(1), FakeConn(1)
    assert dispatch.first_time(src, 11, conn)
    assert not dispatch.first_time(src, 11, again)  # while it runs: dropped
    assert again.sent == []
    _serve(agent, conn, Kind.CALL, (operator.mul, (3, 4), {}), rid=11, flags=_wire.FLAG_ONCE)
    assert _reply(agent, conn) == (Kind.RESPONSE, 11, 12)
    assert not dispatch.first_time(src, 11, again)  # answered: the same reply again
    assert _reply(agent, again) == (Kind.RESPONSE, 11, 12)
    assert agent.debug_info()["agent.num_duplicate_requests"] == 2
    dispatch.once.forget(1)  # another worker under rank 1: its request ids are new
    assert dispatch.first_time(src, 11, conn)


def test_a_probe_is_told_what_arrived_and_gets_the_kept_replies_first(agent):
    dispatch, src = agent.dispatch, agent.registry.workers[1]
    conn = FakeConn(1)
    dispatch.first_time(src, 21, conn)  # runs still
    dispatch.first_time(src, 22, conn)
    _serve(agent, conn, Kind.CALL, (operator.add, (1, 1), {}), rid=22, flags=_wire.FLAG_ONCE)
    probe = FakeConn(1)
    dispatch.answer_probe(probe, src, _wire.pack_probe([20, 21, 22]))
    assert _reply(agent, probe, 0) == (Kind.RESPONSE, 22, 2)
    kind, flags, _ = probe.sent[1]
    assert kind == Kind.ONCE_STATUS and flags & _wire.FLAG_ONEWAY
    assert _wire.parse_status(probe.payloads[1][0]) == [(20, MISSING), (21, RUNNING),
                                                        (22, REPLIED)]


def test_a_reply_the_caller_acknowledged_is_no_longer_kept_but_runs_once(agent):
    dispatch, src = agent.dispatch, agent.registry.workers[1]
    conn = FakeConn(1)
    for rid in (41, 42):
        assert dispatch.first_time(src, rid, conn)
        _serve(agent, conn, Kind.CALL, (operator.add, (rid, 1), {}), rid=rid,
               flags=_wire.FLAG_ONCE)
    assert dispatch.once.kept() == 2
    # The caller's next at-most-once request says it has the reply to 41 (and names ids
    # it never sent, which change nothing).
    assert dispatch.first_time(src, 43, conn)
    _serve(agent, conn, Kind.CALL, (operator.add, (43, 1), {}), rid=43, flags=_wire.FLAG_ONCE,
           meta={ONCE_ACKS: (41, 999)})
    assert _reply(agent, conn) == (Kind.RESPONSE, 43, 44)
    assert dispatch.once.kept() == 2  # 42's and 43's
    again = FakeConn(1)
    assert not dispatch.first_time(src, 41, again)  # a late copy: still not run again
    assert again.sent == []  # and its reply, which the caller has, not sent again
    probe = FakeConn(1)
    dispatch.answer_probe(probe, src, _wire.pack_probe([41, 42]))
    assert _reply(agent, probe, 0) == (Kind.RESPONSE, 42, 43)
    assert _wire.parse_status(probe.payloads[1][0]) == [(41, REPLIED), (42, REPLIED)]


def test_a_reply_whose_connection_broke_goes_on_the_current_one(agent):
    broken, current = FakeConn(1, fail=True), FakeConn(1)
    agent.connections.on_connect(current)
    _serve(agent, broken, Kind.CALL, (operator.add, (1, 2), {}), rid=31)
    assert _reply(agent, current) == (Kind.RESPONSE, 31, 3)


def test_refusing_says_why(agent):
    conn = FakeConn(1)
    src, header, _, _ = _request(agent, Kind.CALL, None, rid=41)
    agent.dispatch.refuse(src, header, conn)
    kind, _, error = _reply(agent, conn)
    assert kind == Kind.ERROR and isinstance(error, RpcError)
    assert "worker0 is overloaded" in str(error) and "max_queued_requests" in str(error)
