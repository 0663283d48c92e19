"""Command line of ``python -m benchmarks``."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from . import chart, twohost
from .options import ALL_WORKLOADS, DEFAULT_WORKLOADS, QUICK_OVERRIDES, BenchOptions
from .report import build_report, combine_reports, render_markdown, threads_label
from .runner import run_benchmark
from .systems import BASELINE, SYSTEMS, parse_system_definition, resolve_systems

__all__ = ["build_parser", "main"]

_HELP = {
    "num_worker_threads": "TensorPipeRpcBackendOptions(num_worker_threads=...) for the pair "
                          "workloads",
    "rpc_timeout": "TensorPipeRpcBackendOptions(rpc_timeout=...), seconds",
    "torch_threads": "torch's intra-op threads in every worker; 0 keeps torch's default "
                     "(one per core); the same as --threads with one setting",
    "small_call": "the small call: 'add' = torch.add(torch.ones(2), 1), 'python' = a "
                  "module-level Python function doing the same",
    "latency_calls": "timed rpc_sync calls",
    "latency_warmup": "untimed rpc_sync calls first",
    "throughput_calls": "concurrent rpc_async calls per round",
    "throughput_repeats": "repeats of the whole batch of calls; the best is reported (in "
                          "turns: at least one a turn, and the median)",
    "remote_calls": "timed remote() + to_here() pairs",
    "remote_warmup": "untimed remote() + to_here() pairs first",
    "echo_sizes_mb": "comma-separated float32 tensor sizes in MiB",
    "echo_iters": "timed echoes per size; the median is reported",
    "echo_warmup": "untimed echoes per size first",
    "echo_numpy_mb": "size in MiB of the float32 numpy array of the echo_numpy workload",
    "train_dims": "comma-separated MLP layer sizes; the first half of the layers runs on the "
                  "caller, the rest on the callee",
    "train_batch": "training batch size",
    "train_steps": "timed training steps, and as many of the same step in the caller alone "
                   "(no RPC); the medians are reported",
    "train_warmup": "untimed training steps first",
    "train_lr": "SGD learning rate",
    "call_turns": "with two or more systems, their latency, remote and throughput sessions "
                  "(when not shared with other workloads) run side by side and take this "
                  "many turns each, one system at a time (throughput: at least one repeat "
                  "each, and the median repeat counts, not the best); 0: one system after "
                  "the other",
    "train_turns": "with two or more systems, their training sessions (when not shared with "
                   "other workloads) run side by side and take this many turns each, one "
                   "system at a time, so that all see the same machine",
    "fanout_callees": "callees of the fanout workload (one caller calls all of them)",
    "fanout_rounds": "timed fan-out rounds (one small call to every callee, then wait)",
    "fanout_warmup": "untimed fan-out rounds first",
    "ps_trainers": "trainers of the ps workload (one more worker is the parameter server)",
    "ps_dims": "comma-separated sizes: the parameter server's embedding table (rows, "
               "width), then the trainers' MLP layers on top of it (the last: classes)",
    "ps_bag": "table rows averaged into one sample (nn.EmbeddingBag, mode 'mean')",
    "ps_batch": "samples per trainer step",
    "ps_steps": "timed steps of every trainer, all trainers at once",
    "ps_warmup": "untimed steps of every trainer first",
    "ps_lr": "SGD learning rate of the ps workload",
    "scale_sizes": "comma-separated worker counts for the scale workload",
    "scale_threads": "num_worker_threads of each worker in the scale workload",
    "scale_time_limit": "hard limit for one scale step (spawn to exit), seconds",
    "min_available_gib": "stop a session (its workers are killed) when the machine's "
                         "available memory falls below this many GiB; 0: never",
    "time_limit": "hard limit for one two-worker session (spawn to exit), seconds",
}


_CHOICES = {"small_call": ("add", "python")}


def _list_parser(kind: type) -> Any:
    def parse(text: str) -> tuple[Any, ...]:
        try:
            return tuple(kind(part) for part in text.split(",") if part.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated {kind.__name__}s, got {text!r}") from None
    return parse


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _thread_settings(text: str) -> tuple[int, ...]:
    """``default,1`` -> ``(0, 1)``: torch's intra-op threads per worker, 0 for torch's
    default."""
    settings = []
    for part in _names(text):
        if part == "default":
            settings.append(0)
            continue
        try:
            count = int(part)
        except ValueError:
            count = -1
        if count < 0:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of 'default' and thread counts (e.g. "
                f"default,1), got {part!r} in {text!r}")
        settings.append(count)
    if not settings:
        raise argparse.ArgumentTypeError("--threads needs at least one setting, e.g. default,1")
    if len(set(settings)) != len(settings):
        raise argparse.ArgumentTypeError(
            f"--threads lists a setting twice: {text!r} (0 is the same as 'default')")
    return tuple(settings)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; every :class:`BenchOptions` field is a ``--flag``."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Run the same RPC workloads on torchrpc and on torch.distributed.rpc, "
                    "each in its own freshly spawned worker processes, and print a table "
                    "with the ratios.",
        epilog="Workloads: latency (small rpc_sync p50/p99), throughput (concurrent "
               "rpc_async), remote (remote()+to_here()), echo (1/64/256 MB tensors and "
               "peak RSS), echo_numpy (a 64 MB numpy array), train (MLP split over two "
               "workers), ps (a parameter server holding an embedding table and 4 "
               "trainers training at once with distributed autograd and "
               "DistributedOptimizer: steps/s of all), fanout (one caller to 8 callees: "
               "rpc_async_many where a system has it, else rpc_async + wait_all; only "
               "when asked for), scale (init, "
               "all-to-all and shutdown of 4..32 workers; only when asked for). "
               "'python -m benchmarks chart REPORT.json -o chart.svg' draws a saved "
               "report's ratios.")
    parser.add_argument("--systems", type=_names, default=None,
                        help=f"comma-separated systems to run, in order; ratios are "
                             f"taken against '{BASELINE}' if it runs, else the first "
                             f"(built in: {', '.join(SYSTEMS)}; default: torch,torchrpc; "
                             f"with --hosts 2: {', '.join(twohost.SYSTEMS)}, all by default)")
    parser.add_argument("--hosts", type=int, choices=(1, 2), default=1,
                        help="2: two-host mode: make two network namespaces joined by a "
                             "veth pair (needs root) and run each system's caller in one, "
                             "its callee in the other; no-op calls and the echo sizes, "
                             "against a raw Python TCP echo and torch restricted to its "
                             "uv transport (see benchmarks/twohost.py; default: 1)")
    parser.add_argument("--define-system", action="append", default=[],
                        metavar="NAME=RPC[,AUTOGRAD[,OPTIM]]",
                        help="add a system made of other modules (repeatable)")
    parser.add_argument("--workloads", type=_names, default=None,
                        help=f"comma-separated workloads or 'all' (choices: "
                             f"{', '.join(ALL_WORKLOADS)}; default: "
                             f"{','.join(DEFAULT_WORKLOADS)})")
    parser.add_argument("--threads", type=_thread_settings, default=None,
                        metavar="SETTING[,SETTING...]",
                        help="run every selected workload under each setting of torch's "
                             "intra-op threads per worker, one after the other, and report "
                             "a table per setting: 'default' is torch's own (one per core), "
                             "a number that many (torch.set_num_threads and "
                             "OMP_NUM_THREADS); e.g. default,1. --torch-threads N is the "
                             "same as --threads N (default: 1)")
    parser.add_argument("--scale", action="store_true",
                        help="scale mode: run the scale workload (alone, unless "
                             "--workloads is given too)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat everything this many times, systems alternating, and "
                             "report medians (default: 1)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes and few iterations, for a smoke run; implies "
                             "--sessions shared unless --sessions is given")
    parser.add_argument("--sessions", choices=("per-workload", "shared"), default=None,
                        help="per-workload (default): each workload in its own fresh pair "
                             "of processes; shared: all of a system's two-worker workloads "
                             "in one pair (faster; peak RSS then covers the workloads run "
                             "before echo too)")
    parser.add_argument("--json", action="store_true",
                        help="print the JSON report on stdout instead of the table")
    parser.add_argument("--json-out", type=Path, help="also write the JSON report here")
    parser.add_argument("--markdown-out", type=Path, help="also write the table here")
    parser.add_argument("--chart-out", type=Path,
                        help="also draw the ratios as an SVG here (as 'python -m benchmarks "
                             "chart REPORT.json -o PATH' does from a saved report)")
    parser.add_argument("--keep-logs", type=Path,
                        help="keep worker specs, records and logs in this directory")
    parser.add_argument("--profile-dir", type=Path,
                        help="with --hosts 2: each worker writes a cProfile of each of its "
                             "threads here (SYSTEM-threads-SETTING/rankR-N-THREAD.prof; "
                             "slows the workers down)")
    parser.add_argument("--strict", action="store_true",
                        help="exit with status 1 if any cell is an error")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    group = parser.add_argument_group("sizes, iterations and limits")
    for field in dataclasses.fields(BenchOptions):
        default = field.default
        flag = "--" + field.name.replace("_", "-")
        if isinstance(default, tuple):
            kind: Any = _list_parser(type(default[0]))
            shown = ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in default)
        else:
            kind = type(default)
            shown = str(default)
        quick = QUICK_OVERRIDES.get(field.name)
        if isinstance(quick, tuple):
            quick = ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in quick)
        extra = f"; --quick: {quick}" if quick is not None else ""
        group.add_argument(flag, dest=field.name, type=kind, default=None,
                           choices=_CHOICES.get(field.name),
                           help=f"{_HELP.get(field.name, '')} (default: {shown}{extra})")
    return parser


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    """Defaults, then --quick's overrides, then every flag given explicitly."""
    options = BenchOptions()
    if args.quick:
        options = dataclasses.replace(options, **QUICK_OVERRIDES)
    explicit = {f.name: getattr(args, f.name) for f in dataclasses.fields(BenchOptions)
                if getattr(args, f.name) is not None}
    options = dataclasses.replace(options, **explicit)
    options.validate()
    return options


