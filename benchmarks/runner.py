"""Running the selected workloads on each system, one system after the other.

With ``rounds > 1`` the whole sequence (every system, every workload) is repeated, systems
alternating, each time in fresh processes; a metric's value is then the median over the
rounds that produced it. That evens out a machine whose load changes during the run.

The training step and the calls are the exception. On a shared machine their speed
drifts by a quarter or more within seconds, more than the difference being measured, so
in each round the systems' sessions of such a workload run side by side instead, and
take turns: every system warms up, then the timed steps (``train_turns``) or calls
(``call_turns``: the latency, remote and throughput workloads) go in turns, one system at
a time, the first system changing from turn to turn. The systems whose turn it is not
are stopped (SIGSTOP): torch's TensorPipe polls its shared-memory queues with a busy
thread even when idle, and would otherwise take a CPU from whoever is measured. Each
system's median then comes from the same stretch of time as the others', with the
machine to itself.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import statistics
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed import TCPStore

from .launcher import SessionOutcome, run_session
from .metrics import (SCALE_MEMORY, SCALE_PHASES, MetricSpec, metric_specs,
                      scale_memory_metric, scale_metric)
from .options import BenchOptions
from .report import Cell
from .systems import SystemSpec

__all__ = ["RunResult", "run_benchmark"]

Log = Callable[[str], None]


class RunResult:
    """Everything measured: per system and metric, the values and errors of each round."""

    def __init__(self, specs: list[MetricSpec], systems: list[SystemSpec]) -> None:
        self.specs = specs
        self.values: dict[str, dict[str, list[float]]] = {
            s.name: {spec.name: [] for spec in specs} for s in systems}
        self.errors: dict[str, dict[str, list[str]]] = {
            s.name: {spec.name: [] for spec in specs} for s in systems}
        self.details: dict[str, dict[str, list[Any]]] = {s.name: {} for s in systems}
        self.sessions: list[dict[str, Any]] = []

    def add(self, system: str, metric: str, cell: Cell) -> None:
        """Record one round's cell."""
        if cell.value is not None:
            self.values[system][metric].append(cell.value)
        else:
            self.errors[system][metric].append(cell.error or "no value")

    def fail_workload(self, system: str, workload: str, message: str) -> None:
        """Record ``message`` as this round's error for every metric of ``workload``."""
        for spec in self.specs:
            if spec.workload == workload:
                self.add(system, spec.name, Cell(error=message))

    def add_details(self, system: str, key: str, details: Any) -> None:
        """Keep a workload's extra information, one entry per round."""
        self.details[system].setdefault(key, []).append(details)

    def cells(self) -> dict[str, dict[str, Cell]]:
        """One cell per system and metric: the median over the rounds that produced a value,
        or the first error when none did."""
        out: dict[str, dict[str, Cell]] = {}
        for system, metrics in self.values.items():
            out[system] = {}
            for metric, values in metrics.items():
                errors = self.errors[system][metric]
                if values:
                    out[system][metric] = Cell(value=statistics.median(values))
                else:
                    out[system][metric] = Cell(error=errors[0] if errors else "not run")
        return out

    def partial_failures(self) -> list[str]:
        """Metrics that have a value but failed in some rounds."""
        notes = []
        for system, metrics in self.values.items():
            for metric, values in metrics.items():
                errors = self.errors[system][metric]
                if values and errors:
                    notes.append(f"{system} {metric}: {len(errors)} of "
                                 f"{len(errors) + len(values)} rounds failed: {errors[0]}")
        return notes


def _stderr_log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _record_pair(result: RunResult, outcome: SessionOutcome) -> None:
    """Store each workload's metrics, or its error, from a pair session."""
    system = outcome.system
    for workload in outcome.workloads:
        error = outcome.workload_error(workload)
        if error is not None:
            result.fail_workload(system, workload, error)
            continue
        metrics = outcome.metrics(workload)
        for spec in result.specs:
            if spec.workload == workload:
                result.add(system, spec.name,
                           Cell.of(metrics[spec.name]) if spec.name in metrics
                           else Cell(error=f"the workload did not report {spec.name}"))
        result.add_details(system, workload, outcome.details(workload))


def _span(records: list[dict[str, Any] | None], phase: str) -> float | None:
    """Seconds from the first rank entering ``phase`` to the last one leaving it."""
    spans: list[tuple[float, float]] = []
    for record in records:
        span = record.get(phase) if record else None
        if span is None:
            return None
        spans.append((span[0], span[1]))
    return max(end for _, end in spans) - min(begin for begin, _ in spans)


def _each(records: list[dict[str, Any] | None], value: Callable[[dict[str, Any]], float]
          ) -> list[float] | None:
    """``value(record)`` of every rank, or None if any rank did not report it."""
    try:
        return [value(record) for record in records if record is not None] \
            if all(records) else None
    except (KeyError, TypeError):
        return None


