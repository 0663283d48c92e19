"""A worker that dies: pending and new calls fail fast naming it, the rest go on, and
graceful shutdown reports it instead of hanging."""

from __future__ import annotations

import signal
import threading
import time
from typing import List

import pytest
import torch

import torchrpc.autograd as dist_autograd
import torchrpc.rpc as rpc
from torchrpc._agent.current import current_agent
from torchrpc.errors import ConnectionLostError, ShutdownError
from torchrpc.optim import DistributedOptimizer

from ..support import helpers
from ..support.group import Group, running_group, sigstop, wait_for


def _fail_times(futs: List, start: float) -> List[float]:
    times = []
    for f in futs:
        with pytest.raises(ConnectionLostError) as info:
            f.wait()
        times.append(time.monotonic() - start)
        assert "worker2" in str(info.value)
        assert info.value.worker == "worker2"
    return times


def _shutdown_reports(name: str, limit: float) -> None:
    start = time.monotonic()
    with pytest.raises(ShutdownError, match=name):
        rpc.shutdown(graceful=True)
    assert time.monotonic() - start < limit


def _cleanup(group: Group) -> dict:
    return group.abandon(30)


def test_sigkill_fails_pending_and_new_calls_and_shutdown_names_the_worker():
    group = Group(3, threads=4, timeout=30.0)
    try:
        group.init_self()
        assert rpc.rpc_sync("worker2", helpers.whoami) == "worker2"
        assert rpc.rpc_sync("worker1", helpers.whoami) == "worker1"
        owned = rpc.remote("worker2", helpers.echo, args=(5,))
        assert owned.to_here() == 5
        # An optimizer with a parameter on worker2 (its step's reply is read by the caller).
        weight = rpc.remote("worker2", torch.zeros, args=(3,), kwargs={"requires_grad": True})
        optimizer = DistributedOptimizer(torch.optim.SGD, [weight], lr=0.1)
        x = torch.ones(3, requires_grad=True)
        ctx_cm = dist_autograd.context()
        ctx = ctx_cm.__enter__()  # a graph through worker2, kept until worker2 is dead
        through_2 = rpc.rpc_sync("worker2", helpers.add, args=(x, 1))
        futs = [rpc.rpc_async("worker2", helpers.sleep_then, args=(30.0,)) for _ in range(6)]
        # A to_here() blocked reading the reply of a creation still running on worker2
        # (both on one private connection).
        fetching = rpc.remote("worker2", helpers.sleep_then, args=(30.0, 1))
        fetched: list = []

        def fetch() -> None:
            try:
                fetching.to_here()
            except Exception as exc:  # noqa: BLE001 - checked below
                fetched.append((time.monotonic(), exc))
        fetcher = threading.Thread(target=fetch)
        fetcher.start()
        time.sleep(0.3)  # the calls are running on worker2
        start = time.monotonic()
        group.procs[2].send_signal(signal.SIGKILL)
        times = _fail_times(futs, start)
        assert max(times) < 2.0, times
        fetcher.join(5)
        assert fetched and fetched[0][0] - start < 2.0, fetched
        assert isinstance(fetched[0][1], ConnectionLostError) and "worker2" in str(fetched[0][1])
        # New calls fail the same way, at once.
        start = time.monotonic()
        with pytest.raises(ConnectionLostError, match="worker2") as info:
            rpc.rpc_sync("worker2", helpers.whoami)
        assert info.value.worker == "worker2" and time.monotonic() - start < 2.0
        # RRefs it owns raise, naming it; a backward pass that needs it fails, naming it.
        with pytest.raises(ConnectionLostError, match="worker2"):
            owned.to_here()
        with pytest.raises(RuntimeError, match="worker2"):
            dist_autograd.backward(ctx, [through_2.sum()])
        start = time.monotonic()
        with pytest.raises(ConnectionLostError, match="worker2"):
            optimizer.step(ctx)
        assert time.monotonic() - start < 2.0
        ctx_cm.__exit__(None, None, None)  # releasing it must not hang either
        # The others keep working with each other, both ways.
        assert rpc.rpc_sync("worker1", helpers.nested_call, args=("worker0", 2)) == \
            "worker1>worker0>worker1"
        # worker1 never talked to worker2; it learns of the loss at shutdown too.
        _shutdown_reports("worker2", 10.0)
    finally:
        codes = _cleanup(group)
    assert codes[1] == 1, codes  # worker1's shutdown raised too, it did not hang


