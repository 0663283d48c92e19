"""Profiling RPC-based workloads with the autograd profiler.

Re-creates the "Profiling PyTorch RPC-Based Workloads" recipe. Two workers:
``worker0`` makes three asynchronous RPCs to ``worker1`` inside
``torch.autograd.profiler.profile()`` and waits for them inside the profiling
scope:

* ``torch.add`` and ``torch.mul``, built-in operators as the RPC target;
* ``slow_udf``, a Python function that sleeps for a second and then runs a few
  tensor operations.

The printed table then holds one event per RPC, named
``rpc_async#<operator or qualified function name>(worker0 -> worker1)``, whose
CPU total is the end-to-end latency (just over 1 s for ``slow_udf``), and the
operators that worker1 ran for each call, recorded there, shipped back and
named ``<rpc event>#remote_op: <operator>`` with node id 1. The trace is also
exported in Chrome's format to a temporary directory.

It exits with an error when the profile holds no RPC event. In torch 2.13 the
autograd profiler is a Kineto profiler, under which ``torch.distributed.rpc``
records no RPC (it "will profile the caller, but not the worker"); torchrpc does
the same by default and records them when the backend option ``profile_kineto``
is on, as here.

Differences from the recipe: the table is sorted by CPU total and names are
not truncated; a short summary of the RPC and remote events follows it; the
trace goes to a temporary directory instead of a fixed path.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import time

import torch
from torch.autograd import profiler

import torchrpc.rpc as rpc
from torchrpc.examples import _launch
from torchrpc.examples._launch import say

CALLER, CALLEE = "worker0", "worker1"


def slow_udf(t1: torch.Tensor, t2: torch.Tensor, seconds: float) -> torch.Tensor:
    """RPC target: sleep, then run a few tensor operations."""
    time.sleep(seconds)
    t3 = t1 + t2
    t4 = t3 * t1
    return torch.mm(t4, t2)


def profile_calls(seconds: float) -> profiler.profile:
    """Run the three RPCs inside the profiler; return the finished profile."""
    t1 = torch.rand((3, 3), requires_grad=True)
    t2 = torch.rand((3, 3), requires_grad=True)
    with profiler.profile() as prof:
        futures = [
            rpc.rpc_async(CALLEE, torch.add, args=(t1, t2)),
            rpc.rpc_async(CALLEE, torch.mul, args=(t1, t2)),
            rpc.rpc_async(CALLEE, slow_udf, args=(t1, t2, seconds)),
        ]
        for fut in futures:   # wait inside the profiling scope
            fut.wait()
    return prof


def summarize(prof: profiler.profile) -> int:
    """Print the RPC events with their latency and the remote events; return how many RPC events."""
    rpc_events = [e for e in prof.function_events
                  if e.name.startswith("rpc_async#") and "#remote_op: " not in e.name]
    remote_events = [e for e in prof.function_events if "#remote_op: " in e.name]
    say(f"\n{len(rpc_events)} RPC events:")
    for event in rpc_events:
        say(f"  {event.name}  {event.cpu_time_total / 1000:.1f} ms")
    say(f"{len(remote_events)} remote operator events, node ids "
        f"{sorted({getattr(e, 'node_id', -1) for e in remote_events})}:")
    for event in remote_events[:8]:
        say(f"  [node {getattr(event, 'node_id', -1)}] {event.name}")
    if len(remote_events) > 8:
        say(f"  ... and {len(remote_events) - 8} more")
    return len(rpc_events)


def export_trace(prof: profiler.profile) -> None:
    """Write the Chrome trace to a temporary directory and report what it holds."""
    with tempfile.TemporaryDirectory(prefix="torchrpc-profile-") as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    say(f"chrome trace: {len(events)} events (written to a temporary directory, then removed)")


def run_rank(rank: int, world_size: int, args: argparse.Namespace) -> None:
    """Entry point of one rank: worker0 profiles calls to worker1, which only serves."""
    name = CALLER if rank == 0 else CALLEE
    rpc.init_rpc(name, rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(profile_kineto=True))
    recorded: int | None = None
    if rank == 0:
        prof = profile_calls(args.sleep)
        say(prof.key_averages().table(sort_by="cpu_time_total", row_limit=args.rows,
                                      max_name_column_width=100))
        recorded = summarize(prof)
        export_trace(prof)
    rpc.shutdown()
    if recorded == 0:
        raise RuntimeError("the profiler recorded no rpc_async# events; the RPC layer in use "
                           "does not report its calls to torch.autograd.profiler")


def main(argv: list[str] | None = None) -> int:
    """Parse flags and run both workers; return the exit status."""
    parser = _launch.base_parser(__doc__.splitlines()[0], default_timeout=120)
    parser.add_argument("--sleep", type=float, default=1.0,
                        help="seconds slow_udf sleeps (default 1.0, as in the recipe)")
    parser.add_argument("--rows", type=int, default=None,
                        help="table rows to print; default 30, or 20 with --smoke")
    args = parser.parse_args(argv)
    _launch.smoke_defaults(parser, args, rows=(20, 30))
    return _launch.launch(run_rank, 2, args)


if __name__ == "__main__":
    # Run through the package module so that RPC peers and spawned ranks see the
    # functions and classes under their importable names, not under __main__.
    sys.exit(importlib.import_module("torchrpc.examples.profile_rpc").main())
