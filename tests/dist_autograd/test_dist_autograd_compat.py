"""Distributed autograd as torch's programs see it: introspection, errors, hooks, copies.

Real worker processes; each check states what torch's distributed autograd does for
the same program.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, List, Tuple

import pytest
import torch
from torch.autograd import Function

import torchrpc.autograd as dist_autograd
import torchrpc.rpc as rpc
from torchrpc.errors import RpcTimeoutError


RECV = "torch::distributed::autograd::RecvRpcBackward"
SEND = "torch::distributed::autograd::SendRpcBackward"


pytestmark = pytest.mark.group(2, threads=4, timeout=30.0)


# -- helpers that run on worker1 ------------------------------------------------------------------

def _callee_graph(context_id: int) -> Tuple[int, List[str], List[str], bool]:
    """On the callee: its send functions of the context, and what lies behind the first."""
    ctx = dist_autograd._retrieve_context(context_id)
    sends = list(ctx._send_functions().values())
    add = sends[0].next_functions[0][0]
    behind = [f.name() for f, _ in add.next_functions]
    same = add.next_functions[0][0] is add.next_functions[1][0]
    return len(sends), [sends[0].name(), add.name()], behind, same


class _Explode(Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise Exception("boom in backward")  # noqa: TRY002 - a bare Exception, as users write


def _explode_remotely(x: torch.Tensor) -> torch.Tensor:
    return _Explode.apply(x * 2)


# -- introspection ---------------------------------------------------------------------------------

def test_graph_records_as_torch_reports_them():
    t1 = torch.ones(3, 3, requires_grad=True)
    t2 = torch.zeros(3, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        ret = rpc.rpc_sync("worker1", torch.add, args=(t1, t2))
        ctx = dist_autograd._current_context()
        assert ctx._context_id() == context_id
        sends, recvs = ctx._send_functions(), ctx._recv_functions()
        assert len(sends) == 1 and len(recvs) == 1
        (send,) = sends.values()
        assert send.name() == SEND
        assert [(f.name(), f.variable is t, nr) for (f, nr), t in zip(send.next_functions, (t1, t2))] \
            == [("torch::autograd::AccumulateGrad", True, 0)] * 2
        assert next(iter(recvs.values())) is ret.grad_fn and ret.grad_fn.name() == RECV
        assert ctx._known_worker_ids() == {1}
        n, names, behind, same = rpc.rpc_sync("worker1", _callee_graph, args=(context_id,))
        assert (n, names, behind, same) == (1, [SEND, "AddBackward0"], [RECV, RECV], True)
    with pytest.raises(RuntimeError, match="Could not find autograd context with id"):
        dist_autograd._retrieve_context(context_id)
    with pytest.raises(RuntimeError, match="doesn't have a valid autograd context"):
        dist_autograd._current_context()


def test_tensors_of_one_message_share_one_recv_node():
    t = torch.rand(10, 2, requires_grad=True)
    with dist_autograd.context() as context_id:
        parts = rpc.rpc_sync("worker1", torch.split, args=(t, 2))
        assert len({id(p.grad_fn) for p in parts}) == 1
        assert [nr for _, nr in parts[0].grad_fn.next_functions] == [0] * 5
        dist_autograd.backward(context_id, [(parts[0] * parts[4]).sum()])
        want = torch.zeros(10, 2)
        want[0:2] = t.detach()[8:10]
        want[8:10] = t.detach()[0:2]
        torch.testing.assert_close(dist_autograd.get_gradients(context_id)[t], want)


def test_context_functions():
    rank = rpc.get_worker_info().id
    assert dist_autograd._get_max_id() == (rank << 48) + (1 << 48) - 1
    ctx = dist_autograd._new_context()
    try:
        context_id = ctx._context_id()
        assert context_id >> 48 == rank
        assert dist_autograd._is_valid_context(context_id)
        assert dist_autograd._current_context() is ctx
        with pytest.raises(RuntimeError, match="Already have an autograd context id"):
            dist_autograd._new_context()
    finally:
        dist_autograd._release_context(context_id)
    assert not dist_autograd._is_valid_context(context_id)
    with pytest.raises(RuntimeError, match=f"Could not find autograd context with id: {context_id}"):
        dist_autograd._release_context(context_id)
    info = dist_autograd._get_debug_info()
    assert sorted(info) == ["num_autograd_contexts", "num_current_backward_passes"]
    assert info["num_current_backward_passes"] == "0"


# -- arguments and errors --------------------------------------------------------------------------

def test_wrong_argument_types_raise_torchs_type_error():
    with dist_autograd.context() as context_id:
        for args in ((context_id, None), (None, None), (context_id, [1.0])):
            with pytest.raises(TypeError, match="incompatible function arguments"):
                dist_autograd.backward(*args)


def test_error_on_another_worker_is_a_runtime_error_naming_the_node():
    x = torch.rand(3, requires_grad=True)
    for _ in range(2):  # a second pass after an error behaves the same
        with dist_autograd.context() as context_id:
            loss = rpc.rpc_sync("worker1", _explode_remotely, args=(x,)).sum()
            with pytest.raises(RuntimeError, match="Error on Node 1: boom in backward"):
                dist_autograd.backward(context_id, [loss])
    with dist_autograd.context() as context_id:  # and a local one names this node
        loss = _Explode.apply(rpc.rpc_sync("worker1", torch.mul, args=(x, 2.0))).sum()
        with pytest.raises(RuntimeError, match="Error on Node 0: boom in backward"):
            dist_autograd.backward(context_id, [loss])


@contextlib.contextmanager
def _rpc_timeout(seconds: float) -> Iterator[None]:
    old = rpc.get_rpc_timeout()
    rpc._set_rpc_timeout(seconds)
    try:
        yield
    finally:
        rpc._set_rpc_timeout(old)


def test_unused_send_function_holds_the_pass_as_in_torch():
    t1 = torch.rand(3, requires_grad=True)
    with _rpc_timeout(2), dist_autograd.context() as context_id:
        rpc.rpc_sync("worker1", torch.add, args=(t1, t1))  # result never used
        with pytest.raises(RpcTimeoutError, match="send function"):
            dist_autograd.backward(context_id, [(t1 * 2).sum()])


class _TwoOut(Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2, x * 3

    @staticmethod
    def backward(ctx, ga, gb):
        return ga * 2 + gb * 3


def _send_both_return_one(x: torch.Tensor) -> torch.Tensor:
    """On worker1: the two outputs of one node go back to the caller; one result is unused."""
    a, b = _TwoOut.apply(x)
    used = rpc.rpc_sync("worker0", torch.mul, args=(a, 2))
    rpc.rpc_sync("worker0", torch.mul, args=(b, 3))  # never used
    return used + 0


def test_a_node_waiting_for_a_send_that_never_gets_its_gradient_times_out():
    # torch runs worker1's _TwoOut once both of its outputs' gradients are in; the one
    # whose result is unused never comes, so the pass fails at the RPC timeout, as in
    # torch's FAST mode, saying what it waited for.
    x = torch.ones(3, requires_grad=True)
    with _rpc_timeout(2), dist_autograd.context() as context_id:
        out = rpc.rpc_sync("worker1", _send_both_return_one, args=(x,))
        with pytest.raises(RpcTimeoutError, match="send that never came"):
            dist_autograd.backward(context_id, [out.sum()])


# -- hooks, copies, .grad --------------------------------------------------------------------------

def test_accumulator_post_hooks_run_once_per_pass():
    calls = []
    t = torch.rand(4, requires_grad=True)
    a = t + t
    acc = a.grad_fn.next_functions[0][0]
    acc.register_hook(lambda outs, ins: calls.append(1))
    acc.register_hook(lambda outs, ins: calls.append(2))
    t.register_post_accumulate_grad_hook(lambda p: calls.append(int(p.grad.sum().item())))
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync("worker1", torch.mul, args=(a, 1.0)).sum()
        dist_autograd.backward(context_id, [loss])
        assert sorted(calls) == [1, 2, 8]
        torch.testing.assert_close(dist_autograd.get_gradients(context_id)[t], torch.full((4,), 2.0))
    assert t.grad is None


def test_gradients_are_stored_without_copy_unless_shared():
    seen = {}

    class Pair(Function):
        @staticmethod
        def forward(ctx, x, y):
            return x + y

        @staticmethod
        def backward(ctx, grad):
            seen["ptr"] = grad.data_ptr()
            return grad, grad

    class Single(Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen["ptr"] = grad.data_ptr()
            return grad

    a = torch.randn(5, 6, requires_grad=True)
    b = torch.randn(5, 6, requires_grad=True)
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [Single.apply(a)[1][0]])
        assert dist_autograd.get_gradients(context_id)[a].data_ptr() == seen["ptr"]
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [Pair.apply(a, b)[1][0]])
        grads = dist_autograd.get_gradients(context_id)
        assert len({grads[a].data_ptr(), grads[b].data_ptr(), seen["ptr"]}) == 3


def test_profiler_sees_torchs_events():
    t1 = torch.rand(3, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync("worker1", torch.add, args=(t1, t1)).sum()
        with torch.autograd.profiler.profile() as prof:
            dist_autograd.backward(context_id, [loss])
    events = prof.function_events
    for key in ("SendRpcBackward", "RecvRpcBackward", "torch::distributed::autograd::backward"):
        first = next(e for e in events if key in e.name)  # as torch's test looks them up
        assert first.count == 1, (key, [e.name for e in events])
    backward = next(e for e in events if e.name == "torch::distributed::autograd::backward")
    send = next(e for e in events if "SendRpcBackward" in e.name)
    assert backward.cpu_time_total > send.cpu_time_total


def test_concurrent_passes_on_shared_parameters_keep_their_own_gradients():
    w = torch.rand(3, requires_grad=True)
    results, errors = [], []

    def one(k: int) -> None:
        try:
            with dist_autograd.context() as context_id:
                loss = rpc.rpc_sync("worker1", torch.mul, args=(w, float(k))).sum()
                dist_autograd.backward(context_id, [loss])
                results.append((k, dist_autograd.get_gradients(context_id)[w].clone()))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(1, 7)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    for k, g in results:
        torch.testing.assert_close(g, torch.full((3,), float(k)))
    assert w.grad is None
