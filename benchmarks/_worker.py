"""Entry point of one benchmark worker process.

Run as ``python -m benchmarks._worker SPEC_JSON``; the launcher writes the spec. The
worker imports its system's modules by name, joins the RPC group and plays its part:

* ``pair`` sessions: rank 0 ("caller") runs the session's workloads, one after the other,
  against rank 1 ("callee"), which only serves (the fanout workload: against ranks 1..N,
  "callee", "callee2", ...; the ps workload: rank 0 is the parameter server, and ranks
  1..N the trainers, which it starts and waits for). The caller records each workload's metrics
  (or error) as soon as it has them, so a later hang or crash loses nothing measured.
* ``scale`` sessions: every rank times ``init_rpc``, an all-to-all round of calls and a
  graceful ``shutdown``, with barriers (on the launcher's TCPStore) between the phases.

Each rank keeps a JSON record (phase reached, results, error) that it rewrites atomically
after every step; the launcher reads it whatever happens. A faulthandler watchdog dumps every
thread's stack and ends the process at the session's time limit, so a worker never outlives
it, even if the launcher is gone.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import importlib
import json
import logging
import os
import sys
import time
import traceback
from types import ModuleType
from typing import Any, Callable, Dict, Tuple

import torch
from torch.distributed import TCPStore

from .options import BenchOptions
from .callees import memory_mb, peak_rss_mb
from .context import Turns, WorkerContext
from .workloads import PAIR_RUNNERS

TIMEOUT_MARKER = "Timeout ("
"""How faulthandler's watchdog starts its report; the launcher looks for it in the log."""

PHASES = ("start", "import", "ready", "init", "init-barrier", "workload", "all_to_all",
          "all_to_all-barrier", "shutdown", "done")
"""Phases a worker reports, in the order it goes through them (barriers wait for others)."""

_EXIT_BARRIER_S = 15.0


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


class Record:
    """This rank's result record, persisted to ``path`` on every :meth:`save`."""

    def __init__(self, path: str, rank: int) -> None:
        self.path = path
        self.data: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "phase": "start"}

    def phase(self, name: str) -> None:
        """Enter phase ``name`` and save, so a timeout can say where it happened."""
        self.data["phase"] = name
        self.save()

    def save(self) -> None:
        """Write the record atomically (temp file + rename)."""
        tmp = f"{self.path}.tmp"
        with open(tmp, "w", encoding="utf-8") as out:
            json.dump(self.data, out)
        os.replace(tmp, self.path)

    def fail(self, exc: BaseException) -> None:
        """Record ``exc`` as this rank's error, in the current phase.

        If the rank already has an error, or results, this failure came after them (in
        shutdown, typically) and is kept as a warning instead of replacing them.
        """
        if "error" in self.data or self.data.get("results"):
            self.data.setdefault("warnings", []).append(
                f"{self.data['phase']} failed: {_describe(exc)}")
        else:
            self.data["error"] = _describe(exc)
            self.data["error_phase"] = self.data["phase"]
            self.data["traceback"] = traceback.format_exc()
        self.save()


def _barrier(store: Any, name: str, world_size: int, timeout: float) -> None:
    """Block until all ``world_size`` ranks reach barrier ``name``."""
    if store.add(f"{name}/count", 1) == world_size:
        store.set(f"{name}/done", "1")
    store.wait([f"{name}/done"], datetime.timedelta(seconds=timeout))


def _backend_options(rpc: ModuleType, spec: dict[str, Any], threads: int,
                     opts: BenchOptions) -> Any:
    return rpc.TensorPipeRpcBackendOptions(num_worker_threads=threads,
                                           rpc_timeout=opts.rpc_timeout,
                                           init_method=spec["init_method"])


def _connect(spec: dict[str, Any]) -> Any:
    """A client of the launcher's store, used for barriers."""
    host, port = spec["store"]
    return TCPStore(host, port, is_master=False,
                    timeout=datetime.timedelta(seconds=spec["time_limit"]))


def _exit_barrier(store: Any, world_size: int) -> None:
    """Wait (briefly) until every rank is through ``shutdown`` before exiting.

    Rank 0 hosts the RPC rendezvous store, which torch's agent still uses during shutdown;
    if rank 0 exited first, the others' shutdown would fail for a reason that has nothing
    to do with the system under test. A missing peer only shortens the wait.
    """
    with contextlib.suppress(Exception):  # a dead or hung peer is the launcher's to report
        _barrier(store, "exit", world_size, _EXIT_BARRIER_S)


def _callee_name(rank: int) -> str:
    """The name of callee ``rank``: "callee" for rank 1, as the pair workloads call it."""
    return "callee" if rank == 1 else f"callee{rank}"


