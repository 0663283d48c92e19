"""TLS links: a self-signed CA made here with the openssl command line tool, mutual TLS,
the HMAC handshake inside TLS, and a whole group running over TLS."""

from __future__ import annotations

import errno
import os
import select
import socket
import ssl
import struct
import threading
import time
from typing import Dict

import pytest
import torch

import torchrpc.rpc as rpc
from torchrpc import _wire
from torchrpc._transport import accept, handshake, tls
from torchrpc._wire import Kind
from torchrpc.errors import AuthenticationError, RpcError
from torchrpc.rpc import api

from ..support import helpers, certs
from ..support import transport as th
from ..support.group import running_group, wait_for

pytestmark = certs.needs_openssl


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Dict[str, str]:
    return certs.make_pki(tmp_path_factory.mktemp("pki"), ("ca", "rogue_ca"), (
        ("worker", "ca", "IP:127.0.0.1"),
        ("rogue", "rogue_ca", "IP:127.0.0.1"),
        ("elsewhere", "ca", "IP:10.9.9.9"),  # the job's CA, another host's address
        ("job_a", "ca", "URI:torchrpc://job-a"),  # a job identity, no address
        ("job_b", "ca", "URI:torchrpc://job-b"),
        ("other", "ca", "IP:127.0.0.1"),  # the job's CA and this address: another holder
    ))


_contexts = th.tls_contexts


def _Peer(rank: int, contexts, secret: bytes = b"s" * 32) -> th.Peer:
    """A bare transport that records what arrives and echoes CALL frames back."""
    return th.Peer(rank, secret=secret, tls_contexts=contexts)


def test_frames_cross_a_tls_link_both_ways_under_concurrency(pki):
    server, client = _Peer(0, _contexts(pki)), _Peer(1, _contexts(pki))
    try:
        conn = client.connect(server)
        assert isinstance(conn.sock, tls.TlsSocket)
        assert conn.sock.ssl_object.version() == "TLSv1.3"
        assert conn.sock.ssl_object.getpeercert()["subject"] == ((("commonName", "worker"),),)
        payloads = {}

        def send(i: int) -> None:
            for j in range(5):
                rid = i * 100 + j
                data = torch.full((((i + j) % 3) * (4 << 20) + 7,), rid % 251, dtype=torch.uint8)
                payloads[rid] = data
                conn.send(Kind.CALL, 0, rid, f"env{rid}".encode(), [_wire.tensor_bytes(data)], data)

        assert not helpers.run_in_threads(send, [(i,) for i in range(4)])
        for _ in range(len(payloads)):
            header, env, bufs = client.frames.get(timeout=30)
            assert header.kind == Kind.RESPONSE and env == f"env{header.request_id}".encode()
            assert torch.equal(bufs[0], payloads[header.request_id])
    finally:
        client.close()
        server.close()


def test_plain_client_cannot_talk_to_a_tls_worker(pki, caplog):
    server = _Peer(0, _contexts(pki))
    try:
        with socket.create_connection(server.t.address, timeout=5) as s:
            s.sendall(handshake.make_hello(1, 0)[0])
            s.settimeout(5)
            try:
                data = s.recv(100)
            except ConnectionResetError:
                data = b""
            assert not data.startswith(b"TRPH") and len(data) < handshake.CHALLENGE.size
        plain = _Peer(1, None)
        with pytest.raises(RpcError):
            plain.connect(server)
        plain.close()
    finally:
        server.close()


def test_mutual_tls_rejects_a_certificate_from_another_ca(pki):
    server = _Peer(0, _contexts(pki))
    rogue = _Peer(1, _contexts(pki, cert="rogue"))  # trusts our CA, presents a rogue cert
    try:
        with pytest.raises(RpcError):
            rogue.connect(server)
    finally:
        rogue.close()
        server.close()
    # Without mutual TLS, the server takes any client certificate; the job secret still
    # decides who gets in.
    server = _Peer(0, _contexts(pki, require=False))
    rogue = _Peer(1, _contexts(pki, cert="rogue"))
    outsider = _Peer(2, _contexts(pki, cert="rogue"), secret=b"x" * 32)
    try:
        assert isinstance(rogue.connect(server).sock, tls.TlsSocket)
        with pytest.raises(RpcError, match="authentication"):
            outsider.connect(server)
    finally:
        rogue.close()
        outsider.close()
        server.close()


def test_client_rejects_a_server_certificate_from_another_ca(pki):
    server = _Peer(0, _contexts(pki, cert="rogue", ca="ca"))
    client = _Peer(1, _contexts(pki))
    try:
        with pytest.raises(RpcError, match="certificate verify failed"):
            client.connect(server)
    finally:
        client.close()
        server.close()


