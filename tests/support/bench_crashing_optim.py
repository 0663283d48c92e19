"""A ``DistributedOptimizer`` for the bench tests whose process dies in its 4th step.

``--define-system crashy=torchrpc.rpc,torchrpc.autograd,tests.support.bench_crashing_optim`` makes
a system whose training caller is killed in the middle of its first turn (with the quick
options: one warmup step, then one untimed and three timed steps a turn).
"""

from __future__ import annotations

import os
from typing import Any

from torchrpc.optim import DistributedOptimizer as _DistributedOptimizer

CRASH_AT_STEP = 4


class DistributedOptimizer(_DistributedOptimizer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._steps = 0

    def step(self, context_id: int) -> None:
        self._steps += 1
        if self._steps == CRASH_AT_STEP:
            os._exit(3)  # as a killed worker: no error recorded, no shutdown
        super().step(context_id)
