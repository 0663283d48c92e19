"""DistributedDataParallel under distributed autograd, on two trainer processes.

worker0 (this process) drives; worker1 and worker2 are trainers that form a gloo
group of two and wrap a layer in DDP. Each step's forward sends a tensor to worker0
and back, so the backward pass crosses workers; DDP's reducer must average the
gradients into the context, as in torch.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import torchrpc.autograd as dist_autograd
import torchrpc.rpc as rpc

from ..support.group import free_port

TRAINERS = ["worker1", "worker2"]
LR = 0.1


pytestmark = pytest.mark.group(3, threads=4, timeout=60.0)


# -- on the trainers ------------------------------------------------------------------------------

_state: Dict[str, object] = {}


def _setup(trainer: int, port: int, find_unused: bool) -> None:
    """Join the trainers' gloo group (once per process) and build this test's DDP model."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=trainer,
                                world_size=len(TRAINERS))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    extra = nn.Linear(4, 2)  # used only when a step asks for it
    _state["plain"] = (model, extra)
    _state["ddp"] = DDP(_Net(model, extra), find_unused_parameters=find_unused)


class _Net(nn.Module):
    def __init__(self, model: nn.Module, extra: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.extra = extra

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        out = self.model(x)
        return out + self.extra(x) if use_extra else out


def _loss(net, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
    # The input goes through worker0 and comes back: the backward pass crosses workers.
    x = rpc.rpc_sync("worker0", torch.mul, args=(x, 2.0))
    return net(x, use_extra).pow(2).sum()


def _step(trainer: int, seed: int, use_extra: bool) -> Tuple[List[torch.Tensor],
                                                              List[torch.Tensor], bool]:
    """One step: (context gradients, local gradients without DDP, whether every .grad
    stayed None); then SGD from the context gradients."""
    ddp = _state["ddp"]
    params = list(ddp.module.parameters())
    gen = torch.Generator().manual_seed(seed * 10 + trainer)
    x = torch.randn(5, 4, generator=gen).requires_grad_()
    # Local reference: the same computation on this trainer alone, by local autograd.
    loss = ddp.module(x.detach() * 2.0, use_extra).pow(2).sum()
    used = [p for p in params if use_extra or not _is_extra(ddp, p)]
    local = list(torch.autograd.grad(loss, used))
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [_loss(ddp, x, use_extra)])
        grads = dist_autograd.get_gradients(context_id)
        in_context = [grads[p].clone() if p in grads else None for p in params]
        assert x in grads
    untouched = all(p.grad is None for p in params)
    with torch.no_grad():
        for p, g in zip(params, in_context):
            if g is not None:
                p -= LR * g
    full_local: List[Optional[torch.Tensor]] = []
    it = iter(local)
    for p in params:
        full_local.append(next(it) if any(p is q for q in used) else None)
    return in_context, full_local, untouched


def _is_extra(ddp, p: torch.Tensor) -> bool:
    return any(p is q for q in ddp.module.extra.parameters())


def _weights() -> List[torch.Tensor]:
    return [p.detach().clone() for p in _state["ddp"].module.parameters()]


# -- the driver ------------------------------------------------------------------------------------

def _on_trainers(fn, *args) -> list:
    futs = [rpc.rpc_async(name, fn, args=(i,) + args) for i, name in enumerate(TRAINERS)]
    return [f.wait() for f in futs]


_gloo_port: List[int] = []  # the trainers' gloo group, made by the first test that runs


def _setup_trainers(find_unused: bool) -> None:
    if not _gloo_port:
        _gloo_port.append(free_port())
    _on_trainers(_setup, _gloo_port[0], find_unused)


def _check_steps(steps: List[bool]) -> None:
    for seed, use_extra in enumerate(steps):
        (ctx0, local0, untouched0), (ctx1, local1, untouched1) = _on_trainers(
            _step, seed, use_extra)
        assert untouched0 and untouched1, "distributed autograd left gradients in .grad"
        for g0, g1, l0, l1 in zip(ctx0, ctx1, local0, local1):
            if l0 is None:
                assert g0 is None and g1 is None
                continue
            want = (l0 + l1) / 2
            torch.testing.assert_close(g0, want)
            torch.testing.assert_close(g1, want)
        w0, w1 = [rpc.rpc_sync(name, _weights) for name in TRAINERS]
        for a, b in zip(w0, w1):
            assert torch.equal(a, b), "the DDP replicas diverged"


def test_context_gradients_are_the_average_of_the_trainers():
    _setup_trainers(find_unused=False)
    _check_steps([True, True, True])


def test_find_unused_parameters():
    _setup_trainers(find_unused=True)
    _check_steps([False, True, False])
