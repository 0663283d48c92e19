"""G2 under explicit deletion, over real processes: a worker that sends its copy of an
RRef to another (in a ``remote()``, whose reply it does not wait for) and then deletes
every user RRef it holds (``_delete_all_user_and_unforked_owner_rrefs``, as torch's tests
and shutdown do) holds that copy's USER_DELETE until the child is accepted. Sent at once,
it let the owner drop the value before the child's FORK_REQUEST arrived, and the child's
``to_here()`` waited for a value that never came. The child here is this process, whose
FORK_REQUEST the fault-injecting backend holds back.
"""

from __future__ import annotations

import pytest
import torch

import torchrpc.rpc as rpc
from torchrpc._testing import faulty
from torchrpc.rpc import api

from ..support.group import running_group, wait_for

_held: dict = {}


@pytest.fixture(scope="module", autouse=True)
def group():
    with running_group(3, threads=4, timeout=30.0, self_backend=faulty.BACKEND_NAME) as g:
        yield g


def keep(rref: rpc.RRef) -> bool:
    """On worker0: keep the child copy."""
    _held["rref"] = rref
    return True


def fork_then_delete_all(owner: str, holder: str) -> bool:
    """On worker1: make an RRef on ``owner``, send a copy to ``holder``, delete every user
    RRef here."""
    rref = rpc.remote(owner, torch.add, args=(torch.ones(4), 1.0))
    rref.to_here()  # confirmed: its deletion would go at once
    rpc.remote(holder, keep, args=(rref,))  # no reply waited for: the child is parked
    api._delete_all_user_and_unforked_owner_rrefs()
    return True


def test_a_child_fetches_the_value_its_parent_deleted_before_the_child_was_accepted():
    agent = api.current_agent()
    plan = agent.inject(delay={"RREF_FORK_REQUEST": 1.5})
    try:
        assert rpc.rpc_sync("worker1", fork_then_delete_all, args=("worker2", "worker0"))
        wait_for("worker1's copy to arrive here", lambda: "rref" in _held, 10)
        rref = _held.pop("rref")
        assert torch.equal(rref.to_here(timeout=10), torch.ones(4) + 1.0)
        assert plan.delayed == {"RREF_FORK_REQUEST": 1}
        del rref
    finally:
        agent.inject()
