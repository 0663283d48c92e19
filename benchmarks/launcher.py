"""Spawning worker processes for one session and collecting what they report.

A session is one system running one or more workloads in freshly started processes: two
for the pair workloads, N for a scale step. Every worker is the leader of its own process group,
runs under a hard time limit (its own faulthandler watchdog, then the launcher's kill), and
leaves a JSON record behind. The launcher never reaps a worker before it has killed the
worker's process group, so the group id cannot have been reused by then.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from torch.distributed import TCPStore

from ._worker import PHASES, TIMEOUT_MARKER
from .options import BenchOptions
from .ports import free_port
from .systems import SystemSpec

__all__ = ["REPO_ROOT", "SessionOutcome", "run_session"]

REPO_ROOT = Path(__file__).resolve().parents[1]
"""The repository root, which holds ``benchmarks`` (and ``torchrpc``); put on the workers'
PYTHONPATH."""

_POLL_S = 0.05
_FAIL_GRACE_S = 2.0
"""After one worker fails, how long the others get to write their records before the kill."""
_DONE_GRACE_S = 15.0
"""After rank 0 has finished (pair sessions), how long the callee gets to exit."""
_KILL_MARGIN_S = 5.0
"""The launcher kills this long after the workers' own watchdog should have fired."""


@dataclasses.dataclass
class SessionOutcome:
    """What came back from one session: each rank's record, exit status and log tail."""

    kind: str
    system: str
    workloads: list[str]
    world_size: int
    time_limit: float
    records: list[dict[str, Any] | None]
    returncodes: list[int]
    log_tails: list[str]
    kill_reason: str | None  # None, "deadline", "peer failed", "caller done" or "memory"
    elapsed_s: float
    # The least memory the machine had available during the session, and the floor
    # below which the session is stopped (GiB; None where /proc/meminfo is missing).
    min_available_gib: float | None = None
    memory_floor_gib: float = 0.0
    # Per rank: tracebacks and ERROR lines in its whole log (exceptions, caught or not).
    log_errors: list[int] = dataclasses.field(default_factory=list)

    def role(self, rank: int) -> str:
        """Human name of ``rank``: caller/callee in pair sessions, workerN otherwise."""
        if self.kind == "pair":
            return "caller" if rank == 0 else "callee"
        return f"worker{rank}"

    def phase(self, rank: int) -> str:
        """The last phase ``rank`` reported entering (with the workload, if in one)."""
        record = self.records[rank]
        if not record:
            return "start (no record)"
        phase = record.get("phase", "start")
        return f"{phase} {record['workload']}" if "workload" in record else phase

    def _phase_index(self, rank: int) -> int:
        record = self.records[rank]
        return _phase_index(record.get("phase", "start")) if record else -1

    def _killed_by_us(self, rank: int) -> bool:
        return self.kill_reason is not None and self.returncodes[rank] == -signal.SIGKILL

    def timed_out(self, rank: int) -> bool:
        """Whether ``rank`` was ended by its watchdog or by the launcher's deadline."""
        return TIMEOUT_MARKER in self.log_tails[rank] or (
            self.kill_reason == "deadline" and self._killed_by_us(rank)
            and self._phase_index(rank) != _phase_index("done"))

    def died(self, rank: int) -> bool:
        """Whether ``rank`` ended badly by itself: not by a timeout, not killed by us."""
        return (self.returncodes[rank] != 0 and not self.timed_out(rank)
                and not self._killed_by_us(rank))

    def complete(self) -> bool:
        """Whether the session produced everything it was for.

        A pair session is complete once the caller recorded an outcome for every workload,
        even if something went wrong in shutdown afterwards (see :meth:`warnings`).
        """
        if self.kind == "pair":
            results = (self.records[0] or {}).get("results", {})
            return all(w in results for w in self.workloads)
        return all(r and r.get("phase") == "done" for r in self.records)

    def failure(self) -> str | None:
        """One line saying why the session failed as a whole, or None if it is complete."""
        if self.complete():
            return None
        if self.kill_reason == "memory":
            return (f"stopped: the machine's available memory fell below "
                    f"{self.memory_floor_gib:g} GiB with {self.world_size} workers running")
        for rank, record in enumerate(self.records):
            if record and "error" in record:
                return (f"{self.role(rank)} failed in {record.get('error_phase')}: "
                        f"{record['error']}")
        # A rank that died by itself (a crash, an abort) is the cause; the others were
        # only waiting for it when they were killed.
        for rank in range(self.world_size):
            if self.died(rank):
                last = _last_line(self.log_tails[rank])
                return (f"{self.role(rank)} died ({_describe_status(self.returncodes[rank])}) "
                        f"in {self.phase(rank)}" + (f": {last}" if last else ""))
        stuck = [rank for rank in range(self.world_size) if self.timed_out(rank)]
        if stuck:
            # The least advanced rank is the one holding the others up.
            rank = min(stuck, key=self._phase_index)
            ahead = sum(1 for r in range(self.world_size)
                        if self._phase_index(r) > self._phase_index(rank))
            return (f"timeout after {self.time_limit:g} s: {self.role(rank)} stuck in "
                    f"{self.phase(rank)}" + (f" ({ahead}/{self.world_size} workers got past "
                                             f"it)" if self.kind == "scale" else ""))
        return "the workers exited without reporting results"

    def workload_error(self, workload: str) -> str | None:
        """Why ``workload`` (of a pair session) has no metrics, or None if it has them."""
        result = (self.records[0] or {}).get("results", {}).get(workload)
        if result is not None and "metrics" in result:
            return None
        if result is not None and "error" in result:
            return f"{workload} failed: {result['error']}"
        return self.failure() or f"no result for {workload}"

    def metrics(self, workload: str) -> dict[str, Any]:
        """The caller's metrics for ``workload`` (empty if it has none)."""
        result = (self.records[0] or {}).get("results", {}).get(workload, {})
        return result.get("metrics", {})

    def details(self, workload: str) -> dict[str, Any]:
        """Extra information the caller reported for ``workload``."""
        record = self.records[0] or {}
        result = record.get("results", {}).get(workload, {})
        details = dict(result.get("details", {}))
        details["workload_s"] = result.get("seconds")
        details["init_s"] = record.get("init_s")
        details["rss_after_init_MB"] = record.get("rss_after_init_MB")
        details["torch_threads"] = record.get("torch_threads")
        return details

    def warnings(self) -> list[str]:
        """Problems that did not cost the session its results."""
        notes = []
        for rank, record in enumerate(self.records):
            role = self.role(rank)
            notes += [f"{role}: {warning}" for warning in (record or {}).get("warnings", [])]
            if record and "error" in record:
                notes.append(f"{role} failed in {record.get('error_phase')}: "
                             f"{record['error']}")
            elif self.returncodes[rank] != 0 or self._phase_index(rank) != _phase_index("done"):
                last = _last_line(self.log_tails[rank]) if self.died(rank) else ""
                notes.append(f"{role} did not exit cleanly "
                             f"({_describe_status(self.returncodes[rank])} in "
                             f"{self.phase(rank)})" + (f": {last}" if last else ""))
        return notes

    def is_import_failure(self) -> bool:
        """Whether the system's modules could not even be imported."""
        return any(record and record.get("error_phase") == "import"
                   for record in self.records)

    def summary(self) -> dict[str, Any]:
        """JSON-ready summary for the report's ``sessions`` list."""
        failing = [rank for rank, code in enumerate(self.returncodes) if code != 0]
        return {
            "system": self.system, "workloads": self.workloads, "kind": self.kind,
            "world_size": self.world_size, "elapsed_s": round(self.elapsed_s, 3),
            "error": self.failure(), "warnings": self.warnings(),
            "returncodes": self.returncodes,
            "log_tails": {self.role(r): self.log_tails[r][-3000:] for r in failing[:3]},
        }


