"""The fault-injecting backend, timeouts under delays, and retries (user and internal)."""

from __future__ import annotations

import time

import pytest
import torch

import torchrpc.rpc as rpc
from torchrpc._agent.retry import RetryPolicy
from torchrpc._testing import faulty
from torchrpc._wire import Kind
from torchrpc.errors import ConnectionLostError, RpcTimeoutError
from torchrpc.rpc import api

from ..support import helpers, robust as rh
from ..support.group import running_group, wait_for


@pytest.fixture(scope="module", autouse=True)
def group():
    # Rank 0 (this process) is the faulty one; worker1 is a normal worker.
    with running_group(2, threads=4, timeout=30.0, self_backend=faulty.BACKEND_NAME) as g:
        yield g


@pytest.fixture()
def agent():
    a = api.current_agent()
    assert isinstance(a, faulty.FaultyAgent)
    yield a
    a.inject()  # no faults for the next test


def _count(key: str) -> int:
    return rpc.rpc_sync("worker1", rh.count, args=(key,))


def test_backend_is_registered_and_options_validate():
    assert rpc.BackendType.FAULTY_TENSORPIPE.name == "FAULTY_TENSORPIPE"
    opts = rpc.backend_registry.construct_rpc_backend_options(
        rpc.BackendType.FAULTY_TENSORPIPE, messages_to_fail=["PYTHON_CALL"], num_fail_sends=2)
    assert isinstance(opts, faulty.FaultyTensorPipeRpcBackendOptions)
    assert faulty.kind_of("PYTHON_CALL") is Kind.CALL
    with pytest.raises(ValueError, match="unknown message kind 'NOPE'"):
        faulty.FaultyTensorPipeRpcBackendOptions(messages_to_fail=["NOPE"])
    with pytest.raises(ValueError, match="num_fail_sends"):
        faulty.FaultyTensorPipeRpcBackendOptions(num_fail_sends=-1)


def test_injected_failure_fails_the_call_naming_the_worker(agent):
    plan = agent.inject(fail=["CALL"], num_fail_sends=1)
    with pytest.raises(ConnectionLostError, match="injected fault") as info:
        rpc.rpc_sync("worker1", rh.bump, args=("plain",))
    assert info.value.worker == "worker1"
    assert rpc.rpc_sync("worker1", rh.bump, args=("plain",)) == 1  # only the first send fails
    assert plan.failed == {"CALL": 1}


def test_delayed_call_times_out_and_late_reply_is_dropped(agent):
    agent.inject(delay={"CALL": 0.6})
    start = time.monotonic()
    with pytest.raises(RpcTimeoutError, match="timed out after 0.2 s"):
        rpc.rpc_sync("worker1", helpers.add, args=(1, 1), timeout=0.2)
    assert time.monotonic() - start < 0.5
    fut = rpc.rpc_async("worker1", helpers.add, args=(2, 2))
    assert fut.wait() == 4 and time.monotonic() - start >= 0.6
    agent.inject(delay={"RESPONSE": 0.5})  # replies of rank 0 to worker1's calls
    with pytest.raises(RpcTimeoutError):
        rpc.rpc_sync("worker1", helpers.nested_call, args=("worker0", 1), timeout=0.3)
    assert agent.faults.delayed["RESPONSE"] >= 1


def test_faults_meet_the_private_connections_of_blocking_calls(agent):
    # The faulty backend runs the production fast path: blocking calls go out on private
    # connections, and the plan meets their frames there.
    assert rpc.rpc_sync("worker1", helpers.add, args=(1, 2)) == 3
    private = agent.lanes.private.idle_to(1)
    assert private and all(isinstance(c, faulty.FaultyConnection) for c in private)
    plan = agent.inject(fail=["CALL"], num_fail_sends=1)
    with pytest.raises(ConnectionLostError, match="injected fault.*worker1") as info:
        rpc.rpc_sync("worker1", rh.bump, args=("private",))
    assert info.value.worker == "worker1" and plan.failed == {"CALL": 1}
    assert rpc.rpc_sync("worker1", rh.bump, args=("private",)) == 1


