"""The metrics each workload reports: names, units, which direction is better, targets.

Names are stable keys of the JSON output. The targets are the ratios the torchrpc issues
ask for (torchrpc / torch in the same run), plus the one absolute memory bound.
"""

from __future__ import annotations

import dataclasses

from .options import BenchOptions

__all__ = ["MetricSpec", "Target", "echo_memcpy_metric", "echo_metric", "echo_numpy_metric", "metric_specs",
           "scale_memory_metric", "scale_metric", "size_label"]


@dataclasses.dataclass(frozen=True)
class Target:
    """A goal for a metric.

    ``kind`` is ``"ratio"`` (compared system / baseline) or ``"absolute"`` (the metric value
    itself); ``op`` is ``"<="`` or ``">="``.
    """

    kind: str
    op: str
    value: float
    source: str

    def met(self, number: float | None) -> bool | None:
        """Whether ``number`` (a ratio or a value, per ``kind``) meets the target."""
        if number is None:
            return None
        return number <= self.value if self.op == "<=" else number >= self.value

    def describe(self) -> str:
        """A short human form, e.g. ``ratio <= 0.4 (issue 20)``."""
        what = "ratio" if self.kind == "ratio" else "value"
        return f"{what} {self.op} {self.value:g} ({self.source})"


@dataclasses.dataclass(frozen=True)
class MetricSpec:
    """One row of the result table."""

    name: str
    label: str
    unit: str
    better: str  # "lower" or "higher"
    workload: str
    target: Target | None = None


def size_label(size_mb: float) -> str:
    """``1.0`` -> ``"1"``, ``0.5`` -> ``"0.5"``: the size part of echo metric names."""
    return f"{size_mb:g}"


def echo_metric(size_mb: float) -> str:
    """Name of the echo-throughput metric for one tensor size."""
    return f"echo_{size_label(size_mb)}MB_GBps"


def echo_memcpy_metric(size_mb: float) -> str:
    """Name of the metric: echo rate over one memcpy's rate, for one tensor size."""
    return f"echo_{size_label(size_mb)}MB_per_memcpy"


def echo_numpy_metric(size_mb: float) -> str:
    """Name of the numpy echo-throughput metric."""
    return f"echo_numpy_{size_label(size_mb)}MB_GBps"


def scale_metric(workers: int, phase: str) -> str:
    """Name of a scale-mode metric; ``phase`` is init, all_to_all or shutdown."""
    return f"scale_{workers}w_{phase}_s"


_ECHO_TARGETS = {1.0: Target("ratio", ">=", 2.0, "issue 20"),
                 64.0: Target("ratio", ">=", 3.0, "issue 20"),
                 256.0: Target("ratio", ">=", 3.0, "issue 20")}

SCALE_PHASES = (("init", "init_rpc"), ("all_to_all", "all-to-all"),
                ("shutdown", "graceful shutdown"))

SCALE_MEMORY = (("rss", "peak RSS per worker (largest)"),
                ("beyond_import", "peak RSS beyond importing torch (mean)"),
                ("private", "private memory per worker after all-to-all (mean)"))
"""Memory metrics of a scale step. Private memory is what a worker adds to the machine:
its resident pages that no other process shares (torch's libraries are shared)."""


def scale_memory_metric(workers: int, what: str) -> str:
    """Name of a scale-mode memory metric; ``what`` is rss, beyond_import or private."""
    return f"scale_{workers}w_{what}_MB"


