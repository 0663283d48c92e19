"""RRefs and remote() over real worker processes: API, forks in every direction, lifetime."""

from __future__ import annotations

import gc
import json
import os
import pickle
import tempfile
import threading
import time
import weakref

import pytest
import torch

import torchrpc.rpc as rpc
from torchrpc._agent.current import handle
from torchrpc._rref import RREF_LAYER
from torchrpc.errors import RpcTimeoutError

from ..support import helpers
from ..support.group import running_group, wait_for

REPORT = tempfile.mkdtemp(prefix="torchrpc-rref-")
THREADS = 4


@pytest.fixture(scope="module", autouse=True)
def group():
    with running_group(3, threads=THREADS, timeout=30.0,
                       extra_env={"TORCHRPC_TEST_REPORT": REPORT}) as g:
        yield g
    # After a graceful shutdown, no owner entries are left on any worker.
    assert handle.last_debug_info["num_owner_rrefs"] == 0
    for name in ("worker1", "worker2"):
        with open(os.path.join(REPORT, f"{name}.json")) as f:
            info = json.load(f)
        assert info["num_owner_rrefs"] == 0, (name, info)
        assert info["num_pending_children"] == 0 and info["num_pending_users"] == 0, info


def counts(name: str) -> dict:
    return rpc.rpc_sync(name, helpers.rref_counts)


def wait_clean(names=("worker0", "worker1", "worker2"), timeout: float = 10.0) -> None:
    last: dict = {}

    def drained() -> bool:
        gc.collect()
        last.update({n: counts(n) for n in names})
        return all(c["num_owner_rrefs"] == 0 and c["num_pending_children"] == 0
                   and c["num_pending_users"] == 0 for c in last.values())
    try:
        wait_for("RRef tables drain", drained, timeout)
    except AssertionError:
        layer = handle.agent.extensions[RREF_LAYER]
        for fid, r in list(layer._users.items()):
            print("LEFT", fid, r, [repr(x)[:300] for x in gc.get_referrers(r)])
        raise AssertionError(f"RRef tables did not drain: {last}") from None


def test_remote_and_to_here():
    rref1 = rpc.remote("worker1", torch.add, args=(torch.ones(2), 3))
    rref2 = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
    assert torch.equal(rref1.to_here() + rref2.to_here(), torch.full((2,), 6.0))
    assert not rref1.is_owner()
    assert rref1.owner() == rpc.get_worker_info("worker1") and rref1.owner_name() == "worker1"
    # The creation's ack may still be in flight.
    wait_for("the owner confirms the RRef", rref1.confirmed_by_owner, 10)
    with pytest.raises(RuntimeError, match="owner"):
        rref1.local_value()
    assert rpc.remote(2, min, args=(4, 5)).to_here() == 4
    assert rpc.remote("worker2", helpers.script_add, args=(torch.ones(1), 1)).to_here().item() == 2


def test_local_owner_rref_and_remote_to_self():
    rref = rpc.RRef(torch.ones(3))
    assert rref.is_owner() and rref.confirmed_by_owner()
    assert torch.equal(rref.local_value(), torch.ones(3))
    assert torch.equal(rref.to_here(), torch.ones(3))
    assert rref.owner_name() == "worker0"
    me = rpc.remote("worker0", helpers.add, args=(1, 2))
    assert me.is_owner() and me.to_here() == 3 and me.local_value() == 3


def test_remote_to_self_is_a_message_whose_arguments_are_copies():
    # As torch, which sends a remote() to itself through itself: the function gets a
    # copy (an in-place change stays there), and an argument that does not pickle fails
    # the call as it would to a peer, leaving no owner entry behind.
    t = torch.zeros(2)
    assert torch.equal(rpc.remote("worker0", torch.Tensor.add_, args=(t, 1)).to_here(),
                       torch.ones(2))
    assert torch.equal(t, torch.zeros(2))
    with pytest.raises(Exception, match="pickle") as peer:
        rpc.remote("worker1", helpers.echo, args=(threading.Lock(),))
    with pytest.raises(type(peer.value), match="pickle"):
        rpc.remote("worker0", helpers.echo, args=(threading.Lock(),))
    wait_clean()


def test_torchscript_function_taking_an_rref():
    # TorchScript's interpreter takes only torch's RRefs; the callee runs the Python original.
    on_owner = rpc.remote("worker1", torch.ones, args=(3,))
    out = rpc.rpc_sync("worker1", helpers.script_rref_add, args=(on_owner, torch.full((3,), 2.0)))
    assert torch.equal(out, torch.full((3,), 3.0))
    elsewhere = rpc.remote("worker2", torch.zeros, args=(3,))  # a user on worker1: fetched
    out = rpc.rpc_sync("worker1", helpers.script_rref_add, args=(elsewhere, torch.ones(3)))
    assert torch.equal(out, torch.ones(3))
    assert torch.equal(rpc.rpc_sync("worker1", helpers.script_add, args=(torch.ones(2), 1)),
                       torch.full((2,), 2.0))  # no RRef: TorchScript runs it