def test_a_held_back_request_arrives_after_its_caller_timed_out(agent):
    # The caller's timeout closes its private connection; the frame held back was on the
    # wire already, and arrives as it would over TCP.
    agent.inject(delay={"CALL": 1.0})
    with pytest.raises(RpcTimeoutError):
        rpc.rpc_sync("worker1", rh.bump, args=("held back",), timeout=0.2)
    agent.inject()
    assert _count("held back") == 0
    wait_for("the held-back call to run", lambda: _count("held back") == 1, 5.0)


def test_an_injected_failure_of_a_reply_breaks_its_connection(agent):
    # A caller learns that its reply will not come only from the break, as with a real
    # failed send: worker1's call fails at once instead of at its 20 s timeout. A reply
    # that fails on a shared connection is tried again on the current one: that fails too.
    # The break fails this worker's own calls to worker1 too, so worker1 calls on its own.
    plan = agent.inject(fail=["RESPONSE"], num_fail_sends=2)
    rpc.rpc_sync("worker1", rh.start_async_call_outcome, args=("reply", "worker0", 20.0, 0.2))

    def outcome():
        try:
            return rpc.rpc_sync("worker1", rh.outcome_of, args=("reply",))
        except ConnectionLostError:  # a poll that met the break
            return None

    wait_for("worker1's call to end", outcome, 30.0)
    got, seconds = outcome()
    assert got.startswith("ConnectionLostError") and "worker0" in got, got
    assert seconds < 10.0 and plan.failed["RESPONSE"] >= 1
    agent.inject()
    assert rpc.rpc_sync("worker1", rh.async_call_outcome, args=("worker0", 20.0))[0] == "worker0"


def test_requests_on_a_connection_this_worker_closes_fail_at_once(agent):
    # Closing a shared connection drops the frames in its outbox, and no reply comes on
    # it: the requests that went out on it fail now, not at their timeout. (Without
    # private connections: a thread's calls would otherwise go out on its burst's.)
    agent.lanes.private.enabled = False
    try:
        futs = [rpc.rpc_async("worker1", helpers.sleep_then, args=(1.0, k), timeout=20)
                for k in range(4)]
    finally:
        agent.lanes.private.enabled = True
    on_shared = {p.conn for p in list(agent.requests.pending.values()) if p.conn is not None}
    assert on_shared, "no request went out on a shared connection"
    start = time.monotonic()
    for conn in on_shared:
        conn.close()
    outcomes = []
    for k, fut in enumerate(futs):
        try:
            outcomes.append(fut.wait())
        except ConnectionLostError as exc:
            assert "closed by this worker" in str(exc) and exc.worker == "worker1"
            outcomes.append("closed")
    assert "closed" in outcomes and time.monotonic() - start < 10.0
    assert all(o in ("closed", k) for k, o in enumerate(outcomes)), outcomes
    assert rpc.rpc_sync("worker1", helpers.add, args=(1, 2)) == 3


def test_requests_of_a_burst_whose_connection_this_worker_closes_fail_at_once(agent):
    assert rpc.rpc_sync("worker1", helpers.add, args=(0, 0)) == 0  # a private connection
    futs = [rpc.rpc_async("worker1", helpers.sleep_then, args=(1.0, k), timeout=20)
            for k in range(4)]
    rank = rpc.get_worker_info("worker1").id
    burst = agent.lanes.bursts._mine.by_rank[rank]
    start = time.monotonic()
    burst.conn.close()
    for fut in futs[1:]:  # the first went out before the burst began: its reply is read
        with pytest.raises(ConnectionLostError, match="worker1"):
            fut.wait()
    assert time.monotonic() - start < 10.0
    assert rpc.rpc_async("worker1", helpers.add, args=(1, 2)).wait() == 3  # a new one


def test_idempotent_call_is_retried_with_backoff(agent):
    plan = agent.inject(fail=["CALL"], num_fail_sends=2)
    start = time.monotonic()
    assert rpc.rpc_sync("worker1", rh.bump_idempotent, args=("retried",)) == 1
    elapsed = time.monotonic() - start
    assert plan.failed == {"CALL": 2}
    assert elapsed >= 0.2 + 0.4 - 0.05  # backoff 0.2 s, then 0.4 s
    assert _count("retried") == 1  # failed sends never left: it ran once


