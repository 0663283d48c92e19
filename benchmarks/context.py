"""What every workload runs with, inside the worker processes: the system's modules and the
options (:class:`WorkerContext`), its part in sessions that take turns (:class:`Turns`),
and the percentile its results are reported by."""

from __future__ import annotations

import dataclasses
import datetime
import os
from types import ModuleType
from typing import Any

from .options import BenchOptions

__all__ = ["Result", "Turns", "WorkerContext", "percentile"]

# What a workload returns: its metrics, and the details that explain them.
Result = tuple[dict[str, float], dict[str, Any]]


@dataclasses.dataclass
class WorkerContext:
    """What a workload needs: the system's modules, the peer's name and the options."""

    rpc: ModuleType
    autograd: ModuleType
    optim: ModuleType
    rpc_module_name: str
    peer: str
    options: BenchOptions
    turns: Turns | None = None
    peers: list[str] = dataclasses.field(default_factory=list)  # every callee (fanout, ps)
    # role -> module name of the system (rpc, autograd, optim), for code run on the callees
    module_names: dict[str, str] = dataclasses.field(default_factory=dict)


class Turns:
    """This system's part in a workload's sessions that take turns with other systems.

    The launcher leads, through its store: once this system has warmed up it says so
    (``ready/I``, with the process ids of both workers); turn N may start once the
    launcher sets ``go/N``, and this system sets ``done/N`` when its turn N is over.
    ``slots`` lists the turns that are this system's. Between its turns the launcher
    stops the system's processes (SIGSTOP), so the one whose turn it is has the machine
    to itself, as when the systems run one after the other.
    """

    def __init__(self, spec: dict[str, Any]) -> None:
        from torch.distributed import TCPStore

        host, port = spec["store"]
        self.slots: list[int] = list(spec["slots"])
        self.index: int = spec["index"]
        self._store = TCPStore(host, port, is_master=False,
                               timeout=datetime.timedelta(seconds=spec["time_limit"]))

    def ready(self, callee_pid: int) -> None:
        """Warmed up: the launcher starts the first turn once every system is."""
        self._store.set(f"ready/{self.index}", f"{os.getpid()},{callee_pid}")

    def start(self, slot: int) -> None:
        """Block until turn ``slot`` may begin."""
        self._store.wait([f"go/{slot}"])

    def end(self, slot: int) -> None:
        """Turn ``slot`` is over: let the next one begin."""
        self._store.set(f"done/{slot}", "1")


def percentile(samples: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``samples``, linearly interpolated."""
    if not samples:
        raise ValueError("percentile of no samples")
    ordered = sorted(samples)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)
