"""CUDA tensors over RPC with device maps, on a real GPU (skipped without one).

The same cases as ``test_device_maps.py`` without the stand-in: a mapped CUDA tensor
arrives on the callee's mapped device and the reply comes back through the inverse map.
Between workers of this host they cross through CUDA IPC (``torchrpc/_agent/cuda_ipc.py``):
with copy semantics (the caller may change its tensor once ``rpc_async`` returns), with
the receiver's stream waiting for the sender's (a reply still being written arrives
whole), and with the sender's memory released when the receiver has copied it or died.
Gradients of tensors that crossed go back to the device each came from.

Four workers: worker1 and worker2 map cuda:0 to cuda:0 (worker2 kills itself in the last
test), worker3 maps cuda:0 to cuda:1 where there are two GPUs.
"""

from __future__ import annotations

import signal

import pytest
import torch

import torchrpc.autograd as dist_autograd
import torchrpc.rpc as rpc
from torchrpc._agent.current import current_agent
from torchrpc._agent.hooks import CUDA_IPC
from torchrpc.errors import ConnectionLostError

from ..support import cuda as ch
from ..support.group import Group, wait_for

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
MAPS = {"device_maps": {"worker1": {"cuda:0": "cuda:0"}, "worker2": {"cuda:0": "cuda:0"},
                        "worker3": {"cuda:0": "cuda:1" if TWO_GPUS else "cuda:0"}},
        "heartbeat_timeout": 2.0}
SPIN = 200_000_000  # GPU cycles: a tenth of a second or more on any recent GPU
MB = 1 << 20


@pytest.fixture(scope="module")
def group():
    # New interpreters: a child of the test zygote could not use CUDA once it is touched.
    g = Group(4, threads=4, timeout=60.0, self_options=MAPS, fresh=True,
              options={"heartbeat_timeout": 2.0}, extra_env={"TORCHRPC_TEST_SERVE": "1"})
    try:
        g.init_self()
        yield g
    finally:
        codes = g.stop_serving_and_abandon(60)
    assert codes[1] == 0 and codes[3] == 0, codes


def _shares():
    return current_agent().extensions[CUDA_IPC].shares


def _counts(name: str = "worker0"):
    if name == "worker0":
        return ch.cuda_ipc_counts()
    return rpc.rpc_sync(name, ch.cuda_ipc_counts)


def test_a_cuda_tensor_arrives_on_the_mapped_device_and_its_reply_comes_back(group):
    x = torch.arange(4.0, device="cuda:0")
    assert rpc.rpc_sync("worker1", ch.where, args=(x,)) == "Tensor on cuda:0"
    out = rpc.rpc_sync("worker1", torch.add, args=(x, 1))
    assert out.device == torch.device("cuda:0")
    assert out.cpu().tolist() == [1.0, 2.0, 3.0, 4.0]


def test_several_cuda_tensors_of_one_message_each_arrive_with_their_values(group):
    xs = [torch.full((100,), float(i), device="cuda:0") for i in range(4)]
    out = rpc.rpc_sync("worker1", ch.add_all, args=("label", *xs))
    assert out.device == torch.device("cuda:0") and out.cpu().tolist() == [6.0] * 100


def test_a_cuda_tensor_to_a_worker_without_a_map_fails_with_torchs_error(group):
    said = rpc.rpc_sync("worker1", ch.send_cuda, args=("worker0",))
    assert said.startswith("DeviceMapError: TensorPipe RPC backend only supports CPU tensors"), said


