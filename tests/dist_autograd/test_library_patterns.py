"""What libraries built on torch's RPC do, under torchrpc and under torch's RPC, compared.

The scenarios of library_scenarios.py run on two groups of three real worker processes,
one on torch.distributed.rpc and one on torchrpc (tests/support/side_by_side.py); torch's values
are the reference. They cover requests a worker addresses to itself inside a distributed
autograd context (a pipeline stage on the driver, started by a remote() to itself),
backward passes where an RPC result's gradient is None (phony dependency tensors) or a
result is not used at all, RRef.backward, DistributedOptimizer over the driver's own
parameters, and RemoteModules traced by torch.fx.
"""

from __future__ import annotations

from typing import Any, Dict, List

import pytest

from ..support.side_by_side import run_both


@pytest.fixture(scope="module")
def results() -> Dict[str, Dict[str, Any]]:
    """Every scenario's value under each implementation: {impl: {scenario: value}}."""
    return run_both("tests.dist_autograd.library_scenarios:all_patterns", 3, timeout=30.0)


def values(results: Dict[str, Dict[str, Any]], scenario: str) -> List[Any]:
    """[torch's value, torchrpc's value] of ``scenario``; neither may have raised."""
    pair = [results["torch"][scenario], results["torchrpc"][scenario]]
    for impl, value in zip(("torch", "torchrpc"), pair):
        assert not (isinstance(value, dict) and "error" in value), \
            f"{scenario} raised under {impl}:\n{value['error']}"
    return pair


def assert_same(theirs: Any, ours: Any, path: str = "", tol: float = 1e-6) -> None:
    """``ours`` equals ``theirs``: the same structure, None where theirs has None, and
    numbers within ``tol``."""
    where = path or "the value"
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and ours.keys() == theirs.keys(), \
            f"{where}: torch gives keys {sorted(theirs)}, torchrpc {ours!r}"
        for key in theirs:
            assert_same(theirs[key], ours[key], f"{path}[{key!r}]", tol)
    elif isinstance(theirs, list):
        assert isinstance(ours, list) and len(ours) == len(theirs), \
            f"{where}: torch gives {theirs!r}, torchrpc {ours!r}"
        for i, (a, b) in enumerate(zip(theirs, ours)):
            assert_same(a, b, f"{path}[{i}]", tol)
    elif isinstance(theirs, float) and not isinstance(ours, bool):
        assert isinstance(ours, (int, float)) and abs(ours - theirs) <= tol, \
            f"{where}: torch gives {theirs!r}, torchrpc {ours!r}"
    else:
        assert ours == theirs, f"{where}: torch gives {theirs!r}, torchrpc {ours!r}"


def test_requests_to_the_worker_itself_run_in_the_callers_context(results):
    theirs, ours = values(results, "self requests")
    # torch: every request, to itself or a peer, runs in the caller's context.
    assert all(theirs["context seen"].values()), theirs["context seen"]
    assert_same(theirs["context seen"], ours["context seen"], "context seen")


def test_remote_to_itself_records_send_and_recv_and_copies_its_arguments(results):
    theirs, ours = values(results, "self requests")
    # Two remote()s to itself with a tensor that requires grad: a send and a recv each.
    assert theirs["records"] == [2, 2]
    assert ours["records"] == theirs["records"]
    assert theirs["gradient"] == [4.0, 4.0, 4.0]
    assert ours["gradient"] == theirs["gradient"]
    assert theirs["argument changed by the callee"] is False
    assert ours["argument changed by the callee"] is False


@pytest.mark.parametrize("batches", ["one batch", "micro-batches"])
def test_pipeline_with_its_first_stage_on_the_driver_trains_as_under_torch(results, batches):
    theirs, ours = values(results, "pipelines")
    theirs, ours = theirs[batches], ours[batches]
    for step in theirs["steps"]:
        # Every parameter gets a gradient, the driver's (first stage) included.
        assert None not in step["gradients"]
        assert step["gradient counts"] == [2, 2, 2]
    assert_same(theirs, ours, batches)


def test_a_result_whose_gradient_is_none_ends_the_pass_with_torchs_gradient(results):
    theirs, ours = values(results, "none and unused")
    theirs, ours = theirs["none gradient"], ours["none gradient"]
    assert theirs["x"] == [1.0, 1.0, 1.0]
    assert ours["x"] == theirs["x"]
    assert ours["seconds"] < 10.0  # the RPC timeout is 30 s: nothing waited for it


def test_a_result_not_used_by_the_loss_times_out_as_in_torch(results):
    theirs, ours = values(results, "none and unused")
    theirs, ours = theirs["unused result"], ours["unused result"]
    # torch's FAST mode waits for every send function: the pass fails at the RPC
    # timeout (2 s here) with a RuntimeError; torchrpc's is an RpcTimeoutError.
    assert theirs["ended"] and theirs["runtime error"] and theirs["says timeout"], theirs
    assert ours["ended"] and ours["runtime error"] and ours["says timeout"], ours
    assert ours["raised"] == "RpcTimeoutError"
    assert 1.9 <= theirs["seconds"] < 10.0 and 1.9 <= ours["seconds"] < 10.0, (theirs, ours)


def test_rref_backward_on_local_and_remote_rrefs(results):
    theirs, ours = values(results, "rref backward")
    assert theirs["local, in a context"] == [36.0] * 3
    assert theirs["remote, in a context"] == [4.0] * 3
    assert theirs["x.grad after the passes"] is None
    assert theirs["local, no context"] == [5.0] * 3
    assert_same(theirs, ours)


def test_remote_modules_traced_by_torch_fx(results):
    theirs, ours = values(results, "traced remote modules")
    assert [op for op, _ in theirs["graph"]] == ["placeholder", "call_module",
                                                 "call_function", "call_module", "output"]
    assert None not in theirs["gradients"]
    assert_same(theirs, ours)


def test_a_node_whose_outputs_went_to_two_workers_runs_once(results):
    theirs, ours = values(results, "graph functions")
    # torch's engine runs a node once a pass, when the gradients of all its outputs are
    # in; torchrpc's waits for the second before it runs (a checkpoint recomputes once).
    assert theirs["two outputs"] == {"x": [13.0] * 3, "runs": 1}
    assert_same(theirs["two outputs"], ours["two outputs"])


def test_an_intermediate_sent_back_to_the_caller_and_into_the_reply(results):
    theirs, ours = values(results, "graph functions")
    # d/dx of (2x)^2 * 2x at 1.5: no part waits for a gradient that needs its own
    assert theirs["call back"] == [54.0] * 3
    assert_same(theirs["call back"], ours["call back"])


def test_a_nested_backward_in_a_function_of_the_pass_accumulates_into_grad(results):
    theirs, ours = values(results, "graph functions")
    # torch's engine captures only the pass's own accumulations in the context: what a
    # backward run inside a function of the pass accumulates goes to .grad
    assert theirs["nested"]["worker1"] == {"context": [2.0] * 3, ".grad": [3.0] * 3}
    assert_same(theirs["nested"], ours["nested"])


def test_gradients_that_are_zeros_reach_the_leaves_as_zeros(results):
    theirs, ours = values(results, "graph functions")
    assert theirs["zeros"] == {"x": [0.0] * 3}
    assert_same(theirs["zeros"], ours["zeros"])