def test_retries_give_up_after_max_attempts(agent):
    plan = agent.inject(fail=["CALL"], num_fail_sends=10)
    with pytest.raises(ConnectionLostError, match="gave up after 3 attempts"):
        rpc.rpc_sync("worker1", rh.bump_idempotent, args=("never",))
    assert plan.failed == {"CALL": 3}
    agent.inject()
    assert _count("never") == 0


def test_no_retry_after_a_remote_exception(agent):
    with pytest.raises(ValueError, match="on purpose"):
        rpc.rpc_sync("worker1", rh.bump_then_fail, args=("raised",))
    assert _count("raised") == 1


def test_no_retry_after_a_timeout(agent):
    with pytest.raises(RpcTimeoutError):
        rpc.rpc_sync("worker1", rh.slow_bump, args=("slow", 0.6), timeout=0.2)
    time.sleep(0.8)
    assert _count("slow") == 1


def test_not_idempotent_is_not_retried(agent):
    plan = agent.inject(fail=["CALL"], num_fail_sends=1)
    with pytest.raises(ConnectionLostError):
        rpc.rpc_sync("worker1", rh.bump, args=("once",))
    assert plan.failed == {"CALL": 1}
    assert _count("once") == 0


def test_retry_after_a_real_connection_loss(agent):
    # The connection breaks while the call runs: the retry goes over a new connection,
    # and whichever reply comes first completes the call (the function is idempotent).
    fut = rpc.rpc_async("worker1", rh.slow_bump, args=("broken", 0.5))
    wait_for("the call runs on worker1", lambda: _count("started:broken") == 1, 10)
    for conn in list(agent.connections.all.get(1, [])):
        conn.close(ConnectionLostError("cut by the test"))
    probes = agent.debug_info()["agent.num_once_probes"]
    assert fut.wait() in (1, 2)
    wait_for("both runs end", lambda: _count("broken") >= 2, 10)
    assert _count("broken") == 2  # it ran twice: that is what idempotent allows
    assert agent.debug_info()["agent.num_once_probes"] == probes  # resent without asking
    assert rpc.rpc_sync("worker1", helpers.add, args=(1, 2)) == 3


def test_internal_request_retry_facility(agent):
    w1 = agent.resolve("worker1")
    payload = (rh.bump, ("internal",), {})
    plan = agent.inject(fail=["CALL"], num_fail_sends=2)
    fut = agent.request(w1, Kind.CALL, payload, 5.0, what="internal",
                        retry=RetryPolicy(max_attempts=3, initial_backoff=0.01))
    assert fut.wait() == 1 and plan.failed == {"CALL": 2}
    # One-way: completes once a send succeeds; the message arrives once.
    plan = agent.inject(fail=["CALL"], num_fail_sends=2)
    fut = agent.request(w1, Kind.CALL, payload, 5.0, oneway=True,
                        retry=RetryPolicy(max_attempts=4, initial_backoff=0.01))
    assert fut.wait() is None and plan.failed == {"CALL": 2}
    wait_for("the one-way message arrives", lambda: _count("internal") >= 2, 10)
    assert _count("internal") == 2
    # A retry never outlives the deadline: backoff longer than the time left fails now.
    agent.inject(fail=["CALL"], num_fail_sends=1)
    start = time.monotonic()
    fut = agent.request(w1, Kind.CALL, payload, 0.3, retry=RetryPolicy(3, initial_backoff=1.0))
    with pytest.raises(ConnectionLostError, match="injected"):
        fut.wait()
    assert time.monotonic() - start < 0.25
    assert agent.debug_info()["agent.num_pending_requests"] == 0


def test_retry_policy_validates():
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(0)
    with pytest.raises(ValueError, match="backoff_multiplier"):
        RetryPolicy(3, backoff_multiplier=0.5)
    assert [RetryPolicy(5, 0.1, 2.0, 0.3).backoff(k) for k in (1, 2, 3)] == [0.1, 0.2, 0.3]
    with pytest.raises(TypeError, match="wrap it"):
        rpc.functions.idempotent(len)


