"""torch's checks of the group's device maps on published facts (no sockets): each failure
is torch's ValueError, its first line torch's words."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from torchrpc._agent import devices
from torchrpc._agent.worker import WorkerInfo
from torchrpc.errors import DeviceMapError


def _infos(*workers):
    """Published facts by rank, from (device count, maps, devices) per worker."""
    out = {}
    for rank, (count, maps, devs) in enumerate(workers):
        out[rank] = {"name": f"w{rank}", "device_count": count}
        if maps:
            out[rank]["device_maps"] = maps
        if devs:
            out[rank]["devices"] = devs
    return out


def test_facts_are_what_peers_check_and_use():
    maps = {"w1": {torch.device("cpu"): torch.device("cuda:1")}}
    facts = devices.facts(maps, [torch.device("cuda:0")])
    count = torch.cuda.device_count()
    seen = {"gpus": os.environ.get("CUDA_VISIBLE_DEVICES", "*")} if count else {}
    assert facts == {"device_count": count, **seen,
                     "device_maps": {"w1": {"cpu": "cuda:1"}}, "devices": ["cuda:0"]}
    assert devices.facts({}, []) == {"device_count": count, **seen}


def test_maps_that_fit_pass():
    devices.check(_infos((2, {"w1": {"cuda:0": "cuda:1"}}, None),
                         (2, {"w0": {"cuda:1": "cpu"}}, ["cuda:1"])))
    devices.check(_infos((0, {"w1": {"cpu": "cpu"}}, None), (0, None, None)))


@pytest.mark.parametrize("workers, words", [
    (((2, None, ["cuda:0", "cuda:0"]), (0, None, None)), "Node w0 has duplicated devices"),
    (((1, None, ["cuda:1"]), (0, None, None)), "Node w0 has devices with invalid indices"),
    (((2, {"w1": {"cuda:0": "cpu", "cuda:1": "cpu"}}, None), (0, None, None)),
     "Node w0 has duplicated target devices in its device map for w1"),
    (((2, {"w1": {"cuda:1": "cpu"}}, ["cuda:0"]), (0, None, None)),
     "Node w0 has unexpected source devices in its device map for w1"),
    (((1, {"w1": {"cuda:1": "cpu"}}, None), (0, None, None)),
     "Node w0 has source devices with invalid indices in its device map for w1"),
    (((1, {"w1": {"cuda:0": "cuda:1"}}, None), (2, None, ["cuda:0"])),
     "Node w0 has unexpected target devices in its device map for w1"),
    (((1, {"w1": {"cuda:0": "cuda:1"}}, None), (1, None, None)),
     "Node w0 has target devices with invalid indices in its device map for w1"),
    (((0, {"w7": {"cpu": "cpu"}}, None), (0, None, None)),
     "Node w0 has invalid target node names in its device maps"),
])
def test_each_of_torchs_checks_fails_with_its_words(workers, words):
    with pytest.raises(ValueError, match="^" + words) as info:
        devices.check(_infos(*workers))
    assert len(str(info.value).splitlines()) >= 3  # what was wrong, and the fix


def test_a_dynamic_group_may_map_to_a_worker_that_has_not_joined():
    devices.check(_infos((0, {"w7": {"cpu": "cpu"}}, None)), static=False)


def test_malformed_facts_are_refused_with_the_worker_named():
    infos = _infos((0, None, None))
    infos[0]["device_maps"] = {"w1": {"cpu": "nonsense"}}
    with pytest.raises(ValueError, match="worker 'w0' .rank 0. published malformed device"):
        devices.check(infos)


# -- the inverse maps that gradients go back through -----------------------------------------

D = torch.device


def test_the_inverse_of_a_map_sends_each_target_back_to_its_source():
    assert devices.inverse({D("cuda:0"): D("cuda:1"), D("cpu"): D("cuda:0")}) == {
        D("cuda:1"): D("cuda:0"), D("cuda:0"): D("cpu")}
    assert devices.inverse({}) == {}


def test_a_map_with_two_sources_for_one_target_cannot_be_inverted():
    with pytest.raises(ValueError, match="cannot be inverted: cuda:0 and cuda:1 both map to "
                                         "cuda:2.*only supports 1-to-1 mapping"):
        devices.inverse({D("cuda:0"): D("cuda:2"), D("cuda:1"): D("cuda:2")})


def _registry():
    """This worker (w0, rank 0) maps cuda:0 to w1's cuda:1; w1 maps its cuda:1 to our
    cuda:0 (the registry keeps the inverse of w1's map, as reply_maps)."""
    return SimpleNamespace(worker_info=WorkerInfo("w0", 0),
                           device_maps={"w1": {D("cuda:0"): D("cuda:1")}},
                           reply_maps={1: {D("cuda:0"): D("cuda:1")}})


def test_gradients_go_back_through_the_inverse_of_the_map_their_tensor_came_by():
    registry, w1 = _registry(), WorkerInfo("w1", 1)
    # A request from w1 came by w1's map: back through its inverse (the reply map).
    assert devices.back_map(registry, w1, reply=False) == {D("cuda:0"): D("cuda:1")}
    # A reply from w1 came by the inverse of our map: back through our map.
    assert devices.back_map(registry, w1, reply=True) == {D("cuda:0"): D("cuda:1")}
    assert devices.back_map(registry, WorkerInfo("w0", 0), reply=False) is None
    assert devices.back_map(registry, WorkerInfo("w2", 2), reply=False) is None
    assert devices.back_map(registry, WorkerInfo("w2", 2), reply=True) is None


def test_a_gradient_goes_to_the_device_its_tensor_came_from():
    back = {D("cuda:1"): D("cuda:0"), D("cuda:0"): D("cpu")}
    assert devices.gradient_device(back, D("cuda:1")) == D("cuda:0")
    assert devices.gradient_device(back, D("cuda:0")) == D("cpu")
    assert devices.gradient_device({D("cpu"): D("cuda:1")}, D("cpu")) == D("cuda:1")
    # A CPU tensor no map moved needs no placing.
    assert devices.gradient_device(back, D("cpu")) is None
    assert devices.gradient_device(None, D("cpu")) is None


def test_a_gradient_on_a_cuda_device_no_map_reaches_fails_with_torchs_error_type():
    with pytest.raises(DeviceMapError, match="received on cuda:3: the device map it came by "
                                             "\\(none\\) has no entry") as info:
        devices.gradient_device(None, D("cuda:3"))
    assert isinstance(info.value, RuntimeError)
    with pytest.raises(DeviceMapError, match="received on cuda:3"):
        devices.gradient_device({D("cuda:1"): D("cuda:0")}, D("cuda:3"))