def test_between_workers_of_this_host_tensors_cross_by_cuda_ipc_and_are_released(group):
    before, callee_before = _counts(), _counts("worker1")
    x = torch.arange(16 * MB // 4, dtype=torch.float32, device="cuda:0")
    out = rpc.rpc_sync("worker1", torch.mul, args=(x, 2))
    assert torch.equal(out, x * 2)
    # The request's share (here) and the reply's (on worker1) are released once copied.
    wait_for("worker0's share released", lambda: _counts()["cuda_ipc_shares_held"] == 0, 10.0,
             _counts)
    assert _counts()["cuda_ipc_shares_released"] > before["cuda_ipc_shares_released"]
    wait_for("worker1's share released",
             lambda: _counts("worker1")["cuda_ipc_shares_held"] == 0, 10.0,
             lambda: _counts("worker1"))
    assert (_counts("worker1")["cuda_ipc_shares_released"]
            > callee_before["cuda_ipc_shares_released"])


def test_the_callee_sees_the_values_sent_though_the_caller_changes_its_tensor_at_once(group):
    x = torch.ones(4 * MB, device="cuda:0")
    torch.cuda._sleep(SPIN)  # the send and the change below queue up behind this
    fut = rpc.rpc_async("worker1", ch.cuda_sum_later, args=(x, SPIN))
    x.add_(1)
    x.mul_(10)
    assert fut.wait() == float(4 * MB)
    assert x[0].item() == 20.0


@pytest.mark.parametrize("side_stream", [False, True], ids=["its-stream", "side-stream"])
def test_a_reply_still_being_written_by_the_callee_arrives_whole(group, side_stream):
    out = rpc.rpc_sync("worker1", ch.written_late, args=(MB, SPIN, side_stream))
    assert out.device == torch.device("cuda:0")
    assert torch.equal(out, torch.full((MB,), 3.0, device="cuda:0"))


def test_an_rref_to_a_cuda_value_fetches_it_through_the_inverse_map(group):
    x = torch.arange(8.0, device="cuda:0")
    rref = rpc.remote("worker1", torch.add, args=(x, 1))
    got = rref.to_here()
    assert got.device == torch.device("cuda:0") and torch.equal(got, x + 1)


def test_a_gradient_returns_to_the_device_its_tensor_came_from_on_one_gpu(group):
    x = torch.arange(4.0, device="cuda:0", requires_grad=True)
    with dist_autograd.context() as ctx:
        y = rpc.rpc_sync("worker1", torch.mul, args=(x, 3.0))
        z = rpc.rpc_sync("worker1", torch.add, args=(y, x))  # a tensor that came in a reply
        dist_autograd.backward(ctx, [(z * z).sum()])
        grads = dist_autograd.get_gradients(ctx)
    g = grads[x]
    assert g.device == torch.device("cuda:0")
    # d/dx (3x + x)^2 = 2 * 4x * 4
    assert torch.allclose(g, 32 * x.detach())


@pytest.mark.skipif(not TWO_GPUS, reason="needs two GPUs: worker3 maps cuda:0 to cuda:1")
def test_a_gradient_returns_through_the_inverse_map_to_another_device(group):
    x = torch.arange(4.0, device="cuda:0", requires_grad=True)
    assert rpc.rpc_sync("worker3", ch.where, args=(x,)) == "Tensor on cuda:1"
    with dist_autograd.context() as ctx:
        y = rpc.rpc_sync("worker3", torch.mul, args=(x, 3.0))
        assert y.device == torch.device("cuda:0")
        dist_autograd.backward(ctx, [y.sum()])
        g = dist_autograd.get_gradients(ctx)[x]
    assert g.device == torch.device("cuda:0") and g.cpu().tolist() == [3.0] * 4


def test_a_callee_that_dies_mid_call_has_the_callers_shared_memory_released(group):
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated(0)
    x = torch.ones(64 * MB // 4, device="cuda:0")
    torch.cuda._sleep(SPIN * 5)  # the receiver's copy waits for this: no release before it dies
    fut = rpc.rpc_async("worker2", ch.die, args=(x,))
    assert _shares().held_for(2) == 1  # the snapshot, kept for worker2
    with pytest.raises(RuntimeError) as info:
        fut.wait()
    assert isinstance(info.value, ConnectionLostError) or "worker2" in str(info.value)
    wait_for("the share held for the dead worker2 dropped",
             lambda: _shares().held_for(2) == 0, 15.0, _counts)
    del x, fut
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated(0) <= baseline  # the snapshot is freed
    assert group.procs[2].wait(10) in (3, -signal.SIGKILL)


def test_a_remote_module_on_a_cuda_device_takes_and_returns_mapped_tensors(group):
    from torchrpc.nn import RemoteModule
    remote = RemoteModule("worker1/cuda:0", torch.nn.Linear, args=(4, 2))
    x = torch.ones(3, 4, device="cuda:0")
    out = remote.forward(x)
    assert out.device == torch.device("cuda:0") and out.shape == (3, 2)
    params = [p.to_here() for p in remote.remote_parameters()]
    assert all(p.device == torch.device("cuda:0") for p in params)
    weight, bias = params
    assert torch.allclose(out, x @ weight.t() + bias)