def _phase_index(phase: str) -> int:
    return PHASES.index(phase) if phase in PHASES else -1


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def _describe_status(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def _worker_env(torch_threads: int = 1) -> dict[str, str]:
    env = dict(os.environ)
    path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + path if path else "")
    if torch_threads:
        env.update({"OMP_NUM_THREADS": str(torch_threads), "MKL_NUM_THREADS": str(torch_threads)})
    else:  # torch's default: one thread per core
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env.pop(name, None)
    env.update({
        "PYTHONUNBUFFERED": "1",
        # Keep torch's TensorPipe (and gloo, if anything starts it) on loopback.
        "TP_SOCKET_IFNAME": "lo",
        "GLOO_SOCKET_IFNAME": "lo",
    })
    return env


def _exit_status(proc: subprocess.Popen) -> int | None:
    """The exit status of ``proc`` if it has ended, without reaping it (Popen-style)."""
    if proc.returncode is not None:
        return proc.returncode
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return proc.poll()
    if info is None or info.si_pid == 0:
        return None
    if info.si_code == os.CLD_EXITED:
        return info.si_status
    return -info.si_status


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def _count_errors(path: Path) -> int:
    """Tracebacks and ERROR log lines in the log at ``path``."""
    try:
        with open(path, "rb") as handle:
            return sum(1 for line in handle
                       if line.startswith(b"Traceback (most recent call last)")
                       or b" ERROR " in line)
    except OSError:
        return 0


