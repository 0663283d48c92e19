"""The agent's table of workers and its part in the membership, driven by membership events
alone: no sockets, no store server, no other process (see tests/support/agent.py)."""

from __future__ import annotations

from typing import List

import pytest
import torch

from torchrpc._agent import WorkerInfo, devices
from torchrpc._wire import pickler
from torchrpc.errors import (DestinationTypeError, DeviceMapError, InvalidArgumentError,
                             ThreadFailedError, WorkerLeftError)
from tests.support.agent import Agents, FakeConn, NoTransport, info, pending_to, running


@pytest.fixture
def make_agent():
    agents = Agents()
    yield agents
    agents.close()


def _join(name: str, rank: int, incarnation: int) -> dict:
    return {"op": "join", **info(name, rank, incarnation)}


def _leave(name: str, rank: int, incarnation: int, lost: str = "") -> dict:
    event = {"op": "leave", "name": name, "rank": rank, "incarnation": incarnation}
    if lost:
        event["lost"] = lost
    return event


# -- a fixed group -------------------------------------------------------------------------------


def test_a_worker_is_found_by_name_rank_and_info(make_agent):
    registry = make_agent(3).registry
    w1 = registry.workers[1]
    assert registry.resolve("worker1") is registry.resolve(1) is registry.resolve(w1) is w1
    assert registry.worker_info == WorkerInfo("worker0", 0)
    assert [w.name for w in registry.worker_infos()] == ["worker0", "worker1", "worker2"]
    assert registry.addresses[1] == ("127.0.0.1", 2) and registry.same_host(1)


def test_an_unknown_destination_is_named_with_the_known_ones(make_agent):
    registry = make_agent(2).registry
    with pytest.raises(InvalidArgumentError, match=r"name:worker9 .* \['worker0', 'worker1'\]"):
        registry.resolve("worker9")
    with pytest.raises(InvalidArgumentError, match=r"rank:5 .* known ranks: \[0, 1\]"):
        registry.resolve(5)
    with pytest.raises(InvalidArgumentError, match="not a member of this group"):
        registry.resolve(WorkerInfo("worker1", 0))
    with pytest.raises(DestinationTypeError, match="got float"):
        registry.resolve(1.0)


def test_a_worker_that_said_goodbye_has_left(make_agent):
    agent = make_agent(2)
    assert not agent.has_left(1)
    agent.registry.left.add(1)  # as its GOODBYE does
    assert agent.has_left(1)


def test_device_maps_both_ways(make_agent, monkeypatch):
    monkeypatch.setattr(pickler._Encoder, "moves_cpu", False)
    agent = make_agent(2)
    registry = agent.registry
    registry.device_maps["worker1"] = {torch.device("cuda:0"): torch.device("cuda:1")}
    peer = registry.workers[1]
    assert devices.target_device(registry, peer, torch.device("cuda:0"), reply=False) == \
        torch.device("cuda:1")
    with pytest.raises(DeviceMapError, match="Request device mapping is not available"):
        devices.target_device(registry, peer, torch.device("cuda:1"), reply=False)
    with pytest.raises(DeviceMapError, match="Response device mapping is not available"):
        devices.target_device(registry, peer, torch.device("cuda:0"), reply=True)
    # worker1 published a map for worker0: replies to it go through its inverse
    registry.add(1, {**info("worker1", 1), "device_maps": {"worker0": {"cuda:2": "cuda:3"}}})
    assert devices.target_device(registry, peer, torch.device("cuda:3"), reply=True) == \
        torch.device("cuda:2")
    # CPU tensors move only where a map names the CPU: worker1's cpu -> worker0's cuda:1
    assert devices.cpu_target(registry, peer, reply=False) is None
    assert devices.cpu_target(registry, peer, reply=True) is None
    assert not pickler._Encoder.moves_cpu  # no map moves CPU tensors yet: none asks
    registry.add(1, {**info("worker1", 1), "device_maps": {"worker0": {"cuda:1": "cpu"}}})
    assert devices.cpu_target(registry, peer, reply=True) == torch.device("cuda:1")
    assert pickler._Encoder.moves_cpu
    registry.device_maps["worker1"] = {torch.device("cpu"): torch.device("cpu")}
    assert devices.cpu_target(registry, peer, reply=False) is None
    registry.device_maps["worker1"] = {torch.device("cpu"): torch.device("cuda:0")}
    assert devices.cpu_target(registry, peer, reply=False) == torch.device("cuda:0")
    assert devices.cpu_target(registry, registry.workers[0], reply=False) is None  # itself


# -- a dynamic group -----------------------------------------------------------------------------


def test_join_and_leave(make_agent):
    agent = running(make_agent(None))
    registry = agent.registry
    registry._apply_events([_join("w1", 1, 11)])
    assert registry.resolve("w1").id == 1
    p = pending_to(agent, 1)
    registry._apply_events([_leave("w1", 1, 11)])
    with pytest.raises(WorkerLeftError, match="w1 .* has shut down and left the group"):
        p.future.wait()
    with pytest.raises(WorkerLeftError, match="has shut down and left the group"):
        registry.resolve("w1")  # still known by name: it left, it is not unknown
    assert agent.has_left(1)


def test_an_event_about_an_earlier_process_under_a_rank_is_ignored(make_agent):
    agent = running(make_agent(None))
    registry = agent.registry
    registry._apply_events([_join("w1", 1, 11), _leave("w1", 1, 10, lost="silent")])
    assert registry.resolve("w1").id == 1 and not agent.has_left(1)


def test_a_member_removed_as_lost_is_dropped_here_too_and_its_rank_taken_again(make_agent):
    agent = running(make_agent(None))
    registry = agent.registry
    lost: List[str] = []
    agent.add_loss_hook(lambda w, error: lost.append(w.name))
    registry._apply_events([_join("w1", 1, 11)])
    conn = FakeConn(1)
    agent.connections.on_connect(conn)
    registry._apply_events([_leave("w1", 1, 11, lost="no heartbeat")])
    assert conn.closed and lost == ["w1"]
    with pytest.raises(WorkerLeftError, match="was lost and removed from the group: no heartb"):
        registry.resolve("w1")
    # The transport refuses the removed process, should it come back ...
    assert "was declared lost" in registry.admit(1, 11)
    # ... and a new process under the rank is a new worker.
    registry._apply_events([_join("w1b", 1, 12)])
    assert registry.resolve(1).name == "w1b" and not agent.has_left(1)
    assert 1 not in registry.removed and registry.admit(1, 12) is None
    assert "another process (incarnation 12) holds the rank" in registry.admit(1, 11)


def test_a_worker_removed_by_the_group_fails(make_agent):
    agent = running(make_agent(None))
    agent._transport = NoTransport()
    registry = agent.registry
    registry._apply_events([_leave("worker0", 0, registry.incarnation + 1, lost="x")])
    assert agent.failure is None  # about an earlier process under this rank
    registry._apply_events([_leave("worker0", 0, registry.incarnation, lost="stopped")])
    assert isinstance(agent.failure, ThreadFailedError)
    assert "was declared lost by the group and removed from it: stopped" in str(agent.failure)
