"""Liveness of peers that go silent (SIGSTOP: a hung host or a cut network looks the same).

A peer with calls outstanding is lost after heartbeat_timeout of silence, whether it was
busy (so never needed to send a heartbeat) or idle; its calls fail naming it, also
without an RPC timeout. A callee drops the private connections (readers and sockets) of
a caller that went silent. SIGCONT brings the worker back, and nothing that failed comes
back to life. One group serves the module: each stopped worker is continued afterwards,
and the group shuts down gracefully at the end.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import List, Tuple

import pytest

import torchrpc.rpc as rpc
from torchrpc._agent.current import current_agent
from torchrpc.errors import ConnectionLostError

from ..support import helpers
from ..support.group import sigstop, wait_for

HB_TIMEOUT = 2.0
# Calls that are running when their callee stops: longer than it takes to detect it, and
# over soon after it continues, so that their late replies arrive while the test looks.
RUNNING = 8.0
# The bound is heartbeat_timeout + 1 s; on this shared 2-core machine the timer
# and readers of the test process can lag, so the asserts allow 1 s more (the measured
# times are printed with -s).
BOUND = HB_TIMEOUT + 1.0
SLACK = 1.0


pytestmark = pytest.mark.group(
    3, threads=4, timeout=60.0, options={"heartbeat_timeout": HB_TIMEOUT})


def _stop(group, rank: int) -> float:
    sigstop(group.procs[rank].pid)
    return time.monotonic()


def _cont(group, rank: int) -> None:
    group.procs[rank].send_signal(signal.SIGCONT)


def _failure_times(futs: List, start: float, name: str) -> List[float]:
    times = []
    for f in futs:
        # Fail, not hang, where the peer is never found lost.
        wait_for(f"a call to {name} fails", f.done,
                 max(0.0, start + BOUND + SLACK + 5 - time.monotonic()))
        with pytest.raises(ConnectionLostError) as info:
            f.wait()
        times.append(time.monotonic() - start)
        assert info.value.worker == name and name in str(info.value), info.value
    return times


def _blocking_call(to: str, out: List[Tuple[float, BaseException]]) -> threading.Thread:
    """rpc_sync without a timeout in a thread (it reads a private connection itself)."""
    def run() -> None:
        try:
            rpc.rpc_sync(to, helpers.sleep_then, args=(RUNNING, 1), timeout=0)
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            out.append((time.monotonic(), exc))
    t = threading.Thread(target=run)
    t.start()
    return t


def _after_continue(group, rank: int, name: str, failed: List, stopped: float) -> None:
    """Continue worker ``rank``: it works again, and the calls that failed stay failed
    after their late replies have come (and been dropped)."""
    _cont(group, rank)
    deadline = time.monotonic() + 30
    while True:  # its first call may meet a connection it has yet to see closed
        try:
            assert rpc.rpc_sync(name, helpers.add, args=(2, 3), timeout=10) == 5
            break
        except ConnectionLostError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    time.sleep(max(0.0, stopped + RUNNING + 1.0 - time.monotonic()))
    for f in failed:
        with pytest.raises(ConnectionLostError):
            f.wait()
    assert current_agent().debug_info()["agent.num_pending_requests"] == 0


def test_a_busy_peer_that_stops_is_lost_and_its_calls_fail_without_a_timeout(group):
    # worker1 is kept busy replying for 3 s, so it never needs to send a heartbeat.
    start = time.monotonic()
    window: List = []
    n = 0
    while time.monotonic() - start < 3.0:
        window.append(rpc.rpc_async("worker1", helpers.echo, args=(n,), timeout=0))
        n += 1
        if len(window) >= 16:
            assert window.pop(0).wait() == n - 16
    assert rpc.get_debug_info()["agent.num_heartbeat_timeouts"] == 0
    blocked: List = []
    reader = _blocking_call("worker1", blocked)
    pending = [rpc.rpc_async("worker1", helpers.sleep_then, args=(RUNNING, i), timeout=0)
               for i in range(4)]
    time.sleep(0.2)
    stopped = _stop(group, 1)
    pending += [rpc.rpc_async("worker1", helpers.echo, args=(i,), timeout=0) for i in range(8)]
    try:
        times = _failure_times(pending, stopped, "worker1")
        reader.join(BOUND + SLACK + 5)
        assert blocked, "the blocking call did not fail"
        times.append(blocked[0][0] - stopped)
        assert isinstance(blocked[0][1], ConnectionLostError) and "worker1" in str(blocked[0][1])
        print(f"busy peer stopped: calls failed after {min(times):.2f}-{max(times):.2f} s",
              file=sys.stderr)
        assert max(times) < BOUND + SLACK, times
        assert rpc.get_debug_info()["agent.num_heartbeat_timeouts"] == 1
        # The others are untouched.
        assert rpc.rpc_sync("worker2", helpers.add, args=(1, 2)) == 3
    finally:
        _after_continue(group, 1, "worker1", pending, stopped)


def test_an_idle_peer_that_stops_is_lost_within_the_bound(group):
    assert rpc.rpc_sync("worker1", helpers.whoami) == "worker1"
    time.sleep(1.5)  # idle: worker1 sends heartbeats now
    before = rpc.get_debug_info()["agent.num_heartbeat_timeouts"]
    pending = [rpc.rpc_async("worker1", helpers.sleep_then, args=(RUNNING, i), timeout=0)
               for i in range(2)]
    blocked: List = []
    reader = _blocking_call("worker1", blocked)
    time.sleep(0.2)
    stopped = _stop(group, 1)
    try:
        times = _failure_times(pending, stopped, "worker1")
        reader.join(BOUND + SLACK + 5)
        assert blocked and isinstance(blocked[0][1], ConnectionLostError)
        times.append(blocked[0][0] - stopped)
        print(f"idle peer stopped: calls failed after {min(times):.2f}-{max(times):.2f} s",
              file=sys.stderr)
        assert max(times) < BOUND + SLACK, times
        assert rpc.get_debug_info()["agent.num_heartbeat_timeouts"] == before + 1
    finally:
        _after_continue(group, 1, "worker1", pending, stopped)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _readers_of(rank: int) -> int:
    """Threads of this process reading a connection from worker ``rank`` right now."""
    n = 0
    for frame in sys._current_frames().values():
        while frame is not None:
            if frame.f_code.co_name == "_next_frame":
                conn = frame.f_locals.get("self")
                if getattr(conn, "peer_rank", None) == rank:
                    n += 1
                    break
            frame = frame.f_back
    return n


def test_a_callee_drops_the_private_connections_of_a_caller_that_stops(group):
    agent = current_agent()
    assert rpc.rpc_sync("worker2", helpers.whoami) == "worker2"
    fds = _fds()
    opened = rpc.rpc_sync("worker2", helpers.open_private_connections, args=("worker0", 4))
    assert opened >= 2, opened  # several calls at once: several private connections
    with agent._lock:  # worker2's connections to this worker, read here
        private = [c for c in agent.connections.private.get(2, []) if not c.closed and not c.outbound]
    assert len(private) >= opened
    helpers_wait = time.monotonic() + 5
    while _readers_of(2) < len(private) + 1 and time.monotonic() < helpers_wait:
        time.sleep(0.05)  # each private connection's reader, and the shared one's
    assert _readers_of(2) >= len(private), _readers_of(2)
    assert _fds() >= fds + len(private)
    stopped = _stop(group, 2)
    try:
        wait_for("the private connections of the silent caller dropped",
                 lambda: not (_readers_of(2) or any(not c.closed for c in private)
                              or _registered_private(2)), BOUND + SLACK + 5,
                 state=lambda: (_readers_of(2), [c.closed for c in private],
                                _registered_private(2)))
        dropped = time.monotonic() - stopped
        print(f"silent caller: its {len(private)} private connections dropped after "
              f"{dropped:.2f} s", file=sys.stderr)
        assert all(c.closed for c in private)
        assert _readers_of(2) == 0
        assert dropped < BOUND + SLACK, dropped
        assert _fds() <= fds, (_fds(), fds)
        assert not _registered_private(2), _registered_private(2)
    finally:
        _after_continue(group, 2, "worker2", [], stopped)


def _registered_private(rank: int) -> list:
    """The private connections to or from ``rank`` the agent here still tracks."""
    agent = current_agent()
    with agent._lock:
        return [(c.outbound, c.closed) for c in agent.connections.private.get(rank, [])]
