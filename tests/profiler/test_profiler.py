"""RPCs appear in torch's profilers, with the callee's operators as remote events."""

from __future__ import annotations

import pytest
import torch

import torchrpc.rpc as rpc

from ..support import helpers


pytestmark = pytest.mark.group(2, threads=2, timeout=30.0, options={"profile_kineto": True})


def _names(events):
    return [e.name for e in events]


def test_autograd_profiler_records_rpcs_and_remote_ops():
    x = torch.ones(4)
    with torch.autograd.profiler.profile() as prof:
        fut = rpc.rpc_async("worker1", torch.add, args=(x, 1))
        assert torch.equal(fut.wait(), x + 1)
        assert rpc.rpc_sync("worker1", helpers.add, args=(x, x)).sum().item() == 8
        rref = rpc.remote("worker1", helpers.add, args=(1, 2))
        assert rref.to_here() == 3  # the remote event ends once the owner made the value
    names = _names(prof.function_events)
    async_name = "rpc_async#aten::add(worker0 -> worker1)"
    sync_name = "rpc_sync#add(worker0 -> worker1)"  # torch's key: the __qualname__
    assert async_name in names and sync_name in names, names
    assert "rpc_remote#add(worker0 -> worker1)" in names, names
    rpc_event = next(e for e in prof.function_events if e.name == async_name)
    assert rpc_event.cpu_time_total > 0
    remote_ops = [n for n in names if n.startswith(async_name + "#remote_op: ")]
    assert any("aten::add" in n for n in remote_ops), names


def test_kineto_profiler_records_rpcs():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        rpc.rpc_sync("worker1", torch.mul, args=(torch.ones(2), 3))
    names = _names(prof.events())
    assert "rpc_sync#aten::mul(worker0 -> worker1)" in names, names
    assert any(n.startswith("rpc_sync#aten::mul(worker0 -> worker1)#remote_op: aten::mul")
               for n in names), names


def test_no_profiler_no_events_and_plain_future():
    fut = rpc.rpc_async("worker1", helpers.add, args=(1, 1))
    assert type(fut).__name__ == "RpcFuture" and fut.wait() == 2
