"""The membership log of a dynamic group on a real store, without workers: claims,
departures and the removal of a lost member, each tied to one process's incarnation."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from torchrpc._rendezvous import membership
from torchrpc._rendezvous.rendezvous import Records
from torchrpc.errors import RendezvousError


SECRET = b"k" * 64


@pytest.fixture(params=["tcp", "file"])
def raw(request, tmp_path):
    """The group's store as anyone who reaches it sees it (no secret)."""
    if request.param == "tcp":
        host = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10),
                             wait_for_workers=False)
    else:
        host = dist.FileStore(str(tmp_path / "store"), -1)
    return dist.PrefixStore(membership.PREFIX, host)


@pytest.fixture
def store(raw):
    """The same store as the group's members see it: records sealed under the secret."""
    return Records(raw, SECRET, membership.PREFIX)


def _join(store, name: str, rank: int, incarnation: int) -> None:
    membership.join(store, name, rank, 10, incarnation=incarnation)
    membership.announce(store, name, rank, ("127.0.0.1", 1000 + incarnation),
                        incarnation=incarnation)


def test_a_lost_member_is_removed_once_and_its_claims_taken_again(store):
    log = membership.EventLog(store)
    _join(store, "a", 1, incarnation=11)
    with pytest.raises(RendezvousError, match="'a' is already in use by rank 1"):
        membership.join(store, "a", 2, 10, incarnation=12)
    with pytest.raises(RendezvousError, match="rank 1 is already used by worker 'a'"):
        membership.join(store, "b", 1, 10, incarnation=13)
    # Two survivors declare process 11 lost: one removes it.
    assert membership.remove_lost(store, "a", 1, 11, "gone") is True
    assert membership.remove_lost(store, "a", 1, 11, "gone") is False
    _join(store, "a", 1, incarnation=21)  # a new process under the same name and rank
    # A third survivor, late, and the old process's own departure touch nothing of it.
    assert membership.remove_lost(store, "a", 1, 11, "gone") is False
    membership.leave(store, "a", 1, incarnation=11)
    with pytest.raises(RendezvousError, match="already in use"):
        membership.join(store, "a", 3, 10, incarnation=31)
    members = membership.EventLog.members(log.poll())
    assert members[1]["incarnation"] == 21 and members[1]["port"] == 1021
    # Its own departure frees both claims.
    membership.leave(store, "a", 1, incarnation=21)
    assert membership.EventLog.members(log.poll(), members) == {}
    _join(store, "a", 3, incarnation=41)


def test_a_leave_event_removes_only_the_member_of_its_incarnation():
    joined = {"op": "join", "rank": 2, "name": "x", "incarnation": 5}
    old = {"op": "leave", "rank": 2, "name": "x", "incarnation": 4, "lost": "silent"}
    mine = {"op": "leave", "rank": 2, "name": "x", "incarnation": 5}
    assert membership.EventLog.members([joined, old]) == {2: joined}
    assert membership.EventLog.members([joined, old, mine]) == {}