def _wait_untracked(peer: "_Peer", timeout: float = 10.0) -> None:
    """Wait until the transport tracks no socket (its handshake threads are done)."""
    wait_for("the transport tracks no socket", lambda: not peer.t._links._sockets, timeout,
             state=lambda: len(peer.t._links._sockets))


def test_a_failed_tls_handshake_leaves_nothing_behind(pki):
    # Each TLS session holds a 256 KiB receive buffer: one kept after a failed handshake
    # would let garbage connections grow a worker's memory without bound.
    server = _Peer(0, _contexts(pki))
    rogue = _Peer(1, _contexts(pki, cert="rogue"))
    try:
        for i in range(30):
            with socket.create_connection(server.t.address, timeout=5) as s:
                # A TLS handshake record header, then garbage.
                s.sendall(b"\x16\x03\x01\x00\xc8" + os.urandom(200))
        for _ in range(3):
            with pytest.raises(RpcError):
                rogue.connect(server)  # fails the TLS handshake on both sides
        _wait_untracked(server)
        _wait_untracked(rogue)
        client = _Peer(2, _contexts(pki))
        try:
            assert isinstance(client.connect(server).sock, tls.TlsSocket)  # still serving
        finally:
            client.close()
    finally:
        rogue.close()
        server.close()


def test_a_trickled_tls_handshake_is_dropped_at_the_handshake_deadline(pki, monkeypatch):
    # One deadline for the whole handshake, TLS included: a byte every 0.2 s would
    # otherwise hold one of the worker's few handshake slots for as long as it likes.
    monkeypatch.setattr(accept, "HANDSHAKE_TIMEOUT", 1.0)
    server = _Peer(0, _contexts(pki))
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls_obj = _contexts(pki).client.wrap_bio(incoming, outgoing)
    with pytest.raises(ssl.SSLWantReadError):
        tls_obj.do_handshake()
    client_hello = outgoing.read()
    try:
        with socket.create_connection(server.t.address, timeout=5) as s:
            start = time.monotonic()
            closed = False
            for i in range(len(client_hello)):
                if time.monotonic() - start > 6:
                    break
                try:
                    s.sendall(client_hello[i:i + 1])
                    if select.select([s], [], [], 0.2)[0]:
                        closed = not s.recv(100)
                except OSError:
                    closed = True
                if closed:
                    break
            assert closed and time.monotonic() - start < 4, time.monotonic() - start
    finally:
        server.close()


def test_bad_certificate_options_name_the_option(pki, tmp_path):
    with pytest.raises(ValueError, match="tls_certfile"):
        tls.make_contexts(str(tmp_path / "missing.pem"), None, pki["ca"], True)
    with pytest.raises(ValueError, match="tls_cafile"):
        tls.make_contexts(pki["worker"], pki["worker.key"], str(tmp_path / "no-ca.pem"), True)
    with pytest.raises(TypeError, match="tls_certfile"):
        rpc.TensorPipeRpcBackendOptions(tls_certfile=3)
    with pytest.raises(ValueError, match="tls_cafile is required"):  # no system trust store
        tls.make_contexts(pki["worker"], pki["worker.key"], None, True)
    with pytest.raises(ValueError, match="tls_identity"):
        rpc.TensorPipeRpcBackendOptions(tls_identity="")


def test_a_certificate_must_name_the_peer_address(pki):
    # Both certificates chain to the job's CA, but name another host's address.
    for server_cert, client_cert, who in (("elsewhere", "worker", "server"),
                                          ("worker", "elsewhere", "client")):
        server = _Peer(0, _contexts(pki, cert=server_cert))
        client = _Peer(1, _contexts(pki, cert=client_cert))
        try:
            with pytest.raises(RpcError):
                client.connect(server)
        finally:
            client.close()
            server.close()
    with pytest.raises(AuthenticationError, match="does not name its address 127.0.0.1"):
        tls.check_identity({"subjectAltName": (("IP Address", "10.9.9.9"),)}, None, "127.0.0.1")
    tls.check_identity({"subjectAltName": (("DNS", "localhost"),)}, None, "127.0.0.1")


def test_a_job_identity_replaces_the_address_check(pki, caplog):
    server = _Peer(0, _contexts(pki, cert="job_a", identity="torchrpc://job-a"))
    client = _Peer(1, _contexts(pki, cert="job_a", identity="torchrpc://job-a"))
    other_job = _Peer(2, _contexts(pki, cert="job_b", identity="torchrpc://job-a"))
    try:
        assert isinstance(client.connect(server).sock, tls.TlsSocket)
        with pytest.raises(RpcError):
            other_job.connect(server)  # the server finds its certificate of another job
        assert "does not carry the job identity 'torchrpc://job-a'" in caplog.text
        # A worker configured for another job refuses this one's server itself.
        other_job.close()
        other_job = _Peer(3, _contexts(pki, cert="job_b", identity="torchrpc://job-b"))
        with pytest.raises(AuthenticationError, match="job identity 'torchrpc://job-b'"):
            other_job.connect(server)
    finally:
        client.close()
        other_job.close()
        server.close()


