"""``python -m torchrpc.inspect`` with no secret given, on the host of a one-host group
started without one: it reads rank 0's secret file the way a worker does. The file lives
as long as rank 0's agent, private to its user; another user can neither read it nor
inspect the group; a file left by a killed group confuses no later group at the same
address; and a group that shares its secret through the store
(``TORCHRPC_INSECURE_SECRET_IN_STORE``) is inspected only with the same opt-in.

Every group here is 3 subprocesses started with no secret variable at all (run as
``python -m tests.rpc.test_inspect_secret_file member ...``)."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import stat
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

import pytest
import torch.distributed as dist

from torchrpc._rendezvous import rendezvous
from torchrpc._rendezvous.secret import SECRET_ENV, SECRET_FILE_ENV, VIA_STORE_ENV

from ..support.group import free_port, start_module, wait_for, worker_env
from ..support.nobody import needs_nobody, run_as_nobody

NAMES = ["worker0", "worker1", "worker2"]
# This module's own temporary directory, open to all like /tmp (mode 1777), where rank 0
# makes its private directory (no XDG_RUNTIME_DIR): what keeps another user out is
# torchrpc's own modes, and the tests never touch the user's real directory.
RUNTIME = tempfile.mkdtemp(prefix="torchrpc-tmp-")
os.chmod(RUNTIME, 0o1777)


def clean_env(port: int, **extra: str) -> Dict[str, str]:
    """A worker's (or the inspector's) environment with no secret given in any way."""
    env = worker_env(port, len(NAMES), {"TMPDIR": RUNTIME})
    for key in (SECRET_ENV, SECRET_FILE_ENV, VIA_STORE_ENV, "XDG_RUNTIME_DIR"):
        env.pop(key, None)
    env.update(extra)
    return env


class Job:
    """A one-host static group of 3 member processes, none of them this one."""

    def __init__(self, port: Optional[int] = None, init_method: Optional[str] = None,
                 **extra: str) -> None:
        self.port = port or free_port()
        self.init_method = init_method or f"tcp://127.0.0.1:{self.port}"
        self.stopfile = os.path.join(tempfile.mkdtemp(prefix="torchrpc-job-"), "stop")
        env = clean_env(self.port, **extra)
        self.procs = [start_module(__name__, ["member", name, str(rank), self.init_method,
                                              self.stopfile], env, capture=True)
                      for rank, name in enumerate(NAMES)]
        self.extra = extra

    def store(self) -> Any:
        """The group's store, as anyone who reaches it sees it."""
        if self.init_method.startswith("file://"):
            raw = dist.FileStore(self.init_method[len("file://"):], -1)
        else:
            raw = dist.TCPStore("127.0.0.1", self.port, is_master=False,
                                timeout=datetime.timedelta(seconds=30))
        return dist.PrefixStore(rendezvous.PREFIX, raw)

    def wait_joined(self) -> Dict[str, str]:
        """Wait until every member's init_rpc has returned; the secret's locator (a dict;
        empty for a group with the secret in the store)."""
        wait_for("all 3 members to join",
                 lambda: all(os.path.exists(f"{self.stopfile}.joined{r}")
                             for r in range(len(NAMES)))
                 or any(p.poll() is not None for p in self.procs), 120)
        assert all(p.poll() is None for p in self.procs), self.outputs()
        store = self.store()
        if not store.check(["secret_locator"]):
            return {}
        return json.loads(store.get("secret_locator"))

    def stop(self) -> List[int]:
        """Let every member shut down gracefully; their exit codes."""
        open(self.stopfile, "w").close()
        codes = []
        for p in self.procs:
            p.communicate(timeout=120)
            codes.append(p.returncode)
        return codes

    def kill(self) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGKILL)
        for p in self.procs:
            p.communicate(timeout=60)

    def outputs(self) -> str:
        return "\n".join(p.communicate(timeout=60)[0] for p in self.procs
                         if p.poll() is not None)

    def inspect(self, *args: str, **env: str) -> tuple:
        """``python -m torchrpc.inspect`` of this user, with no secret; (status, output)."""
        proc = start_module("torchrpc.inspect",
                            ["--init-method", self.init_method, "--timeout", "10", *args],
                            clean_env(self.port, **env), capture=True)
        out, _ = proc.communicate(timeout=120)
        return proc.returncode, out


def secret_path(locator: Dict[str, str]) -> str:
    return os.path.join(locator["dir"], locator["file"])


def rows(out: str) -> Dict[str, int]:
    """The workers of a ``--json`` output: name -> pid."""
    doc = json.loads(out)
    return {w["name"]: w["pid"] for w in doc["workers"]}


@pytest.fixture(scope="module", autouse=True)
def runtime_dir():
    yield RUNTIME
    shutil.rmtree(RUNTIME, ignore_errors=True)


@pytest.fixture(scope="module")
def job():
    j = Job()
    try:
        yield j
    finally:
        if any(p.poll() is None for p in j.procs):
            j.kill()


