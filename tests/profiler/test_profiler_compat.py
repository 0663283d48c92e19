"""Profiling as torch's RPC does it: torch's keys, remote events with the callee's rank,
durations, shapes and memory, nested calls, ``rpc.remote``, server-side profiles, GIL
wait times and distributed autograd."""

from __future__ import annotations

import concurrent.futures
import time
import warnings

import pytest
import torch
from torch.autograd.profiler import record_function
from torch.autograd.profiler_legacy import profile as legacy_profile

import torchrpc.autograd as dist_autograd
import torchrpc.rpc as rpc
from torchrpc.rpc.internal import RPCExecMode, _build_rpc_profiling_key


REMOTE_OP = "#remote_op: "

warnings.filterwarnings("ignore", message=".*profiler_legacy.profile.*deprecated")


pytestmark = pytest.mark.group(3, threads=4, timeout=30.0)


# -- functions the workers run ---------------------------------------------------------------------

def ops(n: int = 4) -> torch.Tensor:
    """A few operators, as torch's tests profile them."""
    t = torch.add(torch.ones(n), torch.ones(n))
    return torch.mul(t, t).relu().sigmoid()


def timed_block(seconds: float) -> torch.Tensor:
    """A block of known duration around one operator."""
    with record_function("timed_block"):
        time.sleep(seconds)
        return torch.ones(2) * 2


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.add(a, b)


def slow_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    time.sleep(0.2)
    return torch.add(x, y)


@rpc.functions.async_execution
def async_slow_add(to: str, x: torch.Tensor, y: torch.Tensor) -> torch.futures.Future:
    return rpc.rpc_async(to, slow_add, args=(x, y))


def get_requests(profile_rref: rpc.RRef) -> list:
    return [[e.name for e in request]
            for request in profile_rref.local_value().process_global_function_events]


def worker_rank() -> int:
    return rpc.get_worker_info().id


def _remote(events):
    return [e for e in events if e.is_remote]


def _key(mode: RPCExecMode, func, dst: str) -> str:
    name = func if isinstance(func, str) else func.__qualname__
    return _build_rpc_profiling_key(mode, name, "worker0", dst)


# -- tests -----------------------------------------------------------------------------------------

def test_keys_node_ids_and_remote_events():
    with legacy_profile() as prof:
        rpc.rpc_async("worker1", ops).wait()
    events = prof.function_events
    key = _key(RPCExecMode.ASYNC, ops, "worker1")
    rpc_event = next(e for e in events if e.name == key)
    assert rpc_event.node_id == 0 and not rpc_event.is_remote
    remote = {e.name: e for e in _remote(events)}
    for op in ("aten::ones", "aten::add", "aten::mul", "aten::relu", "aten::sigmoid"):
        assert key + REMOTE_OP + op in remote, sorted(remote)
    assert all(e.node_id == 1 for e in remote.values())
    # Remote events lie within the RPC event, and local events carry this worker's rank.
    assert all(rpc_event.time_range.start <= e.time_range.start for e in remote.values())
    assert all(e.node_id == 0 for e in events if not e.is_remote)


def test_remote_events_keep_the_callee_durations():
    with legacy_profile() as prof:
        rpc.rpc_sync("worker2", timed_block, args=(0.3,))
    key = _key(RPCExecMode.SYNC, timed_block, "worker2")
    block = next(e for e in prof.function_events if e.name == key + REMOTE_OP + "timed_block")
    assert block.is_remote and block.node_id == 2
    assert 0.3e6 <= block.cpu_time_total < 5e6
    children = [c.name for c in block.cpu_children]
    assert key + REMOTE_OP + "aten::mul" in children, children


def test_builtin_and_script_keys():
    with legacy_profile() as prof:
        rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
    names = [e.name for e in prof.function_events]
    assert _key(RPCExecMode.SYNC, "aten::add", "worker1") in names, names


def test_record_shapes_and_memory_follow_the_caller():
    a, b = torch.ones(100), torch.ones(100)
    with legacy_profile(record_shapes=True) as prof:
        rpc.rpc_sync("worker1", add, args=(a, b))
    remote_add = next(e for e in _remote(prof.function_events) if e.name.endswith("aten::add"))
    assert remote_add.input_shapes == [[100], [100], []]
    with legacy_profile(profile_memory=True) as prof:
        rpc.rpc_sync("worker1", ops, args=(1000,))
    assert any(e.cpu_memory_usage > 0 for e in _remote(prof.function_events))
    with legacy_profile() as prof:
        rpc.rpc_sync("worker1", ops, args=(1000,))
    assert {e.cpu_memory_usage for e in prof.function_events} == {0}
    assert all(not e.input_shapes for e in _remote(prof.function_events))


def test_nested_rpc_of_an_async_function():
    with legacy_profile() as prof:
        rpc.rpc_async("worker1", async_slow_add, args=("worker2", torch.ones(2), torch.ones(2)),
                      timeout=20).wait()
    outer = _key(RPCExecMode.ASYNC, async_slow_add, "worker1")
    nested = _build_rpc_profiling_key(RPCExecMode.ASYNC, slow_add.__qualname__, "worker1",
                                      "worker2")
    by_name = {e.name: e for e in _remote(prof.function_events)}
    nested_event = by_name[outer + REMOTE_OP + nested]
    assert nested_event.node_id == 1
    assert nested_event.cpu_time_total >= 0.2e6  # it ended when worker2 replied
    assert by_name[outer + REMOTE_OP + nested + REMOTE_OP + "aten::add"].node_id == 2


