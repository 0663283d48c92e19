"""Functions the distributed autograd and optimizer tests run remotely (and locally).

Each forward function takes worker names to call next; given ``None`` instead of a
name, it calls the function directly, so the same code is the local reference.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Dict, List, Optional

import torch

import torchrpc.autograd as dist_autograd
import torchrpc.rpc as rpc
from torchrpc.optim import DistributedOptimizer


def call(to: Optional[str], fn: Any, *args: Any) -> Any:
    """``rpc_sync(to, fn, args)``, or ``fn(*args)`` when ``to`` is None."""
    return fn(*args) if to is None else rpc.rpc_sync(to, fn, args=args)


def chain(x: torch.Tensor, hops: List[Optional[str]]) -> torch.Tensor:
    """A few ops, then the rest of the chain on the next hop."""
    h = x.sin() * 2 + x * x
    if not hops:
        return h
    return call(hops[0], chain, h, hops[1:]) * 3


def square_plus(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return y * y + x


def loop(x: torch.Tensor, back: Optional[str]) -> torch.Tensor:
    """Call back to ``back`` (the caller) with a computed tensor and the received one."""
    y = x * 2
    z = call(back, square_plus, y, x)
    return z * x


def scale(t: torch.Tensor, factor: float) -> torch.Tensor:
    return t * factor


def mul_add(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return a * b + c


def pair(a: torch.Tensor, b: torch.Tensor) -> tuple:
    """Several tensors in and out, one of them passed through unchanged."""
    return a * b, b, {"sum": a + b}


def in_place_relu(x: torch.Tensor) -> torch.Tensor:
    return x.relu_() * 2


def sum_of(x: torch.Tensor) -> torch.Tensor:
    return (x * x).sum()


class Explode(torch.autograd.Function):
    """Identity forward; its backward raises."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        raise ValueError("explode-in-backward")


def explode(x: torch.Tensor) -> torch.Tensor:
    return Explode.apply(x) * 2


class SleepInBackward(torch.autograd.Function):
    """Identity forward; its backward sleeps first."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor,  # type: ignore[override]
                seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        time.sleep(ctx.seconds)
        return grad, None


def slow_scale(t: torch.Tensor, factor: float, seconds: float) -> torch.Tensor:
    """``t * factor``, whose backward takes ``seconds``."""
    return SleepInBackward.apply(t, seconds) * factor


@rpc.functions.async_execution
def async_chain(to: str, x: torch.Tensor, z: torch.Tensor) -> torch.futures.Future:
    return rpc.rpc_async(to, torch.mul, args=(x, x)).then(lambda fut: fut.wait() + z * x)


# -- state kept on a worker ------------------------------------------------------------------------

PARAMS: Dict[str, torch.Tensor] = {}
_lock = threading.Lock()


def make_weight(seed: int, rows: int, cols: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g, dtype=torch.float64)


def init_param(name: str, seed: int, rows: int, cols: int) -> None:
    with _lock:
        PARAMS[name] = torch.nn.Parameter(make_weight(seed, rows, cols))


def linear(name: str, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ PARAMS[name])


def param_grad(context_id: int, name: str) -> Optional[torch.Tensor]:
    return dist_autograd.get_gradients(context_id).get(PARAMS[name])


def param_dot_grad(name: str) -> Optional[torch.Tensor]:
    return PARAMS[name].grad


def param_value(name: str) -> torch.Tensor:
    return PARAMS[name].detach().clone()


def new_context_ids(n: int) -> List[int]:
    ids = []
    for _ in range(n):
        with dist_autograd.context() as cid:
            ids.append(cid)
    return ids


def nested_context() -> str:
    """Run inside a context joined from the caller: a new one here must be refused."""
    try:
        with dist_autograd.context():
            return "no error"
    except RuntimeError as exc:
        return str(exc)


def num_contexts() -> int:
    return rpc.get_debug_info()["num_autograd_contexts"]


def rref_value_sum(rref: Any) -> torch.Tensor:
    return rref.local_value().sum()


# -- DistributedOptimizer --------------------------------------------------------------------------

def warm_up_optimizers() -> None:
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


def new_param(seed: int, rows: int, cols: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(make_weight(seed, rows, cols))


def rref_linear(rref: Any, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ rref.local_value())


def rref_scaled_sum(rref: Any, x: torch.Tensor) -> torch.Tensor:
    return (rref.local_value() * x).sum()


def shared_param(name: str) -> torch.Tensor:
    return PARAMS[name]


def train_shared(name: str, owner: str, xs: List[torch.Tensor], lr: float) -> int:
    """A trainer: SGD steps on the shared parameter ``name`` of ``owner``, loss linear in it."""
    rref = rpc.remote(owner, shared_param, args=(name,))
    opt = DistributedOptimizer(torch.optim.SGD, [rref], lr=lr)
    for x in xs:
        with dist_autograd.context() as cid:
            loss = rpc.rpc_sync(owner, rref_scaled_sum, args=(rref, x))
            dist_autograd.backward(cid, [loss])
            opt.step(cid)
    return len(xs)


def random_tensor(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand((3, 3), generator=g).requires_grad_()


def seeded_mlp(seed: int, d_in: int, d_out: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(d_in, 8), torch.nn.Tanh(), torch.nn.Linear(8, d_out))


_hook_calls: List[str] = []
_hook_handles: List[Any] = []


def add_step_hooks() -> None:
    """Register a global optimizer step pre-hook and post-hook on this worker."""
    from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                       register_optimizer_step_pre_hook)
    _hook_calls.clear()
    _hook_handles.append(register_optimizer_step_pre_hook(
        lambda opt, args, kwargs: _hook_calls.append(f"pre:{type(opt).__name__}")))
    _hook_handles.append(register_optimizer_step_post_hook(
        lambda opt, args, kwargs: _hook_calls.append(f"post:{type(opt).__name__}")))


def remove_step_hooks() -> List[str]:
    """Remove the hooks of :func:`add_step_hooks`; the calls they saw."""
    while _hook_handles:
        _hook_handles.pop().remove()
    return list(_hook_calls)



def sparse_scale(t: torch.Tensor, factor: float) -> torch.Tensor:
    """A sparse COO tensor times a number: the result stays sparse."""
    return t * factor


def embedding_bag(weight: torch.Tensor, idx: torch.Tensor, offsets: torch.Tensor,
                  per_sample: torch.Tensor) -> torch.Tensor:
    """A sum-mode EmbeddingBag lookup whose weight gradient is sparse."""
    return torch.nn.functional.embedding_bag(idx, weight, offsets, mode="sum", sparse=True,
                                             per_sample_weights=per_sample)


_bags: Dict[str, torch.nn.EmbeddingBag] = {}


def new_bag(name: str, seed: int, num: int, dim: int) -> None:
    """Make an ``nn.EmbeddingBag(sparse=True)`` on this worker, seeded for a local copy."""
    torch.manual_seed(seed)
    _bags[name] = torch.nn.EmbeddingBag(num, dim, mode="sum", sparse=True)


def bag_forward(name: str, idx: torch.Tensor, offsets: torch.Tensor,
                per_sample: torch.Tensor) -> torch.Tensor:
    return _bags[name](idx, offsets, per_sample)


def bag_grad(context_id: int, name: str) -> Optional[torch.Tensor]:
    """The gradient of the named bag's weight in the context (None if it has none)."""
    return dist_autograd.get_gradients(context_id).get(_bags[name].weight)
