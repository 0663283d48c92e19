"""The echo workloads: tensors and numpy arrays sent to the callee and back, with the
peak RSS they cost each process."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from .callees import baseline_rss_mb, echo, peak_rss_mb, remote_peak_rss_mb
from .context import Result, WorkerContext, percentile
from .metrics import echo_memcpy_metric, echo_metric, echo_numpy_metric

__all__ = ["run_echo", "run_echo_numpy"]


def run_echo(ctx: WorkerContext) -> Result:
    """Echo float32 tensors of each size: median GB/s (2 x size / time), and peak RSS."""
    opts = ctx.options
    metrics: dict[str, float] = {}
    details: dict[str, Any] = {"rss_after_init_caller_MB": baseline_rss_mb(),
                               "rss_after_init_callee_MB":
                                   ctx.rpc.rpc_sync(ctx.peer, baseline_rss_mb)}
    for size_mb in opts.echo_sizes_mb:
        numel = max(1, int(size_mb * 2**20) // 4)
        x = torch.rand(numel)
        metrics[echo_metric(size_mb)], details[echo_metric(size_mb)] = _echo_rate(
            ctx, x, numel * 4, lambda back, x=x: isinstance(back, torch.Tensor)
            and back.dtype == x.dtype and torch.equal(back, x), f"{size_mb:g} MB")
        del x
    metrics["peak_rss_caller_MB"] = peak_rss_mb()
    metrics["peak_rss_callee_MB"] = ctx.rpc.rpc_sync(ctx.peer, remote_peak_rss_mb)
    # What the echoes added to each process's peak: the payload copies it held at once,
    # without the footprint of torch and the agent (a few hundred MiB either way).
    metrics["rss_growth_caller_MB"] = (metrics["peak_rss_caller_MB"]
                                       - details["rss_after_init_caller_MB"])
    metrics["rss_growth_callee_MB"] = (metrics["peak_rss_callee_MB"]
                                       - details["rss_after_init_callee_MB"])
    # After the peak RSS is read: the copy's second tensor must not count in it.
    for size_mb in opts.echo_sizes_mb:
        if size_mb >= 64:
            copy_rate = _memcpy_rate(max(1, int(size_mb * 2**20) // 4), opts.echo_iters)
            details[echo_memcpy_metric(size_mb)] = {"memcpy_GBps": copy_rate}
            metrics[echo_memcpy_metric(size_mb)] = metrics[echo_metric(size_mb)] / copy_rate
    return metrics, details


def run_echo_numpy(ctx: WorkerContext) -> Result:
    """Echo a float32 numpy array: median GB/s (2 x size / time)."""
    # numpy is optional for torchrpc: only this workload needs it.
    import numpy as np

    size_mb = ctx.options.echo_numpy_mb
    x = np.random.default_rng(0).random(max(1, int(size_mb * 2**20) // 4), dtype=np.float32)
    name = echo_numpy_metric(size_mb)
    rate, details = _echo_rate(
        ctx, x, x.nbytes, lambda back: isinstance(back, np.ndarray) and back.dtype == x.dtype
        and np.array_equal(back, x), f"numpy {size_mb:g} MB")
    return {name: rate}, {name: details}


def _memcpy_rate(numel: int, iters: int) -> float:
    """GB/s of copying ``numel`` float32 once into memory already touched (the median of
    ``iters``)."""
    x = torch.rand(numel)
    y = torch.empty_like(x)
    y.copy_(x)
    times = []
    for _ in range(max(3, iters)):
        start = time.perf_counter()
        y.copy_(x)
        times.append(time.perf_counter() - start)
    return x.numel() * x.element_size() / percentile(times, 50) / 1e9


def _echo_rate(ctx: WorkerContext, x: Any, nbytes: int, same: Callable[[Any], bool],
               label: str) -> tuple[float, dict[str, Any]]:
    """Echo ``x`` (checked once with ``same``), warm up, then time ``echo_iters`` echoes:
    the median GB/s (2 x ``nbytes`` / time) and the details."""
    opts = ctx.options
    back = ctx.rpc.rpc_sync(ctx.peer, echo, args=(x,))
    if not same(back):
        raise AssertionError(f"echo of {label} came back different")
    del back
    for _ in range(opts.echo_warmup):
        del_me = ctx.rpc.rpc_sync(ctx.peer, echo, args=(x,))
        del del_me
    times = []
    for _ in range(opts.echo_iters):
        start = time.perf_counter()
        back = ctx.rpc.rpc_sync(ctx.peer, echo, args=(x,))
        times.append(time.perf_counter() - start)
        del back
    rates = [2 * nbytes / t / 1e9 for t in times]
    return 2 * nbytes / percentile(times, 50) / 1e9, {"bytes": nbytes, "best_GBps": max(rates),
                                                      "all_GBps": rates}
