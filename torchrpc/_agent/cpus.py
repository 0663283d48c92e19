"""The CPUs of this host, and torch's OpenMP threads on a host with too few of them.

Theory of operation (``SpinGuard``). torch runs its intra-op work on OpenMP teams. With
libgomp (torch's Linux wheels), the threads of a team busy-wait for the next parallel
region after each one, for 300,000 polls, unless the process runs more OpenMP threads
than the host has CPUs; then for 1,000. libgomp counts the threads of its own process
only. Where the workers of a host together run more torch threads than it has CPUs
(torch's default: one per CPU in every worker), each worker that computes on one thread
thinks it has the CPUs to itself, and its waiting threads take the CPUs the other
workers compute and reply on. So on such a host, unless the user chose a wait policy
(``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``), the agent parks one more team: a thread of its
own runs a single parallel region and then sleeps, its team's threads with it, and
libgomp, counting them, waits briefly. The thread ends with the agent (a stop hook),
and its team then too, or at the interpreter's exit, where it is stopped and joined
before the interpreter finalizes (``_threads.join_all``): a thread that comes back from
torch's C++ code after that is ended by an unwind that aborts the process. See
docs/design.md, "OpenMP on a crowded host".
"""

from __future__ import annotations

import os
import threading
import time
from typing import Optional

import torch

from .. import _threads
from .._threads import Guard, start

# Elements per thread of the parked region: above torch's grain size, so that it runs
# in parallel on every thread.
_REGION_PER_THREAD = 1 << 16


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def libgomp_spins() -> bool:
    """Whether torch's OpenMP runtime here is libgomp with its default wait policy."""
    if os.environ.get("OMP_WAIT_POLICY") or os.environ.get("GOMP_SPINCOUNT"):
        return False
    try:
        with open("/proc/self/maps") as maps:
            return any("libgomp" in line for line in maps)
    except OSError:
        return False


class SpinGuard:
    """One agent's parked OpenMP team, started while its host is crowded (module docs)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._end = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._applies: Optional[bool] = None  # libgomp_spins(), once asked

    @property
    def parked(self) -> bool:
        """Whether a team is parked."""
        return self._thread is not None

    def check(self, workers: int, threads: Optional[int] = None,
              cpus: Optional[int] = None) -> None:
        """Timer: park a team if ``workers`` workers of ``threads`` torch threads each
        (default: this process's) outnumber the host's ``cpus`` (default: usable here)."""
        if self._thread is not None or self._applies is False or self._end.is_set():
            return
        threads = torch.get_num_threads() if threads is None else threads
        cpus = usable_cpus() if cpus is None else cpus
        if threads < 2 or threads * max(workers, 1) <= cpus:
            return
        if self._applies is None:
            self._applies = libgomp_spins()
            if not self._applies:
                return
        # A guard stopped meanwhile starts a thread that ends at once (_hold); the
        # interpreter's exit ends it too (a guard of no agent, or one never stopped).
        try:
            self._thread = start(self._name, Guard(f"the OpenMP team of {self._name}"),
                                 self._hold, threads, stop=self._end.set)
        except RuntimeError:  # the interpreter exits: no team now
            self._applies = False

    def _hold(self, threads: int) -> None:
        if not self._end.is_set():
            torch.ones(threads * _REGION_PER_THREAD).add_(1)  # this thread's team starts here
        self._end.wait()

    def stop(self, until: Optional[float] = None) -> None:
        """The agent stops: end the thread, and with it its team, waiting for it no later
        than ``until`` (a ``time.monotonic()``; by default 5 s from now)."""
        self._end.set()
        thread, self._thread = self._thread, None
        _threads.join([thread], time.monotonic() + 5.0 if until is None else until)
