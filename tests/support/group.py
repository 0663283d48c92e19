"""Start a group of real worker processes for a test module.

The pytest process is rank 0 of the group, so tests call the RPC API directly.
Ranks 1..n-1 are subprocesses running ``tests.support.worker_main``: they
``init_rpc`` and then wait in a graceful ``shutdown()``, serving requests until rank 0
shuts down too.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from benchmarks.ports import free_port  # noqa: F401 - the tests' one way to pick a port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def worker_env(port: int, world_size: int, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
               PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    if extra:
        env.update(extra)
    return env


FORK_ENV = "TORCHRPC_TEST_FORK"  # "0": start group members as new interpreters


def start_module(module: str, args: List[str], env: Dict[str, str], capture: bool = False,
                 fresh: bool = False, prefix: Sequence[str] = ()) -> Any:
    """``python -m module *args`` with environment ``env``: forked from the test zygote
    (``tests.support.zygote``, which has imported torch once for all), or a new interpreter where
    ``TORCHRPC_TEST_FORK=0``, with ``fresh`` (a process whose memory must be its own) or
    with a command ``prefix`` (``ip netns exec NS``: a worker in another network). Either
    answers ``subprocess.Popen``'s pid, poll, wait, send_signal and kill; with
    ``capture``, also ``stdout`` (text, stderr merged in) and ``communicate``. Every test
    starts its worker processes here."""
    if fresh or prefix or os.environ.get(FORK_ENV, "1") == "0":
        pipes: Dict[str, Any] = (dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                                 if capture else {})
        return subprocess.Popen([*prefix, sys.executable, "-m", module, *args], cwd=ROOT,
                                env=env, **pipes)
    from tests.support import zygote
    return zygote.spawn(module, args, env, ROOT, capture)


OPTIONS_ENV = "TORCHRPC_TEST_OPTIONS"  # JSON: extra keyword arguments of the options
BACKEND_ENV = "TORCHRPC_TEST_BACKEND"  # a backend name, e.g. FAULTY_TENSORPIPE


def backend_and_options(threads: int, timeout: float, env: Mapping[str, str]) -> Tuple[Any, Any]:
    """The backend and options a group member uses, from the two variables above."""
    import torchrpc.rpc as rpc
    extra = json.loads(env.get(OPTIONS_ENV) or "{}") or {}
    name = env.get(BACKEND_ENV) or "TENSORPIPE"
    if name == "FAULTY_TENSORPIPE":
        from torchrpc._testing import faulty
        opts = faulty.FaultyTensorPipeRpcBackendOptions(
            num_worker_threads=threads, rpc_timeout=timeout, **extra)
    else:
        opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=threads, rpc_timeout=timeout,
                                               **extra)
    return rpc.BackendType[name], opts


class Group:
    """Subprocess workers of one group; rank 0 is the caller's process.

    ``options`` (extra keyword arguments of the backend options, JSON-able) and
    ``backend`` (a backend name) apply to every member; ``self_options`` and
    ``self_backend``, when given, replace them for rank 0 only. ``fresh`` starts the
    members as new interpreters (a child forked from a process that has touched CUDA
    cannot use CUDA).
    """

    def __init__(self, world_size: int, threads: int = 4, timeout: float = 60.0,
                 extra_env: Optional[Dict[str, str]] = None, names: Optional[List[str]] = None,
                 options: Optional[Dict[str, Any]] = None, backend: Optional[str] = None,
                 self_options: Optional[Dict[str, Any]] = None,
                 self_backend: Optional[str] = None, fresh: bool = False) -> None:
        self.world_size = world_size
        self.port = free_port()
        self.threads = threads
        self.timeout = timeout
        self.names = names or [f"worker{r}" for r in range(world_size)]
        extra_env = dict(extra_env or {})
        if options:
            extra_env[OPTIONS_ENV] = json.dumps(options)
        if backend:
            extra_env[BACKEND_ENV] = backend
        self.self_env = {OPTIONS_ENV: json.dumps(options if self_options is None else self_options),
                         BACKEND_ENV: (self_backend or backend or "")}
        env = worker_env(self.port, world_size, extra_env)
        self.procs: Dict[int, Any] = {}
        for r in range(1, world_size):
            self.procs[r] = start_module("tests.support.worker_main",
                                         [self.names[r], str(r), str(world_size), str(threads),
                                          str(timeout)], env, fresh=fresh)

    def init_self(self) -> None:
        import torchrpc.rpc as rpc
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port))
        backend, opts = backend_and_options(self.threads, self.timeout, self.self_env)
        rpc.init_rpc(self.names[0], backend=backend, rank=0, world_size=self.world_size,
                     rpc_backend_options=opts)

    def kill(self, rank: int) -> None:
        self.procs[rank].send_signal(signal.SIGKILL)
        self.procs[rank].wait()

    def abandon(self, timeout: float = 30.0) -> Dict[int, int]:
        """After a fault: stop rank 0 here at once (if still up) and reap the subprocesses."""
        import torchrpc.rpc as rpc
        from torchrpc._agent.current import handle
        if handle.agent is not None:
            rpc.shutdown(graceful=False)
        return self.wait(timeout)

    def stop_serving_and_abandon(self, timeout: float = 30.0,
                                 within: float = 20.0) -> Dict[int, int]:
        """For a group started with ``TORCHRPC_TEST_SERVE``: tell each subprocess still up to
        stop serving, then :meth:`abandon`; return the exit codes. A stopped process is
        continued first; one continued after SIGSTOP may take a moment to answer (rank 0
        declared it lost and connects to it again for only heartbeat_timeout), so the call
        is repeated while it runs, for ``within`` s; one that never answers is left to
        :meth:`wait`."""
        import torchrpc.rpc as rpc
        from . import helpers
        for r, p in self.procs.items():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
            deadline = time.monotonic() + within
            while p.poll() is None:
                try:
                    rpc.rpc_sync(f"worker{r}", helpers.stop_serving, timeout=10)
                    break
                except Exception as exc:  # noqa: BLE001 - said, and the exit codes are checked
                    print(f"worker{r} did not take stop_serving: {exc!r}", file=sys.stderr)
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
        return self.abandon(timeout)

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


@contextlib.contextmanager
def serving_group(world_size: int, codes: Dict[int, int], heartbeat_timeout: float = 2.0,
                  before_stop: Optional[Callable[[Group], None]] = None,
                  **kwargs: Any) -> Iterator[Group]:
    """A group for a module that kills or stops some of its workers: they serve until told
    to stop (``TORCHRPC_TEST_SERVE``) rather than leave in a graceful shutdown that a lost
    worker would fail. Init rank 0 here and yield; then ``before_stop(group)``,
    :meth:`Group.stop_serving_and_abandon`, and check that the subprocesses exited with
    ``codes`` (rank: exit status, negative for a signal). ``kwargs`` go to :class:`Group`
    (``threads`` 4 and ``timeout`` 0, no RPC timeout, unless given)."""
    options = {"heartbeat_timeout": heartbeat_timeout, **kwargs.pop("options", {})}
    extra_env = {"TORCHRPC_TEST_SERVE": "1", **kwargs.pop("extra_env", {})}
    kwargs = {"threads": 4, "timeout": 0.0, **kwargs}
    group = Group(world_size, options=options, extra_env=extra_env, **kwargs)
    try:
        group.init_self()
        yield group
        if before_stop is not None:
            before_stop(group)
    finally:
        got = group.stop_serving_and_abandon(60)
    assert got == codes, got


def sigstop(pid: int, limit: float = 10.0) -> None:
    """SIGSTOP process ``pid`` and return once every thread of it is stopped: ``kill()``
    returns before a thread running on another CPU has stopped, and a request sent in
    between could still be answered."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + limit
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:
                continue  # a thread that ended meanwhile
        if all(state in ("T", "t", "Z", "X") for state in states):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} not stopped after {limit:g} s: {states}")
        time.sleep(0.001)


def wait_for(what: str, check: Callable[[], Any], limit: float,
             state: Optional[Callable[[], Any]] = None) -> float:
    """Poll ``check`` until true; how long it took; fail naming ``what`` after ``limit``,
    with ``state()`` in the message when given."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > limit:
            seen = "" if state is None else f"; {state()!r}"
            raise AssertionError(f"{what}: not after {limit:g} s{seen}")
        time.sleep(0.05)
    return time.monotonic() - start


def exit_fast() -> None:
    """Exit with 0, skipping the interpreter's teardown of torch (about a second per
    worker, which every group waits for); atexit handlers still run (torchrpc's removes
    a secret file)."""
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    os._exit(0)
