"""The systems the benchmark compares, named by the modules that implement them.

A system is nothing but three module names: the RPC module (``init_rpc``, ``rpc_sync``,
``TensorPipeRpcBackendOptions``, ...), the distributed-autograd module (``context``,
``backward``) and the module that holds ``DistributedOptimizer``. The modules are imported
only inside the spawned worker processes, by name, so a system that is missing or broken
shows up as an error row instead of taking the whole benchmark down.

``torchrpc-tcp`` is torchrpc over plain TCP, as between hosts (no Unix socket, no shared
memory), frame MACs included.

``floor`` and ``floor-self`` are a featureless RPC (``variants/floor.py``): what any
pure-Python design costs on this machine, for the latency and throughput workloads only.

``shim`` is torch again under another label. It exists to develop and test the harness
end to end without depending on torchrpc being complete.
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["BASELINE", "SYSTEMS", "SystemSpec", "parse_system_definition", "resolve_systems"]


@dataclasses.dataclass(frozen=True)
class SystemSpec:
    """One system under test: a label and the modules that provide its API."""

    name: str
    rpc: str
    autograd: str
    optim: str

    def modules(self) -> dict[str, str]:
        """Return the role -> module-name table the worker imports from."""
        return {"rpc": self.rpc, "autograd": self.autograd, "optim": self.optim}


_TORCH_MODULES = {
    "rpc": "torch.distributed.rpc",
    "autograd": "torch.distributed.autograd",
    "optim": "torch.distributed.optim",
}

SYSTEMS: dict[str, SystemSpec] = {
    "torch": SystemSpec("torch", **_TORCH_MODULES),
    "torchrpc": SystemSpec("torchrpc", rpc="torchrpc.rpc", autograd="torchrpc.autograd",
                           optim="torchrpc.optim"),
    "torchrpc-tcp": SystemSpec("torchrpc-tcp", rpc="benchmarks.variants.tcp",
                               autograd="torchrpc.autograd", optim="torchrpc.optim"),
    "shim": SystemSpec("shim", **_TORCH_MODULES),
    "floor": SystemSpec("floor", rpc="benchmarks.variants.floor",
                        autograd="torchrpc.autograd", optim="torchrpc.optim"),
    "floor-self": SystemSpec("floor-self", rpc="benchmarks.variants.floor_self",
                             autograd="torchrpc.autograd", optim="torchrpc.optim"),
}
"""Built-in systems, selectable with ``--systems``."""

BASELINE = "torch"
"""Ratios are taken against this system when it is part of the run."""

_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*$")


def parse_system_definition(text: str) -> SystemSpec:
    """Parse ``NAME=RPC_MODULE[,AUTOGRAD_MODULE[,OPTIM_MODULE]]`` into a :class:`SystemSpec`.

    Missing autograd/optim modules default to the package of the RPC module, e.g.
    ``mine=mypkg.rpc`` means ``mypkg.rpc``, ``mypkg.autograd``, ``mypkg.optim``.
    """
    name, sep, rest = text.partition("=")
    name = name.strip()
    if not sep or not _NAME_RE.match(name) or not rest.strip():
        raise ValueError(
            f"bad system definition {text!r}: expected NAME=RPC_MODULE[,AUTOGRAD_MODULE"
            f"[,OPTIM_MODULE]], for example 'mine=mypkg.rpc'")
    parts = [p.strip() for p in rest.split(",")]
    if len(parts) > 3 or not all(parts):
        raise ValueError(f"bad system definition {text!r}: give one to three module names")
    package = parts[0].rpartition(".")[0]
    prefix = f"{package}." if package else ""
    autograd = parts[1] if len(parts) > 1 else f"{prefix}autograd"
    optim = parts[2] if len(parts) > 2 else f"{prefix}optim"
    return SystemSpec(name, rpc=parts[0], autograd=autograd, optim=optim)


def resolve_systems(names: list[str], extra: list[SystemSpec]) -> list[SystemSpec]:
    """Look up ``names`` in the built-in table plus ``extra`` definitions, keeping order."""
    table = dict(SYSTEMS)
    table.update({spec.name: spec for spec in extra})
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(
            f"unknown system(s) {', '.join(unknown)}; choose from {', '.join(sorted(table))} "
            f"or define one with --define-system NAME=RPC_MODULE")
    if len(set(names)) != len(names):
        raise ValueError(f"--systems lists a system twice: {','.join(names)}")
    return [table[n] for n in names]
