"""No shared-memory segment outlives the workers that use it, even when all of them are
SIGKILLed at once: segments are memfds, never files in /dev/shm; a peer that cannot open
this worker's memfds gets its large buffers over the socket."""

from __future__ import annotations

import os
import re
import signal
import time
from typing import Optional

import torch

import torchrpc.rpc as rpc

from ..support import helpers
from ..support.group import Group, running_group, wait_for
from .test_transport import torchrpc_segments

_MEMFD = re.compile(r"/memfd:torchrpc-\d+-(\d+)-")  # the creator's pid


def _memfd_mappings(pid: int, creator: Optional[int] = None) -> int:
    """How many mappings of torchrpc memfds process ``pid`` has (of ``creator``'s only)."""
    with open(f"/proc/{pid}/maps") as f:
        return sum(m is not None and (creator is None or int(m.group(1)) == creator)
                   for m in map(_MEMFD.search, f))


def test_segments_of_workers_killed_together_leave_nothing_behind():
    group = Group(3, threads=4, timeout=30.0, extra_env={"TORCHRPC_TEST_SERVE": "1"})
    try:
        group.init_self()
        pids = [p.pid for p in group.procs.values()]
        # worker1 sends 4 MiB tensors to worker2 (and gets them back) as fast as it can.
        assert rpc.rpc_sync("worker1", helpers.stream_to, args=("worker2", 4 << 20, 60.0))
        wait_for("shared memory between worker1 and worker2",
                 lambda: all(_memfd_mappings(pid) for pid in pids), 20)
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


def test_a_peer_that_cannot_see_our_pids_gets_no_shared_memory_and_the_same_data():
    # A peer in another pid namespace cannot open this worker's memfds (through /proc):
    # its large buffers go over the socket; what it sends here still uses shared memory.
    from torchrpc._agent.current import current_agent
    with running_group(2, threads=4, timeout=30.0) as group:
        agent = current_agent()
        agent._transport._links.same_pids = lambda rank: False  # before any large send
        x = torch.arange(1 << 20, dtype=torch.int32)  # 4 MiB
        for i in range(3):
            assert torch.equal(rpc.rpc_sync("worker1", helpers.echo, args=(x + i,)), x + i)
        here = rpc.get_debug_info()
        there = rpc.rpc_sync("worker1", helpers.debug_info)
        assert here["transport.shm_buffers_sent"] == 0, here
        assert there["transport.shm_buffers_received"] == 0, there
        assert there["transport.shm_buffers_sent"] >= 3
        assert here["transport.shm_buffers_received"] >= 3
        assert _memfd_mappings(group.procs[1].pid, creator=os.getpid()) == 0  # none of ours
        assert _memfd_mappings(os.getpid(), creator=group.procs[1].pid) >= 1
        assert torchrpc_segments([os.getpid(), group.procs[1].pid]) == []
