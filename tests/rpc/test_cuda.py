"""CUDA tensors over RPC with device maps, on a real GPU (skipped without one).

The same cases as ``test_device_maps.py`` without the stand-in: a mapped CUDA tensor
arrives on the callee's mapped device and the reply comes back through the inverse map.
"""

from __future__ import annotations

import pytest
import torch

import torchrpc.rpc as rpc

from ..support import cuda as ch
from ..support.group import running_group

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MAPS = {"device_maps": {"worker1": {"cuda:0": "cuda:0"}}}


@pytest.fixture(scope="module")
def group():
    # New interpreters: a child of the test zygote could not use CUDA once it is touched.
    with running_group(2, threads=4, timeout=60.0, self_options=MAPS, fresh=True) as g:
        yield g


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
