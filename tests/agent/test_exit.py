"""Every way a worker can end, in fresh interpreters: no process ends by a signal, none
prints ``terminate called``, and each exits with the code its program chose (see
torchrpc/_agent/process_exit.py and tests/support/exit_worker.py).

In CI each way runs once with torch's default threads and once with one torch thread.
``TORCHRPC_EXIT_REPEAT=N`` runs each N times instead (the full form: N=17 makes 204
groups, 408 worker processes) and prints the count of each way's runs and failures.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from typing import Dict, List, Tuple

import pytest

from tests.support.exit_worker import CODES, DIED

from ..support.group import free_port, start_module, worker_env

REPEAT = int(os.environ.get("TORCHRPC_EXIT_REPEAT", "1"))
TIMEOUT = 120
MODES = ["graceful", "local", "peer_died", "no_shutdown", "async_exit", "sigterm"]
THREADS = ["default", "1"]

Outcome = Tuple[int, int, str]  # rank, exit status (negative: the signal), output


def run_group(mode: str, threads: str, world: int = 2) -> List[Outcome]:
    """Start the ``world`` workers of ``mode``, wait for them; how each ended."""
    env = worker_env(free_port(), world)
    if threads == "default":
        env.pop("OMP_NUM_THREADS", None)  # torch's default: a thread per CPU
    procs = [start_module("tests.support.exit_worker", [mode, str(r), str(world), threads], env,
                          capture=True, fresh=True) for r in range(world)]
    outputs: Dict[int, List[str]] = {r: [] for r in range(world)}
    ready = [threading.Event() for _ in procs]

    def read(r: int) -> None:
        for line in procs[r].stdout:
            outputs[r].append(line)
            if line.startswith("READY"):
                ready[r].set()
        ready[r].set()  # ended (its output says how)
    readers = [threading.Thread(target=read, args=(r,), daemon=True) for r in range(world)]
    for t in readers:
        t.start()
    if mode == "sigterm":
        for r, p in enumerate(procs):
            ready[r].wait(TIMEOUT)
        time.sleep(0.3)  # calls go both ways now
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
    end = time.monotonic() + TIMEOUT
    for r, p in enumerate(procs):
        try:
            p.wait(max(end - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            outputs[r].append("\nTIMEOUT (killed)\n")
    for t in readers:
        t.join(10)
    return [(r, p.returncode, "".join(outputs[r])) for r, p in enumerate(procs)]


def expected_code(mode: str, rank: int) -> int:
    return DIED if mode == "peer_died" and rank == 1 else CODES[mode]


def problems(mode: str, threads: str, outcomes: List[Outcome]) -> List[str]:
    """What went wrong in one group's run: one line each, with the output's tail."""
    found = []
    for rank, code, out in outcomes:
        what = []
        if code < 0:
            what.append(f"ended by signal {-code}")
        elif code != expected_code(mode, rank):
            what.append(f"exit code {code}, not {expected_code(mode, rank)}")
        if "terminate called" in out:
            what.append("printed 'terminate called'")
        if "EXITING" not in out:
            what.append("did not reach its exit")
        if what:
            found.append(f"{mode}/{threads} rank {rank}: {', '.join(what)}\n{out[-3000:]}")
    return found


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("mode", MODES)
def test_every_way_to_end_exits_cleanly(mode, threads):
    failures, runs = [], 0
    for _ in range(REPEAT):
        outcomes = run_group(mode, threads)
        runs += len(outcomes)
        failures += problems(mode, threads, outcomes)
    if REPEAT > 1:
        print(f"\n{mode}/{threads}: {runs} worker processes, {len(failures)} failed")
    assert not failures, "\n\n".join(failures)


def test_a_thread_that_outlasts_the_exit_wait_is_named_and_the_code_kept():
    outcomes = run_group("stuck", "1")
    assert not problems("stuck", "1", outcomes)
    for rank, _, out in outcomes:
        # The pool thread that sleeps in the request's function, by name.
        assert "torchrpc threads still run at the interpreter's exit" in out, out[-3000:]
        assert f"torchrpc-w{rank}-" in out.split("interpreter's exit", 1)[1], out[-3000:]
        # The stop of its agent, at exit, said so first.
        assert f"threads of w{rank} still run after shutdown's wait" in out, out[-3000:]