def threads_from_args(args: argparse.Namespace, options: BenchOptions) -> tuple[int, ...]:
    """The thread settings to run under: ``--threads``, else ``--torch-threads`` (or its
    default) as the one setting."""
    if args.threads is None:
        return (options.torch_threads,)
    if args.torch_threads is not None:
        raise ValueError(f"give --threads or --torch-threads, not both (--torch-threads "
                         f"{args.torch_threads} is --threads "
                         f"{threads_label(args.torch_threads)})")
    return args.threads


def workloads_from_args(args: argparse.Namespace) -> list[str]:
    """The workloads to run, in canonical order."""
    chosen = args.workloads
    if chosen is None:
        chosen = ["scale"] if args.scale else list(DEFAULT_WORKLOADS)
    elif args.scale and "scale" not in chosen:
        chosen = chosen + ["scale"]
    if "all" in chosen:
        chosen = list(ALL_WORKLOADS)
    unknown = [w for w in chosen if w not in ALL_WORKLOADS]
    if unknown:
        raise ValueError(f"unknown workload(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(ALL_WORKLOADS)} or 'all'")
    return [w for w in ALL_WORKLOADS if w in chosen]


def machine_info() -> dict[str, Any]:
    """Where the numbers come from: CPU, memory, OS, Python and torch versions."""
    cpu_model = platform.processor() or "?"
    memory = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo", encoding="utf-8") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    memory = round(int(line.split()[1]) / 2**20, 1)
                    break
    except OSError:
        pass
    cpus: int | None
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count()
    return {
        "cpu_model": cpu_model, "cpus": cpus, "memory_GiB": memory,
        "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or, with ``chart`` first, draw a saved report); return the
    process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["chart"]:
        return chart.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        options = options_from_args(args)
        settings = threads_from_args(args, options)
        workloads = workloads_from_args(args)
        extra = [parse_system_definition(text) for text in args.define_system]
        systems = resolve_systems(args.systems or ["torch", "torchrpc"], extra) \
            if args.hosts == 1 else []
    except ValueError as exc:
        parser.error(str(exc))
    if args.hosts == 2:
        return twohost.run(args, argv, options, settings, machine_info(), (
            (lambda message: None) if args.quiet else
            (lambda message: print(message, file=sys.stderr, flush=True))))
    if not systems:
        parser.error("--systems is empty")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    log = (lambda message: None) if args.quiet else (
        lambda message: print(message, file=sys.stderr, flush=True))

    sessions = args.sessions or ("shared" if args.quick else "per-workload")
    shared = sessions == "shared"
    labels = [threads_label(n) for n in settings]
    log(f"benchmarks: systems {', '.join(s.name for s in systems)}; workloads "
        f"{', '.join(workloads)}; torch threads per worker {', '.join(labels)}")
    names = [s.name for s in systems]
    machine = machine_info()
    reports = []
    failed = False
    for threads, label in zip(settings, labels):
        if len(settings) > 1:
            log(f"torch threads per worker: {label}")
        setting = dataclasses.replace(options, torch_threads=threads)
        if args.keep_logs is not None:
            workdir = args.keep_logs / f"threads-{label}" if len(settings) > 1 \
                else args.keep_logs
            workdir.mkdir(parents=True, exist_ok=True)
            result = run_benchmark(systems, workloads, setting, workdir, log, args.rounds,
                                   shared)
        else:
            with tempfile.TemporaryDirectory(prefix="torchrpc-bench-") as tmp:
                result = run_benchmark(systems, workloads, setting, Path(tmp), log,
                                       args.rounds, shared)
        cells = result.cells()
        failed = failed or any(cell.error is not None for per_system in cells.values()
                               for cell in per_system.values())
        reports.append(build_report(
            specs=result.specs, systems={s.name: s.modules() for s in systems},
            baseline=BASELINE if BASELINE in names else names[0] if len(names) > 1 else None,
            cells=cells, details=result.details, sessions=result.sessions,
            machine=machine, options=setting.to_json(),
            command=shlex.join(["python", "-m", "benchmarks", *argv]),
            workloads=workloads, rounds=args.rounds, samples=result.values,
            warnings=result.partial_failures(), threads=label))
    report = combine_reports(reports)
    markdown = render_markdown(report)
    document = json.dumps(report, indent=2)
    if args.json_out is not None:
        args.json_out.write_text(document + "\n", encoding="utf-8")
    if args.markdown_out is not None:
        args.markdown_out.write_text(markdown, encoding="utf-8")
    if args.chart_out is not None:
        try:
            args.chart_out.write_text(chart.render_svg([report]), encoding="utf-8")
        except ValueError as exc:  # no ratios: a single system
            log(f"no chart: {exc}")
    print(document if args.json else markdown, end="\n" if args.json else "")
    return 1 if args.strict and failed else 0