def test_the_inspector_reads_the_secret_file_of_a_group_started_without_one(job):
    locator = job.wait_joined()
    path = secret_path(locator)
    # Private: a 0600 regular file of this user in a 0700 directory of this user, named
    # for the process that made it (rank 0).
    st, dst = os.lstat(path), os.lstat(locator["dir"])
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
    assert stat.S_ISDIR(dst.st_mode) and stat.S_IMODE(dst.st_mode) == 0o700, oct(dst.st_mode)
    assert st.st_uid == dst.st_uid == os.geteuid()
    assert locator["dir"] == os.path.join(RUNTIME, f"torchrpc-{os.geteuid()}")
    assert f"-{job.procs[0].pid}-" in locator["file"]
    code, out = job.inspect("--json")
    assert code == 0, out
    assert rows(out) == {name: p.pid for name, p in zip(NAMES, job.procs)}
    code, out = job.inspect()
    assert code == 0, out
    for name in NAMES:
        assert f"\n{name} " in out, out
    assert os.path.exists(path)  # inspecting changes nothing


@needs_nobody
def test_another_user_can_neither_read_the_file_nor_inspect_the_group(job):
    path = secret_path(job.wait_joined())
    script = ("import sys\n"
              "try:\n"
              f"    open({path!r}, 'rb').read()\n"
              "except PermissionError:\n"
              "    print('DENIED')\n"
              "else:\n"
              "    print('READ')\n"
              "sys.stdout.flush()\n"
              "from torchrpc.inspect import main\n"
              f"sys.exit(main(['--init-method', {job.init_method!r}, '--timeout', '10']))\n")
    start = time.monotonic()
    out = run_as_nobody(script, {})
    assert out.stdout.startswith("DENIED\n"), out
    assert out.returncode == 2, out
    assert "no job secret" in out.stderr and SECRET_ENV in out.stderr, out
    # The private directory of rank 0's user, in a directory open to all.
    assert f"({os.path.dirname(path)}): [Errno 13] Permission denied" in out.stderr, out
    assert not any(name in out.stdout for name in NAMES), out  # it learned nothing
    assert time.monotonic() - start < 60


def test_a_graceful_shutdown_removes_the_file(job):
    path = secret_path(job.wait_joined())
    assert os.path.exists(path)
    assert job.stop() == [0, 0, 0], job.outputs()
    assert not os.path.exists(path)
    assert not os.listdir(os.path.dirname(path))


def test_a_killed_group_at_an_address_confuses_no_later_group_there():
    first = Job()
    stale = secret_path(first.wait_joined())
    first.kill()
    assert os.path.exists(stale)  # SIGKILL skips every cleanup
    code, out = first.inspect()
    assert code == 2 and "no rendezvous store reachable" in out, out
    second = Job(port=first.port)  # the same MASTER_ADDR and MASTER_PORT
    try:
        locator = second.wait_joined()
        assert secret_path(locator) != stale
        assert not os.path.exists(stale)  # the next rank 0 of this user removed it
        code, out = second.inspect("--json")
        assert code == 0, out
        assert rows(out) == {name: p.pid for name, p in zip(NAMES, second.procs)}
    finally:
        assert second.stop() == [0, 0, 0], second.outputs()
    assert not os.path.exists(secret_path(locator))


def test_a_stale_file_store_is_refused_clearly_then_taken_over(tmp_path):
    # A file:// store outlives a killed group, and with it the locator of the dead rank
    # 0's secret file: no one may use that secret.
    init_method = f"file://{tmp_path / 'store'}"
    first = Job(init_method=init_method)
    stale = secret_path(first.wait_joined())
    first.kill()
    assert os.path.exists(stale)
    start = time.monotonic()
    code, out = first.inspect()
    assert code == 2, out
    assert "no job secret" in out and "has ended" in out and "killed" in out, out
    assert time.monotonic() - start < 60
    second = Job(init_method=init_method)
    try:
        locator = second.wait_joined()
        assert secret_path(locator) != stale and not os.path.exists(stale)
        code, out = second.inspect("--json")
        assert code == 0, out
        assert rows(out) == {name: p.pid for name, p in zip(NAMES, second.procs)}
    finally:
        assert second.stop() == [0, 0, 0], second.outputs()


def test_a_group_with_its_secret_in_the_store_is_inspected_with_the_same_opt_in():
    job = Job(**{VIA_STORE_ENV: "1"})
    try:
        assert job.wait_joined() == {}  # no secret file: the secret is in the store
        code, out = job.inspect()
        assert code == 2, out
        assert "no job secret" in out and f"{VIA_STORE_ENV}=1" in out, out
        assert not any(f"\n{name} " in out for name in NAMES), out
        code, out = job.inspect("--json", **{VIA_STORE_ENV: "1"})
        assert code == 0, out
        assert rows(out) == {name: p.pid for name, p in zip(NAMES, job.procs)}
    finally:
        assert job.stop() == [0, 0, 0], job.outputs()


def member(name: str, rank: str, init_method: str, stopfile: str) -> None:
    """A member of a group here: join with no secret given, serve until ``stopfile``
    exists, shut down gracefully."""
    import torchrpc.rpc as rpc
    from tests.support.group import exit_fast
    rpc.init_rpc(name, rank=int(rank), world_size=len(NAMES),
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                     num_worker_threads=2, rpc_timeout=60, init_method=init_method))
    open(f"{stopfile}.joined{rank}", "w").close()
    while not os.path.exists(stopfile):
        time.sleep(0.05)
    rpc.shutdown()
    exit_fast()


if __name__ == "__main__" and sys.argv[1:2] == ["member"]:
    member(*sys.argv[2:6])
