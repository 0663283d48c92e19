"""torchrpc with Python's cycle collector off, for measuring what its collections cost.

``--define-system torchrpc-nogc=benchmarks.variants.nogc,torchrpc.autograd,torchrpc.optim`` (run
from the repository root) is torchrpc with ``gc.disable()`` in every benchmark worker once
``init_rpc`` returns; with ``TORCHRPC_BENCH_NOGC=caller`` (or ``callee``) set, only in the
worker of that name. It turns off a process-wide service, so it is for a benchmark worker
and nothing else, which is why it lives with the benchmarks and not in the package.
"""

from __future__ import annotations

import gc
import os
from typing import Any

from torchrpc import rpc as _rpc


def init_rpc(name: str, *args: Any, **kwargs: Any) -> None:
    """``torchrpc.rpc.init_rpc``, then the collector off in the chosen workers."""
    _rpc.init_rpc(name, *args, **kwargs)
    only = os.environ.get("TORCHRPC_BENCH_NOGC")
    if not only or only == name:
        gc.disable()


def __getattr__(name: str) -> Any:
    """Every other name is torchrpc.rpc's."""
    return getattr(_rpc, name)
