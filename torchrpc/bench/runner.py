"""Running the selected workloads on each system, one system after the other.

With ``rounds > 1`` the whole sequence (every system, every workload) is repeated, systems
alternating, each time in fresh processes; a metric's value is then the median over the
rounds that produced it. That evens out a machine whose load changes during the run.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from .launcher import SessionOutcome, run_session
from .metrics import SCALE_PHASES, MetricSpec, metric_specs, scale_metric
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


def _record_pair(result: RunResult, outcome: SessionOutcome, workload: str) -> Optional[str]:
    """Store a pair session's metrics or its error; return the error, if any."""
    error = outcome.error()
    system = outcome.system
    if error is not None:
        result.fail_workload(system, workload, error)
        return error
    record = outcome.records[0] or {}
    metrics = record.get("metrics", {})
    for spec in result.specs:
        if spec.workload == workload:
            result.add(system, spec.name,
                       Cell.of(metrics[spec.name]) if spec.name in metrics
                       else Cell(error=f"the workload did not report {spec.name}"))
    details = dict(record.get("details", {}))
    details.update({k: record[k] for k in ("init_s", "rss_after_init_MB", "workload_s")
                    if k in record})
    result.add_details(system, workload, details)
    return None


def _span(records: list[Optional[dict[str, Any]]], phase: str) -> Optional[float]:
    """Seconds from the first rank entering ``phase`` to the last one leaving it."""
    spans = [r.get(phase) if r else None for r in records]
    if any(s is None for s in spans):
        return None
    return max(end for _, end in spans) - min(begin for begin, _ in spans)


def _record_scale(result: RunResult, outcome: SessionOutcome, workers: int) -> Optional[str]:
    """Store a scale step's three timings (or errors); return the session error, if any."""
    error = outcome.error()
    for phase, _ in SCALE_PHASES:
        span = _span(outcome.records, phase)
        result.add(outcome.system, scale_metric(workers, phase),
                   Cell.of(span) if span is not None
                   else Cell(error=error or "no timing reported"))
    result.add_details(outcome.system, f"scale_{workers}w", {
        "elapsed_s": outcome.elapsed_s,
        "finished": sum(1 for r in outcome.records if r and r.get("phase") == "done"),
    })
    return error


def run_benchmark(systems: list[SystemSpec], workloads: list[str], options: BenchOptions,
                  workdir: Path, log: Log = _stderr_log, rounds: int = 1) -> RunResult:
    """Run ``workloads`` on every system in turn, ``rounds`` times, and collect the cells."""
    specs = [spec for w in workloads for spec in metric_specs(w, options)]
    result = RunResult(specs, systems)
    broken: dict[str, str] = {}
    for round_no in range(rounds):
        if rounds > 1:
            log(f"round {round_no + 1} of {rounds}")
        for system in systems:
            for workload in workloads:
                if system.name in broken:
                    result.fail_workload(system.name, workload, broken[system.name])
                    log(f"[{system.name}] {workload}: skipped, {broken[system.name]}")
                    continue
                error = _run_workload(result, system, workload, options, workdir, log)
                if error is not None:
                    broken[system.name] = error
    return result


def _run_workload(result: RunResult, system: SystemSpec, workload: str,
                  options: BenchOptions, workdir: Path, log: Log) -> Optional[str]:
    """Run one workload on one system; return an error if the system cannot be imported."""
    if workload == "scale":
        for workers in options.scale_sizes:
            outcome = run_session(system, workload, "scale", workers, options,
                                  options.scale_time_limit, workdir)
            result.sessions.append(outcome.summary())
            error = _record_scale(result, outcome, workers)
            _log_outcome(log, system.name, f"scale {workers} workers", outcome, error)
            if outcome.is_import_failure():
                remaining = [n for n in options.scale_sizes if n > workers]
                for later in remaining:
                    for phase, _ in SCALE_PHASES:
                        result.add(system.name, scale_metric(later, phase),
                                   Cell(error=error or "import failed"))
                return error
        return None
    outcome = run_session(system, workload, "pair", 2, options, options.time_limit, workdir)
    result.sessions.append(outcome.summary())
    error = _record_pair(result, outcome, workload)
    _log_outcome(log, system.name, workload, outcome, error)
    return error if outcome.is_import_failure() else None


def _log_outcome(log: Log, system: str, what: str, outcome: SessionOutcome,
                 error: Optional[str]) -> None:
    status = f"FAILED: {error}" if error else "ok"
    log(f"[{system}] {what}: {status} ({outcome.elapsed_s:.1f} s)")
