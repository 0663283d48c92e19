"""fairscale's distributed pipeline (fairscale 0.4.13) trains under torchrpc, substituted for
torch's RPC by import redirection, exactly as under torch's RPC.

fairscale_scenario.py trains two pipelines of RemoteModules over three real worker
processes, once on torch.distributed.rpc and once on torchrpc (tests/support/side_by_side.py):
one whose first partition lives on the driver (started by a remote() to the driver
itself), and one traced by torch.fx with a branch to two workers. Both use four
micro-batches joined by phony tensors whose gradient is None, checkpointing,
DistributedLoss, RRef.backward(context_id) and a DistributedOptimizer over every
partition's parameters. torch's values are the reference: every parameter's gradient
in each step, each worker's gradient count, and the losses.
"""

from __future__ import annotations

from typing import Any, Dict

import pytest

from ..dist_autograd.test_library_patterns import assert_same
from ..support.side_by_side import run_both


@pytest.fixture(scope="module")
def results() -> Dict[str, Dict[str, Any]]:
    return run_both("tests.nn.fairscale_scenario:pipelines", 3, timeout=30.0)


@pytest.mark.parametrize("pipeline", ["sequence", "traced"])
def test_fairscale_pipeline_trains_as_under_torch(results, pipeline):
    theirs, ours = results["torch"][pipeline], results["torchrpc"][pipeline]
    assert "error" not in theirs, theirs.get("error")
    assert "error" not in ours, f"under torchrpc:\n{ours.get('error')}"
    for step in theirs["steps"]:
        assert None not in step["gradients"]  # the driver's partition's too
        assert all(n > 0 for n in step["gradient counts"])
    assert theirs["loss after"] < theirs["steps"][0]["loss"]  # it learns
    assert_same(theirs, ours, pipeline)
