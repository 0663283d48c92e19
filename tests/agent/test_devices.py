"""torch's checks of the group's device maps on published facts (no sockets): each failure
is torch's ValueError, its first line torch's words."""

from __future__ import annotations

import pytest
import torch

from torchrpc._agent import devices


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
    assert facts == {"device_count": torch.cuda.device_count(),
                     "device_maps": {"w1": {"cpu": "cuda:1"}}, "devices": ["cuda:0"]}
    assert devices.facts({}, []) == {"device_count": torch.cuda.device_count()}


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