def _relay_once(pki, target) -> "tuple[socket.socket, threading.Thread]":
    """A party in the middle holding another certificate of the job's CA: it ends the
    client's TLS session, opens one to ``target`` and passes the handshake through."""
    listener = socket.create_server(("127.0.0.1", 0))
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(pki["other"], pki["other.key"])
    server_ctx.load_verify_locations(pki["ca"])
    server_ctx.verify_mode = ssl.CERT_OPTIONAL
    client_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client_ctx.check_hostname = False
    client_ctx.load_verify_locations(pki["ca"])
    client_ctx.load_cert_chain(pki["other"], pki["other.key"])

    def run() -> None:
        raw, _ = listener.accept()
        with server_ctx.wrap_socket(raw, server_side=True) as a, \
                client_ctx.wrap_socket(socket.create_connection(target)) as b:
            for src, dst, n in ((a, b, handshake.HELLO.size), (b, a, handshake.CHALLENGE.size),
                                (a, b, handshake.PROOF.size), (b, a, 1)):
                data = b""
                while len(data) < n:
                    chunk = src.recv(n - len(data))
                    if not chunk:
                        return
                    data += chunk
                dst.sendall(data)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return listener, thread


def test_the_hmac_handshake_is_bound_to_the_tls_session(pki):
    server, client = _Peer(0, _contexts(pki)), _Peer(1, _contexts(pki))
    listener, relay = _relay_once(pki, server.t.address)
    try:
        with pytest.raises(AuthenticationError, match="tampered"):
            client.t.connect(0, *listener.getsockname(), timeout=5)
        relay.join(10)
        assert isinstance(client.connect(server).sock, tls.TlsSocket)  # directly: fine
    finally:
        listener.close()
        client.close()
        server.close()


def test_a_group_runs_over_tls(pki):
    with running_group(3, threads=4, timeout=30.0, options=certs.tls_options(pki)):
        big = torch.randn(4 << 20)
        assert torch.equal(rpc.rpc_sync("worker1", helpers.echo, args=(big,)), big)
        assert rpc.rpc_sync("worker2", helpers.nested_call, args=("worker1", 2)) == \
            "worker2>worker1>worker2"
        agent = api.current_agent()
        assert all(isinstance(c.sock, tls.TlsSocket) for lst in agent.connections.all.values() for c in lst)
        host, port = agent.registry.addresses[1]
        with socket.create_connection((host, port), timeout=5) as s:  # plain bytes: refused
            s.sendall(handshake.make_hello(0, 0)[0])
            s.settimeout(5)
            try:
                assert not s.recv(100).startswith(b"TRPH")
            except ConnectionResetError:
                pass


def test_a_64_mb_tensor_and_many_small_frames_cross_a_tls_link(pki):
    server, client = _Peer(0, _contexts(pki)), _Peer(1, _contexts(pki))
    try:
        conn = client.connect(server)
        # TLS 1.3's suites are OpenSSL's defaults (see tls.py); an AEAD either way.
        assert conn.sock.ssl_object.cipher()[0] in ("TLS_AES_256_GCM_SHA384",
                                                    "TLS_AES_128_GCM_SHA256",
                                                    "TLS_CHACHA20_POLY1305_SHA256")
        if not tls.kernel_tls_available():
            assert conn.sock.ktls == (False, False)  # OpenSSL does the records itself
        big = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8)
        conn.send(Kind.CALL, 0, 1, b"big", [_wire.tensor_bytes(big)], big)
        header, env, bufs = client.frames.get(timeout=120)
        assert header.request_id == 1 and env == b"big" and torch.equal(bufs[0], big)
        del bufs, big

        # Many small frames from several threads at once: writers' frames go out together,
        # several to a record, and each frame's tensor is read on its own (a few bytes of
        # a record, the rest left decrypted inside OpenSSL, unseen by poll).
        def send(i: int) -> None:
            for j in range(300):
                rid = 1000 + i * 1000 + j
                data = torch.tensor([rid % 251, i, j % 256], dtype=torch.uint8)
                conn.send(Kind.CALL, 0, rid, b"s", [_wire.tensor_bytes(data)], data)

        assert not helpers.run_in_threads(send, [(i,) for i in range(6)])
        seen = set()
        for _ in range(6 * 300):
            header, env, bufs = client.frames.get(timeout=30)
            rid = header.request_id
            i, j = divmod(rid - 1000, 1000)
            assert bufs[0].tolist() == [rid % 251, i, j % 256]
            seen.add(rid)
        assert len(seen) == 6 * 300
    finally:
        client.close()
        server.close()


