"""Background threads survive unexpected exceptions: each loop logs them at ERROR and goes
on; a loop that cannot go on fails the agent loudly; shared tables are read from snapshots.

Every test injects an exception into one loop's body (a method patched to raise once) and
checks that the loop logged it with its traceback and kept working.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from typing import Any, Callable, List

import pytest

import torchrpc.rpc as rpc
from torchrpc import _threads, _wire
from torchrpc._agent import WorkerInfo
from torchrpc._agent.current import current_agent, handle
from torchrpc._dist_autograd import ENGINE
from torchrpc._rref import RREF_LAYER
from torchrpc._threads import Guard
from torchrpc._transport import Transport, handshake
from torchrpc._wire import Kind
from torchrpc.errors import ConnectionLostError, RpcError, RpcTimeoutError, ThreadFailedError

from ..support import helpers
from ..support.group import free_port, wait_for


class Boom(Exception):
    """The exception the tests inject."""


def raise_once(real: Callable[..., Any], exc: BaseException = None) -> Callable[..., Any]:
    """``real``, except that its first call raises ``exc`` (a :class:`Boom`)."""
    state = {"raised": 0}

    def patched(*args: Any, **kwargs: Any) -> Any:
        if not state["raised"]:
            state["raised"] += 1
            raise exc or Boom("injected")
        return real(*args, **kwargs)
    patched.state = state
    return patched


def errors_about(caplog: Any, words: str) -> List[logging.LogRecord]:
    """ERROR records of the torchrpc loggers that mention ``words`` and carry a traceback."""
    return [r for r in caplog.records if r.name.split(".")[0] == "torchrpc"
            and r.levelno == logging.ERROR and words in r.getMessage() and r.exc_info is not None]


@pytest.fixture
def caplog(caplog):
    caplog.set_level(logging.ERROR, logger="torchrpc")
    return caplog


@pytest.fixture
def agent():
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=2, rpc_timeout=20,
                                           init_method=f"tcp://127.0.0.1:{free_port()}",
                                           heartbeat_interval=0.05, heartbeat_timeout=5.0)
    rpc.init_rpc("solo", rank=0, world_size=1, rpc_backend_options=opts)
    a = current_agent()
    try:
        yield a
    finally:
        if handle.agent is not None:  # a test may have shut it down
            try:
                rpc.shutdown(graceful=False)
            except ThreadFailedError:
                pass


# -- the guard itself -------------------------------------------------------------------------


def test_guard_logs_goes_on_and_gives_up_after_failing_rounds_in_a_row(caplog):
    fatal: List[ThreadFailedError] = []
    guard = Guard("the test loop", fatal.append, limit=3)
    with guard:
        raise Boom("first")
    assert guard.ok and errors_about(caplog, "the test loop")
    with guard:
        pass  # a clean round: the count starts again
    for _ in range(2):
        with guard:
            raise Boom("again")
    assert guard.ok and not fatal
    with guard:
        guard.failed(Boom("a step of a round"))  # counts too, though the round goes on
    assert not guard.ok
    assert len(fatal) == 1 and "the test loop cannot go on" in str(fatal[0])
    assert "a step of a round" in str(fatal[0]) and isinstance(fatal[0].__cause__, Boom)


def test_whatever_escapes_a_thread_is_reported_not_lost(caplog, monkeypatch):
    hooked: List[Any] = []
    monkeypatch.setattr(threading, "excepthook", hooked.append)
    fatal: List[ThreadFailedError] = []

    def target() -> None:
        raise SystemExit("ended by the loop itself")
    _threads.start("torchrpc-test", Guard("the test thread", fatal.append), target).join(5)
    assert not hooked
    assert fatal and "the test thread cannot go on: SystemExit" in str(fatal[0])
    assert errors_about(caplog, "the test thread cannot go on")


# -- the agent's loops ------------------------------------------------------------------------


def test_timer_survives_and_still_fails_expired_calls(agent, caplog, monkeypatch):
    reading = agent.inbound.role
    monkeypatch.setattr(reading, "check_lent", raise_once(reading.check_lent))
    wait_for("an error about the timer thread of solo",
             lambda: errors_about(caplog, "timer thread of solo"), 10)
    with pytest.raises(RpcTimeoutError, match="timed out after 0.3 s"):
        rpc.rpc_sync("solo", helpers.sleep_then, args=(2.0,), timeout=0.3)
    assert agent.scheduler.thread.is_alive() and agent.failure is None


def test_heartbeat_survives_and_goes_on_beating(agent, caplog, monkeypatch):
    assert rpc.rpc_sync("solo", helpers.add, args=(1, 2)) == 3  # a connection to beat on
    beats: List[int] = []
    liveness = agent.liveness
    real_beat = liveness._beat

    def beat(rank, *args):
        beats.append(rank)
        return real_beat(rank, *args)
    monkeypatch.setattr(liveness, "_beat", beat)
    monkeypatch.setattr(liveness, "_connections_by_peer",
                        raise_once(liveness._connections_by_peer))
    wait_for("an error about the heartbeat thread of solo",
             lambda: errors_about(caplog, "heartbeat thread of solo"), 10)
    wait_for("three heartbeats", lambda: len(beats) >= 3, 10)
    assert liveness.thread.is_alive() and agent.failure is None


def test_a_peer_whose_connection_closes_meanwhile_is_never_an_empty_list(agent):
    class Closing:
        """Open when first asked, closed ever after (a connection closing meanwhile)."""

        def __init__(self) -> None:
            self.asked = 0

        @property
        def closed(self) -> bool:
            self.asked += 1
            return self.asked > 1

    with agent._lock:
        agent.connections.all[7] = [Closing()]
    try:
        assert all(shared or private
                   for shared, private in agent.liveness._connections_by_peer().values())
    finally:
        with agent._lock:
            del agent.connections.all[7]


def test_a_timer_that_cannot_go_on_fails_the_agent_loudly(agent, caplog, monkeypatch):
    pending = rpc.rpc_async("solo", helpers.sleep_then, args=(3.0,), timeout=0)
    monkeypatch.setattr(agent.liveness, "check", lambda now: (_ for _ in ()).throw(Boom("x")))
    with pytest.raises(ThreadFailedError, match="timer thread of solo cannot go on: Boom"):
        pending.wait()
    assert errors_about(caplog, "timer thread of solo cannot go on")
    for call in (lambda: rpc.rpc_sync("solo", helpers.add, args=(1, 2)),
                 lambda: rpc.rpc_async("solo", helpers.add, args=(1, 2)),
                 lambda: rpc.remote("solo", helpers.add, args=(1, 2)),
                 rpc.get_worker_info):
        with pytest.raises(ThreadFailedError, match="has failed: .*init_rpc"):
            call()
    with pytest.raises(ThreadFailedError, match="timer thread"):
        rpc.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        rpc.get_worker_info()


def test_a_request_whose_serving_fails_costs_only_that_request(agent, caplog, monkeypatch):
    monkeypatch.setattr(agent.dispatch, "serve", raise_once(agent.dispatch.serve))
    with pytest.raises(RpcTimeoutError):
        rpc.rpc_async("solo", helpers.add, args=(1, 1), timeout=1.0).wait()
    # Served inline on a reader ("serving a CALL ...") or on the pool ("task ... failed").
    assert any(r.exc_info[0] is Boom for r in errors_about(caplog, ""))
    assert rpc.rpc_async("solo", helpers.add, args=(2, 2)).wait() == 4


def test_rref_sender_survives_and_still_flushes(agent, caplog, monkeypatch):
    control = agent.extensions[RREF_LAYER].control
    monkeypatch.setattr(control, "_send_deletes", raise_once(control._send_deletes))
    control._queue.put(("deletes", None))
    wait_for("an error about the RRef sender thread of solo",
             lambda: errors_about(caplog, "RRef sender thread of solo"), 10)
    control.flush(time.monotonic() + 10)  # the sender still answers
    assert control._sender.is_alive() and agent.failure is None
    assert rpc.remote("solo", helpers.add, args=(1, 2)).to_here() == 3


def test_a_release_that_fails_spares_the_other_workers(agent, caplog, monkeypatch):
    engine = agent.extensions[ENGINE]
    sent: List[int] = []

    def request(dst, kind, payload, *args, **kwargs):
        if dst.id == 5:
            raise KeyError("injected")
        sent.append(dst.id)
    monkeypatch.setattr(agent, "resolve", lambda rank: WorkerInfo(f"w{rank}", rank))
    monkeypatch.setattr(agent, "request", request)
    engine.contexts.owe(5, [1])
    engine.contexts.owe(6, [2])
    engine._flush_releases()
    assert sent == [6]
    assert errors_about(caplog, "sending autograd context releases")


# -- the transport's loops --------------------------------------------------------------------


class _Peer:
    """A bare transport that echoes CALL frames (through ``on_frame``, replaceable)."""

    def __init__(self, rank: int) -> None:
        self.closed: List[Any] = []
        self.fatal: List[Any] = []
        self.on_frame = self._echo
        self.t = Transport(rank, b"s" * 32, _wire.Limits(), lambda c: None,
                           lambda *a: self.on_frame(*a), lambda c, why: self.closed.append(why),
                           "127.0.0.1", features=handshake.FEATURE_SHM, shm_threshold=1 << 20,
                           same_host=lambda r: True, on_fatal=self.fatal.append)

    @staticmethod
    def _echo(conn, header, envelope, buffers) -> None:
        if header.kind == Kind.CALL:
            conn.send(Kind.RESPONSE, 0, header.request_id, bytes(envelope), [])

    def connect(self, other: "_Peer"):
        return self.t.connect(other.t.rank, *other.t.address, timeout=5)


@pytest.fixture
def peers():
    made: List[_Peer] = []

    def make(rank: int) -> _Peer:
        made.append(_Peer(rank))
        return made[-1]
    yield make
    for p in made:
        p.t.close()


def _call(conn, replies: "queue.Queue", rid: int) -> Any:
    conn.send(Kind.CALL, 0, rid, b"e", [])
    return replies.get(timeout=5)


def test_reader_survives_a_failing_frame_callback_and_reads_on(peers, caplog):
    a, b = peers(0), peers(1)
    b.on_frame = raise_once(b._echo)
    replies: "queue.Queue" = queue.Queue()
    a.on_frame = lambda conn, header, env, bufs: replies.put(header.request_id)
    conn = a.connect(b)
    conn.send(Kind.CALL, 0, 1, b"e", [])  # its frame callback raises: no reply
    wait_for("an error about the reader of the connection to rank 0",
             lambda: errors_about(caplog, "reader of the connection to rank 0"), 10)
    assert _call(conn, replies, 2) == 2
    assert not conn.closed and not b.closed


def test_accept_loop_survives_a_failure_and_accepts_the_next(peers, caplog, monkeypatch):
    a, b = peers(0), peers(1)
    monkeypatch.setattr(b.t._links, "spawn", raise_once(b.t._links.spawn, RuntimeError("can't start new thread")))
    with pytest.raises(RpcError):
        a.connect(b)
    wait_for("an error about torchrpc-accept-1",
             lambda: errors_about(caplog, "torchrpc-accept-1"), 10)
    replies: "queue.Queue" = queue.Queue()
    a.on_frame = lambda conn, header, env, bufs: replies.put(header.request_id)
    assert _call(a.connect(b), replies, 3) == 3
    assert not b.fatal


def test_accept_loop_that_cannot_go_on_tells_its_owner(peers, caplog, monkeypatch):
    a, b = peers(0), peers(1)

    def spawn(*args, **kwargs):
        raise RuntimeError("can't start new thread")
    monkeypatch.setattr(b.t._links, "spawn", spawn)
    monkeypatch.setattr(_threads, "_PAUSE", 0.0)
    for _ in range(_threads.IN_A_ROW):
        with pytest.raises(RpcError):
            a.connect(b)
    wait_for("b records a fatal error", lambda: b.fatal, 10)
    assert "torchrpc-accept-1 cannot go on: RuntimeError" in str(b.fatal[0])


def test_connection_tables_are_read_from_snapshots_while_connections_come(peers):
    # A WeakSet iterates in Python: without a snapshot under the lock, a connection added
    # meanwhile raised "Set changed size during iteration" in the timer's housekeeping.
    t = peers(0).t
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    stop = threading.Event()
    errors: List[BaseException] = []

    class Fake:
        features = handshake.FEATURE_SHM
        shm_tx = shm_rx = shm_decider = None
        closed = False
        peer_rank = 9

    keep: List[Fake] = []

    def add() -> None:
        while not stop.is_set():
            keep.append(Fake())
            t._links.register(keep[-1])
            if len(keep) > 200:
                del keep[:100]
    adder = threading.Thread(target=add)
    adder.start()
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            try:
                t.housekeeping()
                t.connections()
            except RuntimeError as exc:
                errors.append(exc)
                break
    finally:
        stop.set()
        adder.join()
        sys.setswitchinterval(interval)
    assert not errors, errors