def _scale_memory(records: list[dict[str, Any] | None]) -> dict[str, float | None]:
    """The memory metrics of a scale step (see ``SCALE_MEMORY``), None where unreported."""
    peak = _each(records, lambda r: r["peak_rss_MB"])
    beyond = _each(records, lambda r: r["peak_rss_MB"] - r["memory_after_import_MB"]["rss"])
    private = _each(records, lambda r: r["memory_after_all_to_all_MB"]["private"])
    return {"rss": max(peak) if peak else None,
            "beyond_import": sum(beyond) / len(beyond) if beyond else None,
            "private": sum(private) / len(private) if private else None}


def _record_scale(result: RunResult, outcome: SessionOutcome, workers: int) -> None:
    """Store a scale step's timings and memory, or why each is missing."""
    error = outcome.failure()
    for phase, _ in SCALE_PHASES:
        span = _span(outcome.records, phase)
        result.add(outcome.system, scale_metric(workers, phase),
                   Cell.of(span) if span is not None
                   else Cell(error=error or "no timing reported"))
    memory = _scale_memory(outcome.records)
    for what, _ in SCALE_MEMORY:
        result.add(outcome.system, scale_memory_metric(workers, what),
                   Cell.of(memory[what]) if memory[what] is not None
                   else Cell(error=error or "no memory reported"))
    imported = _each(outcome.records, lambda r: r["memory_after_import_MB"]["private"])
    threads = _each(outcome.records, lambda r: r["memory_after_all_to_all_MB"]["threads"])
    result.add_details(outcome.system, f"scale_{workers}w", {
        "elapsed_s": outcome.elapsed_s,
        "finished": sum(1 for r in outcome.records if r and r.get("phase") == "done"),
        "private_after_import_MB": sum(imported) / len(imported) if imported else None,
        "threads_per_worker_max": max(threads) if threads else None,
        "min_available_GiB": outcome.min_available_gib,
        "workers_with_errors_in_log": sum(1 for n in outcome.log_errors if n),
    })


def run_benchmark(systems: list[SystemSpec], workloads: list[str], options: BenchOptions,
                  workdir: Path, log: Log = _stderr_log, rounds: int = 1,
                  shared_session: bool = False) -> RunResult:
    """Run ``workloads`` on every system in turn, ``rounds`` times, and collect the cells.

    Each pair workload gets its own fresh pair of processes, unless ``shared_session``, in
    which case a system's pair workloads all run in one pair (faster, less isolated).
    """
    specs = [spec for w in workloads for spec in metric_specs(w, options)]
    result = RunResult(specs, systems)
    pair = [w for w in workloads if w not in ("scale", "fanout", "ps")]
    groups = ([pair] if shared_session else [[w] for w in pair]) if pair else []
    if "ps" in workloads:  # a session of its own: the server and ps_trainers trainers
        groups.append(["ps"])
    if "fanout" in workloads:  # a session of its own: one caller, fanout_callees callees
        groups.append(["fanout"])
    if "scale" in workloads:
        groups.append(["scale"])
    # The sessions of these workloads take turns (see the module docs), last in a round.
    counts = {"latency": options.call_turns, "remote": options.call_turns,
              "throughput": options.call_turns, "train": options.train_turns}
    in_turns = [w for w in pair if [w] in groups and counts.get(w) and len(systems) > 1]
    for workload in in_turns:
        groups.remove([workload])
    broken: dict[str, str] = {}

    def skip(system: SystemSpec, group: list[str]) -> bool:
        if system.name not in broken:
            return False
        for workload in group:
            result.fail_workload(system.name, workload, broken[system.name])
        log(f"[{system.name}] {'+'.join(group)}: skipped, {broken[system.name]}")
        return True

    for round_no in range(rounds):
        if rounds > 1:
            log(f"round {round_no + 1} of {rounds}")
        for system in systems:
            for group in groups:
                if skip(system, group):
                    continue
                if group == ["scale"]:
                    error = _run_scale(result, system, options, workdir, log)
                else:
                    error = _run_pair(result, system, group, options, workdir, log)
                if error is not None:
                    broken[system.name] = error
        for workload in in_turns:
            live = [system for system in systems if not skip(system, [workload])]
            if len(live) > 1:
                broken.update(_run_in_turns(result, live, workload, counts[workload],
                                            round_no, options, workdir, log))
            elif live:
                error = _run_pair(result, live[0], [workload], options, workdir, log)
                if error is not None:
                    broken[live[0].name] = error
    return result


def _run_pair(result: RunResult, system: SystemSpec, workloads: list[str],
              options: BenchOptions, workdir: Path, log: Log) -> str | None:
    """Run pair workloads (or the fanout workload with its callees, or the ps workload
    with its trainers) in one session; return an error if the system cannot be imported."""
    world_size = (options.fanout_callees + 1 if workloads == ["fanout"]
                  else options.ps_trainers + 1 if workloads == ["ps"] else 2)
    outcome = run_session(system, workloads, "pair", world_size, options, options.time_limit,
                          workdir)
    return _take_pair(result, outcome, log)