def test_rref_creation_failure_and_timeout_surface_on_use(agent):
    plan = agent.inject(fail=["PYTHON_REMOTE_CALL"], num_fail_sends=1)
    rref = rpc.remote("worker1", helpers.add, args=(1, 2))
    with pytest.raises(ConnectionLostError, match="injected"):
        rref.to_here()
    assert plan.failed == {"RREF_REMOTE_CALL": 1}
    assert rpc.remote("worker1", helpers.add, args=(1, 2)).to_here() == 3
    agent.inject(delay={"RREF_REMOTE_CALL": 0.6})
    rref = rpc.remote("worker1", helpers.add, args=(2, 2), timeout=0.2)
    with pytest.raises(RpcTimeoutError):
        rref.to_here()
    agent.inject()
    # The late creation lands; the owner's bookkeeping settles at shutdown.
    wait_for("the late creation lands on worker1",
             lambda: rpc.rpc_sync("worker1", helpers.owns_rref, args=(rref._rref_id,)), 10)


def test_rref_control_messages_are_retried(agent):
    import gc
    plan = agent.inject(fail=["RREF_FORK_REQUEST", "RREF_CHILD_ACCEPT", "RREF_USER_DELETE"],
                        num_fail_sends=2)
    rref = rpc.remote("worker1", helpers.echo, args=(41,))
    assert rref.to_here() == 41
    # A user -> user fork (to this worker itself): FORK_REQUEST to the owner, CHILD_ACCEPT back.
    assert rpc.rpc_sync("worker0", helpers.rref_value_plus, args=(rref, 1)) == 42
    del rref
    last: dict = {}

    def settled() -> bool:
        gc.collect()
        last.update(mine=helpers.rref_counts(), owner=rpc.rpc_sync("worker1", helpers.rref_counts))
        return last["owner"]["num_owner_rrefs"] == 0 and last["mine"]["num_pending_children"] == 0 \
            and last["mine"]["num_user_rrefs"] == 0
    wait_for("the RRef tables settle", settled, 15, state=lambda: (plan.failed, last))
    assert plan.failed == {"RREF_FORK_REQUEST": 2, "RREF_CHILD_ACCEPT": 2, "RREF_USER_DELETE": 2}


def test_autograd_control_messages_are_retried(agent):
    import torch
    import torchrpc.autograd as dist_autograd
    plan = agent.inject(fail=["AUTOGRAD_BACKWARD", "AUTOGRAD_RELEASE"], num_fail_sends=1)
    x = torch.ones(3, requires_grad=True)
    with dist_autograd.context() as ctx:
        y = rpc.rpc_sync("worker1", helpers.add, args=(x, 2.0))
        dist_autograd.backward(ctx, [(y * y).sum()])
        assert torch.allclose(dist_autograd.get_gradients(ctx)[x], 2 * (x.detach() + 2))
    wait_for("the retried release arrives", lambda: rpc.rpc_sync(
        "worker1", helpers.debug_info)["num_autograd_contexts"] == 0, 10)
    assert plan.failed == {"AUTOGRAD_BACKWARD": 1, "AUTOGRAD_RELEASE": 1}


# At most once: a request with the ONCE flag (internal kinds with a retry policy; here a
# stand-in, rh.ONCE_KIND, that counts its runs) whose send may have reached the callee is
# sent again only if a probe finds that the callee never got it.


def _cut(agent) -> None:
    """Break every connection of this worker with worker1 (as a network fault would)."""
    for conn in list(agent.connections.all.get(1, [])):
        conn.close(ConnectionLostError("cut by the test"))


def _settle() -> None:
    # Let worker1 see the cut before this worker calls it again: a reply that worker1
    # writes on its side of a cut connection it has not noticed yet is lost, and a plain
    # call waits for its timeout (a limit of plain calls; the ONCE probe covers its own).
    time.sleep(0.5)


def _probe_counters(info) -> tuple:
    return (info["agent.num_once_probes"], info["agent.num_resends_avoided"],
            info["agent.num_resends_after_probe"])


@pytest.fixture()
def once_kind(agent):
    rpc.rpc_sync("worker1", rh.serve_once_kind)
    rh.serve_once_kind()
    return agent.resolve("worker1")


def _duplicates(where: str) -> int:
    info = rpc.rpc_sync(where, helpers.debug_info) if where != "here" else rpc.get_debug_info()
    return info["agent.num_duplicate_requests"]


