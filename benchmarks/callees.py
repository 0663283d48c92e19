"""What runs in a benchmark worker by reference: the functions the callee executes when a
call is unpickled, the ``ps`` workload's trainer, and the process's memory readings.

None of this imports an RPC module: code that needs one looks it up by module name, so it
works for whichever system the worker runs.
"""

from __future__ import annotations

import importlib
import itertools
import os
import resource
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PSTrainer", "add_one", "baseline_rss_mb", "echo", "make_ps_table", "make_stage",
           "memory_mb", "mlp", "noop", "peak_rss_mb", "ps_train", "remote_peak_rss_mb",
           "stage_forward", "stage_param_rrefs", "worker_pid"]


def memory_mb() -> dict[str, float]:
    """This process's memory now, in MiB: ``rss`` (resident), ``private`` (resident and
    not shared with other processes, e.g. by torch's libraries: what the process adds to
    the machine) and ``threads`` (a count). Empty where ``/proc`` is missing."""
    out: dict[str, float] = {}
    try:
        with open("/proc/self/smaps_rollup", encoding="ascii") as rollup:
            for line in rollup:
                key, _, rest = line.partition(":")
                if key in ("Rss", "Private_Clean", "Private_Dirty"):
                    out[key] = int(rest.split()[0]) / 1024.0
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Threads:"):
                    out["threads"] = float(line.split()[1])
    except (OSError, ValueError, IndexError):
        return {}
    return {"rss": out.get("Rss", 0.0),
            "private": out.get("Private_Clean", 0.0) + out.get("Private_Dirty", 0.0),
            "threads": out.get("threads", 0.0)}


def peak_rss_mb() -> float:
    """Peak resident set size of this process, in MiB.

    Reads ``VmHWM`` from ``/proc/self/status``: the same high-water mark as ``ru_maxrss``,
    but per address space, so it is not inflated by the parent's size, which Linux folds
    into ``ru_maxrss`` across ``fork`` + ``exec``. Falls back to ``ru_maxrss`` elsewhere.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# Elements of the tensor that runs the echo workload's own torch code before its baseline:
# more than torch's intra-op grain size (32,768), so that the code for large tensors runs
# and the intra-op threads start, as they do for the payloads.
_WARM_NUMEL = 1 << 16


def baseline_rss_mb() -> float:
    """The resident set size, in MiB, once the echo workload's own torch code (making and
    comparing large tensors) has run, so that its code pages and torch's intra-op threads
    do not count as the echoes' growth. The current size, not the peak: the warm-up's
    tensors are gone, and the echoes' peak counts from what stays."""
    check = torch.rand(_WARM_NUMEL)
    torch.equal(check.clone(), check)
    del check
    return memory_mb().get("rss") or peak_rss_mb()


def add_one(x: torch.Tensor) -> torch.Tensor:
    """A tiny Python function: ``x + 1``."""
    return x + 1


def echo(x: Any) -> Any:
    """Return the argument unchanged."""
    return x


def remote_peak_rss_mb() -> float:
    """Peak RSS of the process this runs in (called over RPC on the callee)."""
    return peak_rss_mb()


def process_cpu_s() -> float:
    """CPU seconds this process has used (user and system, all threads)."""
    return time.process_time()


def noop(x: int) -> int:
    """Return the int argument: a call with no tensor anywhere."""
    return x


def mlp(dims: list[int], final_relu: bool) -> nn.Sequential:
    """Linear layers between consecutive ``dims`` with ReLU between them."""
    layers: list[nn.Module] = []
    for i, (d_in, d_out) in enumerate(itertools.pairwise(dims)):
        layers.append(nn.Linear(d_in, d_out))
        if final_relu or i < len(dims) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def worker_pid() -> int:
    """This worker's process id."""
    return os.getpid()


def make_stage(dims: list[int], seed: int) -> nn.Module:
    """Build the callee's half of the MLP (last layers, no final activation)."""
    torch.manual_seed(seed)
    return mlp(dims, final_relu=False)


def stage_forward(stage_rref: Any, x: torch.Tensor) -> torch.Tensor:
    """Run the module that ``stage_rref`` owns on ``x``."""
    return stage_rref.local_value()(x)


def stage_param_rrefs(stage_rref: Any, rpc_module_name: str) -> list[Any]:
    """RRefs to the parameters of the module ``stage_rref`` owns.

    The RRef class is looked up by module name so that this works for whichever system
    the worker runs.
    """
    rref_cls = importlib.import_module(rpc_module_name).RRef
    return [rref_cls(p) for p in stage_rref.local_value().parameters()]


class PSTrainer:
    """One trainer of the ``ps`` workload, built on its worker with ``rpc.remote``.

    The model is an embedding table on the parameter server (``table``, an RRef to the
    server's ``nn.EmbeddingBag``) under a small MLP of the trainer's own. Each step looks
    up the batch's rows on the server, runs the MLP, and inside a distributed autograd
    context runs ``backward`` and a ``DistributedOptimizer`` (SGD) step over the table's
    parameters and the MLP's. Uses only the system's public API, found by module name.
    """

    def __init__(self, table: Any, modules: dict[str, str], dims: list[int], bag: int,
                 batch: int, lr: float, seed: int) -> None:
        self.rpc = importlib.import_module(modules["rpc"])
        self.autograd = importlib.import_module(modules["autograd"])
        optim = importlib.import_module(modules["optim"])
        self.table = table
        self.server = table.owner()
        torch.manual_seed(seed)
        self.head = mlp(dims[1:], final_relu=False)
        params = self.rpc.rpc_sync(self.server, stage_param_rrefs,
                                   args=(table, modules["rpc"]))
        params += [self.rpc.RRef(p) for p in self.head.parameters()]
        self.optimizer = optim.DistributedOptimizer(torch.optim.SGD, params, lr=lr)
        # A fixed batch whose class is a function of its rows, so the loss can fall.
        self.rows = torch.randint(0, dims[0], (batch, bag))
        self.targets = self.rows[:, 0] % dims[-1]

    def step(self) -> float:
        """One training step; returns the loss."""
        with self.autograd.context() as context_id:
            embedded = self.rpc.rpc_sync(self.server, stage_forward,
                                         args=(self.table, self.rows))
            loss = F.cross_entropy(self.head(embedded), self.targets)
            self.autograd.backward(context_id, [loss])
            self.optimizer.step(context_id)
        return float(loss)


def make_ps_table(rows: int, width: int, seed: int) -> nn.Module:
    """The parameter server's embedding table: each sample is the mean of its rows."""
    torch.manual_seed(seed)
    return nn.EmbeddingBag(rows, width, mode="mean")


def ps_train(trainer: Any, steps: int) -> dict[str, list[float]]:
    """Run ``steps`` steps of the trainer ``trainer`` (an RRef this worker owns): the
    milliseconds and the loss of each."""
    local = trainer.local_value()
    times, losses = [], []
    for _ in range(steps):
        start = time.perf_counter()
        losses.append(local.step())
        times.append((time.perf_counter() - start) * 1e3)
    return {"ms": times, "losses": losses}

