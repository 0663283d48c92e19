"""Start test worker processes by forking one process that has already imported torch and
torchrpc, instead of starting a new interpreter for each (which spends seconds of a
2-core machine importing torch).

:func:`spawn` runs ``python -m MODULE ARGS`` with environment ``env`` in a child of the
forking process (the zygote) and returns a :class:`Forked`, which answers the part of
``subprocess.Popen`` the tests use: ``pid``, ``poll``, ``wait``, ``send_signal``, ``kill``,
``terminate``, ``returncode``, and with ``capture`` ``stdout`` and ``communicate``. The
child writes to the stdout and stderr the test process has when it asks (the descriptors
travel over the zygote's socket), so pytest captures its output as it captures a
subprocess's. The zygote starts on first use, runs no thread (a forked child starts from
a clean state), reaps its children and reports their exit statuses; it exits when the
test process closes its socket.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from typing import IO, Dict, List, Mapping, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Imported once in the zygote, before any fork.
PRELOAD = ("torch", "torchrpc.rpc", "torchrpc.autograd", "torchrpc.optim", "torchrpc.nn",
           "tests.support.group", "tests.support.thread_watch", "tests.support.helpers",
           "tests.support.robust")


class Forked:
    """A child of the zygote, with the ``subprocess.Popen`` methods the tests use."""

    def __init__(self, pid: int, stdout: Optional[IO[str]] = None) -> None:
        self.pid = pid
        self.stdout = stdout  # with ``capture``: the child's stdout and stderr, as text
        self.returncode: Optional[int] = None
        self._done = threading.Event()
        self._reader: Optional[threading.Thread] = None  # reads stdout for communicate()
        self._output = ""

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._done.set()

    def poll(self) -> Optional[int]:
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"forked worker {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def communicate(self, timeout: Optional[float] = None) -> Tuple[Optional[str], None]:
        """Read the captured output to its end and wait for the exit, as ``Popen``'s."""
        if self.stdout is None:
            self.wait(timeout)
            return None, None
        if self._reader is None:
            self._reader = threading.Thread(target=self._read_all, daemon=True)
            self._reader.start()
        self._reader.join(timeout)
        if self._reader.is_alive():
            raise subprocess.TimeoutExpired(f"forked worker {self.pid}", timeout or 0.0)
        self.wait(timeout)
        return self._output, None

    def _read_all(self) -> None:
        assert self.stdout is not None
        self._output = self.stdout.read()
        self.stdout.close()

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # as Popen: never signal a pid that may be reused
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class _Client:
    """The test process's end: one socket to the zygote and a thread reading its reports."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.zygote",
                                      str(theirs.fileno())],
                                     cwd=ROOT, env=env, pass_fds=[theirs.fileno()])
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()  # one spawn request at a time
        self.children: Dict[int, Forked] = {}
        self.early: Dict[int, int] = {}  # exits reported before the spawn's reply was read
        self.replies: List[int] = []
        self.cv = threading.Condition()
        threading.Thread(target=self._read, name="zygote-reports", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(4096)
            except OSError:
                data = b""
            if not data:
                with self.cv:
                    self.replies.append(-1)
                    self.cv.notify_all()
                return
            msg = json.loads(data)
            with self.cv:
                if "pid" in msg:
                    self.replies.append(msg["pid"])
                    self.cv.notify_all()
                    continue
                child = self.children.pop(msg["exit"], None)
                if child is None:
                    self.early[msg["exit"]] = msg["code"]
            if child is not None:
                child._exited(msg["code"])

    def spawn(self, module: str, args: Sequence[str], env: Mapping[str, str], cwd: str,
              capture: bool) -> Forked:
        request = json.dumps({"module": module, "args": list(args), "env": dict(env),
                              "cwd": cwd}).encode()
        out: Optional[IO[str]] = None
        with self.lock:
            sys.stdout.flush()
            sys.stderr.flush()
            if capture:
                r, w = os.pipe()
                try:
                    socket.send_fds(self.sock, [request], [w, w])
                finally:
                    os.close(w)
                out = open(r, encoding="utf-8", errors="replace")
            else:
                socket.send_fds(self.sock, [request], [1, 2])
            with self.cv:
                while not self.replies:
                    self.cv.wait()
                pid = self.replies.pop(0)
                if pid < 0:
                    raise RuntimeError("the test zygote exited; see its output above")
                child = Forked(pid, out)
                if pid in self.early:
                    child._exited(self.early.pop(pid))
                else:
                    self.children[pid] = child
        return child


_client: Optional[_Client] = None
_client_lock = threading.Lock()


def spawn(module: str, args: Sequence[str], env: Mapping[str, str], cwd: str = ROOT,
          capture: bool = False) -> Forked:
    """Run ``python -m module *args`` with exactly ``env`` as its environment, forked from
    the zygote (started on first use); with ``capture``, its stdout and stderr go to one
    pipe, read as ``.stdout`` or by ``communicate()``."""
    global _client
    with _client_lock:
        if _client is None or _client.proc.poll() is not None:
            _client = _Client()
        client = _client
    return client.spawn(module, args, env, cwd, capture)


# -- the zygote ------------------------------------------------------------------------------


def _serve(sock: socket.socket) -> Optional[dict]:
    """Fork a child per request and report exits; in a child, return its request."""
    import select
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    while True:
        while True:  # reap
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            code = os.waitstatus_to_exitcode(status)
            sock.send(json.dumps({"exit": pid, "code": code}).encode())
        try:
            ready, _, _ = select.select([sock, wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in ready:
            os.read(wake_r, 4096)
        if sock not in ready:
            continue
        data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
        if not data:
            return None  # the test process is gone
        request = json.loads(data)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (wake_r, wake_w):
                os.close(fd)
            sock.close()
            os.dup2(fds[0], 1)
            os.dup2(fds[1], 2)
            for fd in fds:
                os.close(fd)
            return request
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"pid": pid}).encode())


def _main() -> None:
    import importlib
    import runpy
    for name in PRELOAD:
        importlib.import_module(name)
    request = _serve(socket.socket(fileno=int(sys.argv[1])))
    if request is None:
        return
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = [request["module"], *request["args"]]
    # The child ends as the interpreter would after ``python -m``: atexit handlers run,
    # non-daemon threads are joined, SystemExit gives the status.
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _main()
