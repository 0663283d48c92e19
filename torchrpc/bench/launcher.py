"""Spawning worker processes for one session and collecting what they report.

A session is one system running one workload in freshly started processes: two for the
pair workloads, N for a scale step. Every worker is the leader of its own process group,
runs under a hard time limit (its own faulthandler watchdog, then the launcher's kill), and
leaves a JSON record behind. The launcher never reaps a worker before it has killed the
worker's process group, so the group id cannot have been reused by then.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from ._worker import PHASES, TIMEOUT_MARKER
from .options import BenchOptions
from .systems import SystemSpec

__all__ = ["SessionOutcome", "run_session", "free_port", "REPO_ROOT"]

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The directory that holds the ``torchrpc`` package; put on the workers' PYTHONPATH."""

_POLL_S = 0.05
_FAIL_GRACE_S = 2.0
"""After one worker fails, how long the others get to write their records before the kill."""
_DONE_GRACE_S = 15.0
"""After rank 0 has finished (pair sessions), how long the callee gets to exit."""
_KILL_MARGIN_S = 5.0
"""The launcher kills this long after the workers' own watchdog should have fired."""


@dataclasses.dataclass
class SessionOutcome:
    """What came back from one session: each rank's record, exit status and stderr."""

    kind: str
    system: str
    workload: str
    world_size: int
    time_limit: float
    records: list[Optional[dict[str, Any]]]
    returncodes: list[int]
    stderr_tails: list[str]
    killed: bool
    elapsed_s: float

    def role(self, rank: int) -> str:
        """Human name of ``rank``: caller/callee in pair sessions, workerN otherwise."""
        if self.kind == "pair":
            return "caller" if rank == 0 else "callee"
        return f"worker{rank}"

    def phase(self, rank: int) -> str:
        """The last phase ``rank`` reported entering."""
        record = self.records[rank]
        return record.get("phase", "start") if record else "start (no record)"

    def timed_out(self, rank: int) -> bool:
        """Whether ``rank`` was ended by its watchdog or by the launcher's deadline."""
        return TIMEOUT_MARKER in self.stderr_tails[rank] or (
            self.killed and self.returncodes[rank] == -signal.SIGKILL
            and self.phase(rank) != "done")

    def error(self) -> Optional[str]:
        """One line saying why the session failed, or None if every rank succeeded.

        For pair sessions success means the caller produced metrics; a failure after that
        (in shutdown) is a warning, see :meth:`warnings`.
        """
        if self.kind == "pair" and self.records[0] and "metrics" in self.records[0]:
            return None
        for rank, record in enumerate(self.records):
            if record and "error" in record:
                return f"{self.role(rank)} failed in {record.get('phase')}: {record['error']}"
        stuck = [rank for rank in range(self.world_size) if self.timed_out(rank)]
        if stuck:
            # The least advanced rank is the one holding the others up.
            rank = min(stuck, key=lambda r: _phase_index(self.phase(r)))
            ahead = sum(1 for r in range(self.world_size)
                        if _phase_index(self.phase(r)) > _phase_index(self.phase(rank)))
            return (f"timeout after {self.time_limit:g} s: {self.role(rank)} stuck in "
                    f"{self.phase(rank)}" + (f" ({ahead}/{self.world_size} workers got past "
                                             f"it)" if self.kind == "scale" else ""))
        for rank, code in enumerate(self.returncodes):
            if code != 0:
                last = _last_line(self.stderr_tails[rank])
                return (f"{self.role(rank)} exited with {_describe_status(code)} in "
                        f"{self.phase(rank)}" + (f": {last}" if last else ""))
        if self.kind == "pair":
            return "caller finished without metrics"
        return None

    def warnings(self) -> list[str]:
        """Problems that did not cost the session its metrics."""
        notes = []
        for rank, record in enumerate(self.records):
            if record and "warning" in record:
                notes.append(f"{self.role(rank)}: {record['warning']}")
            elif self.returncodes[rank] != 0 or (record and record.get("phase") != "done"):
                notes.append(f"{self.role(rank)} did not exit cleanly "
                             f"({_describe_status(self.returncodes[rank])} in "
                             f"{self.phase(rank)})")
        return notes

    def is_import_failure(self) -> bool:
        """Whether the system's modules could not even be imported."""
        return any(record and "error" in record and record.get("phase") == "import"
                   for record in self.records)

    def summary(self) -> dict[str, Any]:
        """JSON-ready summary for the report's ``sessions`` list."""
        failing = [rank for rank, code in enumerate(self.returncodes) if code != 0]
        return {
            "system": self.system, "workload": self.workload, "kind": self.kind,
            "world_size": self.world_size, "elapsed_s": round(self.elapsed_s, 3),
            "error": self.error(), "warnings": self.warnings(),
            "returncodes": self.returncodes,
            "stderr_tails": {self.role(r): self.stderr_tails[r][-3000:] for r in failing[:3]},
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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + path if path else "")
    env.update({
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        # Keep torch's TensorPipe (and gloo, if anything starts it) on loopback.
        "TP_SOCKET_IFNAME": "lo",
        "GLOO_SOCKET_IFNAME": "lo",
    })
    return env