def test_get_type_of_a_failed_value_raises_its_error_and_backward_needs_a_context():
    rref = rpc.remote("worker1", helpers.raise_value_error, args=("no value",))
    with pytest.raises(ValueError, match="no value"):
        rref._get_type()
    with pytest.raises(ValueError, match="no value"):
        rpc.remote("worker1", helpers.raise_value_error, args=("no value",))._get_type(
            blocking=False).wait()
    with pytest.raises(RuntimeError, match="User RRefs require 'dist_autograd_ctx_id'"):
        rpc.remote("worker1", torch.ones, args=(1,)).backward()


def test_rref_is_generic_and_not_picklable_outside_rpc():
    assert rpc.RRef[torch.Tensor] is not None
    with pytest.raises(RuntimeError, match="only be pickled"):
        pickle.dumps(rpc.RRef(1))


def test_proxies_and_async_methods():
    store = rpc.remote("worker1", helpers.Store, args=(10,))
    assert store.rpc_sync().get() == 10
    assert store.rpc_sync().add(5) == 15
    assert store.rpc_async().add(1).wait() == 16
    assert store.remote().get().to_here() == 16
    assert store.rpc_sync().async_get_plus("worker2", 4) == 20
    assert store.rpc_async().async_get_plus("worker2", 1).wait() == 17
    assert store.remote().async_get_plus("worker2", 2).to_here() == 18
    cls_rref = rpc.remote("worker1", helpers.AsyncExecutionClass)
    out = cls_rref.rpc_sync().static_async_add("worker2", torch.ones(2), 1, 2)
    assert torch.equal(out, torch.full((2,), 4.0))
    out = cls_rref.remote().static_async_add("worker2", torch.ones(2), 1, 2).to_here()
    assert torch.equal(out, torch.full((2,), 4.0))
    with pytest.raises(AttributeError, match="no_such_method"):
        store.rpc_sync().no_such_method()
    local = rpc.RRef(helpers.Store(1))
    assert local.rpc_sync().add(1) == 2
    del store, cls_rref, local  # pytest keeps failed-assertion frames alive; drop our refs


def test_the_creation_future_is_a_torch_future_before_and_after_its_reply():
    # remote() leaves its creation reply for to_here() to read; _get_future() still hands
    # out a torch future of it, whether the reply is in or not, and the creation's error.
    slow = rpc.remote("worker1", helpers.sleep_then, args=(0.3, 1))
    fut = slow._get_future()
    assert isinstance(fut, torch.futures.Future) and not fut.done()
    assert slow._get_future() is fut
    assert torch.futures.wait_all([fut]) == [None] and slow.to_here() == 1
    fast = rpc.remote("worker1", helpers.add, args=(1, 2))
    assert fast.to_here() == 3
    done = fast._get_future()
    assert isinstance(done, torch.futures.Future) and done.done() and done.wait() is None
    bad = rpc.remote("worker1", helpers.raise_value_error, args=("no creation",))
    with pytest.raises(ValueError, match="no creation"):
        bad._get_future().wait()
    del slow, fut, fast, done, bad
    wait_clean()


def test_fork_to_the_owner_is_accepted_by_the_reply():
    # A user RRef sent to its owner in a call: the reply itself accepts the child, so
    # nothing is pending on this worker once rpc_sync returns, and the owner sends no
    # RREF_CHILD_ACCEPT (its RRef sender thread has nothing to do for it).
    rref = rpc.remote("worker1", helpers.echo, args=(5,))
    assert rref.to_here() == 5
    for i in range(20):
        assert rpc.rpc_sync("worker1", helpers.rref_value_plus, args=(rref, i)) == 5 + i
        assert counts("worker0")["num_pending_children"] == 0
    # A one-way path keeps the message: a fork to the owner inside a reply.
    back = rpc.rpc_sync("worker1", helpers.echo_rrefs, args=(rref,))
    assert back.owner_name() == "worker1" and back.to_here() == 5
    # And an asynchronous call accepts it when its reply comes.
    fut = rpc.rpc_async("worker1", helpers.rref_value_plus, args=(rref, 1))
    assert fut.wait() == 6
    del rref, back, fut
    wait_clean()


