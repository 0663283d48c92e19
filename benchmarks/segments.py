"""``python -m benchmarks.segments``: where the time of one small ``rpc_sync`` goes.

Two torchrpc workers on this host; the caller makes ``--calls`` blocking calls of a no-op
(``noop(i)``) or of ``torch.add(torch.ones(2), 1)``, or (``--call remote``) creates the
result of the latter with ``rpc.remote`` and fetches it with ``to_here()``. Both
processes note the time at the same points of each call (one clock:
``time.perf_counter_ns`` is CLOCK_MONOTONIC), by wrapping the functions the call goes
through: the caller's call, encode, send and read of the reply, the callee's frame,
decode, run, encode and send. The report is the median
time between consecutive points, over the calls whose points came in the usual order,
then the median time of each point from the call's start (the timeline: where the two
requests of a ``remote`` call overlap, it reads better than the segments).
The wrapping adds about a microsecond per point; the segments, not the total, are the
point. This is a developer's tool: it reaches into torchrpc's private modules.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import queue
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

import torch

from .ports import free_port

_EVENTS: List[Tuple[int, str]] = []


def noop(x: int) -> int:
    """The no-op call: returns its argument."""
    return x

_ON = [False]


def _wrap(owner: Any, name: str, before: str, after: str = "") -> None:
    """Note ``before`` when ``owner.name`` is called and ``after`` when it returns."""
    inner: Callable[..., Any] = getattr(owner, name)
    clock, events, on = time.perf_counter_ns, _EVENTS, _ON

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if before and on[0]:
            events.append((clock(), before))
        result = inner(*args, **kwargs)
        if after and on[0]:
            events.append((clock(), after))
        return result

    setattr(owner, name, wrapper)


def _instrument() -> None:
    from torchrpc import _wire
    from torchrpc._agent import calls, dispatch, inbound
    from torchrpc._transport import connection

    _wrap(connection.Connection, "send", "send>", "send<")
    _wrap(connection.Connection, "read_frame", "", "frame<")
    _wrap(inbound.Inbound, "on_frame", "frame")
    _wrap(dispatch.Dispatch, "serve", "serve>")
    _wrap(dispatch, "run_callable", "run>", "run<")
    _wrap(calls.Calls, "on_reply", "reply>", "reply<")
    _wrap(_wire, "encode", "encode>", "encode<")
    _wrap(_wire, "decode", "decode>", "decode<")


def _start() -> None:
    _EVENTS.clear()
    _ON[0] = True


def _stop() -> List[Tuple[int, str]]:
    _ON[0] = False
    return list(_EVENTS)


def _worker(rank: int, port: int, threads: int, call: str, calls: int,
            out: "multiprocessing.Queue[str]") -> None:
    import torchrpc.rpc as rpc

    _instrument()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if threads:
        torch.set_num_threads(threads)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2)
    if rank == 0:
        x = torch.ones(2)
        func, args = (noop, (1,)) if call == "noop" else (torch.add, (x, 1))

        def one() -> Any:
            if call == "remote":
                return rpc.remote("w1", func, args=args).to_here()
            return rpc.rpc_sync("w1", func, args=args)

        for _ in range(min(1000, calls)):
            one()
        rpc.rpc_sync("w1", _start)
        _start()
        clock = time.perf_counter_ns
        for _ in range(calls):
            _EVENTS.append((clock(), "CALL"))
            one()
            _EVENTS.append((clock(), "DONE"))
        mine = _stop()
        theirs = rpc.rpc_sync("w1", _stop)
        out.put(_report(mine, theirs, call, threads, calls))
    rpc.shutdown()


def _report(mine: List[Tuple[int, str]], theirs: List[Tuple[int, str]], call: str,
            threads: int, calls: int) -> str:
    merged = sorted([(t, "caller " + n) for t, n in mine]
                    + [(t, "callee " + n) for t, n in theirs])
    runs: List[List[Tuple[int, str]]] = []
    current: List[Tuple[int, str]] = []
    for t, n in merged:
        if n == "caller CALL":
            current = [(t, n)]
        elif current:
            current.append((t, n))
            if n == "caller DONE":
                runs.append(current)
                current = []
    usual = collections.Counter(tuple(n for _, n in r) for r in runs).most_common(1)[0][0]
    spans: Dict[Tuple[str, str], List[float]] = collections.defaultdict(list)
    at: Dict[int, List[float]] = collections.defaultdict(list)  # point -> us from the call
    totals = []
    for r in runs:
        if tuple(n for _, n in r) != usual:
            continue
        for (t1, n1), (t2, n2) in zip(r, r[1:]):
            spans[(n1, n2)].append((t2 - t1) / 1e3)
        for i, (t, _) in enumerate(r):
            at[i].append((t - r[0][0]) / 1e3)
        totals.append((r[-1][0] - r[0][0]) / 1e3)
    lines = [f"{call} call, torch threads {threads or 'default'}: {len(totals)} of "
             f"{len(runs)} calls in the usual order (of {calls}); median total "
             f"{_median(totals):.1f} us", "", "| from | to | median us |", "|---|---|---:|"]
    lines += [f"| {a} | {b} | {_median(v):.1f} |" for (a, b), v in spans.items()]
    lines += ["", "| point | median us from the call |", "|---|---:|"]
    lines += [f"| {n} | {_median(at[i]):.1f} |" for i, n in enumerate(usual)]
    return "\n".join(lines)


def _median(values: List[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else float("nan")


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.segments",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--call", choices=("noop", "add", "remote"), default="noop")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads per worker (0: torch's default)")
    parser.add_argument("--calls", type=int, default=2000)
    opts = parser.parse_args(argv)
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    out: "multiprocessing.Queue[str]" = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, opts.threads, opts.call, opts.calls,
                                               out)) for r in (0, 1)]
    for p in procs:
        p.start()
    report = ""
    try:
        deadline = time.monotonic() + 300
        while not report:
            try:
                report = out.get(timeout=1)
            except queue.Empty:
                if time.monotonic() > deadline or any(p.exitcode for p in procs):
                    sys.stderr.write("a worker failed or hung: no report\n")
                    return 1
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    sys.stdout.write(report + "\n")
    return 0 if all(p.exitcode == 0 for p in procs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
