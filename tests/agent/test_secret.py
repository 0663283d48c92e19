"""The job secret never travels through the rendezvous store, and no other user can read
the file that shares it between the workers of one host."""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import stat
import subprocess
import tempfile

import pytest
import torch.distributed as dist

import torchrpc.rpc as rpc
from torchrpc._agent import current
from torchrpc._rendezvous import secret
from torchrpc.errors import RendezvousError
from torchrpc.rpc import api

from ..support.group import running_group


@pytest.fixture
def private_runtime(tmp_path, monkeypatch):
    """A fresh XDG_RUNTIME_DIR, so the tests never touch the real per-user directory."""
    base = tmp_path / "run"
    base.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
    monkeypatch.delenv(secret.SECRET_ENV, raising=False)
    monkeypatch.delenv(secret.SECRET_FILE_ENV, raising=False)
    monkeypatch.setattr(current.handle, "launcher_secret", None)
    return base


def _source(**fields):
    """The secret source of an init_rpc with these options, in this environment."""
    _, plan = api._read_environment(rpc.TensorPipeRpcBackendOptions(**fields))
    return plan.secret


def test_launcher_secret_is_checked_and_leaves_the_environment(private_runtime, monkeypatch):
    monkeypatch.setenv(secret.SECRET_ENV, "short")
    with pytest.raises(RendezvousError, match="at least 32"):
        secret.launcher_secret(_source())
    value = "a" * 40
    monkeypatch.setenv(secret.SECRET_ENV, value)
    assert secret.launcher_secret(_source()) == value.encode()
    assert secret.SECRET_ENV not in os.environ  # child processes don't inherit it
    assert secret.launcher_secret(_source()) == value.encode()  # a second init_rpc still has it
    assert value not in repr(_source()) and value not in repr(
        rpc.TensorPipeRpcBackendOptions(secret=value))
    other = "c" * 40  # the option wins over the variable
    assert secret.launcher_secret(_source(secret=other)) == other.encode()


def test_secret_file_must_be_private(private_runtime, monkeypatch, tmp_path):
    path = tmp_path / "job.secret"
    path.write_text("b" * 32 + "\n")
    path.chmod(0o644)
    monkeypatch.setenv(secret.SECRET_FILE_ENV, str(path))
    with pytest.raises(RendezvousError, match="chmod 600"):
        secret.launcher_secret(_source())
    path.chmod(0o600)
    assert secret.launcher_secret(_source()) == b"b" * 32


def test_an_opened_up_runtime_directory_is_passed_over(private_runtime, monkeypatch, tmp_path,
                                                       caplog):
    squat = private_runtime / "torchrpc"
    squat.mkdir()
    squat.chmod(0o777)  # as if another user had created it first
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)
    (tmp / f"torchrpc-{os.geteuid()}").symlink_to(squat)  # and the fallback too
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setattr(secret, "_fallback", [])
    caplog.set_level(logging.WARNING, logger="torchrpc")
    path = secret.runtime_dir()
    assert os.path.dirname(path) == str(tmp) and os.path.basename(path).startswith(
        f"torchrpc-{os.geteuid()}-")
    st = os.lstat(path)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "its mode is 0777" in said and "it is a symlink" in said
    assert secret.runtime_dir() == path  # one directory for the process
    value, locator = secret.create_local("h")
    try:
        assert json.loads(locator)["dir"] == path
        assert secret.read_local(locator, "h") == value
        squat.chmod(0o700)
        os.rename(path, path + ".moved")  # a symlink in its place is refused
        os.symlink(path + ".moved", path)
        with pytest.raises(RendezvousError, match="Not a directory"):
            secret.read_local(locator, "h")
    finally:
        os.unlink(path)
        os.rename(path + ".moved", path)
        secret.discard_local()


def test_another_host_is_told_how_to_provide_a_secret(private_runtime):
    _, locator = secret.create_local("host-a")
    try:
        with pytest.raises(RendezvousError, match=secret.SECRET_ENV) as info:
            secret.read_local(locator, "host-b")
        assert secret.SECRET_FILE_ENV in str(info.value)
        assert secret.read_local(locator, "host-a")  # same host, same user: readable
    finally:
        secret.discard_local()


