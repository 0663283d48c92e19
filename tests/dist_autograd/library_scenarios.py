"""What libraries built on torch's RPC do, as scenarios that run under torch's RPC and under
torchrpc alike (see tests/support/side_by_side.py; test_library_patterns.py compares the two).

Each scenario runs on rank 0 (``worker0``, the driver) of a group of three and returns
plain values: whether requests to the driver itself run in the caller's distributed
autograd context, what a backward pass gives when an RPC result's gradient is None or
when a result is not used, the gradients and losses of a pipeline whose first stage
lives on the driver, ``RRef.backward``, and a module of ``RemoteModule``s traced by
torch.fx.
"""

from __future__ import annotations

import threading
import time
import traceback
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx
from torch import nn

from ..support.side_by_side import api

API = api()
rpc = API.rpc
dist_autograd = API.dist_autograd

DRIVER = "worker0"


def _rounded(t: Optional[torch.Tensor]) -> Optional[List[float]]:
    """A tensor as a flat list (None stays None), for JSON."""
    return None if t is None else [float(v) for v in t.detach().reshape(-1)]


class Linear(nn.Linear):
    """A linear layer whose parameters come from its own generator seeded with ``seed``:
    the workers create modules on pool threads while the driver draws its data, so the
    global generator would hand out numbers in any order."""

    def __init__(self, n_in: int, n_out: int, seed: int = 0) -> None:
        super().__init__(n_in, n_out)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.weight.copy_(torch.randn(n_out, n_in, generator=gen) / n_in ** 0.5)
            self.bias.copy_(torch.randn(n_out, generator=gen) / n_in ** 0.5)


# -- helpers run on any worker -----------------------------------------------------------------------

def context_seen() -> Optional[int]:
    """The id of the distributed autograd context current where this runs, or None."""
    try:
        return int(dist_autograd._current_context()._context_id())
    except RuntimeError:
        return None


@rpc.functions.async_execution
def context_seen_async() -> torch.futures.Future:
    """``context_seen``, answered through a future (``@async_execution``)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(context_seen())
    return fut


class Holder:
    """A value whose methods the RRef proxies call on its owner."""

    def context_seen(self) -> Optional[int]:
        return context_seen()

    def double(self, t: torch.Tensor) -> torch.Tensor:
        return t * 2


def bump(t: torch.Tensor) -> torch.Tensor:
    t.add_(1)
    return t


def records() -> Tuple[int, int]:
    """(send functions, recv functions) of the current context here."""
    ctx = dist_autograd._current_context()
    return len(ctx._send_functions()), len(ctx._recv_functions())


def gradient_count(context_id: int) -> int:
    """How many gradients context ``context_id`` holds on this worker."""
    return len(dist_autograd.get_gradients(context_id))


def gradient_of(param: Any, context_id: int) -> Optional[List[float]]:
    """The gradient of the parameter behind RRef ``param`` in context ``context_id``."""
    return _rounded(dist_autograd.get_gradients(context_id).get(param.local_value()))


def step_record(loss: Any, params: List[Any], context_id: int, workers: int = 3
                ) -> Dict[str, Any]:
    """What a training step of a pipeline gives: its loss (an RRef), every parameter's
    gradient in the context and each worker's gradient count."""
    return {"loss": float(loss.to_here()),
            "gradients": [rpc.rpc_sync(p.owner(), gradient_of, args=(p, context_id))
                          for p in params],
            "gradient counts": [rpc.rpc_sync(f"worker{r}", gradient_count, args=(context_id,))
                                for r in range(workers)]}


# -- requests to the driver itself -------------------------------------------------------------------