def test_a_once_request_lost_before_delivery_is_sent_again_after_the_probe(agent, once_kind):
    dups, mine = _duplicates("worker1"), _probe_counters(agent.debug_info())
    plan = agent.inject(drop=[rh.ONCE_KIND], num_drop_sends=1)
    fut = agent.request(once_kind, rh.ONCE_KIND, "lost", 20.0, what="once",
                        retry=RetryPolicy(max_attempts=5, initial_backoff=0.05))
    # The frame "left" (its send returned) but never arrived.
    wait_for("the frame is dropped", lambda: plan.dropped == {"PROFILED_CALL": 1}, 10)
    assert plan.dropped == {"PROFILED_CALL": 1} and not fut.done() and _count("lost") == 0
    _cut(agent)
    assert fut.wait() == 1
    assert _count("lost") == 1
    # One probe, which found the request missing: it was sent again, and ran once.
    probes, avoided, after = _probe_counters(agent.debug_info())
    assert (probes - mine[0], avoided - mine[1], after - mine[2]) == (1, 0, 1)
    assert _duplicates("worker1") == dups


def test_a_probe_that_cannot_be_sent_is_retried_under_the_policy(agent, once_kind):
    mine = _probe_counters(agent.debug_info())
    plan = agent.inject(drop=[rh.ONCE_KIND], num_drop_sends=1, fail=["ONCE_PROBE"],
                        num_fail_sends=2)
    fut = agent.request(once_kind, rh.ONCE_KIND, "reprobed", 20.0, what="once",
                        retry=RetryPolicy(max_attempts=5, initial_backoff=0.05))
    wait_for("the frame is dropped", lambda: plan.dropped == {"PROFILED_CALL": 1}, 10)
    _cut(agent)
    assert fut.wait() == 1 and _count("reprobed") == 1
    assert plan.failed == {"ONCE_PROBE": 2}  # attempts 2 and 3; attempt 4 asked and resent
    probes, avoided, after = _probe_counters(agent.debug_info())
    assert (probes - mine[0], avoided - mine[1], after - mine[2]) == (1, 0, 1)
    # Out of attempts: a probe that keeps failing fails the request, naming the worker.
    plan = agent.inject(drop=[rh.ONCE_KIND], num_drop_sends=1, fail=["ONCE_PROBE"],
                        num_fail_sends=9)
    fut = agent.request(once_kind, rh.ONCE_KIND, "given up", 20.0, what="once",
                        retry=RetryPolicy(max_attempts=3, initial_backoff=0.05))
    wait_for("the frame is dropped", lambda: plan.dropped == {"PROFILED_CALL": 1}, 10)
    _cut(agent)
    with pytest.raises(ConnectionLostError, match="gave up after 3 attempts"):
        fut.wait()
    assert _count("given up") == 0


def test_a_once_request_whose_send_failed_is_sent_again_without_a_probe(agent, once_kind):
    # A send that raised never queued its frame: the caller knows it did not arrive.
    mine = _probe_counters(agent.debug_info())
    plan = agent.inject(fail=[rh.ONCE_KIND], num_fail_sends=2)
    fut = agent.request(once_kind, rh.ONCE_KIND, "unsent", 5.0, what="once",
                        retry=RetryPolicy(max_attempts=3, initial_backoff=0.01))
    assert fut.wait() == 1 and plan.failed == {"PROFILED_CALL": 2}
    assert _count("unsent") == 1
    assert _probe_counters(agent.debug_info()) == mine


def test_a_once_reply_lost_with_its_connection_comes_again_on_the_probe(agent, once_kind):
    # worker1 asks this worker; the reply is lost; after the break worker1's probe finds
    # it answered here, and this worker sends the kept reply again instead of a rerun.
    dups = _duplicates("here")
    theirs = _probe_counters(rpc.rpc_sync("worker1", helpers.debug_info))
    plan = agent.inject(drop=["RESPONSE"], num_drop_sends=1)
    rpc.rpc_sync("worker1", rh.start_once_request, args=("worker0", "replied", 20.0))
    wait_for("the request runs here", lambda: plan.dropped == {"RESPONSE": 1}, 10.0)
    assert rh.count("replied") == 1
    assert rpc.rpc_sync("worker1", rh.once_result, args=("replied",)) is None
    _cut(agent)
    _settle()
    wait_for("the reply reaches worker1",
             lambda: rpc.rpc_sync("worker1", rh.once_result, args=("replied",)) is not None,
             15.0)
    assert rpc.rpc_sync("worker1", rh.once_result, args=("replied",)) == 1
    assert rh.count("replied") == 1 and _duplicates("here") == dups
    probes, avoided, after = _probe_counters(rpc.rpc_sync("worker1", helpers.debug_info))
    assert (probes - theirs[0], avoided - theirs[1], after - theirs[2]) == (1, 1, 0)


