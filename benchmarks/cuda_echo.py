"""The CUDA echo: a CUDA tensor to a worker on the same GPU and back (device map cuda:0 ->
cuda:0), torch's TensorPipe backend and torchrpc in one run, beside the device's own
device-to-device copy rate measured in the same run; and a small CUDA call's p50.

    python -m benchmarks.cuda_echo [--sizes-mb 1,64,256] [--iters 10] [--small-calls 300]

Each system runs in two fresh processes of its own, one after the other (the GPU is
shared, never both at once). An echo moves its bytes twice (there and back), so its rate
is 2 x size / round-trip time, the time the caller waits until the reply's tensor is
ready on its GPU; the copy rate counts what one device-to-device copy moves. Prints one
JSON object (and writes it to ``--json-out``); without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List

import torch
import torch.multiprocessing as mp

from .callees import add_one, echo
from .ports import free_port

MB = 1 << 20


def _ready(device: str) -> None:
    """Wait until the work queued on this thread's stream (a reply's copy) is done."""
    if device != "cpu":
        torch.cuda.current_stream().synchronize()


def _measure(rpc: Any, device: str, sizes: List[int], iters: int,
             small_calls: int) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for mb in sizes:
        x = torch.ones(mb * MB // 4, device=device)
        for _ in range(2):
            rpc.rpc_sync("worker1", echo, args=(x,))
        _ready(device)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            y = rpc.rpc_sync("worker1", echo, args=(x,))
            _ready(device)
            times.append(time.perf_counter() - start)
        assert torch.equal(y, x)
        out[f"echo_{mb}MB_GBps"] = 2 * mb * MB / statistics.median(times) / 1e9
    small = torch.ones(4, device=device)
    for _ in range(20):
        rpc.rpc_sync("worker1", add_one, args=(small,))
    times = []
    for _ in range(small_calls):
        start = time.perf_counter()
        rpc.rpc_sync("worker1", add_one, args=(small,))
        _ready(device)
        times.append(time.perf_counter() - start)
    out["small_call_p50_us"] = statistics.median(times) * 1e6
    return out


def _worker(rank: int, system: str, port: int, args: argparse.Namespace, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if system == "torch":
        import torch.distributed.rpc as rpc
    else:
        import torchrpc.rpc as rpc  # type: ignore[no-redef]
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=8, rpc_timeout=300)
    if rank == 0 and args.device != "cpu":
        opts.set_device_map("worker1", {0: 0})
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    try:
        if rank == 0:
            queue.put(_measure(rpc, args.device, args.sizes, args.iters, args.small_calls))
    finally:
        rpc.shutdown()


def copy_rate(mb: int, iters: int) -> float:
    """The device's own device-to-device copy rate (GB/s) for ``mb`` MB, by CUDA events."""
    src = torch.ones(mb * MB // 4, device="cuda:0")
    dst = torch.empty_like(src)
    dst.copy_(src)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return mb * MB * iters / (begin.elapsed_time(end) / 1e3) / 1e9


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cuda_echo")
    parser.add_argument("--sizes-mb", default="1,64,256")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--small-calls", type=int, default=300)
    parser.add_argument("--systems", default="torch,torchrpc")
    parser.add_argument("--json-out", default="")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="CPU tensors and no device map: tries the harness without a GPU")
    args = parser.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes_mb.split(",") if s]
    args.device = "cpu" if args.cpu_dry_run else "cuda:0"
    if not args.cpu_dry_run and not torch.cuda.is_available():
        print("cuda_echo: no CUDA device here; nothing measured")
        return 0
    result: Dict[str, Any] = {"torch": torch.__version__, "device": "cpu (dry run)"}
    if not args.cpu_dry_run:
        result["device"] = torch.cuda.get_device_name(0)
        result["d2d_copy_GBps"] = {mb: copy_rate(mb, args.iters) for mb in args.sizes}
    ctx = mp.get_context("spawn")
    for system in args.systems.split(","):
        queue = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(r, system, port, args, queue))
                 for r in range(2)]
        for p in procs:
            p.start()
        try:
            result[system] = queue.get(timeout=600)
        finally:
            for p in procs:
                p.join(60)
    if "torch" in result and "torchrpc" in result:
        ours, theirs = result["torchrpc"], result["torch"]
        result["ratios"] = {
            **{f"echo_{mb}MB_vs_torch": ours[f"echo_{mb}MB_GBps"] / theirs[f"echo_{mb}MB_GBps"]
               for mb in args.sizes},
            **{f"echo_{mb}MB_vs_d2d": ours[f"echo_{mb}MB_GBps"] / result["d2d_copy_GBps"][mb]
               for mb in args.sizes if "d2d_copy_GBps" in result},
            "small_call_p50_vs_torch": ours["small_call_p50_us"] / theirs["small_call_p50_us"]}
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