def self_requests() -> Dict[str, Any]:
    """Which requests to the driver itself (and, for comparison, to a peer) run in the
    caller's context, whether a remote() to itself copies its arguments, and the records
    and gradients of a remote() to itself inside a context."""
    seen: Dict[str, Any] = {}
    holder = rpc.remote(DRIVER, Holder)
    with dist_autograd.context() as cid:
        calls = {
            "remote to itself": lambda: rpc.remote(DRIVER, context_seen).to_here(),
            "rpc_sync to itself": lambda: rpc.rpc_sync(DRIVER, context_seen),
            "rpc_async to itself": lambda: rpc.rpc_async(DRIVER, context_seen).wait(),
            "async_execution remote to itself":
                lambda: rpc.remote(DRIVER, context_seen_async).to_here(),
            "async_execution rpc_sync to itself":
                lambda: rpc.rpc_sync(DRIVER, context_seen_async),
            "proxy rpc_sync to its owner itself": lambda: holder.rpc_sync().context_seen(),
            "proxy rpc_async to its owner itself":
                lambda: holder.rpc_async().context_seen().wait(),
            "proxy remote to its owner itself":
                lambda: holder.remote().context_seen().to_here(),
            "remote to a peer": lambda: rpc.remote("worker1", context_seen).to_here(),
            "rpc_sync to a peer": lambda: rpc.rpc_sync("worker1", context_seen),
        }
        for name, call in calls.items():
            seen[name] = call() == cid
        x = torch.ones(3, requires_grad=True)
        value = rpc.remote(DRIVER, torch.mul, args=(x, 2)).to_here()
        doubled = holder.remote().double(x).to_here()
        sends, recvs = records()
        dist_autograd.backward(cid, [(value + doubled).sum()])
        grad = _rounded(dist_autograd.get_gradients(cid)[x])
    plain = torch.zeros(2)
    rpc.remote(DRIVER, bump, args=(plain,)).to_here()
    return {"context seen": seen, "records": [sends, recvs], "gradient": grad,
            "argument changed by the callee": plain.tolist() != [0.0, 0.0]}


# -- gradients that are None, results that are not used ----------------------------------------------

class NoneGrad(torch.autograd.Function):
    """Passes its first input on; its backward gives the second none (a phony's join,
    which makes the first input's backward wait for the phony's lane)."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[torch.Tensor, None]:
        return g, None


def none_gradient() -> Dict[str, Any]:
    """The issue's minimal case: an RPC result joined through a function whose backward
    returns None for it. The pass must finish, with x's gradient from the other result."""
    with dist_autograd.context() as cid:
        x = torch.ones(3, requires_grad=True)
        t = rpc.rpc_sync("worker1", torch.add, args=(x, 1))
        phony = rpc.rpc_sync("worker1", torch.mul, args=(x, 2))
        loss = NoneGrad.apply(t, phony).sum()
        start = time.monotonic()
        dist_autograd.backward(cid, [loss])
        took = time.monotonic() - start
        grads = dist_autograd.get_gradients(cid)
        # Two hops: the phony's gradient (zeros) goes to worker1 and back to x here.
        return {"x": _rounded(grads[x]), "seconds": took}