def _tail(path: Path, limit: int = 8000) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - limit))
            return handle.read().decode("utf-8", "replace")
    except OSError:
        return ""


def run_session(system: SystemSpec, workloads: list[str], kind: str, world_size: int,
                options: BenchOptions, time_limit: float, workdir: Path,
                extra: dict[str, Any] | None = None) -> SessionOutcome:
    """Run one session to completion, failure or time limit, and collect the records.

    ``extra`` is added to every worker's spec (the turn plan of a training session that
    takes turns with other systems, see runner.py).
    """
    # The workers' barriers (between scale phases, before exiting) use this store, which
    # lives as long as the session: torch's, but apart from the system under test.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=time_limit))
    store_addr = ["127.0.0.1", store.port]
    label = "+".join(workloads)
    session_dir = workdir / f"{system.name}-{label}-{world_size}w-{time.time_ns()}"
    session_dir.mkdir(parents=True)
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs: list[subprocess.Popen] = []
    env = _worker_env(options.torch_threads)
    start = time.monotonic()
    try:
        for rank in range(world_size):
            spec = {
                "system": {"name": system.name, "rpc": system.rpc,
                           "modules": system.modules()},
                "kind": kind, "workloads": workloads, "rank": rank,
                "world_size": world_size,
                "init_method": init_method, "options": options.to_json(),
                "time_limit": time_limit, "store": store_addr,
                "result_path": str(session_dir / f"rank{rank}.result.json"),
                **(extra or {}),
            }
            spec_path = session_dir / f"rank{rank}.spec.json"
            spec_path.write_text(json.dumps(spec), encoding="utf-8")
            with open(session_dir / f"rank{rank}.log", "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "benchmarks._worker", str(spec_path)],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                    start_new_session=True))
        kill_reason, least = _supervise(procs, kind, time_limit + _KILL_MARGIN_S, start,
                                        options.min_available_gib)
    finally:
        for proc in procs:
            _kill_group(proc)
        returncodes = [proc.wait() for proc in procs]
        del store
    elapsed = time.monotonic() - start
    return SessionOutcome(
        kind=kind, system=system.name, workloads=workloads, world_size=world_size,
        time_limit=time_limit,
        records=[_read_json(session_dir / f"rank{r}.result.json") for r in range(world_size)],
        returncodes=returncodes,
        log_tails=[_tail(session_dir / f"rank{r}.log") for r in range(world_size)],
        kill_reason=kill_reason, elapsed_s=elapsed, min_available_gib=least,
        memory_floor_gib=options.min_available_gib,
        log_errors=[_count_errors(session_dir / f"rank{r}.log") for r in range(world_size)])


def available_gib() -> float | None:
    """The machine's available memory (``MemAvailable``), GiB; None if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        pass
    return None


def _supervise(procs: list[subprocess.Popen], kind: str, hard_limit: float,
               start: float, floor_gib: float) -> tuple[str | None, float | None]:
    """Wait for the workers to exit; also return the least available memory seen.

    The reason is None if they all exited, else why the rest must be killed:
    ``"deadline"`` (the hard limit passed), ``"peer failed"`` (one failed and the others
    had their grace), ``"caller done"`` (a pair session's caller exited and the callee had
    its grace) or ``"memory"`` (the machine's available memory fell below ``floor_gib``).
    """
    deadline = start + hard_limit
    reason = "deadline"
    least: float | None = None
    while True:
        statuses = [_exit_status(p) for p in procs]
        if all(s is not None for s in statuses):
            return None, least
        available = available_gib()
        if available is not None:
            least = available if least is None else min(least, available)
            if available < floor_gib:
                return "memory", least
        now = time.monotonic()
        failed = any(s not in (None, 0) for s in statuses)
        if failed and now + _FAIL_GRACE_S < deadline:
            deadline, reason = now + _FAIL_GRACE_S, "peer failed"
        elif not failed and kind == "pair" and statuses[0] == 0 and (
                now + _DONE_GRACE_S < deadline):
            deadline, reason = now + _DONE_GRACE_S, "caller done"
        if now >= deadline:
            return reason, least
        time.sleep(_POLL_S)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group that ``proc`` leads (it is not reaped yet)."""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
