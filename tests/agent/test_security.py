"""Hostile peers: nothing is unpickled before authentication, bad frames close only their
own connection (with a logged reason), and the listener is not on every interface."""

from __future__ import annotations

import logging
import os
import socket
import struct

import pytest

import torchrpc.rpc as rpc
from torchrpc import _wire
from torchrpc._rendezvous import rendezvous
from torchrpc._agent.current import current_agent
from torchrpc._transport import handshake
from torchrpc._transport.logbudget import LogBudget
from torchrpc._wire import Kind
from torchrpc.rpc import api
from torchrpc.rpc.options import LISTEN_ADDR_ENV, read_environment

from ..support import helpers, robust as rh
from ..support.group import running_group, wait_for
from ..support.handshake import authenticate, recv_exact


@pytest.fixture(scope="module", autouse=True)
def group():
    with running_group(3, threads=4, timeout=30.0) as g:
        # Every pair is connected, so a fake peer claiming a rank is never the only link.
        assert rpc.rpc_sync("worker1", helpers.nested_call, args=("worker0", 1)) == "worker1>worker0"
        assert rpc.rpc_sync("worker2", helpers.nested_call, args=("worker0", 1)) == "worker2>worker0"
        yield g


class CreatesFile:
    """Unpickling this creates ``path``: the canary of remote code execution."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.fixture(autouse=True)
def fresh_log_budget():
    # The tests read the reasons this worker logs; earlier tests' rejections must not have
    # used up the budget that keeps a flood out of the log (LogBudget: 20 a minute).
    current_agent()._transport._links.rejects = LogBudget()


def _address(rank: int):
    return api.current_agent().registry.addresses[rank]


def _secret() -> bytes:
    return api.current_agent()._transport._secret


def _closed_by_peer(s: socket.socket, timeout: float = 5.0) -> bool:
    """Drain until the peer closes; True if it did within ``timeout``."""
    s.settimeout(timeout)
    try:
        while s.recv(65536):
            pass
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False
    return True


def _hostile_frame(path: str) -> bytes:
    env, bufs, _ = _wire.encode((CreatesFile(path), (), {}))
    assert not bufs
    return _wire.pack_header(Kind.CALL, 0, 7, len(env), []) + env


def _authenticate(host: str, port: int, claim_rank: int, server_rank: int) -> socket.socket:
    return authenticate(host, port, _secret(), claim_rank, server_rank)


def _still_serving() -> None:
    assert rpc.rpc_sync("worker1", helpers.add, args=(20, 22)) == 42
    assert rpc.rpc_sync("worker1", helpers.nested_call, args=("worker0", 1)) == "worker1>worker0"
    assert rpc.rpc_sync("worker2", helpers.nested_call, args=("worker1", 1)) == "worker2>worker1"


def test_hostile_pickle_without_the_secret_is_never_unpickled(tmp_path, caplog):
    # The payload is live: decoding it here does create the file.
    probe = str(tmp_path / "probe")
    frame = _hostile_frame(probe)
    _wire.decode(frame[_wire.HEADER_SIZE:], [])
    assert os.path.exists(probe)

    canary = str(tmp_path / "pwned")
    frame = _hostile_frame(canary)
    caplog.set_level(logging.WARNING, logger="torchrpc")
    for rank in (1, 0):  # worker1 (a subprocess), and rank 0 (this process, log checked)
        host, port = _address(rank)
        # 1. Raw, no handshake at all.
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(frame * 4)
            assert _closed_by_peer(s)
        # 2. HELLO, then the frame right away instead of a proof (pipelined).
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(handshake.make_hello(0, 0)[0] + frame)
            assert _closed_by_peer(s)
        # 3. A proof made with the wrong secret, then the frame.
        with socket.create_connection((host, port), timeout=5) as s:
            hello, nonce = handshake.make_hello(0, 0)
            s.sendall(hello)
            server_rank, server_features, server_nonce, _ = handshake.CHALLENGE.unpack(
                recv_exact(s, handshake.CHALLENGE.size))
            wrong = handshake._mac(b"not the secret", b"cli", server_nonce, nonce, 0, server_rank,
                                   0, server_features, b"")
            s.sendall(wrong + frame)
            assert _closed_by_peer(s)
        # 4. A replayed HELLO/PROOF pair can't pass either: the server's nonce is fresh.
    def failures() -> list:
        return [r.getMessage() for r in caplog.records if "failed the handshake" in r.getMessage()]
    wait_for("three handshake failures logged", lambda: len(failures()) >= 3, 10, state=failures)
    assert not os.path.exists(canary)
    reasons = failures()
    assert any("not a torchrpc handshake" in r for r in reasons)
    assert any("wrong job secret" in r for r in reasons)
    _still_serving()


@pytest.mark.parametrize("name, build", [
    ("oversized envelope", lambda: struct.pack("<4sBBHQII", b"TRPC", 1, Kind.CALL, 0, 1, 3 << 30, 0)),
    ("too many buffers", lambda: struct.pack("<4sBBHQII", b"TRPC", 1, Kind.CALL, 0, 1, 10, 1 << 20)),
    ("oversized buffers", lambda: struct.pack("<4sBBHQII", b"TRPC", 1, Kind.CALL, 0, 1, 10, 2)
     + struct.pack("<2Q", 1 << 30, 3 << 30)),
    ("bad magic", lambda: b"XRPC" + bytes(20)),
    ("unknown kind", lambda: struct.pack("<4sBBHQII", b"TRPC", 1, 99, 0, 1, 0, 0)),
    ("unknown flags", lambda: struct.pack("<4sBBHQII", b"TRPC", 1, Kind.CALL, 0x80, 1, 0, 0)),
    ("bad version", lambda: struct.pack("<4sBBHQII", b"TRPC", 9, Kind.CALL, 0, 1, 0, 0)),
])
def test_bad_frames_from_an_authenticated_peer_close_that_connection(name, build, caplog):
    caplog.set_level(logging.WARNING, logger="torchrpc")
    before = rpc.rpc_sync("worker1", rh.rss_kib)
    for rank, claim in ((0, 1), (1, 0)):
        s = _authenticate(*_address(rank), claim_rank=claim, server_rank=rank)
        with s:
            s.sendall(build())
            assert _closed_by_peer(s), name
    # This worker logs the reason on its reading thread just after the close that the
    # peer saw: wait for it.
    wait_for(f"a reason logged for {name}", lambda: any(
        "closed its connection with rank 1" in r.getMessage() for r in caplog.records), 10.0)
    # Nothing was allocated for the lengths the header claimed.
    assert rpc.rpc_sync("worker1", rh.rss_kib) - before < 64 * 1024
    _still_serving()


def test_truncated_frames_close_with_a_logged_reason(caplog):
    caplog.set_level(logging.WARNING, logger="torchrpc")
    env, _, _ = _wire.encode((helpers.add, (1, 2), {}))
    cases = [
        _wire.pack_header(Kind.CALL, 0, 1, len(env), [])[:10],            # inside the header
        _wire.pack_header(Kind.CALL, 0, 1, len(env), []) + env[:5],       # inside the envelope
        _wire.pack_header(Kind.CALL, 0, 1, len(env), [1 << 20]) + env + b"x" * 1000,  # buffer
        _wire.pack_header(Kind.CALL, 0, 1, 100 << 20, []) + b"y" * 1000,  # a big claim
    ]
    for data in cases:
        for rank, claim in ((0, 1), (1, 0)):
            s = _authenticate(*_address(rank), claim_rank=claim, server_rank=rank)
            s.sendall(data)
            s.close()
    def logged() -> list:
        return [r.getMessage() for r in caplog.records if "truncated frame" in r.getMessage()]
    wait_for("a truncated frame logged for each case", lambda: len(logged()) >= len(cases), 10,
             state=logged)
    _still_serving()


def _non_loopback_ipv4() -> str | None:
    for _, name in socket.if_nameindex():
        try:
            addr = rendezvous._interface_address(name)
        except Exception:  # noqa: BLE001 - interfaces without an IPv4 address
            continue
        if not addr.startswith("127."):
            return addr
    return None


def test_listener_is_not_reachable_on_other_interfaces():
    addr = _non_loopback_ipv4()
    if addr is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    for rank in (0, 1):
        host, port = _address(rank)
        assert host == "127.0.0.1"
        with pytest.raises(OSError):
            socket.create_connection((addr, port), timeout=2).close()


def _listen_host(init_method, environ, listen_addr=None):
    """Where a worker listens: its options read from ``environ`` as init_rpc reads them."""
    opts = rpc.TensorPipeRpcBackendOptions(init_method=init_method, listen_addr=listen_addr)
    read, _ = read_environment(opts, environ)
    return rendezvous.listen_host(init_method, read.listen_addr)


def test_listen_address_is_configurable(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert _listen_host("env://", {}) == "127.0.0.1"
    assert _listen_host("tcp://localhost:1234", {}) == "127.0.0.1"
    assert _listen_host("env://", {}, "10.1.2.3") == "10.1.2.3"
    env = {LISTEN_ADDR_ENV: "0.0.0.0"}
    assert _listen_host("env://", env) == "0.0.0.0"
    assert _listen_host("env://", env, "10.1.2.3") == "10.1.2.3"  # the option wins


def test_a_peer_cannot_answer_a_call_sent_to_another():
    # worker0's call to worker1 waits; a peer authenticated as rank 2 forges its reply.
    fut = rpc.rpc_async("worker1", helpers.sleep_then, args=(1.0, "real"))
    rids = [rid for rid, p in list(api.current_agent().requests.pending.items()) if p.dst.id == 1]
    assert rids
    env, bufs, _ = _wire.encode("forged")
    s = _authenticate(*_address(0), claim_rank=2, server_rank=0)
    try:
        for rid in rids:
            s.sendall(_wire.pack_header(Kind.RESPONSE, 0, rid, len(env), []) + env)
        assert fut.wait() == "real"
    finally:
        s.close()
    _still_serving()
