"""The CUDA IPC release protocol between workers over real sockets, on any machine: a
receiver's ``CUDA_RELEASE`` makes its sender drop the shares it names (those it holds for
that receiver only), and a receiver that dies has every share held for it dropped once it
is lost. The shares here are entries of the sender's table without GPU memory behind them
(sharing memory needs a GPU: tests/rpc/test_cuda.py kills a receiver holding real ones).

A group of three serves the module; worker2 is SIGKILLed in the last test.
"""

from __future__ import annotations

import signal
import time

import pytest

import torchrpc.rpc as rpc
from torchrpc._agent.current import current_agent
from torchrpc._agent.hooks import CUDA_IPC

from ..support import cuda as ch
from ..support.group import serving_group, wait_for

HB_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def group():
    with serving_group(3, {1: 0, 2: -signal.SIGKILL}, HB_TIMEOUT) as g:
        yield g


def _hold(peer: int, n: int):
    """Note ``n`` shares held for worker ``peer`` in this worker's table; their ids."""
    table = current_agent().extensions[CUDA_IPC].shares
    ids = [max(table.outstanding, default=0) + 1 + i for i in range(n)]
    for share_id in ids:
        table.outstanding[share_id] = (peer, ("snapshot", "event"))
    return ids


def _held(peer: int):
    return sorted(i for i, (rank, _) in current_agent().extensions[CUDA_IPC]
                  .shares.outstanding.items() if rank == peer)


def test_a_receivers_release_drops_the_shares_it_names(group):
    ones, twos = _hold(1, 3), _hold(2, 2)
    assert rpc.rpc_sync("worker1", ch.acknowledge, args=(0, ones[:2]), timeout=10) == 1
    wait_for("worker1's release", lambda: _held(1) == ones[2:], 10.0, lambda: _held(1))
    assert _held(2) == twos
    info = rpc.api._get_current_rpc_agent().debug_info("cuda_ipc")
    assert info["cuda_ipc_shares_held"] == 3 and info["cuda_ipc_shares_released"] >= 2
    rpc.rpc_sync("worker1", ch.acknowledge, args=(0, ones[2:]), timeout=10)
    wait_for("worker1's second release", lambda: _held(1) == [], 10.0, lambda: _held(1))


def test_a_release_of_shares_held_for_another_worker_is_ignored(group):
    ones, twos = _hold(1, 1), _held(2)
    # worker2 names worker1's share: not its own to release.
    rpc.rpc_sync("worker2", ch.acknowledge, args=(0, ones + twos[:1]), timeout=10)
    wait_for("worker2's release", lambda: _held(2) == twos[1:], 10.0, lambda: _held(2))
    assert _held(1) == ones
    rpc.rpc_sync("worker1", ch.acknowledge, args=(0, ones), timeout=10)
    wait_for("worker1's release", lambda: _held(1) == [], 10.0, lambda: _held(1))


def test_the_shares_held_for_a_receiver_that_dies_are_dropped_once_it_is_lost(group):
    twos = _held(2) + _hold(2, 3)
    ones = _hold(1, 1)
    group.kill(2)
    killed = time.monotonic()
    wait_for("shares of the killed worker2 dropped", lambda: _held(2) == [],
             HB_TIMEOUT + 10.0, lambda: _held(2))
    print(f"shares of a killed receiver dropped after {time.monotonic() - killed:.2f} s")
    assert len(twos) == 4 and _held(1) == ones