def test_remote_ends_when_the_owner_made_the_value():
    for dst, rank in (("worker1", 1), ("worker0", 0)):
        with legacy_profile() as prof:
            rref = rpc.remote(dst, ops)
            rref._get_profiling_future().wait()
        key = _key(RPCExecMode.REMOTE, ops, dst)
        events = prof.function_events
        assert any(e.name == key and e.node_id == 0 for e in events), [e.name for e in events]
        remote = [e for e in events if e.name.startswith(key + REMOTE_OP)]
        assert remote and all(e.node_id == rank and e.is_remote for e in remote)
        assert torch.equal(rref.to_here(), ops())
    with pytest.raises(RuntimeError, match="Profiling future has not been set"):
        rpc.remote("worker1", ops)._get_profiling_future()


def test_profiles_on_two_threads_keep_their_own_events():
    def one(dst: str) -> set:
        with legacy_profile() as prof:
            rpc.rpc_async(dst, ops).wait()
        return {e.node_id for e in _remote(prof.function_events)}

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(one, dst) for dst in ("worker1", "worker2") * 3]
        results = [f.result() for f in futures]
    assert results == [{1}, {2}] * 3


@pytest.mark.parametrize("profiler", ["torch.profiler", "torch.autograd.profiler"])
def test_kineto_profiles_record_no_rpc_by_default(profiler):
    # As torch's RPC: only the legacy profiler records RPCs (option profile_kineto).
    kineto = torch.profiler.profile if profiler == "torch.profiler" \
        else torch.autograd.profiler.profile
    with kineto() as prof:
        first = rpc.rpc_async("worker1", ops)
        assert torch.equal(rpc.rpc_async("worker1", ops).wait(), first.wait())
        assert rpc.remote("worker1", ops).to_here() is not None
    events = prof.events() if profiler == "torch.profiler" else prof.function_events
    names = [e.name for e in events]
    assert not [n for n in names if n.startswith("rpc_")], names
    assert "aten::add" not in names, names  # the callee's operators were not profiled


def test_server_process_global_profile():
    x, y = torch.tensor(1), torch.tensor(2)
    outer = rpc.remote("worker1", rpc._server_process_global_profile)
    outer.rpc_sync().__enter__()
    rpc.rpc_sync("worker1", torch.add, (x, y))
    inner = rpc.remote("worker1", rpc._server_process_global_profile,
                       kwargs={"record_shapes": True})
    inner.rpc_sync().__enter__()
    rpc.rpc_sync("worker1", torch.sub, (x, y))
    inner.rpc_sync().__exit__(None, None, None)
    outer.rpc_sync().__exit__(None, None, None)
    rpc.rpc_sync("worker1", torch.mul, (x, y))  # after both: in neither
    assert rpc.rpc_sync("worker1", get_requests, (inner,)) == [["aten::sub"]]
    outer_requests = rpc.rpc_sync("worker1", get_requests, (outer,))
    assert sorted(outer_requests) == [["aten::add"], ["aten::sub"]]
    assert "aten::sub" in str(inner.rpc_sync().key_averages())


def test_gil_profiling():
    assert "agent.gil_average_wait_time_us" not in rpc.api._get_current_rpc_agent().get_debug_info()
    rpc.enable_gil_profiling(True)
    try:
        rpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), 1))
        info = rpc.api._get_current_rpc_agent().get_debug_info()
        assert info["agent.gil_average_wait_time_us"] >= 0
    finally:
        rpc.enable_gil_profiling(False)
    assert "agent.gil_average_wait_time_us" not in rpc.api._get_current_rpc_agent().get_debug_info()


def test_profiling_inside_a_distributed_autograd_context():
    t1 = torch.rand(3, 3, requires_grad=True)
    t2 = torch.rand(3, 3, requires_grad=True)
    with legacy_profile() as prof, dist_autograd.context():
        rpc.rpc_async("worker1", torch.mul, args=(t1, t2)).wait()
    assert any(e.name.endswith(REMOTE_OP + "aten::mul") and e.node_id == 1
               for e in _remote(prof.function_events))
    with dist_autograd.context() as context_id:
        with legacy_profile() as prof:
            loss = rpc.rpc_async("worker1", torch.mul, args=(t1, t2)).wait().sum()
        assert any(e.name.endswith(REMOTE_OP + "aten::mul") and e.node_id == 1
                   for e in _remote(prof.function_events))
        with torch.autograd.profiler.profile() as prof:
            dist_autograd.backward(context_id, [loss])
        events = prof.function_events
        backward = next(e for e in events if e.name == "torch::distributed::autograd::backward")
        for name in ("SendRpcBackward", "RecvRpcBackward"):
            part = next(e for e in events if name in e.name)
            assert backward.cpu_time_total > part.cpu_time_total
        grads = dist_autograd.get_gradients(context_id)
    assert torch.allclose(grads[t1], t2) and torch.allclose(grads[t2], t1)


def test_no_profiler_no_remote_profiling():
    fut = rpc.rpc_async("worker1", worker_rank)
    assert type(fut).__name__ == "RpcFuture" and fut.wait() == 1