def test_forks_in_every_direction():
    # user -> owner (argument)
    rref = rpc.remote("worker1", helpers.echo, args=(7,))
    assert rpc.rpc_sync("worker1", helpers.rref_value_plus, args=(rref, 1)) == 8
    assert rpc.rpc_sync("worker1", helpers.rref_info, args=(rref,)) == (True, "worker1", True)
    # user -> user
    assert rpc.rpc_sync("worker2", helpers.rref_value_plus, args=(rref, 2)) == 9
    assert rpc.rpc_sync("worker2", helpers.rref_info, args=(rref,))[:2] == (False, "worker1")
    # user -> user -> user (chain through worker2 to worker0 itself)
    assert rpc.rpc_sync("worker2", helpers.forward_rref, args=("worker0", rref)) == 7
    # owner -> user (argument)
    mine = rpc.RRef(40)
    assert rpc.rpc_sync("worker1", helpers.rref_value_plus, args=(mine, 2)) == 42
    # owner -> user (return value)
    theirs = rpc.rpc_sync("worker2", helpers.make_rref, args=(5,))
    assert not theirs.is_owner() and theirs.owner_name() == "worker2" and theirs.to_here() == 5
    # user -> user (return value): worker1 creates an RRef owned by worker2 and returns it
    relayed = rpc.rpc_sync("worker1", helpers.hold_remote, args=("worker2", 11))
    assert relayed.owner_name() == "worker2" and relayed.to_here() == 11
    # back to the owner as a return value
    back = rpc.rpc_sync("worker1", helpers.echo_rrefs, args=(mine,))
    assert back.is_owner() and back.local_value() == 40
    # nested in containers
    refs = [rpc.remote("worker1", helpers.echo, args=(i,)) for i in range(3)]
    data = {"list": refs, "map": {"x": rpc.remote("worker2", helpers.echo, args=(10,))}}
    assert rpc.rpc_sync("worker2", helpers.rref_in_containers, args=(data,)) == 13
    del rref, mine, theirs, relayed, back, refs, data
    wait_clean()


def test_creator_drops_reference_while_fork_in_flight():
    for _ in range(20):
        rref = rpc.remote("worker1", helpers.sleep_then, args=(0.05, 99))
        fut = rpc.rpc_async("worker2", helpers.rref_to_here, args=(rref,))
        del rref
        gc.collect()
        assert fut.wait() == 99
    wait_clean()


def test_creation_failure_is_recorded_on_the_rref():
    rref = rpc.remote("worker1", helpers.raise_value_error, args=("no value",))
    with pytest.raises(ValueError, match="no value"):
        rref.to_here()
    wait_for("the creation failure is recorded", lambda r=rref: r._error is not None, 5)
    with pytest.raises(ValueError, match="no value"):
        rpc.rpc_sync("worker2", helpers.rref_to_here, args=(rref,))  # a fork raises too
    slow = rpc.remote("worker1", helpers.sleep_then, args=(2.0, 1), timeout=0.2)
    with pytest.raises(RuntimeError, match="timed out"):
        slow.to_here()
    # The recorded errors must not tie the RRefs into a reference cycle through traceback
    # frames: reference counting alone frees them, with the cycle collector off.
    alive = [weakref.ref(rref), weakref.ref(slow)]
    gc.disable()
    try:
        del rref, slow
        wait_for("failed RRefs freed without the gc", lambda: all(r() is None for r in alive), 5)
    finally:
        gc.enable()
    time.sleep(2.0)
    wait_clean()


def test_deletions_travel_with_the_next_request():
    # A loop of remote().to_here() drops one RRef per call; each deletion rides along with
    # the next REMOTE_CALL or FETCH to the owner instead of costing a message of its own.
    before = rpc.rpc_sync("worker1", helpers.debug_info)["num_delete_messages_received"]
    n = 300
    for i in range(n):
        assert rpc.remote("worker1", helpers.echo, args=(i,)).to_here() == i
    wait_clean()
    sent = rpc.rpc_sync("worker1", helpers.debug_info)["num_delete_messages_received"] - before
    assert 1 <= sent < n // 3, sent  # the last one (at least) goes out by itself


def test_unclaimed_creation_reply_is_read_for_the_rref():
    # The creation's reply waits for a to_here() that never comes: it is read anyway, so
    # the RRef is confirmed and a failed creation is recorded without any call.
    rref = rpc.remote("worker1", helpers.echo, args=(7,))
    failed = rpc.remote("worker2", helpers.raise_value_error, args=("unread",))
    wait_for("the parked creation replies are read",
             lambda r=rref, f=failed: r.confirmed_by_owner() and f._error is not None, 5)
    with pytest.raises(ValueError, match="unread"):
        failed.to_here()
    assert rref.to_here() == 7
    assert rpc.get_debug_info()["agent.num_parked"] == 0
    del rref, failed
    wait_clean()


