"""torchrpc without the parked OpenMP team, for measuring what the team buys.

``--define-system torchrpc-nopark=benchmarks.variants.nopark,torchrpc.autograd,torchrpc.optim``
(run from the repository root): ``GOMP_SPINCOUNT`` is set in the worker's environment
before ``init_rpc``, which libgomp has read already (its own wait policy is unchanged)
but which tells the agent the user chose a policy, so it parks no team.
"""

from __future__ import annotations

import os
from typing import Any

from torchrpc import rpc as _rpc


def init_rpc(name: str, *args: Any, **kwargs: Any) -> None:
    """``torchrpc.rpc.init_rpc`` with no OpenMP team parked."""
    os.environ.setdefault("GOMP_SPINCOUNT", "300000")
    _rpc.init_rpc(name, *args, **kwargs)


def __getattr__(name: str) -> Any:
    """Every other name is torchrpc.rpc's."""
    return getattr(_rpc, name)
