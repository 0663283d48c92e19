"""DistributedOptimizer over real worker processes, checked against local optimizers."""

from __future__ import annotations

import threading

import pytest
import torch

import torchrpc.autograd as dist_autograd
import torchrpc.optim
import torchrpc.rpc as rpc
from torchrpc.nn import RemoteModule
from torchrpc.optim import DistributedOptimizer

from ..support import autograd as h
from ..support.group import running_group


@pytest.fixture(scope="module", autouse=True)
def group():
    with running_group(3, threads=4, timeout=30.0) as g:
        # torch imports torch._dynamo (seconds) when the first optimizer is made: do it
        # everywhere at once, without a deadline, so no test's RPC waits for it.
        warm = [rpc.rpc_async(w, h.warm_up_optimizers, timeout=0) for w in ("worker1", "worker2")]
        h.warm_up_optimizers()
        torch.futures.wait_all(warm)
        yield g


def inputs(n: int, seed: int, shape=(5, 4)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=torch.float64) for _ in range(n)]


def model(x, w1, w2):
    return torch.tanh(torch.tanh(x @ w1) @ w2).pow(2).mean()


def train_local(optimizer_class, xs, **kwargs):
    w1, w2 = h.new_param(1, 4, 3), h.new_param(2, 3, 2)
    opt = optimizer_class([w1, w2], **kwargs)
    for x in xs:
        opt.zero_grad()
        model(x, w1, w2).backward()
        opt.step()
    return w1.detach(), w2.detach()


def train_distributed(optimizer_class, xs, **kwargs):
    r1 = rpc.remote("worker1", h.new_param, args=(1, 4, 3))
    r2 = rpc.remote("worker2", h.new_param, args=(2, 3, 2))
    opt = DistributedOptimizer(optimizer_class, [r1, r2], **kwargs)
    for x in xs:
        with dist_autograd.context() as cid:
            hid = rpc.rpc_sync("worker1", h.rref_linear, args=(r1, x))
            out = rpc.rpc_sync("worker2", h.rref_linear, args=(r2, hid))
            dist_autograd.backward(cid, [out.pow(2).mean()])
            opt.step(cid)
    return r1.to_here(), r2.to_here()


def test_public_surface():
    assert torchrpc.optim.__all__ == ["DistributedOptimizer"]


@pytest.mark.parametrize("optimizer_class, kwargs", [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    (torch.optim.Adam, {"lr": 0.05}),
    (torch.optim.Adagrad, {"lr": 0.1}),
])
def test_three_steps_match_the_local_optimizer(optimizer_class, kwargs):
    xs = inputs(3, seed=3)
    want = train_local(optimizer_class, xs, **kwargs)
    got = train_distributed(optimizer_class, xs, **kwargs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert not torch.equal(got[0], h.make_weight(1, 4, 3))  # it did move


def test_design_note_example():
    # "Simple end to end example" of the distributed autograd design note
    with dist_autograd.context() as context_id:
        rref1 = rpc.remote("worker1", h.random_tensor, args=(1,))
        rref2 = rpc.remote("worker1", h.random_tensor, args=(2,))
        loss = rref1.to_here() + rref2.to_here()
        dist_autograd.backward(context_id, [loss.sum()])
        dist_optim = DistributedOptimizer(torch.optim.SGD, [rref1, rref2], lr=0.05)
        dist_optim.step(context_id)
    for rref, seed in ((rref1, 1), (rref2, 2)):
        torch.testing.assert_close(rref.to_here(), h.random_tensor(seed).detach() - 0.05)


def test_positional_args_and_local_parameters():
    local = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    remote = rpc.remote("worker1", h.new_param, args=(5, 3, 1))
    opt = DistributedOptimizer(torch.optim.SGD, [rpc.RRef(local), remote], 0.5)
    x = torch.arange(3.0, dtype=torch.float64)
    with dist_autograd.context() as cid:
        loss = (local * x).sum() + rpc.rpc_sync("worker1", h.rref_scaled_sum, args=(remote, 2.0))
        dist_autograd.backward(cid, [loss])
        opt.step(cid)
    torch.testing.assert_close(local.detach(), 1 - 0.5 * x)
    torch.testing.assert_close(remote.to_here(), h.make_weight(5, 3, 1) - 0.5 * 2.0)
    assert local.grad is None


def test_parameters_without_gradients_are_unchanged():
    used = rpc.remote("worker1", h.new_param, args=(6, 2, 2))
    unused_same_owner = rpc.remote("worker1", h.new_param, args=(7, 2, 2))
    unused_other_owner = rpc.remote("worker2", h.new_param, args=(8, 2, 2))
    opt = DistributedOptimizer(torch.optim.Adam, [used, unused_same_owner, unused_other_owner],
                               lr=0.1, weight_decay=0.1)
    for _ in range(2):
        with dist_autograd.context() as cid:
            loss = rpc.rpc_sync("worker1", h.rref_scaled_sum, args=(used, 1.0))
            dist_autograd.backward(cid, [loss])
            opt.step(cid)
    assert not torch.equal(used.to_here(), h.make_weight(6, 2, 2))
    torch.testing.assert_close(unused_same_owner.to_here(), h.make_weight(7, 2, 2))
    torch.testing.assert_close(unused_other_owner.to_here(), h.make_weight(8, 2, 2))
    # and a step in a context with no backward at all changes nothing either
    with dist_autograd.context() as cid:
        before = used.to_here()
        opt.step(cid)
    torch.testing.assert_close(used.to_here(), before)


def test_remote_module_trains_through_remote_parameters():
    remote = RemoteModule("worker2/cpu", h.seeded_mlp, args=(21, 4, 2))
    local = h.seeded_mlp(21, 4, 2)
    dist_opt = DistributedOptimizer(torch.optim.SGD, remote.remote_parameters(), lr=0.1,
                                    momentum=0.5)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.1, momentum=0.5)
    for x in inputs(3, seed=22, shape=(6, 4)):
        x = x.float()
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [remote(x).pow(2).sum()])
            dist_opt.step(cid)
        local_opt.zero_grad()
        local(x).pow(2).sum().backward()
        local_opt.step()
    got = [p.to_here() for p in remote.remote_parameters()]
    assert len(got) == 4
    for g, w in zip(got, local.parameters()):
        torch.testing.assert_close(g, w.detach())


