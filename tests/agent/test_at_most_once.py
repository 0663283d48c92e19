"""At most once: a request whose connection broke after it was delivered does not run
again on the callee (here a part of a backward pass, which would add its gradients
twice): the caller asks the callee first (a probe) and does not send it again. And a
reply goes back on the connection its request came on, the one the caller watches."""

from __future__ import annotations

import threading
from typing import List

import pytest
import torch

import torchrpc.autograd as dist_autograd
import torchrpc.rpc as rpc
from torchrpc._agent.current import current_agent
from torchrpc.errors import ConnectionLostError

from ..support import helpers, robust
from ..support.group import wait_for


pytestmark = pytest.mark.group(2, threads=4, timeout=30.0)


def _cut(rank: int) -> int:
    """Break every connection of this worker with ``rank`` (as a network fault would)."""
    conns = [c for c in current_agent()._transport.connections() if c.peer_rank == rank]
    for c in conns:
        c.close(ConnectionLostError("connection cut by the test"))
    return len(conns)


def test_a_backward_part_whose_connection_broke_after_delivery_runs_once():
    before = rpc.rpc_sync("worker1", helpers.debug_info)["agent.num_duplicate_requests"]
    mine = rpc.get_debug_info()
    with dist_autograd.context() as ctx:
        x = torch.ones(4, requires_grad=True)
        y = rpc.rpc_sync("worker1", helpers.scale_slowly, args=(x,))
        errors: List[BaseException] = []

        def backward() -> None:
            try:
                dist_autograd.backward(ctx, [y.sum()])
            except BaseException as exc:  # noqa: BLE001 - checked below
                errors.append(exc)
        t = threading.Thread(target=backward)
        t.start()
        # worker1 runs its part (2 s): the request was delivered.
        wait_for("worker1 runs its part", lambda: rpc.rpc_sync(
            "worker1", robust.count, args=("backward",)) >= 1, 10)
        assert _cut(1) >= 2  # the shared connection and the private one the part went on
        t.join(30)
        assert not t.is_alive() and not errors, errors
        assert rpc.rpc_sync("worker1", robust.count, args=("backward",)) == 1
        assert torch.equal(rpc.rpc_sync("worker1", helpers.weight_gradient, args=(ctx,)),
                           torch.ones(4))
        assert torch.equal(dist_autograd.get_gradients(ctx)[x], torch.full((4,), 3.0))
    # The probe found the part running there: the frame was not sent again.
    info = rpc.rpc_sync("worker1", helpers.debug_info)
    assert info["agent.num_duplicate_requests"] == before, info
    now = rpc.get_debug_info()
    # One probe, then one a second later for each second the part still ran (see _RECHECK).
    assert now["agent.num_once_probes"] >= mine["agent.num_once_probes"] + 1, now
    assert now["agent.num_resends_avoided"] == mine["agent.num_resends_avoided"] + 1, now
    assert now["agent.num_resends_after_probe"] == mine["agent.num_resends_after_probe"], now


def test_replies_kept_for_a_resend_go_once_the_caller_has_them():
    # Each backward part's reply carries the gradient of x (1 MiB); worker1 keeps it for a
    # resend only until this worker's next at-most-once request says it arrived.
    x = torch.ones(65536, 4, requires_grad=True)
    for _ in range(30):
        with dist_autograd.context() as ctx:
            y = rpc.rpc_sync("worker1", helpers.times_weight, args=(x,))
            dist_autograd.backward(ctx, [y.sum()])
            assert torch.equal(dist_autograd.get_gradients(ctx)[x], torch.full((65536, 4), 3.0))
    info = rpc.rpc_sync("worker1", helpers.debug_info)
    assert info["agent.num_remembered_requests"] >= 30, info  # each still runs at most once
    assert info["agent.num_kept_replies"] <= 2, info


def test_a_reply_goes_back_on_the_connection_its_request_came_on():
    # worker1's current connection to this worker swallows what it writes (a link that
    # broke while worker1 has not noticed); a reply sent there would never arrive.
    assert rpc.rpc_sync("worker1", robust.black_hole_current_connection, args=(0,))
    try:
        # rpc_async: on the shared connection (an rpc_sync may take a private one).
        for _ in range(3):
            assert rpc.rpc_async("worker1", helpers.whoami, timeout=5).wait() == "worker1"
        assert rpc.rpc_async("worker1", helpers.add, args=(torch.ones(2), 1),
                             timeout=5).wait().tolist() == [2.0, 2.0]
    finally:
        assert rpc.rpc_sync("worker1", robust.close_black_holes, timeout=10) == 1