def test_a_file_whose_maker_ended_is_refused_and_swept(private_runtime, caplog):
    # Secret files that a killed rank 0 left: its pid is gone, or reused by another process
    # (another start time). No reader uses them; the next rank 0 of this user removes them.
    caplog.set_level(logging.INFO, logger="torchrpc")
    gone = _ended_pid()
    value, locator = secret.create_local("h")
    directory, name = json.loads(locator)["dir"], json.loads(locator)["file"]
    ns, pid, start, token = name[len("job-"):].split("-")
    assert (int(pid), int(ns)) == (os.getpid(), os.stat("/proc/self/ns/pid").st_ino)
    stale = {"ended": f"job-{ns}-{gone}-{start}-{token}",
             "reused": f"job-{ns}-{pid}-{int(start) + 1}-{token}"}
    kept = {"kept": f"job-{token}",  # a dynamic group's, made to outlive its maker
            "other pid namespace": f"job-{int(ns) + 1}-{gone}-{start}-{token}"}
    try:
        for what, other in {**stale, **kept}.items():
            fd = os.open(os.path.join(directory, other), os.O_WRONLY | os.O_CREAT, 0o600)
            os.write(fd, b"s" * 64)
            os.close(fd)
            where = json.dumps({"host": "h", "dir": directory, "file": other})
            if what in stale:
                with pytest.raises(RendezvousError, match=r"has ended: it is left from a job "
                                                          r"that was killed"):
                    secret.read_local(where, "h")
            else:
                assert secret.read_local(where, "h") == b"s" * 64, what
        assert secret.read_local(locator, "h") == value  # its maker runs: this process
        secret.create_local("h")
        left = set(os.listdir(directory))
        assert not left & set(stale.values()) and set(kept.values()) <= left, left
        assert name in left
        assert f"removed the stale secret file {os.path.join(directory, stale['ended'])}" \
            in caplog.text
    finally:
        secret.discard_local()
        for other in kept.values():
            os.unlink(os.path.join(directory, other))
    assert not os.listdir(directory)


@pytest.mark.parametrize("keep", [False, True])
def test_a_second_rank_0_takes_the_first_ones_secret_and_leaves_no_file(private_runtime, keep):
    # A duplicate rank 0, or rank 0 rejoining a dynamic group: it uses the secret already
    # shared, and removes the file it made for nothing (kept or not).
    store = dist.HashStore()
    first = secret._create_shared(store, "h", keep)
    directory = json.loads(store.get(secret.LOCATOR_KEY))["dir"]
    assert len(os.listdir(directory)) == 1
    try:
        assert secret._create_shared(store, "h", keep) == first
        assert len(os.listdir(directory)) == 1
    finally:
        secret.discard_local()
        if keep:
            os.unlink(os.path.join(directory, os.listdir(directory)[0]))
    assert not os.listdir(directory)


def _ended_pid() -> int:
    """The pid of a process that has ended (and was reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("runuser") is None,
                    reason="needs root to run a probe as the user nobody")
def test_another_user_cannot_read_the_shared_secret(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)  # the real default: /tmp/torchrpc-<uid>
    value, locator = secret.create_local("h")
    path = os.path.join(secret.runtime_dir(), json.loads(locator)["file"])
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(secret.runtime_dir()).st_mode) == 0o700
        # The system python, no torch: the probe only tries to read the file.
        probe = ("import sys\n"
                 "try:\n    open(sys.argv[1], 'rb').read()\nexcept PermissionError:\n"
                 "    print('denied')\nelse:\n    print('READ')\n")
        out = subprocess.run(["runuser", "-u", "nobody", "--", "/usr/bin/python3", "-c", probe,
                              path], capture_output=True, text=True, timeout=60)
        assert out.stdout.strip() == "denied", out
    finally:
        secret.discard_local()
    assert not os.path.exists(path)


def test_the_store_holds_no_secret():
    with running_group(2, threads=2, timeout=30.0) as g:
        # What anyone who reaches the store's port sees.
        store = dist.PrefixStore("torchrpc", dist.TCPStore(
            "127.0.0.1", g.port, is_master=False, timeout=datetime.timedelta(seconds=10)))
        job_secret = api.current_agent()._transport._secret
        assert not store.check(["secret"]) and not store.check(["insecure_secret"])
        locator = store.get("secret_locator").decode()
        assert job_secret.decode() not in locator
        # Rank 0 keeps the file while it runs (for the inspector), private to this user.
        where = json.loads(locator)
        path = os.path.join(where["dir"], where["file"])
        st = os.lstat(path)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_uid == os.geteuid()
    assert not os.path.exists(path)  # removed when rank 0 shut down
