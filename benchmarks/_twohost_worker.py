"""One worker of the two-host mode (:mod:`.twohost`), run inside a network namespace.

Run as ``ip netns exec NS python -m benchmarks._twohost_worker SPEC_JSON``. Rank 0 (the
caller) lives in one namespace, rank 1 (the callee) in the other; they meet over the veth
link only. Rank 0 times no-op calls (p50, p99) and the echo of each size, then the peak RSS
of both; the record has the shape of :mod:`._worker`'s, so the launcher's
``SessionOutcome`` reads it.

The systems:

* ``tcp-raw``: no RPC at all. A Python TCP echo over one socket: an 8-byte length, then
  the bytes, sent back as they came (``sendall`` of the tensor's memory, ``recv_into`` a
  tensor). The no-op call is the 8-byte length alone, there and back. What any Python RPC
  can reach on the link.
* ``torch``: ``torch.distributed.rpc`` restricted to what it uses between hosts, the
  ``uv`` transport and the ``mpt_uv``/``basic`` channels, on the veth interface.
* ``torchrpc-tcp``: torchrpc over plain TCP (no Unix socket, no shared memory), tensor
  bytes covered by the frame MACs (the default).
* ``torchrpc-tls``: torchrpc over TLS, certificates made by the launcher for each address.
* ``torchrpc-nomac``, ``torchrpc-nospin`` and ``torchrpc-onestream`` (only when asked
  for): ``torchrpc-tcp`` with ``tensor_mac=False``, with ``spin_us=0``, and with
  ``stripe_threshold=0`` (every frame on one socket).
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import socket
import struct
import time
import traceback
from typing import Any

import torch

from ._worker import Record, _describe, begin, run_and_exit
from .callees import (baseline_rss_mb, echo, noop, peak_rss_mb, process_cpu_s,
                      remote_peak_rss_mb)
from .context import WorkerContext, percentile
from .echo import run_echo
from .options import BenchOptions

_HEADER = struct.Struct("!Q")
_STOP = 2**64 - 1
_CPU = 2**64 - 2
_CPU_REPLY = struct.Struct("!d")


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view:
        got = sock.recv_into(view)
        if not got:
            raise ConnectionError("the peer closed the connection")
        view = view[got:]


def _recv_header(sock: socket.socket) -> int:
    buf = bytearray(_HEADER.size)
    _recv_exact(sock, memoryview(buf))
    return _HEADER.unpack(buf)[0]


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")


def _raw_serve(spec: dict[str, Any]) -> None:
    """Rank 1 of ``tcp-raw``: echo every message until the caller says stop, then send
    this process's peak RSS and its RSS before the echoes (JSON)."""
    with socket.create_server((spec["addr"], spec["raw_port"])) as server:
        server.settimeout(spec["time_limit"])
        conn, _ = server.accept()
    baseline = baseline_rss_mb()
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            n = _recv_header(conn)
            if n == _CPU:
                conn.sendall(_CPU_REPLY.pack(process_cpu_s()))
                continue
            if n == _STOP:
                reply = json.dumps({"peak": peak_rss_mb(), "baseline": baseline}).encode()
                conn.sendall(_HEADER.pack(len(reply)) + reply)
                return
            # Received into a fresh tensor, as an RPC hands its callee a new tensor.
            payload = torch.empty(n, dtype=torch.uint8)
            if n:
                _recv_exact(conn, _bytes_of(payload))
            conn.sendall(_HEADER.pack(n))
            if n:
                conn.sendall(_bytes_of(payload))
            del payload