def unused_result(timeout: float = 2.0) -> Dict[str, Any]:
    """A pass where one RPC result is not used by the loss, under an RPC timeout of
    ``timeout`` seconds: whether it ends, how, and after how long (torch's FAST mode waits
    for every send function, and the pass fails with a timeout)."""
    rpc._set_rpc_timeout(timeout)
    outcome: Dict[str, Any] = {}

    def run() -> None:
        with dist_autograd.context() as cid:
            x = torch.ones(3, requires_grad=True)
            t = rpc.rpc_sync("worker1", torch.add, args=(x, 1))
            rpc.rpc_sync("worker1", torch.mul, args=(x, 2))  # not used by the loss
            start = time.monotonic()
            try:
                dist_autograd.backward(cid, [t.sum()])
                outcome["raised"] = None
            except Exception as exc:  # noqa: BLE001 - what it raises is the result
                outcome["raised"] = type(exc).__name__
                outcome["runtime error"] = isinstance(exc, RuntimeError)
                outcome["says timeout"] = "time" in str(exc).lower()
            outcome["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout * 10)
    outcome["ended"] = not thread.is_alive()
    return outcome


def none_and_unused() -> Dict[str, Any]:
    """:func:`none_gradient`, then :func:`unused_result` (last: it may leave work behind)."""
    return {"none gradient": none_gradient(), "unused result": unused_result()}


# -- a pipeline whose first stage lives on the driver --------------------------------------------------

class _Fork(torch.autograd.Function):
    """Branches a phony off a tensor (fairscale's ``fork``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return x.detach(), torch.empty(0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _phony_grad: Any) -> torch.Tensor:
        return grad


class Stage:
    """One stage of a micro-batched pipeline, on its worker: inputs arrive by ``feed`` (each
    answered with a phony tensor), ``run`` computes the chunks in order and feeds the next
    stage; a stage joins the phony of its previous chunk's output, fetched with
    ``to_here()``, before computing the next (fairscale's fence)."""

    def __init__(self, n_in: int, n_out: int, seed: int) -> None:
        self.layer = Linear(n_in, n_out, seed)
        self.inputs: Dict[int, torch.Tensor] = {}
        self.ready = threading.Condition()

    def param_rrefs(self) -> List[Any]:
        return [rpc.RRef(p) for p in self.layer.parameters()]

    def feed(self, chunk: int, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            x, phony = _Fork.apply(x)
        else:
            phony = torch.empty(0)
        with self.ready:
            self.inputs[chunk] = x
            self.ready.notify_all()
        return phony

    def run(self, chunks: int, following: Any) -> Optional[torch.Tensor]:
        phonies: List[Any] = []
        outputs = []
        for chunk in range(chunks):
            with self.ready:
                while chunk not in self.inputs:
                    self.ready.wait()
                x = self.inputs.pop(chunk)
            if phonies and torch.is_grad_enabled():
                x = NoneGrad.apply(x, phonies[-1].to_here())
            y = torch.tanh(self.layer(x))
            if following is None:
                outputs.append(y)
            else:
                phonies.append(following.remote().feed(chunk, y))
        return torch.cat(outputs) if following is None else None


def _mse(out: Any, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out.to_here(), target)


def _pipeline_step(stages: List[Any], x: torch.Tensor, chunks: int) -> Any:
    """One forward of the pipeline: every stage's run started (the driver's own by a
    remote() to itself, through its RRef's proxy), then the input chunks fed to stage 0,
    the driver's, through an rpc_async proxy to itself; the RRef of the output."""
    runs = [stage.remote().run(chunks, following)
            for stage, following in zip(stages, stages[1:] + [None])]
    for chunk, part in enumerate(x.chunk(chunks)):
        stages[0].rpc_async().feed(chunk, part).wait()
    return runs[-1]


def pipeline(chunks: int = 1, steps: int = 2) -> Dict[str, Any]:
    """Train a three-stage pipeline (worker0, the driver, then worker1, worker2) for
    ``steps`` steps with ``chunks`` micro-batches: the loss is an RRef on worker2 whose
    ``backward(context_id)`` runs the pass, and a DistributedOptimizer steps over the RRefs
    of every parameter, the driver's own included. Per step: every parameter's gradient
    and each worker's gradient count; then the loss after the steps."""
    DistributedOptimizer = API.DistributedOptimizer
    gen = torch.Generator().manual_seed(1)
    x, target = torch.randn(8, 4, generator=gen), torch.randn(8, 2, generator=gen)
    sizes = [(4, 6, 1), (6, 5, 2), (5, 2, 3)]
    stages = [rpc.remote(f"worker{i}", Stage, args=size) for i, size in enumerate(sizes)]
    params = [p for stage in stages for p in stage.rpc_sync().param_rrefs()]
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.1)
    per_step = []
    for _ in range(steps):
        with dist_autograd.context() as cid:
            out = _pipeline_step(stages, x, chunks)
            loss = rpc.remote("worker2", _mse, args=(out, target))
            loss.backward(cid)
            per_step.append(step_record(loss, params, cid))
            opt.step(cid)
    out = _pipeline_step(stages, x, chunks)
    final = float(rpc.rpc_sync("worker2", _mse, args=(out, target)))
    return {"steps": per_step, "loss after": final}


def pipelines() -> Dict[str, Any]:
    """:func:`pipeline` whole-batch, and with four micro-batches joined by phonies."""
    return {"one batch": pipeline(chunks=1), "micro-batches": pipeline(chunks=4)}


# -- RRef.backward, RemoteModule traced by torch.fx ----------------------------------------------------

def _remote_loss(x: torch.Tensor) -> torch.Tensor:
    return (x * x).sum()


def rref_backward() -> Dict[str, Any]:
    """``RRef.backward(context_id)`` on a local (owner) RRef and on a remote one, and
    ``RRef.backward()`` without a context on a local one."""
    out: Dict[str, Any] = {}
    with dist_autograd.context() as cid:
        x = torch.full((3,), 2.0, requires_grad=True)
        y = rpc.rpc_sync("worker1", torch.mul, args=(x, 3))
        rpc.RRef((y * y).sum()).backward(cid)
        out["local, in a context"] = _rounded(dist_autograd.get_gradients(cid)[x])
    with dist_autograd.context() as cid:
        x = torch.full((3,), 2.0, requires_grad=True)
        rpc.remote("worker1", _remote_loss, args=(x,)).backward(cid)
        out["remote, in a context"] = _rounded(dist_autograd.get_gradients(cid)[x])
        out["x.grad after the passes"] = _rounded(x.grad)
    x = torch.full((3,), 2.0, requires_grad=True)
    rpc.RRef((x * 5).sum()).backward()
    out["local, no context"] = _rounded(x.grad)
    return out


class _Traced(nn.Module):
    """Two RemoteModules, one on the driver itself, and an operator between them."""

    def __init__(self) -> None:
        super().__init__()
        RemoteModule = API.RemoteModule
        self.first = RemoteModule(f"{DRIVER}/cpu", Linear, args=(4, 3, 4))
        self.second = RemoteModule("worker1/cpu", Linear, args=(3, 2, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


class _RemoteModuleLeaves(torch.fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualified_name: str) -> bool:
        return isinstance(m, API.RemoteModule) or super().is_leaf_module(m, qualified_name)


def traced_remote_modules() -> Dict[str, Any]:
    """A module of RemoteModules traced by torch.fx (RemoteModules as leaves): its graph,
    and the output and gradients of the traced module run in a context."""
    model = _Traced()
    tracer = _RemoteModuleLeaves()
    # RemoteModule refuses named_modules(), which the tracer walks: lent nn.Module's for the
    # trace, as fairscale's pipeline does.
    RemoteModule = API.RemoteModule
    saved = RemoteModule.named_modules, RemoteModule.named_children
    RemoteModule.named_modules, RemoteModule.named_children = \
        nn.Module.named_modules, nn.Module.named_children
    try:
        graph = tracer.trace(model)
    finally:
        RemoteModule.named_modules, RemoteModule.named_children = saved
    traced = torch.fx.GraphModule(model, graph)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(6))
    params = model.first.remote_parameters() + model.second.remote_parameters()
    with dist_autograd.context() as cid:
        out = traced(x)
        dist_autograd.backward(cid, [out.sum()])
        grads = [rpc.rpc_sync(p.owner(), gradient_of, args=(p, cid)) for p in params]
    return {"graph": [[n.op, getattr(n.target, "__name__", str(n.target))] for n in graph.nodes],
            "output": _rounded(out),
            "gradients": grads}


# -- functions of the graph that torch's engine runs once a pass ---------------------------------------

BACKWARD_CALLS: List[str] = []  # on each worker: the backward functions of _TwoOut run here


class _TwoOut(torch.autograd.Function):
    """Two outputs of one node, whose backward must run once a pass (it counts its runs)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x * 3

    @staticmethod
    def backward(ctx: Any, ga: torch.Tensor, gb: torch.Tensor) -> torch.Tensor:
        BACKWARD_CALLS.append("two outputs")
        return ga * 2 + gb * 3


def split_and_send(x: torch.Tensor) -> torch.Tensor:
    """On worker1: the two outputs of one node go to two workers (one is the caller)."""
    a, b = _TwoOut.apply(x)
    return (rpc.rpc_sync("worker2", torch.mul, args=(a, 2))
            + rpc.rpc_sync(DRIVER, torch.mul, args=(b, 3)))


def backward_calls() -> int:
    return len(BACKWARD_CALLS)


def call_back_shared(x: torch.Tensor) -> torch.Tensor:
    """On worker1: an intermediate goes back to the caller and into the reply as well."""
    y = x * 2
    z = rpc.rpc_sync(DRIVER, torch.mul, args=(y, y))
    return z * y


PARAMS: Dict[str, torch.Tensor] = {}


class _NestedBackward(torch.autograd.Function):
    """Identity whose backward runs a backward of its own (as checkpointing does)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            inner = (PARAMS["p"] * 3).sum()
        torch.autograd.backward([inner])
        return g


def nested(x: torch.Tensor) -> torch.Tensor:
    """On worker1: a parameter used by the graph and by a nested backward of it."""
    PARAMS["p"] = nn.Parameter(torch.full((3,), 0.5))
    return _NestedBackward.apply(x) * PARAMS["p"]


def nested_gradients(context_id: int) -> Dict[str, Any]:
    p = PARAMS["p"]
    return {"context": _rounded(dist_autograd.get_gradients(context_id).get(p)),
            ".grad": _rounded(p.grad)}


def graph_functions() -> Dict[str, Any]:
    """Node runs and gradients where torch's engine runs a function once: two outputs of a
    node sent to two workers; an intermediate sent back to the caller and used in the
    reply; a nested backward in a function of the pass; a pass whose gradients are zeros."""
    out: Dict[str, Any] = {}
    with dist_autograd.context() as cid:
        x = torch.full((3,), 2.0, requires_grad=True)
        rpc.rpc_sync("worker1", split_and_send, args=(x,))  # not used: a warm-up call
    with dist_autograd.context() as cid:
        before = rpc.rpc_sync("worker1", backward_calls)
        x = torch.full((3,), 2.0, requires_grad=True)
        dist_autograd.backward(cid, [rpc.rpc_sync("worker1", split_and_send, args=(x,)).sum()])
        out["two outputs"] = {"x": _rounded(dist_autograd.get_gradients(cid)[x]),
                              "runs": rpc.rpc_sync("worker1", backward_calls) - before}
    with dist_autograd.context() as cid:
        x = torch.full((3,), 1.5, requires_grad=True)
        dist_autograd.backward(cid, [rpc.rpc_sync("worker1", call_back_shared,
                                                  args=(x,)).sum()])
        out["call back"] = _rounded(dist_autograd.get_gradients(cid)[x])
    with dist_autograd.context() as cid:
        x = torch.full((3,), 2.0, requires_grad=True)
        dist_autograd.backward(cid, [rpc.rpc_sync("worker1", nested, args=(x,)).sum()])
        out["nested"] = {"x": _rounded(dist_autograd.get_gradients(cid)[x]),
                         "worker1": rpc.rpc_sync("worker1", nested_gradients, args=(cid,))}
    with dist_autograd.context() as cid:
        x = torch.full((3,), 2.0, requires_grad=True)
        r = rpc.rpc_sync("worker1", torch.mul, args=(x, 2))
        dist_autograd.backward(cid, [(r * 0).sum()])
        out["zeros"] = {k: _rounded(v) for k, v in
                        (("x", dist_autograd.get_gradients(cid).get(x)),)}
    return out


# -- all of them, in one group -------------------------------------------------------------------------

SCENARIOS = {"self requests": self_requests, "pipelines": pipelines,
             "rref backward": rref_backward, "traced remote modules": traced_remote_modules,
             "graph functions": graph_functions,
             # last: it lowers the RPC timeout, and may leave a part of its pass waiting
             "none and unused": none_and_unused}


def all_patterns() -> Dict[str, Any]:
    """Every scenario above, in order, by name; a scenario that raises gives
    ``{"error": its traceback}``, and the next ones still run."""
    results: Dict[str, Any] = {}
    for name, scenario in SCENARIOS.items():
        try:
            results[name] = scenario()
        except Exception:  # noqa: BLE001 - reported to the test, which names it
            results[name] = {"error": traceback.format_exc()}
    return results
