"""SpinGuard: an OpenMP team parked while a host's workers run more torch threads than
it has CPUs, so that libgomp's threads wait briefly (see torchrpc/_agent/cpus.py)."""

import os
import subprocess
import sys
import threading

import pytest
import torch

from torchrpc._agent import cpus
from torchrpc._agent.cpus import SpinGuard

from ..support.group import ROOT, free_port, wait_for


def _tasks() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_no_team_where_the_cpus_suffice_or_one_thread_computes(monkeypatch):
    monkeypatch.setattr(cpus, "libgomp_spins", lambda: True)
    guard = SpinGuard("torchrpc-omp-test")
    guard.check(2, threads=2, cpus=4)  # 4 threads on 4 CPUs
    guard.check(4, threads=1, cpus=2)  # one thread per worker: no team to wait
    assert not guard.parked


def test_a_chosen_wait_policy_is_left_alone(monkeypatch):
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.setenv(name, "1000" if name == "GOMP_SPINCOUNT" else "PASSIVE")
        assert not cpus.libgomp_spins()
        guard = SpinGuard("torchrpc-omp-test")
        guard.check(2, threads=2, cpus=2)
        assert not guard.parked
        monkeypatch.delenv(name)


@pytest.mark.skipif(not cpus.libgomp_spins(), reason="torch here does not run on libgomp")
def test_a_crowded_host_parks_a_team_until_the_agent_stops(two_threads):
    guard = SpinGuard("torchrpc-omp-test")
    before = _tasks()
    guard.check(2, threads=2, cpus=2)  # two workers of two threads on two CPUs
    assert guard.parked
    # The thread and its team's second thread, which sleep on.
    wait_for("the parked team", lambda: _tasks() >= before + 2, 10, state=_tasks)
    assert "torchrpc-omp-test" in [t.name for t in threading.enumerate()]
    guard.check(2, threads=2, cpus=2)  # once is enough
    assert _tasks() <= before + 2
    guard.stop()
    assert not guard.parked
    assert "torchrpc-omp-test" not in [t.name for t in threading.enumerate()]
    wait_for("the team's end", lambda: _tasks() <= before, 10, state=_tasks)
    guard.check(2, threads=2, cpus=2)  # stopped for good
    assert not guard.parked


_EXIT_AT_ONCE = """
import torch
torch.set_num_threads(2)
from torchrpc._agent.cpus import SpinGuard
SpinGuard("torchrpc-omp-exit").check(2, threads=2, cpus=2)
"""


@pytest.mark.skipif(not cpus.libgomp_spins(), reason="torch here does not run on libgomp")
def test_a_process_that_exits_while_its_team_starts_exits_cleanly():
    # Without the stop at exit, the parked thread comes back from torch's C++ code after
    # the interpreter began to finalize, and the unwind that ends it aborts the process.
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", _EXIT_AT_ONCE], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]


_CHECK_AFTER_EXIT = """
import atexit, torch
torch.set_num_threads(2)

def tick_late():
    # As an agent's timer may, in a program that never shut its agent down: after
    # torchrpc's exit handler ran, while the interpreter exits.
    guard.check(2, threads=2, cpus=2)
    print("parked" if guard.parked else "not parked", flush=True)

atexit.register(tick_late)  # before torchrpc's handler is registered: runs after it
from torchrpc._agent.cpus import SpinGuard
guard = SpinGuard("torchrpc-omp-late")
"""


@pytest.mark.skipif(not cpus.libgomp_spins(), reason="torch here does not run on libgomp")
def test_no_team_is_parked_once_the_process_exits():
    done = subprocess.run([sys.executable, "-c", _CHECK_AFTER_EXIT], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "not parked"


_NOPARK = """
import torch
from torchrpc._agent import cpus
from torchrpc.rpc import api
import benchmarks.variants.nopark as variant
guard = cpus.SpinGuard("torchrpc-omp-probe")
guard.check(2, threads=2, cpus=2)
parked_before = guard.parked
guard.stop()
variant.init_rpc("w", rank=0, world_size=1)
omp = api._get_current_rpc_agent().omp
omp.check(2, threads=2, cpus=2)  # as crowded as it gets: two workers of two threads
print(parked_before, omp.parked)
variant.shutdown()
"""


@pytest.mark.skipif(not cpus.libgomp_spins(), reason="torch here does not run on libgomp")
def test_the_benchmarks_nopark_variant_parks_no_team():
    # benchmarks/variants/nopark.py, the system without the team that BENCHMARKS.md compares.
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               PYTHONPATH=ROOT)
    env.pop("GOMP_SPINCOUNT", None)
    env.pop("OMP_WAIT_POLICY", None)
    done = subprocess.run([sys.executable, "-c", _NOPARK], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "False"], done.stdout