def _exit_status(proc: subprocess.Popen) -> Optional[int]:
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


def _read_json(path: Path) -> Optional[dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def _tail(path: Path, limit: int = 8000) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - limit))
            return handle.read().decode("utf-8", "replace")
    except OSError:
        return ""


def run_session(system: SystemSpec, workload: str, kind: str, world_size: int,
                options: BenchOptions, time_limit: float, workdir: Path) -> SessionOutcome:
    """Run one session to completion, failure or time limit, and collect the records."""
    store = None
    store_addr: Optional[list[Any]] = None
    if kind == "scale":
        # Imported here so that pair-only runs keep the launcher free of torch.
        from torch.distributed import TCPStore

        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=time_limit))
        store_addr = ["127.0.0.1", store.port]
    session_dir = workdir / f"{system.name}-{workload}-{world_size}w-{time.time_ns()}"
    session_dir.mkdir(parents=True)
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs: list[subprocess.Popen] = []
    env = _worker_env()
    start = time.monotonic()
    try:
        for rank in range(world_size):
            spec = {
                "system": {"name": system.name, "rpc": system.rpc,
                           "modules": system.modules()},
                "kind": kind, "workload": workload, "rank": rank, "world_size": world_size,
                "init_method": init_method, "options": options.to_json(),
                "time_limit": time_limit, "store": store_addr,
                "result_path": str(session_dir / f"rank{rank}.result.json"),
            }
            spec_path = session_dir / f"rank{rank}.spec.json"
            spec_path.write_text(json.dumps(spec), encoding="utf-8")
            with open(session_dir / f"rank{rank}.log", "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "torchrpc.bench._worker", str(spec_path)],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                    start_new_session=True))
        killed = _supervise(procs, kind, session_dir, time_limit + _KILL_MARGIN_S, start)
    finally:
        for proc in procs:
            _kill_group(proc)
        returncodes = [proc.wait() for proc in procs]
        del store
    elapsed = time.monotonic() - start
    return SessionOutcome(
        kind=kind, system=system.name, workload=workload, world_size=world_size,
        time_limit=time_limit,
        records=[_read_json(session_dir / f"rank{r}.result.json") for r in range(world_size)],
        returncodes=returncodes,
        stderr_tails=[_tail(session_dir / f"rank{r}.log") for r in range(world_size)],
        killed=killed, elapsed_s=elapsed)


def _supervise(procs: list[subprocess.Popen], kind: str, session_dir: Path,
               hard_limit: float, start: float) -> bool:
    """Wait for the workers; return True if some had to be killed."""
    deadline = start + hard_limit
    while True:
        statuses = [_exit_status(p) for p in procs]
        if all(s is not None for s in statuses):
            return False
        now = time.monotonic()
        if any(s not in (None, 0) for s in statuses):
            deadline = min(deadline, now + _FAIL_GRACE_S)
        elif kind == "pair" and statuses[0] == 0:
            deadline = min(deadline, now + _DONE_GRACE_S)
        if now >= deadline:
            return True
        time.sleep(_POLL_S)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group that ``proc`` leads (it is not reaped yet)."""
    if proc.returncode is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
