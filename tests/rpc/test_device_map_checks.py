"""Device maps that do not fit the group fail ``init_rpc`` on every worker, with torch's
ValueError and wording: each worker publishes its CUDA device count and maps at
rendezvous and checks everyone's (``torchrpc/_agent/devices.py``)."""

from __future__ import annotations

import os

import pytest

import torchrpc.rpc as rpc

from ..support.group import Group

# cuda:63 is a device no machine of ours has.
@pytest.mark.parametrize("maps, words", [
    ({"worker1": {"cuda:63": "cpu"}},
     "Node worker0 has source devices with invalid indices in its device map for worker1"),
    ({"worker1": {"cpu": "cuda:63"}},
     "Node worker0 has target devices with invalid indices in its device map for worker1"),
    ({"worker9": {"cpu": "cpu"}}, "Node worker0 has invalid target node names in its "
                                  "device maps"),
])
def test_a_device_map_that_does_not_fit_the_group_fails_init_on_every_worker(maps, words):
    g = Group(2, timeout=30.0, self_options={"device_maps": maps})  # worker1 has no map
    with pytest.raises(ValueError, match="^" + words) as info:
        g.init_self()
    assert "device map" in str(info.value) and "\n" in str(info.value)
    assert not rpc.api._is_current_rpc_agent_set()
    assert g.wait(30) == {1: 1}  # worker1 read the same facts and failed alike


def test_two_sources_mapped_to_one_target_over_two_calls_fail_init():
    # Each call is 1-to-1; together they are not, which only init_rpc can tell (as torch).
    opts = rpc.TensorPipeRpcBackendOptions(device_maps={"worker1": {"cpu": "cpu"}})
    opts.set_device_map("worker1", {"cuda:63": "cpu"})
    g = Group(2, timeout=30.0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(g.port))
    with pytest.raises(ValueError, match="^Node worker0 has duplicated target devices in its "
                                         "device map for worker1"):
        rpc.init_rpc("worker0", rank=0, world_size=2, rpc_backend_options=opts)
    assert not rpc.api._is_current_rpc_agent_set()
    assert g.wait(30) == {1: 1}