def _take_pair(result: RunResult, outcome: SessionOutcome, log: Log, how: str = "") -> str | None:
    """Record and log a pair session's outcome; return an error if the system cannot be
    imported. ``how`` follows the workload's name in the log."""
    result.sessions.append(outcome.summary())
    _record_pair(result, outcome)
    for workload in outcome.workloads:
        _log_outcome(log, outcome.system, workload + how, outcome,
                     outcome.workload_error(workload))
    return outcome.failure() if outcome.is_import_failure() else None


def _run_in_turns(result: RunResult, systems: list[SystemSpec], workload: str, count: int,
                  round_no: int, options: BenchOptions, workdir: Path, log: Log
                  ) -> dict[str, str]:
    """The sessions of ``workload`` on ``systems`` side by side, taking ``count`` turns
    each (module docs).

    Returns the import errors of systems that could not run at all.
    """
    n = len(systems)
    owner: list[int] = []  # turn -> system
    for turn in range(count):
        first = (turn + round_no) % n
        owner += [*range(first, n), *range(first)]
    limit = options.time_limit + 30.0
    timeout = datetime.timedelta(seconds=limit)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    # The sessions' threads and the leading thread each use their own client.
    waiter = TCPStore("127.0.0.1", store.port, is_master=False, timeout=timeout)
    lock = threading.Lock()
    outcomes: list[SessionOutcome | None] = [None] * n
    ended = [False] * n
    pids: list[list[int]] = [[] for _ in systems]

    def session(i: int) -> None:
        slots = [turn for turn, who in enumerate(owner) if who == i]
        try:
            outcomes[i] = run_session(
                systems[i], [workload], "pair", 2, options, options.time_limit, workdir,
                extra={"turns": {"store": ["127.0.0.1", store.port], "index": i,
                                 "slots": slots, "time_limit": limit}})
        finally:
            ended[i] = True
            with lock:  # over, in whatever way: nobody waits for this system any more
                store.set(f"ready/{i}", "")
                for turn in slots:
                    store.set(f"done/{turn}", "")

    def signal_all(i: int, sig: int) -> None:
        for pid in pids[i]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, sig)  # each worker leads its own process group

    threads = [threading.Thread(target=session, args=(i,), name=f"bench-{workload}-{i}",
                                daemon=True) for i in range(n)]
    for thread in threads:
        thread.start()
    try:
        waiter.wait([f"ready/{i}" for i in range(n)])
        for i in range(n):
            pids[i] = [int(p) for p in waiter.get(f"ready/{i}").decode().split(",") if p]
        for turn, i in enumerate(owner):
            if ended[i]:
                continue
            for j in range(n):
                if j != i:
                    signal_all(j, signal.SIGSTOP)
            signal_all(i, signal.SIGCONT)
            waiter.set(f"go/{turn}", "1")
            waiter.wait([f"done/{turn}"])
    except Exception as exc:  # noqa: BLE001 - the sessions' own limits end them
        log(f"{workload} (in turns): the turns stopped early: {exc}")
    except BaseException:  # interrupted: leave no stopped workers behind
        for i in range(n):
            signal_all(i, signal.SIGKILL)
        raise
    finally:
        for i in range(n):
            signal_all(i, signal.SIGCONT)
    for thread in threads:
        thread.join()
    errors = {}
    for system, outcome in zip(systems, outcomes):
        if outcome is None:  # run_session itself failed
            result.fail_workload(system.name, workload, "the session could not be run")
            continue
        error = _take_pair(result, outcome, log, " (in turns)")
        if error is not None:
            errors[system.name] = error
    return errors


def _run_scale(result: RunResult, system: SystemSpec, options: BenchOptions, workdir: Path,
               log: Log) -> str | None:
    """Run every scale step; return an error if the system cannot be imported."""
    for index, workers in enumerate(options.scale_sizes):
        outcome = run_session(system, ["scale"], "scale", workers, options,
                              options.scale_time_limit, workdir)
        result.sessions.append(outcome.summary())
        _record_scale(result, outcome, workers)
        error = outcome.failure()
        _log_outcome(log, system.name, f"scale {workers} workers", outcome, error)
        if outcome.is_import_failure() or outcome.kill_reason == "memory":
            why = (error or "import failed") if outcome.is_import_failure() else \
                f"skipped: memory ran out at {workers} workers"
            for later in options.scale_sizes[index + 1:]:
                for name in ([scale_metric(later, p) for p, _ in SCALE_PHASES]
                             + [scale_memory_metric(later, m) for m, _ in SCALE_MEMORY]):
                    result.add(system.name, name, Cell(error=why))
            return error if outcome.is_import_failure() else None
    return None


def _log_outcome(log: Log, system: str, what: str, outcome: SessionOutcome,
                 error: str | None) -> None:
    status = f"FAILED: {error}" if error else "ok"
    log(f"[{system}] {what}: {status} ({outcome.elapsed_s:.1f} s)")
