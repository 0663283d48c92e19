"""Run one scenario on a group of worker processes under torch's RPC or torchrpc, so that a
test can compare torchrpc's results with torch's, computed in the same test.

A scenario is a function ``module:function`` that rank 0 calls once every member has
called ``init_rpc``; it returns a JSON-able value. Its module picks its RPC modules with
:func:`api`, by the implementation the group runs (``TORCHRPC_TEST_IMPL``), and so do
the functions it runs on the other members: each member imports the module with the same
setting. Every member seeds torch's generator with 0 before ``init_rpc``, so modules
created on a member get the same parameters under both implementations.

``python -m tests.support.side_by_side IMPL SCENARIO RANK WORLD_SIZE TIMEOUT`` is one member
(TensorPipe options: 16 threads, ``TIMEOUT`` as the RPC timeout); rank 0 prints the
scenario's value on one line after :data:`RESULT`.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import types
from typing import Any, Dict, List, Optional

from .group import exit_fast, free_port, start_module, worker_env

IMPL_ENV = "TORCHRPC_TEST_IMPL"  # "torch" or "torchrpc"
RESULT = "SIDE-BY-SIDE-RESULT "
IMPLS = ("torch", "torchrpc")


def api() -> types.SimpleNamespace:
    """The RPC modules of the implementation this process runs: ``rpc``,
    ``dist_autograd``, ``DistributedOptimizer`` and ``RemoteModule``, torch's or ours."""
    impl = os.environ.get(IMPL_ENV, "torchrpc")
    if impl == "torch":
        import torch.distributed.autograd as dist_autograd
        import torch.distributed.rpc as rpc
        from torch.distributed.nn import RemoteModule
        from torch.distributed.optim import DistributedOptimizer
    elif impl == "torchrpc":
        import torchrpc.autograd as dist_autograd
        import torchrpc.rpc as rpc
        from torchrpc.nn import RemoteModule
        from torchrpc.optim import DistributedOptimizer
    else:
        raise ValueError(f"{IMPL_ENV} must be one of {IMPLS}, got {impl!r}")
    return types.SimpleNamespace(impl=impl, rpc=rpc, dist_autograd=dist_autograd,
                                 DistributedOptimizer=DistributedOptimizer,
                                 RemoteModule=RemoteModule)


def _resolve(scenario: str) -> Any:
    module, _, name = scenario.partition(":")
    return getattr(importlib.import_module(module), name)


def main() -> None:
    impl, scenario, rank, world_size, timeout = sys.argv[1:6]
    os.environ[IMPL_ENV] = impl
    import torch
    torch.set_num_threads(1)
    torch.manual_seed(0)
    run = _resolve(scenario)  # imported before init_rpc, as a program's own modules are
    rpc = api().rpc
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=float(timeout))
    rpc.init_rpc(f"worker{rank}", rank=int(rank), world_size=int(world_size),
                 rpc_backend_options=opts)
    if int(rank) == 0:
        value = run()
        print(RESULT + json.dumps(value), flush=True)
    rpc.shutdown()


def start(impl: str, scenario: str, world_size: int, timeout: float,
          env: Optional[Dict[str, str]] = None) -> List[Any]:
    """Start a group running ``scenario`` under ``impl``; its members, rank 0 first (whose
    output is captured); read the value with :func:`result`."""
    port = free_port()
    member_env = worker_env(port, world_size, {IMPL_ENV: impl, **(env or {})})
    return [start_module("tests.support.side_by_side",
                         [impl, scenario, str(rank), str(world_size), str(timeout)],
                         member_env, capture=rank == 0)
            for rank in range(world_size)]


def result(members: List[Any], limit: float = 240.0) -> Any:
    """Wait for the group of :func:`start`; the value its scenario returned. Fails with
    rank 0's output when a member fails or no value came (members still running after
    ``limit`` seconds are killed)."""
    try:
        out, _ = members[0].communicate(timeout=limit)
        codes = [members[0].returncode] + [m.wait(limit) for m in members[1:]]
    finally:
        for m in members:
            if m.poll() is None:
                m.kill()
                m.wait()
    lines = [line for line in out.splitlines() if line.startswith(RESULT)]
    assert codes == [0] * len(members) and lines, \
        f"group exited with {codes}; rank 0 printed:\n{out[-6000:]}"
    return json.loads(lines[-1][len(RESULT):])


def run_both(scenario: str, world_size: int, timeout: float = 30.0,
             env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """``scenario``'s value under torch's RPC and under torchrpc (the two groups run at
    the same time), by implementation name."""
    groups = {impl: start(impl, scenario, world_size, timeout, env) for impl in IMPLS}
    return {impl: result(members) for impl, members in groups.items()}


if __name__ == "__main__":
    main()
    exit_fast()