def _tls_pair(pki, send_timeout: float = 0.0) -> "tuple[tls.TlsSocket, tls.TlsSocket]":
    """Two ends of a TLS session over loopback TCP, handshaken; the first one's socket
    has SO_SNDTIMEO ``send_timeout`` before TLS takes it over (as Links.bound sets it)."""
    contexts = _contexts(pki)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        raw_a = socket.create_connection(listener.getsockname())
        raw_b, _ = listener.accept()
    if send_timeout:
        sec = int(send_timeout)
        raw_a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                         struct.pack("ll", sec, int((send_timeout - sec) * 1e6)))
    a = tls.TlsSocket(raw_a, contexts.client, False)
    b = tls.TlsSocket(raw_b, contexts.server, True)
    done = threading.Thread(target=b.do_handshake, args=(time.monotonic() + 10,))
    done.start()
    a.do_handshake(time.monotonic() + 10)
    done.join()
    return a, b


def test_bytes_decrypted_inside_openssl_are_read_while_the_socket_is_quiet(pki):
    # The classic bug of TLS on a non-blocking socket: a record holds many small frames;
    # the reader takes a few bytes, OpenSSL keeps the rest decrypted, and the kernel has
    # nothing, so waiting on the socket first would sleep on bytes that have arrived.
    a, b = _tls_pair(pki)
    try:
        frames = [f"frame{i:05d}".encode() * 4 for i in range(300)]  # 40 bytes apiece
        a.sendmsg(frames)
        b.settimeout(2.0)  # a wait on the socket here would raise socket.timeout
        buf = bytearray(40)
        assert b.recv_into(buf, 40) == 40 and bytes(buf) == frames[0]
        assert b.pending() > 0  # the rest of the record, decrypted, inside OpenSSL ...
        deadline = time.monotonic() + 5
        while b.pending() < 299 * 40 - 40 and time.monotonic() < deadline:
            time.sleep(0.01)
        # ... while the socket has nothing to read (the whole record was taken from it).
        if b.pending() >= 299 * 40 - 40:
            assert not select.select([b.fileno()], [], [], 0)[0]
        for want in frames[1:]:
            got = 0
            while got < 40:
                got += b.recv_into(memoryview(buf)[got:], 40 - got)
            assert bytes(buf) == want
        with pytest.raises(socket.timeout):
            b.recv_into(buf)  # and now nothing is left anywhere: a wait, to its timeout
    finally:
        a.close()
        b.close()


def test_a_tls_send_that_makes_no_progress_fails_at_the_send_timeout(pki):
    # The socket under TLS is non-blocking, where SO_SNDTIMEO does nothing: the session
    # reads it when it takes the socket over, keeps the deadline itself, and reports it
    # as the kernel would (EAGAIN, which the connection words as send_timeout's).
    a, b = _tls_pair(pki, send_timeout=0.5)
    try:
        blob = bytes(32 << 20)  # more than the two sockets' buffers hold; b never reads
        start = time.monotonic()
        with pytest.raises(OSError) as info:
            a.sendall(blob)
        assert info.value.errno == errno.EAGAIN
        assert 0.4 < time.monotonic() - start < 10
    finally:
        a.close()
        b.close()


def test_a_close_from_another_thread_wakes_the_reader(pki):
    a, b = _tls_pair(pki)
    result = []

    def read() -> None:
        try:
            result.append(b.recv_into(bytearray(100)))
        except OSError as exc:
            result.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.2)
    b.shutdown(socket.SHUT_RDWR)  # what Connection.close does, then close()
    reader.join(5)
    b.close()
    a.close()
    assert not reader.is_alive()
    assert result == [0] or isinstance(result[0], OSError), result


def test_kernel_tls_is_asked_for_only_where_the_kernel_offers_it(pki):
    contexts = _contexts(pki)
    offered = tls.kernel_tls_available()
    with open("/proc/sys/net/ipv4/tcp_available_ulp") as f:
        assert offered == ("tls" in f.read().split())
    for ctx in (contexts.client, contexts.server):
        assert bool(ctx.options & tls._OP_ENABLE_KTLS) == offered
    a, b = _tls_pair(pki)
    try:
        if not offered:  # OpenSSL does the records itself, and says so
            assert a.ktls == b.ktls == (False, False)
        a.sendall(b"over whichever does the records")
        assert b.recv(100) == b"over whichever does the records"
    finally:
        a.close()
        b.close()
    with socket.create_server(("127.0.0.1", 0)) as listener:  # plain TCP: no kernel TLS
        with socket.create_connection(listener.getsockname()) as plain:
            assert tls.ktls(plain) == (False, False)