def _connect(addr: str, port: int, limit: float) -> socket.socket:
    deadline = time.monotonic() + limit
    while True:
        try:
            return socket.create_connection((addr, port), timeout=limit)
        except ConnectionRefusedError:  # the server is still starting
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _raw_call(conn: socket.socket) -> Any:
    """The raw ``rpc`` of :func:`_raw_caller`: ``rpc_sync(peer, fn, args)`` over the echo
    socket, for the no-op and ``echo`` calls only."""
    class RawRpc:
        @staticmethod
        def rpc_sync(peer: str, fn: Any, args: tuple = ()) -> Any:
            if fn is noop:
                conn.sendall(_HEADER.pack(0))
                if _recv_header(conn) != 0:
                    raise AssertionError("ping came back with a payload")
                return args[0]
            if fn is echo:
                x = args[0].contiguous()
                data = _bytes_of(x.view(torch.uint8).reshape(-1))
                conn.sendall(_HEADER.pack(len(data)))
                conn.sendall(data)
                n = _recv_header(conn)
                back = torch.empty_like(x)
                _recv_exact(conn, _bytes_of(back.view(torch.uint8).reshape(-1)))
                if n != len(data):
                    raise AssertionError(f"echo of {len(data)} bytes came back as {n}")
                return back
            if fn is process_cpu_s:
                conn.sendall(_HEADER.pack(_CPU))
                reply = bytearray(_CPU_REPLY.size)
                _recv_exact(conn, memoryview(reply))
                return _CPU_REPLY.unpack(reply)[0]
            if fn in (baseline_rss_mb, remote_peak_rss_mb):
                # The callee's memory comes with its last reply; see _raw_caller.
                return 0.0
            raise NotImplementedError(f"raw TCP cannot call {fn!r}")

    return RawRpc


def _raw_caller(spec: dict[str, Any], opts: BenchOptions) -> tuple[dict, dict]:
    conn = _connect(spec["peer_addr"], spec["raw_port"], spec["time_limit"])
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rpc = _raw_call(conn)
        ctx = WorkerContext(rpc=rpc, autograd=None, optim=None,  # type: ignore[arg-type]
                            rpc_module_name="socket", peer="callee", options=opts)
        metrics, details = _latency(ctx)
        echo_metrics, echo_details = _echo_with_cpu(ctx)
        conn.sendall(_HEADER.pack(_STOP))
        reply = bytearray(_recv_header(conn))
        _recv_exact(conn, memoryview(reply))
    peer = json.loads(reply)
    echo_metrics["peak_rss_callee_MB"] = peer["peak"]
    echo_metrics["rss_growth_callee_MB"] = peer["peak"] - peer["baseline"]
    echo_details["rss_after_init_callee_MB"] = peer["baseline"]
    metrics.update(echo_metrics)
    details.update(echo_details)
    return metrics, details


def _latency(ctx: WorkerContext) -> tuple[dict, dict]:
    """No-op ``rpc_sync`` calls one after the other: p50 and p99 in microseconds."""
    opts = ctx.options
    numbers = itertools.count()
    samples = []
    for i in range(opts.latency_warmup + opts.latency_calls):
        n = next(numbers)
        start = time.perf_counter()
        back = ctx.rpc.rpc_sync(ctx.peer, noop, args=(n,))
        elapsed = time.perf_counter() - start
        if back != n:
            raise AssertionError(f"no-op call did not return its argument {n}")
        if i >= opts.latency_warmup:
            samples.append(elapsed * 1e6)
    return ({"noop_p50_us": percentile(samples, 50), "noop_p99_us": percentile(samples, 99)},
            {"noop_calls": len(samples), "noop_min_us": min(samples)})


def _backend_options(rpc: Any, spec: dict[str, Any], opts: BenchOptions) -> Any:
    init_method = f"tcp://{spec['rendezvous']}:{spec['rdzv_port']}"
    common = {"num_worker_threads": opts.num_worker_threads, "rpc_timeout": opts.rpc_timeout,
              "init_method": init_method}
    name = spec["system"]
    if name == "torch":
        return rpc.TensorPipeRpcBackendOptions(**common, _transports=["uv"],
                                               _channels=["mpt_uv", "basic"])
    extra: dict[str, Any] = {"listen_addr": spec["addr"], "enable_shm": False,
                             "enable_uds": False}
    if name == "torchrpc-tls":
        extra.update(spec["tls"])
    elif name == "torchrpc-nomac":
        extra["tensor_mac"] = False
    elif name == "torchrpc-nospin":
        extra["spin_us"] = 0.0
    elif name == "torchrpc-onestream":
        extra["stripe_threshold"] = 0
    return rpc.TensorPipeRpcBackendOptions(**common, **extra)


