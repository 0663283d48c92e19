"""Same-host Unix sockets check who is at the other end (SO_PEERCRED): a name squatted by
another user is refused and reported, and another user's process cannot even start a
handshake on a worker's local socket."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import time

import pytest

from torchrpc import _wire
from torchrpc._transport import Transport, dial, handshake, sockets

from ..support.group import free_port, wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("runuser") is None,
                                reason="needs root to run a process as the user nobody")

# Runs as nobody with the system python: squat (bind) or dial the abstract name given in hex.
_AS_NOBODY = """
import socket, sys, time
name = bytes.fromhex(sys.argv[2])
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
if sys.argv[1] == "squat":
    s.bind(name); s.listen(8)
    print("ready", flush=True)
    time.sleep(60)
else:
    s.connect(name)
    s.settimeout(10)
    try:
        s.sendall(bytes.fromhex(sys.argv[3]))
        data = s.recv(100)
    except OSError:  # closed before or after the HELLO
        data = b""
    print("got", len(data), flush=True)
"""


def _nobody(*args: str) -> subprocess.Popen:
    # A session of its own: runuser waits for its python child, which _stop must end too.
    return subprocess.Popen(["runuser", "-u", "nobody", "--", "/usr/bin/python3", "-c",
                             _AS_NOBODY, *args], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)


def _stop(proc: subprocess.Popen, name: str) -> None:
    """Kill runuser and its child, and wait until the child's socket ``name`` is free: a
    squatter left behind would hold it (and so a TCP port's same-host socket) for later
    tests. The child dies after runuser, whose exit ``wait`` sees."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while True:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.bind(name)
            return
        except OSError:
            assert time.monotonic() < deadline, f"{name!r} still taken after the kill"
            time.sleep(0.01)
        finally:
            probe.close()


def _transport(port: int = 0) -> Transport:
    return Transport(0, b"s" * 32, _wire.Limits(), lambda c: None, lambda *a: None,
                     lambda c, why: None, "127.0.0.1", port=port, local_socket=True)


def _name(port: int) -> str:
    return sockets.local_name("127.0.0.1", port)


def _squat(port: int) -> subprocess.Popen:
    squatter = _nobody("squat", _name(port).encode().hex())
    assert squatter.stdout.readline().strip() == "ready"
    return squatter


def test_a_squatted_name_is_refused_by_the_dialer(caplog):
    port = free_port()
    squatter = _squat(port)
    try:
        with caplog.at_level(logging.ERROR, logger="torchrpc"):
            assert dial.connect_local("127.0.0.1", port, 5) is None
        assert f"held by process {squatter.pid}" in caplog.text or "not by this user" in caplog.text
        assert "squatter" in caplog.text
    finally:
        _stop(squatter, _name(port))
    # Stopped, it holds the name no more: a worker on that port gets its local socket.
    t = _transport(port)
    try:
        assert t._acceptor.local is not None
    finally:
        t.close()


def test_a_worker_whose_name_is_squatted_reports_it(caplog):
    port = free_port()
    squatter = _squat(port)
    try:
        with caplog.at_level(logging.ERROR, logger="torchrpc"):
            t = _transport(port)
        try:
            assert t._acceptor.local is None  # no local socket: same-host peers use TCP
            assert "is taken by another process" in caplog.text
        finally:
            t.close()
    finally:
        _stop(squatter, _name(port))


def test_another_user_cannot_start_a_handshake_on_the_local_socket(caplog):
    t = _transport()
    try:
        assert t._acceptor.local is not None
        hello = handshake.make_hello(1, 0)[0]
        with caplog.at_level(logging.WARNING, logger="torchrpc"):
            prober = _nobody("dial", sockets.local_name(*t.address).encode().hex(), hello.hex())
            out, _ = prober.communicate(timeout=30)
            wait_for("the refusal logged", lambda: "another user" in caplog.text, 5,
                     state=lambda: caplog.text)
        assert out.strip() == "got 0", out  # closed without a CHALLENGE
        assert f"uid {_uid_of('nobody')}" in caplog.text
        # This user's own processes still get a CHALLENGE there.
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(sockets.local_name(*t.address))
        s.sendall(hello)
        assert len(s.recv(handshake.CHALLENGE.size)) > 0
        s.close()
    finally:
        t.close()


def _uid_of(user: str) -> int:
    import pwd
    return pwd.getpwnam(user).pw_uid