def metric_specs(workload: str, options: BenchOptions) -> list[MetricSpec]:
    """Every metric ``workload`` reports under ``options``, in table order."""
    if workload == "latency":
        return [
            MetricSpec("rpc_sync_p50_us", "small rpc_sync p50", "us", "lower", workload,
                       Target("ratio", "<=", 0.4, "issue 20")),
            MetricSpec("rpc_sync_p99_us", "small rpc_sync p99", "us", "lower", workload),
            MetricSpec("noop_p50_us", "no-op rpc_sync (int argument) p50", "us", "lower",
                       workload, Target("ratio", "<=", 0.15, "issue 20")),
        ]
    if workload == "throughput":
        return [MetricSpec("rpc_async_calls_per_s",
                           f"{options.throughput_calls} concurrent rpc_async", "calls/s",
                           "higher", workload, Target("ratio", ">=", 3.0, "issue 20"))]
    if workload == "remote":
        return [
            MetricSpec("remote_to_here_p50_us", "remote() + to_here() p50", "us", "lower",
                       workload, Target("ratio", "<=", 0.3, "issue 20")),
            MetricSpec("remote_to_here_p99_us", "remote() + to_here() p99", "us", "lower",
                       workload),
            MetricSpec("remote_noop_p50_us", "no-op remote() + to_here() p50", "us", "lower",
                       workload),
        ]
    if workload == "echo":
        specs = [MetricSpec(echo_metric(s), f"echo {size_label(s)} MB float32", "GB/s",
                            "higher", workload, _ECHO_TARGETS.get(s))
                 for s in options.echo_sizes_mb]
        # How close a round trip (two crossings) comes to copying the payload once, in
        # the same process and run; for the sizes where bulk copying dominates.
        specs += [MetricSpec(echo_memcpy_metric(s), f"echo {size_label(s)} MB / one memcpy",
                             "x", "higher", workload,
                             Target("absolute", ">=", 0.8, "issue 20: one copy"))
                  for s in options.echo_sizes_mb if s >= 64]
        specs += rss_specs(max(options.echo_sizes_mb), workload, "issue 20: 2x payload")
        return specs
    if workload == "echo_numpy":
        return [MetricSpec(echo_numpy_metric(options.echo_numpy_mb),
                           f"echo {size_label(options.echo_numpy_mb)} MB numpy float32",
                           "GB/s", "higher", workload)]
    if workload == "train":
        dims = "-".join(str(d) for d in options.train_dims)
        return [MetricSpec("train_step_ms", f"train step, MLP {dims}, batch "
                           f"{options.train_batch}", "ms", "lower", workload,
                           Target("ratio", "<=", 0.5, "issue 20")),
                # The step's floor: the same model and step in the caller alone, no RPC.
                MetricSpec("train_local_step_ms", "the same step in one process, no RPC",
                           "ms", "lower", workload)]
    if workload == "fanout":
        n = options.fanout_callees
        return [
            MetricSpec("fanout_calls_per_s", f"fan-out to {n} callees, one round at a time",
                       "calls/s", "higher", workload),
            MetricSpec("fanout_round_p50_us", f"fan-out round to {n} callees p50", "us",
                       "lower", workload),
        ]
    if workload == "ps":
        table = "x".join(str(d) for d in options.ps_dims[:2])
        mlp = "-".join(str(d) for d in options.ps_dims[1:])
        n = options.ps_trainers
        return [
            MetricSpec("ps_steps_per_s", f"parameter server, {n} trainers: steps of all "
                       f"(table {table}, MLP {mlp}, batch {options.ps_batch})", "steps/s",
                       "higher", workload, Target("ratio", ">=", 2.0, "issue 20")),
            MetricSpec("ps_step_p50_ms", f"parameter server, {n} trainers: one step p50",
                       "ms", "lower", workload),
        ]
    if workload == "scale":
        specs = []
        for n in options.scale_sizes:
            specs += [MetricSpec(scale_metric(n, phase), f"{n} workers: {label}", "s", "lower",
                                 workload) for phase, label in SCALE_PHASES]
            specs += [MetricSpec(scale_memory_metric(n, what), f"{n} workers: {label}", "MiB",
                                 "lower", workload) for what, label in SCALE_MEMORY]
        return specs
    raise ValueError(f"unknown workload {workload!r}")


def rss_specs(largest_mb: float, workload: str, source: str) -> list[MetricSpec]:
    """The peak RSS metrics of an echo workload whose largest payload is ``largest_mb``.

    The bound is about the payload copies a process holds: its growth over its peak
    before the echoes (torch alone is ~300 MB, which no transport can shed). Below 64 MB
    the allocator's own slack dominates and a 2x bound means nothing."""
    bound = Target("absolute", "<=", 2 * largest_mb, source) if largest_mb >= 64 else None
    return [
        MetricSpec("peak_rss_caller_MB", "peak RSS caller (echo)", "MiB", "lower", workload),
        MetricSpec("peak_rss_callee_MB", "peak RSS callee (echo)", "MiB", "lower", workload),
        MetricSpec("rss_growth_caller_MB", "peak RSS growth caller (echo)", "MiB", "lower",
                   workload, bound),
        MetricSpec("rss_growth_callee_MB", "peak RSS growth callee (echo)", "MiB", "lower",
                   workload, bound),
    ]