def _rpc_worker(spec: dict[str, Any], opts: BenchOptions, record: Record) -> None:
    record.phase("import")
    rpc = importlib.import_module("torch.distributed.rpc" if spec["system"] == "torch"
                                  else "torchrpc.rpc")
    record.phase("init")
    rank = spec["rank"]
    start = time.perf_counter()
    rpc.init_rpc("caller" if rank == 0 else "callee", rank=rank, world_size=2,
                 rpc_backend_options=_backend_options(rpc, spec, opts))
    record.data["init_s"] = time.perf_counter() - start
    record.data["rss_after_init_MB"] = peak_rss_mb()
    if rank == 0:
        ctx = WorkerContext(rpc=rpc, autograd=None, optim=None,  # type: ignore[arg-type]
                            rpc_module_name=rpc.__name__, peer="callee", options=opts)
        _run_workload(record, lambda: _both(ctx))
    record.phase("shutdown")
    rpc.shutdown()
    record.phase("done")


def _echo_with_cpu(ctx: WorkerContext) -> tuple[dict, dict]:
    """The echo workload, and the CPU seconds each process spent in it: the same work on
    every system, so comparable in one run however loaded the machine is."""
    caller, callee = time.process_time(), ctx.rpc.rpc_sync(ctx.peer, process_cpu_s)
    metrics, details = run_echo(ctx)
    metrics["echo_cpu_caller_s"] = time.process_time() - caller
    metrics["echo_cpu_callee_s"] = ctx.rpc.rpc_sync(ctx.peer, process_cpu_s) - callee
    return metrics, details


def _both(ctx: WorkerContext) -> tuple[dict, dict]:
    metrics, details = _latency(ctx)
    echo_metrics, echo_details = _echo_with_cpu(ctx)
    return {**metrics, **echo_metrics}, {**details, **echo_details}


def _run_workload(record: Record, run: Any) -> None:
    record.data["workload"] = "twohost"
    record.phase("workload")
    results = record.data.setdefault("results", {})
    start = time.perf_counter()
    try:
        metrics, details = run()
    except Exception as exc:  # the error cells of this system; the launcher reports them
        results["twohost"] = {"error": _describe(exc), "traceback": traceback.format_exc()}
    else:
        results["twohost"] = {"metrics": metrics, "details": details}
    results["twohost"]["seconds"] = time.perf_counter() - start
    del record.data["workload"]
    record.save()


def _profile_threads(directory: str, rank: int) -> Any:
    """Profile every thread started from now on, and this one, with cProfile; return a
    function that writes the profiles to ``directory`` (one file per thread)."""
    import cProfile
    import threading

    profiles: list[tuple[str, cProfile.Profile]] = []

    def start(*_: Any) -> None:
        profile = cProfile.Profile()
        profiles.append((threading.current_thread().name, profile))
        profile.enable()  # replaces this hook in the new thread

    threading.setprofile(start)
    start()

    def dump() -> None:
        for i, (name, profile) in enumerate(profiles):
            profile.disable()
            safe = "".join(c if c.isalnum() else "_" for c in name)
            profile.dump_stats(os.path.join(directory, f"rank{rank}-{i:02d}-{safe}.prof"))

    return dump


def main(argv: list[str]) -> int:
    """Run the worker described by the spec file ``argv[0]``; return the exit status."""
    spec, record, opts = begin(argv[0])
    dump = _profile_threads(spec["profile_dir"], spec["rank"]) if spec.get("profile_dir") \
        else None
    try:
        if spec["system"] != "tcp-raw":
            _rpc_worker(spec, opts, record)
        elif spec["rank"] == 0:
            _run_workload(record, lambda: _raw_caller(spec, opts))
            record.phase("done")
        else:
            record.phase("workload")
            _raw_serve(spec)
            record.phase("done")
    except BaseException as exc:  # anything, including SystemExit from the system
        record.fail(exc)
        traceback.print_exc()
        return 1
    finally:
        if dump is not None:
            dump()
    return 0


if __name__ == "__main__":
    run_and_exit(main)