def test_concurrent_trainers_on_a_shared_parameter():
    rpc.rpc_sync("worker1", h.init_param, args=("shared", 9, 3, 3))
    lr = 0.01
    batches = [inputs(4, seed=10 + i, shape=(3, 3)) for i in range(4)]
    errors = []

    def local_trainer(xs):
        try:
            h.train_shared("shared", "worker1", xs, lr)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=local_trainer, args=(batches[i],)) for i in range(2)]
    for t in threads:
        t.start()
    remote_runs = [rpc.rpc_async(w, h.train_shared, args=("shared", "worker1", batches[i], lr))
                   for w, i in (("worker2", 2), ("worker1", 3))]
    for t in threads:
        t.join(60)
    assert [f.wait() for f in remote_runs] == [4, 4]
    assert not errors, errors
    # The loss is linear in the parameter, so the result does not depend on the order.
    want = h.make_weight(9, 3, 3) - lr * sum(x for xs in batches for x in xs)
    torch.testing.assert_close(rpc.rpc_sync("worker1", h.param_value, args=("shared",)), want)


def test_step_hooks_and_the_profiler_still_see_every_step():
    # The local step skips torch's profiling wrapper only while nothing would notice.
    r1 = rpc.remote("worker1", h.new_param, args=(13, 4, 3))
    local = h.new_param(14, 4, 3)
    opt = DistributedOptimizer(torch.optim.SGD, [r1, rpc.RRef(local)], lr=0.1)
    x = inputs(1, 15, shape=(2, 4))[0]

    def step() -> None:
        with dist_autograd.context() as cid:
            out = rpc.rpc_sync("worker1", h.rref_linear, args=(r1, x)) + x @ local
            dist_autograd.backward(cid, [out.sum()])
            opt.step(cid)

    rpc.rpc_sync("worker1", h.add_step_hooks)
    h.add_step_hooks()
    try:
        step()
    finally:
        remote_calls = rpc.rpc_sync("worker1", h.remove_step_hooks)
        local_calls = h.remove_step_hooks()
    assert remote_calls == local_calls == ["pre:SGD", "post:SGD"]
    step()  # no hooks now: the unwrapped step, still a step
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    assert "Optimizer.step#SGD.step" in {e.name for e in prof.events()}
    before = local.detach().clone()
    step()
    assert not torch.equal(local.detach(), before)


def test_errors():
    r = rpc.remote("worker1", h.new_param, args=(12, 2, 2))
    with pytest.raises(TypeError, match="must be an RRef"):
        DistributedOptimizer(torch.optim.SGD, [torch.ones(2)], lr=0.1)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        DistributedOptimizer(torch.optim.SGD, [r], lr=-1.0)
    opt = DistributedOptimizer(torch.optim.SGD, [r], lr=0.1)
    with pytest.raises(RuntimeError, match="987654321"):
        opt.step(987654321)
    with pytest.raises(TypeError):
        opt.step("1")
