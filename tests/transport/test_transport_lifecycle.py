"""Shared-memory segments never outlive their group, and large echoes stay within 3x RSS.

Both start their own worker processes: the leak test kills two of them with SIGKILL,
the memory test measures fresh processes' peak RSS.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import torchrpc.rpc as rpc

from ..support import helpers
from ..support import transport as th
from ..support.group import Group, free_port, sigstop, start_module, wait_for, worker_env
from .test_transport import LARGE, THRESHOLD, torchrpc_segments


def _memfds(pid: int) -> int:
    """Shared-memory segments (memfds) process ``pid`` has open."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:torchrpc-")
        except OSError:
            pass  # closed meanwhile
    return n


def test_no_segment_files_left_after_sigkill():
    """Segments of killed workers, and segments sent to killed workers, are removed: they
    are memfds, never files, and a sender lets go of those of a connection that died."""
    group = Group(4, threads=4, timeout=30.0, options={"shm_threshold": THRESHOLD})
    pids = [os.getpid()] + [p.pid for p in group.procs.values()]
    before = _memfds(os.getpid())
    try:
        group.init_self()
        for r in (1, 2, 3):
            assert rpc.rpc_sync(f"worker{r}", helpers.whoami) == f"worker{r}"
        # worker2 talks to worker1 already; then worker1 stops reading, and worker0 and
        # worker2 each send it a large tensor: two segments exist that nobody will map.
        assert rpc.rpc_sync("worker2", helpers.nested_call, args=("worker1", 1)) == "worker2>worker1"
        sigstop(group.procs[1].pid)
        fut = rpc.rpc_async("worker1", th.hold, args=("x", torch.ones(LARGE)), timeout=0)
        rpc.rpc_sync("worker2", th.fire, args=("worker1", LARGE))
        wait_for("worker0 and worker2 each make a segment",
                 lambda: _memfds(os.getpid()) > before and _memfds(group.procs[2].pid) >= 1, 10,
                 state=lambda: (before, _memfds(os.getpid()), _memfds(group.procs[2].pid)))
        assert not torchrpc_segments(pids)
        # Both die: worker2 (the creator of one) and worker1 (the would-be receiver).
        group.kill(2)
        group.kill(1)
        with pytest.raises(Exception):
            fut.wait()
        assert rpc.rpc_sync("worker3", helpers.whoami) == "worker3"  # the rest go on
        # This sender lets go of what it sent worker1 once its connection is closed, which
        # may come a moment after the call failed (the peer was found lost first).
        wait_for("worker0 to let go of its segment", lambda: _memfds(os.getpid()) == before,
                 10, state=lambda: (before, _memfds(os.getpid())))
    finally:
        group.abandon(30)
    assert not torchrpc_segments(pids)
    assert _memfds(os.getpid()) == before  # and a stopped agent holds none


@pytest.mark.parametrize("shm_on", [True, False], ids=["shm", "socket"])
def test_echo_of_256mb_keeps_peak_rss_within_the_payloads_it_holds(tmp_path, shm_on):
    payload = 256 << 20
    port = free_port()
    out = tmp_path / "rss.json"
    env = worker_env(port, 2, {"SHM": "1" if shm_on else "0", "PAYLOAD": str(payload)})
    # New interpreters: a forked worker would count the zygote's pages in its peak RSS.
    procs = [start_module("tests.support.transport", ["memory", str(r), str(port), str(out)],
                          env, fresh=True) for r in (0, 1)]
    try:
        codes = [p.wait(120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0, 0]
    report = json.loads(out.read_text())
    assert report["ok"]
    # The bound is on what the echo adds above the process's own baseline (Python plus
    # torch, about 230 MiB here), with 32 MiB for the allocator: the caller holds two
    # payloads at once (sent and echoed), the callee one; no transport copy stays alive.
    slack_kib = 32 << 10
    for who, payloads in (("caller", 2), ("callee", 1)):
        growth = report[who]["vmhwm_kib"] - report["base"][who]["vmhwm_kib"]
        assert growth <= payloads * payload // 1024 + slack_kib, \
            (who, growth // 1024, "MiB above baseline", report)