def run_pair(spec: dict[str, Any], mods: dict[str, ModuleType], opts: BenchOptions,
             record: Record) -> None:
    """Caller or callee of a session with one caller: two workers, or a caller and
    ``world_size - 1`` callees (the fanout workload)."""
    rpc = mods["rpc"]
    store = _connect(spec)
    rank = spec["rank"]
    world_size = spec.get("world_size", 2)
    record.phase("init")
    start = time.perf_counter()
    rpc.init_rpc("caller" if rank == 0 else _callee_name(rank), rank=rank,
                 world_size=world_size,
                 rpc_backend_options=_backend_options(rpc, spec, opts.num_worker_threads,
                                                      opts))
    record.data["init_s"] = time.perf_counter() - start
    record.data["rss_after_init_MB"] = peak_rss_mb()
    if rank == 0:
        turns = spec.get("turns")
        ctx = WorkerContext(rpc=rpc, autograd=mods["autograd"], optim=mods["optim"],
                            rpc_module_name=spec["system"]["rpc"], peer="callee",
                            options=opts, turns=Turns(turns) if turns else None,
                            peers=[_callee_name(r) for r in range(1, world_size)],
                            module_names=dict(spec["system"]["modules"]))
        results = record.data.setdefault("results", {})
        for workload in spec["workloads"]:
            record.data["workload"] = workload
            record.phase("workload")
            start = time.perf_counter()
            try:
                metrics, details = PAIR_RUNNERS[workload](ctx)
            except Exception as exc:  # this workload's error cell; the next one may work
                results[workload] = {"error": _describe(exc),
                                     "traceback": traceback.format_exc()}
            else:
                results[workload] = {"metrics": metrics, "details": details}
            results[workload]["seconds"] = time.perf_counter() - start
        del record.data["workload"]
    record.phase("shutdown")
    start = time.perf_counter()
    rpc.shutdown()
    record.data["shutdown_s"] = time.perf_counter() - start
    record.phase("done")
    _exit_barrier(store, world_size)


def run_scale(spec: dict[str, Any], mods: dict[str, ModuleType], opts: BenchOptions,
              record: Record) -> None:
    """One of N workers timing init, all-to-all and shutdown."""
    rpc = mods["rpc"]
    rank, world_size = spec["rank"], spec["world_size"]
    limit = spec["time_limit"]
    store = _connect(spec)
    record.phase("ready")
    _barrier(store, "ready", world_size, limit)

    record.phase("init")
    start = time.time()
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=_backend_options(rpc, spec, opts.scale_threads, opts))
    record.data["init"] = [start, time.time()]
    record.phase("init-barrier")
    _barrier(store, "inited", world_size, limit)

    record.phase("all_to_all")
    start = time.time()
    futs = [rpc.rpc_async(f"worker{peer}", torch.add, args=(torch.ones(2), 1))
            for peer in range(world_size) if peer != rank]
    for value in torch.futures.wait_all(futs):
        if not torch.equal(value, torch.full((2,), 2.0)):
            raise AssertionError(f"all-to-all call returned {value!r}")
    record.data["all_to_all"] = [start, time.time()]
    record.data["memory_after_all_to_all_MB"] = memory_mb()
    record.phase("all_to_all-barrier")
    _barrier(store, "called", world_size, limit)

    record.phase("shutdown")
    start = time.time()
    rpc.shutdown()
    record.data["shutdown"] = [start, time.time()]
    record.data["peak_rss_MB"] = peak_rss_mb()
    record.phase("done")
    _exit_barrier(store, world_size)


def begin(spec_path: str) -> Tuple[Dict[str, Any], "Record", BenchOptions]:
    """A worker's start: its spec, the time limit, the log, its record and options, and
    torch's threads as the options say (every worker of the bench, one host or two)."""
    with open(spec_path, encoding="utf-8") as spec_file:
        spec = json.load(spec_file)
    faulthandler.dump_traceback_later(spec["time_limit"], exit=True)
    # The systems' warnings and errors go to this rank's log, where the launcher looks.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s "
                        "%(name)s %(threadName)s: %(message)s")
    record = Record(spec["result_path"], spec["rank"])
    opts = BenchOptions.from_json(spec["options"])
    if opts.torch_threads:
        torch.set_num_threads(opts.torch_threads)
    record.data["torch_threads"] = torch.get_num_threads()
    return spec, record, opts


def main(argv: list[str]) -> int:
    """Run the worker described by the spec file ``argv[0]``; return the exit status."""
    spec, record, opts = begin(argv[0])
    try:
        record.phase("import")
        mods = {role: importlib.import_module(name)
                for role, name in spec["system"]["modules"].items()}
        record.data["memory_after_import_MB"] = memory_mb()
        if spec["kind"] == "pair":
            run_pair(spec, mods, opts, record)
        else:
            run_scale(spec, mods, opts, record)
    except BaseException as exc:  # anything, including SystemExit from the system
        record.fail(exc)
        traceback.print_exc()
        return 1
    return 0


def run_and_exit(main_fn: Callable[[list[str]], int]) -> None:
    """Run a worker's ``main_fn`` on the command line and exit with its status, skipping
    interpreter teardown: a system's leftover threads must not keep the worker alive."""
    status = main_fn(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    run_and_exit(main)