def test_many_creations_in_flight_then_fetched_in_any_order():
    refs = [rpc.remote(f"worker{1 + i % 2}", helpers.sleep_then, args=(0.01, i))
            for i in range(40)]
    assert [r.to_here() for r in reversed(refs)] == list(reversed(range(40)))
    wait_for("no reply parked", lambda: rpc.get_debug_info()["agent.num_parked"] == 0, 5,
             state=rpc.get_debug_info)
    del refs
    wait_clean()


def test_to_here_timeout():
    rref = rpc.remote("worker1", helpers.sleep_then, args=(1.5, "late"))
    start = time.monotonic()
    with pytest.raises(RpcTimeoutError, match="timed out") as info:
        rref.to_here(timeout=0.2)
    assert time.monotonic() - start < 1.2
    # The error names the fetch and its RRef (the name is made only for the error).
    assert f"RRef.to_here() of {rref!r} timed out" in str(info.value)
    assert rref.to_here() == "late"


def test_blocking_to_here_beyond_pool_size_does_not_deadlock():
    owned = [rpc.remote("worker2", helpers.sleep_then, args=(0.2, i)) for i in range(3 * THREADS)]
    futs = [rpc.rpc_async("worker1", helpers.blocking_to_here, args=(r,), timeout=20) for r in owned]
    assert torch.futures.wait_all(futs) == list(range(3 * THREADS))
    del owned, futs
    wait_clean()


def test_many_rrefs_are_all_freed():
    n = 10_000
    refs = [rpc.remote(f"worker{1 + i % 2}", helpers.echo, args=(i,)) for i in range(n)]
    # user -> user, user -> owner, nested in containers, returned back
    assert rpc.rpc_sync("worker1", helpers.echo_rrefs, args=(refs[:500],))[0].to_here() == 0
    assert rpc.rpc_sync("worker2", helpers.rref_in_containers,
                        args=({"list": refs[:5], "map": {"x": refs[5]}},)) == 15
    assert rpc.rpc_sync("worker2", helpers.fan_out, args=("worker1", 200)) == 3
    owned = [rpc.RRef(i) for i in range(200)]
    assert rpc.rpc_sync("worker1", helpers.echo_rrefs, args=(owned,))[199].local_value() == 199
    peak = counts("worker1")
    assert peak["num_owner_rrefs"] >= n // 2 - 1
    del refs, owned, peak
    wait_clean(timeout=30)


def test_debug_info_and_bad_input():
    info = rpc.get_debug_info()
    for key in ("num_owner_rrefs", "num_pending_users", "num_forks",
                "agent.num_pending_requests", "agent.thread_pool_size"):
        assert key in info
    with pytest.raises(ValueError, match="ghost"):
        rpc.remote("ghost", helpers.echo, args=(1,))
    with pytest.raises(TypeError, match="callable"):
        rpc.remote("worker1", 3)


def test_remote_module():
    from torchrpc.nn import RemoteModule
    torch.manual_seed(0)
    rm = RemoteModule("worker1/cpu", torch.nn.Linear, args=(4, 2))
    x = torch.randn(3, 4)
    params = rm.remote_parameters()
    assert len(params) == 2 and all(p.owner_name() == "worker1" for p in params)
    weight, bias = (p.to_here() for p in params)
    expected = x @ weight.t() + bias
    assert torch.allclose(rm(x), expected)
    assert torch.allclose(rm.forward_async(x).wait(), expected)
    assert rm.get_module_rref().owner_name() == "worker1"
    assert len(rm.remote_parameters(recurse=False)) == 2
    rm2 = RemoteModule("worker2", torch.nn.ReLU)
    assert torch.equal(rm2(torch.tensor([-1.0, 2.0])), torch.tensor([0.0, 2.0]))
    rm.eval()
    rm.train()
    for method in ("parameters", "state_dict", "to", "cuda", "zero_grad"):
        with pytest.raises(ValueError, match=method):
            getattr(rm, method)()
    for bad in ("worker1/cpu/0", "/cpu", "worker1/notadevice", ""):
        with pytest.raises(ValueError, match="worker"):
            RemoteModule(bad, torch.nn.ReLU)
    bad_args = RemoteModule("worker1", torch.nn.Linear, args=("x",))  # created asynchronously
    with pytest.raises(TypeError):
        bad_args(x)
    del rm, rm2, bad_args, params, weight, bias
    wait_clean()