def test_a_once_reply_lost_after_the_probe_found_it_running_comes_on_the_next_probe(
        agent, once_kind):
    # worker1's request runs here for a second; the connection breaks meanwhile, worker1's
    # probe finds it running, and then its reply is lost too: worker1 asks again a second
    # later and gets the kept reply, long before its 20 s deadline, without a rerun.
    dups = _duplicates("here")
    theirs = _probe_counters(rpc.rpc_sync("worker1", helpers.debug_info))
    plan = agent.inject(drop=["RESPONSE"], num_drop_sends=1)
    rpc.rpc_sync("worker1", rh.start_once_request, args=("worker0", "slow-rerun", 20.0))
    wait_for("the request runs here", lambda: rh.count("started:slow-rerun") == 1, 10)
    _cut(agent)
    start = time.monotonic()
    _settle()
    wait_for("the reply reaches worker1",
             lambda: rpc.rpc_sync("worker1", rh.once_result, args=("slow-rerun",)) is not None,
             10.0)
    assert time.monotonic() - start < 6.0
    assert plan.dropped == {"RESPONSE": 1}
    assert rpc.rpc_sync("worker1", rh.once_result, args=("slow-rerun",)) == 1
    assert rh.count("slow-rerun") == 1 and _duplicates("here") == dups
    probes, avoided, after = _probe_counters(rpc.rpc_sync("worker1", helpers.debug_info))
    assert probes - theirs[0] >= 2 and (avoided - theirs[1], after - theirs[2]) == (1, 0)


def test_the_requests_of_one_peer_are_asked_about_in_one_probe(agent, once_kind):
    # Three requests: the first one's frame is lost, the others arrive and run slowly.
    # After the break, one probe asks about all three; only the lost one is sent again.
    dups, mine = _duplicates("worker1"), _probe_counters(agent.debug_info())
    rpc.rpc_sync("worker1", rh.serve_once_kind)
    plan = agent.inject(drop=[rh.ONCE_KIND], num_drop_sends=1)
    keys = ["batch-lost", "slow-batch-1", "slow-batch-2"]
    futs = [agent.request(once_kind, rh.ONCE_KIND, key, 20.0, what="once",
                          retry=RetryPolicy(max_attempts=5, initial_backoff=0.05))
            for key in keys]
    wait_for("the first frame is dropped and the others run on worker1",
             lambda: plan.dropped == {"PROFILED_CALL": 1}
             and _count("started:slow-batch-1") == _count("started:slow-batch-2") == 1, 10)
    _cut(agent)
    assert [f.wait() for f in futs] == [1, 1, 1]
    assert [_count(key) for key in keys] == [1, 1, 1]
    probes, avoided, after = _probe_counters(agent.debug_info())
    assert (avoided - mine[1], after - mine[2]) == (2, 1)
    assert probes - mine[0] <= 3  # one for all three, then at most a recheck or two
    assert _duplicates("worker1") == dups


def test_a_backward_report_lost_with_its_connection_is_sent_again(agent):
    # worker1 roots a backward pass whose remote part runs here; this worker's report of
    # its credit to worker1 is lost with a connection that then breaks. The report is
    # asked about and sent again, so the pass ends now rather than at its RPC timeout.
    plan = agent.inject(drop=["AUTOGRAD_DONE"], num_drop_sends=1)
    assert rpc.rpc_sync("worker1", rh.start_backward_through, args=("worker0", "lost report"))
    wait_for("the report to be dropped", lambda: plan.dropped.get("AUTOGRAD_DONE") == 1, 10)
    time.sleep(0.2)
    cut = time.monotonic()
    _cut(agent)
    _settle()
    wait_for("the backward pass to end", lambda: rpc.rpc_sync(
        "worker1", rh.backward_result, args=("lost report",)), 20)
    grad, _ = rpc.rpc_sync("worker1", rh.backward_result, args=("lost report",))
    assert torch.equal(grad, torch.full((4,), 2.0)), grad
    assert time.monotonic() - cut < 10
