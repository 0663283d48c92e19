"""fairscale's distributed pipeline trained on three workers, under torch's RPC or under
torchrpc substituted by import redirection (see tests/support/side_by_side.py and
test_fairscale_pipeline.py).

Under torchrpc, fairscale's modules see torchrpc wherever they name
``torch.distributed.rpc`` or ``torch.distributed.nn`` (tests/conformance/redirect.py, with
fairscale's modules as the code that sees it), as a user who ports fairscale by its
imports would have it; this module uses the implementation's modules directly.

Two pipelines, each trained two steps in distributed autograd contexts with four
micro-batches: one built with ``PipelineModulesGraph.add_sequence`` whose first partition
lives on the driver (fairscale starts it with a remote() to the driver itself), and one
traced by torch.fx from a module of ``RemoteModule``s (a DAG: a split into two branches on
two workers, joined on the third). Each step records every parameter's gradient in the
context and each worker's gradient count; then the loss after the two steps.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
from torch import nn

from ..dist_autograd.library_scenarios import Linear, step_record
from ..support.side_by_side import api

API = api()
if API.impl == "torchrpc":
    from ..conformance import redirect
    redirect.install("torchrpc", code=("fairscale.",))

from fairscale.experimental.nn.distributed_pipeline import (  # noqa: E402 - after the redirection
    DistributedLoss, DistributedPipeline, PipelineModulesGraph)
from fairscale.experimental.nn.distributed_pipeline.trace import make_graph  # noqa: E402

rpc = API.rpc
dist_autograd = API.dist_autograd
RemoteModule = API.RemoteModule


class Split(nn.Module):
    """Two halves of the features (a module with a tuple output)."""

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return x[:, :3], x[:, 3:]


class Concatenate(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cat([a, b], dim=1)


class Branches(nn.Module):
    """A model of RemoteModules for torch.fx: a layer and a split on the driver, one
    branch each on worker1 and worker2, joined on worker2."""

    def __init__(self) -> None:
        super().__init__()
        self.first = RemoteModule("worker0/cpu", Linear, (4, 6, 1))
        self.split = RemoteModule("worker0/cpu", Split, ())
        self.left = RemoteModule("worker1/cpu", Linear, (3, 3, 2))
        self.right = RemoteModule("worker2/cpu", Linear, (3, 3, 3))
        self.join = RemoteModule("worker2/cpu", Concatenate, ())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.split(self.first(x))
        return self.join(self.left(a), self.right(b))


def sequence_graph() -> PipelineModulesGraph:
    """Four layers in a row: two on the driver, then one on worker1 and one on worker2."""
    layers = [RemoteModule("worker0/cpu", Linear, (4, 6, 1)),
              RemoteModule("worker0/cpu", nn.Tanh, ()),
              RemoteModule("worker1/cpu", Linear, (6, 5, 2)),
              RemoteModule("worker2/cpu", Linear, (5, 6, 3))]
    graph = PipelineModulesGraph()
    graph.add_sequence(layers, [0])
    return graph


def train(graph: PipelineModulesGraph, steps: int = 2, chunks: int = 4) -> Dict[str, Any]:
    """Train ``graph`` as fairscale's pipeline does: gradients and counts per step, the
    loss after the steps."""
    pipe = DistributedPipeline(graph, chunks=chunks)
    params = pipe.parameter_rrefs()
    opt = API.DistributedOptimizer(torch.optim.SGD, params, lr=0.1)
    criterion = DistributedLoss(nn.MSELoss)
    gen = torch.Generator().manual_seed(4)
    x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 6, generator=gen)
    per_step = []
    for _ in range(steps):
        with dist_autograd.context() as cid:
            pipe.train()
            loss = criterion(pipe(x), rpc.RRef(y))
            loss.backward(cid)
            per_step.append(step_record(loss, params, cid))
            opt.step(cid)
    final = float(criterion(pipe(x), rpc.RRef(y)).to_here())
    return {"steps": per_step, "loss after": final}


def pipelines() -> Dict[str, Any]:
    """Both pipelines' training records (a pipeline that raises gives ``{"error": ...}``)."""
    import traceback
    out: Dict[str, Any] = {}
    for name, make in (("sequence", sequence_graph), ("traced", lambda: make_graph(Branches()))):
        try:
            out[name] = train(make())
        except Exception:  # noqa: BLE001 - reported to the test, which names it
            out[name] = {"error": traceback.format_exc()}
    return out