def test_shutdown_finds_a_worker_that_died_unseen():
    # Nobody ever connects to worker2 before it dies.
    group = Group(3, threads=2, timeout=30.0)
    try:
        group.init_self()
        assert rpc.rpc_sync("worker1", helpers.whoami) == "worker1"
        group.kill(2)
        _shutdown_reports("worker2", 10.0)
    finally:
        codes = _cleanup(group)
    assert codes[1] == 1, codes


def test_shutdown_names_the_dead_worker_not_the_one_that_left_for_it():
    # worker1 finds worker2 dead at the shutdown barrier (its connection to it broke) and
    # leaves before this worker, which never connected to worker2, begins its shutdown:
    # this worker's error names worker2, as worker1's did.
    group = Group(3, threads=2, timeout=30.0)
    try:
        group.init_self()
        assert rpc.rpc_sync("worker1", helpers.nested_call, args=("worker2", 1)) == \
            "worker1>worker2"
        group.kill(2)
        wait_for("worker1 to leave the group", lambda: current_agent().registry.has_left(1), 15)
        _shutdown_reports("worker2", 10.0)
    finally:
        codes = _cleanup(group)
    assert codes[1] == 1, codes


def test_heartbeat_detects_a_silent_worker():
    # SIGSTOP: the socket stays open and nothing comes, as when a host dies or the network
    # is cut. Only heartbeats can tell. Rank 0 times a silent peer out after 1.5 s (the
    # default is 5 s, so that an overloaded worker is not taken for a dead one).
    group = Group(3, threads=4, timeout=30.0,
                  self_options={"heartbeat_interval": 0.5, "heartbeat_timeout": 1.5})
    try:
        group.init_self()
        assert rpc.rpc_sync("worker2", helpers.whoami) == "worker2"
        wait_for("a heartbeat from worker2 on the idle connection",
                 lambda: 2 in current_agent().liveness.beating, 10)
        futs = [rpc.rpc_async("worker2", helpers.sleep_then, args=(30.0, 1)) for _ in range(4)]
        time.sleep(0.2)
        start = time.monotonic()
        sigstop(group.procs[2].pid)
        times = _fail_times(futs, start)
        assert max(times) < 2.0, times
        assert rpc.rpc_sync("worker1", helpers.add, args=(1, 2)) == 3
        group.kill(2)
        _shutdown_reports("worker2", 10.0)
    finally:
        if group.procs[2].poll() is None:
            group.kill(2)
        codes = _cleanup(group)
    assert codes[1] == 1, codes


def test_a_silent_worker_that_runs_on_this_host_is_starved_not_dead():
    # Dozens of workers on a few cores: a worker's heartbeat thread may not run for
    # seconds. The kernel says it runs, so its silence does not make it dead.
    with running_group(2, threads=2, timeout=30.0,
                       self_options={"heartbeat_interval": 0.2, "heartbeat_timeout": 1.0}):
        assert rpc.rpc_sync("worker1", helpers.whoami) == "worker1"
        # worker1 has sent heartbeats: it is watched.
        wait_for("a heartbeat from worker1", lambda: 1 in current_agent().liveness.beating, 10)
        assert rpc.rpc_sync("worker1", helpers.stop_heartbeats)
        time.sleep(3.0)  # three heartbeat timeouts of silence
        assert rpc.get_debug_info()["agent.num_heartbeat_timeouts"] == 0
        assert rpc.rpc_sync("worker1", helpers.add, args=(1, 2)) == 3


def test_a_busy_peer_on_this_host_is_connected_to_again(monkeypatch):
    # Dozens of workers connecting at once: a handshake may time out although the peer
    # runs. Connecting tries again (here after two timed-out handshakes).
    with running_group(2, threads=2, timeout=30.0):
        agent = current_agent()
        real = agent._transport.connect
        failures = []

        def connect(*args, **kwargs):
            if len(failures) < 2:
                failures.append(1)
                raise ConnectionLostError("handshake failed: timed out") from TimeoutError()
            return real(*args, **kwargs)
        monkeypatch.setattr(agent._transport, "connect", connect)
        assert rpc.rpc_async("worker1", helpers.whoami).wait() == "worker1"
        assert len(failures) == 2
        monkeypatch.undo()
