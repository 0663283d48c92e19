"""No shared-memory segment outlives the workers that use it, even when all of them are
SIGKILLed at once: segments are memfds, never files in /dev/shm."""

from __future__ import annotations

import signal
import time

import torchrpc.rpc as rpc

from . import helpers
from .group import Group
from .test_transport import torchrpc_segments


def _memfd_mappings(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum("/memfd:torchrpc-" in line for line in f)


def test_segments_of_workers_killed_together_leave_nothing_behind():
    group = Group(3, threads=4, timeout=30.0, extra_env={"TORCHRPC_TEST_SERVE": "1"})
    try:
        group.init_self()
        pids = [p.pid for p in group.procs.values()]
        # worker1 sends 4 MiB tensors to worker2 (and gets them back) as fast as it can.
        assert rpc.rpc_sync("worker1", helpers.stream_to, args=("worker2", 4 << 20, 60.0))
        deadline = time.monotonic() + 20
        while not all(_memfd_mappings(pid) for pid in pids):
            assert time.monotonic() < deadline, "no shared memory between worker1 and worker2"
            time.sleep(0.05)
        for _ in range(20):  # while they run: not one file in /dev/shm
            assert torchrpc_segments(pids) == []
            time.sleep(0.02)
        for p in group.procs.values():
            p.send_signal(signal.SIGKILL)
        for p in group.procs.values():
            p.wait(10)
        assert torchrpc_segments(pids) == []
    finally:
        codes = group.abandon(30)
    assert codes == {1: -signal.SIGKILL, 2: -signal.SIGKILL}, codes
