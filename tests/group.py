"""Start a group of real worker processes for a test module.

The pytest process is rank 0 of the group, so tests call the RPC API directly.
Ranks 1..n-1 are subprocesses running ``tests.worker_main``: they ``init_rpc``
and then wait in a graceful ``shutdown()``, serving requests until rank 0 shuts
down too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, Iterator, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(port: int, world_size: int, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
               PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    if extra:
        env.update(extra)
    return env


class Group:
    """Subprocess workers of one group; rank 0 is the caller's process."""

    def __init__(self, world_size: int, threads: int = 4, timeout: float = 60.0,
                 extra_env: Optional[Dict[str, str]] = None, names: Optional[List[str]] = None) -> None:
        self.world_size = world_size
        self.port = free_port()
        self.threads = threads
        self.timeout = timeout
        self.names = names or [f"worker{r}" for r in range(world_size)]
        env = worker_env(self.port, world_size, extra_env)
        self.procs: Dict[int, subprocess.Popen] = {}
        for r in range(1, world_size):
            self.procs[r] = subprocess.Popen(
                [sys.executable, "-m", "tests.worker_main", self.names[r], str(r), str(world_size),
                 str(threads), str(timeout)],
                cwd=ROOT, env=env)

    def init_self(self) -> None:
        import torchrpc.rpc as rpc
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port))
        opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=self.threads,
                                               rpc_timeout=self.timeout)
        rpc.init_rpc(self.names[0], rank=0, world_size=self.world_size, rpc_backend_options=opts)

    def kill(self, rank: int) -> None:
        self.procs[rank].send_signal(signal.SIGKILL)
        self.procs[rank].wait()

    def wait(self, timeout: float = 60.0) -> Dict[int, int]:
        """Wait for every subprocess; kill what is left after ``timeout``; return exit codes."""
        deadline = time.monotonic() + timeout
        codes = {}
        for r, p in self.procs.items():
            try:
                codes[r] = p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                codes[r] = p.wait()
        return codes


@contextlib.contextmanager
def running_group(world_size: int, **kwargs: object) -> Iterator[Group]:
    """Start the group, init rank 0 here, yield; then shut down gracefully and reap."""
    import torchrpc.rpc as rpc
    group = Group(world_size, **kwargs)
    try:
        group.init_self()
    except BaseException:
        group.wait(1)
        raise
    try:
        yield group
    finally:
        rpc.shutdown()
        codes = group.wait()
        assert all(c == 0 for c in codes.values()), f"workers exited with {codes}"
