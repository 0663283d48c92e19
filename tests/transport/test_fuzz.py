"""Fuzzing a worker's listeners with random and mutated handshakes and frames.

The same fuzz runs against each transport a worker listens on: its TCP port, its
Unix socket (which same-host peers use) and, in a group run over TLS, its TLS port.
Unauthenticated clients send random bytes and mutated handshakes and frames, and over
TLS also garbage before and inside the TLS handshake; an authenticated client (it has
the job secret and, over TLS, a certificate of the job's CA) sends mutated frames after
a real handshake. The worker must never crash, its memory must stay bounded, it must
keep accepting connections, and legitimate calls must keep succeeding throughout.

Each transport gets ``TORCHRPC_FUZZ_ITERS`` hostile inputs (handshakes and frames;
default 10,000, a few seconds to half a minute each); ``-s`` shows the count and time
of each. For a long run::

    TORCHRPC_FUZZ_ITERS=1000000 TORCHRPC_FUZZ_SEED=7 python -m pytest tests/transport/test_fuzz.py -s

Under CPython 3.11 a worker may print ``SystemError: deallocated bytearray object has
exported buffers``: a mutated pickle's BYTEARRAY8 claims more bytes than can be allocated,
and CPython frees the half-built bytearray before it has set its export count. The
unpickler then raises MemoryError and the worker answers with an error; the line is noise.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import pickletools
import random
import select
import socket
import ssl
import struct
import time
from typing import Callable, Dict, List, Optional, Tuple

import pytest
import torch

import torchrpc.rpc as rpc
from torchrpc import _wire
from torchrpc._transport import handshake, sockets
from torchrpc._wire import Kind
from torchrpc.rpc import api

from ..support import helpers, certs, robust as rh
from ..support.group import Group, running_group
from ..support.handshake import recv_exact

ITERS = int(os.environ.get("TORCHRPC_FUZZ_ITERS", "10000"))
SEED = int(os.environ.get("TORCHRPC_FUZZ_SEED", str(random.randrange(1 << 30))))
# RSS growth allowed over one transport's run; the worker allocates nothing for a length it
# was only told about, so this is about caches and fragmentation, not about the frames (a
# TLS session kept after each failed handshake, 256 KiB apiece, once grew it by 100 MiB).
RSS_LIMIT_KIB = 64 * 1024
_SAFE_KINDS = [int(k) for k in Kind if k not in (Kind.GOODBYE,)]


# The authenticated fuzzer claims to be worker2, a real member that only listens: worker1
# sends its (error) replies to fuzzed requests there, not to rank 0, which does the
# fuzzing and the legitimate calls.
FAKE_RANK = 2


class _Groups:
    """At most one running group at a time (rank 0 is this process), started on first use:
    the TCP and Unix socket fuzzes share the plain group, the TLS fuzz has its own."""

    def __init__(self) -> None:
        self._kind: Optional[str] = None
        self._stack = contextlib.ExitStack()
        self._group: Optional[Group] = None

    def get(self, kind: str, pki: Optional[Dict[str, str]] = None) -> Group:
        if kind != self._kind:
            self.close()
            options = certs.tls_options(pki) if pki else None
            self._group = self._stack.enter_context(
                running_group(3, threads=4, timeout=30.0, options=options))
            self._kind = kind
            # A real connection both ways, so the fake peer is never worker1's only link to 2.
            assert rpc.rpc_sync("worker2", helpers.nested_call, args=("worker1", 1)) == "worker2>worker1"
            assert rpc.rpc_sync("worker1", helpers.nested_call, args=("worker2", 1)) == "worker1>worker2"
        assert self._group is not None
        return self._group

    def close(self) -> None:
        self._kind, self._group = None, None
        stack, self._stack = self._stack, contextlib.ExitStack()
        stack.close()


@pytest.fixture(scope="module")
def groups():
    g = _Groups()
    try:
        yield g
    finally:
        g.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Dict[str, str]:
    # The workers' certificate, and the authenticated fuzzer's: both of the job's CA and
    # naming this host, so the fuzzer passes mutual TLS and reaches the HMAC handshake.
    return certs.make_pki(tmp_path_factory.mktemp("pki"), ("ca",), (
        ("worker", "ca", "IP:127.0.0.1"), ("client", "ca", "IP:127.0.0.1")))


def _templates(rng: random.Random) -> List[bytes]:
    """Well-formed frames of every shape, as torchrpc's own encoder makes them."""
    out = []
    small = torch.arange(6, dtype=torch.float32)
    bodies = [
        (Kind.CALL, (helpers.add, (1, 2), {})),
        (Kind.CALL, (helpers.echo, ({"t": small, "v": small[1:3]},), {})),
        (Kind.CALL, (helpers.echo, ([1, "two", 3.0, None, b"\x00" * 40],), {})),
        (Kind.RESPONSE, 12345),
        (Kind.ERROR, "boom"),
        (Kind.HEARTBEAT, None),
        (Kind.RREF_FETCH, ("rref", 1, 2)),
        (Kind.AUTOGRAD_RELEASE, 42),
    ]
    for kind, body in bodies:
        env, bufs, _ = _wire.encode(body)
        rid = (1 << 62) | rng.randrange(1 << 40)  # never one of rank 0's real request ids
        out.append(_wire.pack_header(kind, 0, rid, len(env), [len(b) for b in bufs])
                   + env + b"".join(bytes(b) for b in bufs))
    return out


def _mutate(rng: random.Random, frame: bytes, in_step: bool = False) -> Tuple[bytes, bool]:
    """A mutated frame and whether its header still matches its length (so the
    connection stays in step after it); with ``in_step``, only such mutations."""
    data = bytearray(frame)
    op = rng.randrange(2) if in_step else rng.randrange(9)
    header_end = _wire.HEADER_SIZE
    if op == 0:  # flip bits in the body
        for _ in range(rng.randint(1, 8)):
            if len(data) > header_end:
                i = rng.randrange(header_end, len(data))
                data[i] ^= 1 << rng.randrange(8)
        return bytes(data), True
    if op == 1:  # overwrite body bytes with interesting values
        for _ in range(rng.randint(1, 4)):
            if len(data) > header_end:
                i = rng.randrange(header_end, len(data))
                data[i] = rng.choice([0, 1, 0x7F, 0x80, 0xFF, ord("("), ord("."), ord("c")])
        return bytes(data), True
    if op == 2:  # change the kind or flags only
        data[5] = rng.choice(_SAFE_KINDS + [0, 7, 99, 255])
        if rng.random() < 0.3:
            data[6] = rng.randrange(256)
        return bytes(data), data[5] in _SAFE_KINDS and data[6] & ~3 == 0
    if op == 3:  # lie about the envelope length
        struct.pack_into("<I", data, 16, rng.choice(
            [0, 1, rng.randrange(1 << 32), 0xFFFFFFFF, (2 << 30) + 1, len(data) * 2]))
        return bytes(data), False
    if op == 4:  # lie about the buffers
        n = rng.choice([1, 2, 1000, 1 << 16, (1 << 16) + 1, 0xFFFFFFFF])
        struct.pack_into("<I", data, 20, n)
        lens = struct.pack(f"<{min(n, 4)}Q", *[rng.choice([0, 8, 1 << 31, 1 << 63, rng.randrange(1 << 64)])
                                             for _ in range(min(n, 4))])
        return bytes(data[:header_end]) + lens + bytes(data[header_end:]), False
    if op == 5:  # truncate anywhere
        return bytes(data[:rng.randrange(len(data))]), False
    if op == 6:  # splice random bytes in
        i = rng.randrange(len(data))
        return bytes(data[:i]) + rng.randbytes(rng.randint(1, 64)) + bytes(data[i:]), False
    if op == 7:  # corrupt the header anywhere
        i = rng.randrange(header_end)
        data[i] = rng.randrange(256)
        if i == 5 and data[5] == Kind.GOODBYE:
            # A GOODBYE from an authenticated peer is a member leaving (see _SAFE_KINDS).
            data[5] = frame[5]
        ok = data[:6] == frame[:6] and data[16:] == frame[16:] and (i not in (6, 7) or data[6] & ~3 == 0)
        return bytes(data), ok and data[5] in _SAFE_KINDS
    return rng.randbytes(rng.randint(1, 200)), False  # pure noise


_MEMO_WRITES = {"PUT", "LONG_BINPUT"}


def _is_memo_bomb(frame: bytes) -> bool:
    """Whether the frame carries a pickle that writes a huge memo index.

    CPython's unpickler trusts memo indices: ``LONG_BINPUT n`` grows the memo to 2n
    slots and zeroes them, holding the GIL, so one corrupted byte can make a worker
    allocate and touch gigabytes. torchrpc's encoder never writes these opcodes, and
    a peer that holds the job secret can run any code on the worker anyway (pickle),
    so the authenticated fuzzer leaves them out: they test CPython, not torchrpc
    (see docs/robustness.md). Everything else a mutation can do to a pickle is sent.
    """
    for start in range(_wire.HEADER_SIZE, min(len(frame), _wire.HEADER_SIZE + 40), 8):
        stream = io.BytesIO(frame[start:])
        try:
            for _ in range(2):  # the metadata pickle, then the payload pickle
                for op, arg, _ in pickletools.genops(stream):
                    if op.name in _MEMO_WRITES and isinstance(arg, int) and arg > 100_000:
                        return True
        except Exception:  # noqa: BLE001 - the unpickler stops where genops stops
            pass
    return False


def _drain(s: socket.socket) -> bool:
    """Read what the worker sent (heartbeats); False if it closed the connection."""
    try:
        while select.select([s], [], [], 0)[0]:
            if not s.recv(65536):
                return False
    except OSError:  # ssl.SSLError (a partial record, an alert) included
        return False
    return True


def _send_quietly(s: socket.socket, data: bytes) -> bool:
    try:
        s.sendall(data)
        return True
    except OSError:
        return False


class _Target:
    """Opens connections to worker1 over one transport: "tcp", "unix" or "tls"."""

    def __init__(self, transport: str, host: str, port: int, secret: bytes,
                 pki: Optional[Dict[str, str]] = None) -> None:
        self.transport = transport
        self.host, self.port, self.secret = host, port, secret
        self.connections = 0
        self.tls: Optional[ssl.SSLContext] = None
        self.anonymous: Optional[ssl.SSLContext] = None  # TLS without a client certificate
        if pki is not None:
            self.tls, self.anonymous = self._context(pki, True), self._context(pki, False)

    @staticmethod
    def _context(pki: Dict[str, str], with_certificate: bool) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False  # the worker is reached by address; its CA is what counts
        ctx.load_verify_locations(pki["ca"])
        if with_certificate:
            ctx.load_cert_chain(pki["client"], pki["client.key"])
        return ctx

    def raw(self) -> socket.socket:
        """A connected socket, before any TLS."""
        self.connections += 1
        if self.transport == "unix":
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            # Blocking, as a peer's connect: it waits (at most 5 s) while the worker's
            # backlog is full, where a timeout's non-blocking connect fails at once (EAGAIN).
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 5, 0))
            try:
                s.connect(sockets.local_name(self.host, self.port))
            except OSError:
                s.close()
                raise
            s.settimeout(5)
            return s
        s = socket.create_connection((self.host, self.port), timeout=5)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s

    def stream(self, anonymous: bool = False) -> socket.socket:
        """A connection where torchrpc's handshake starts: over TLS, after the TLS one."""
        s = self.raw()
        ctx = self.anonymous if anonymous else self.tls
        if ctx is None:
            return s
        try:
            return ctx.wrap_socket(s)
        except BaseException:
            s.close()
            raise

    def authenticated(self) -> socket.socket:
        # The worker refuses a connection while MAX_HANDSHAKES hostile ones still run
        # (accept.py): on a loaded machine those outlive the fuzzer's sockets a while.
        for attempt in range(20):
            try:
                return self._authenticated()
            except ConnectionResetError:
                if attempt == 19:
                    raise
                time.sleep(0.25)
        raise AssertionError("unreachable")

    def _authenticated(self) -> socket.socket:
        s = self.stream()
        try:
            # Under TLS the HMAC proof covers the server certificate's hash (tls.py).
            binding = hashlib.sha256(s.getpeercert(True)).digest() if self.tls else b""
            hello, nonce = handshake.make_hello(FAKE_RANK, 0)
            s.sendall(hello)
            proof, _, _ = handshake.answer_challenge(
                self.secret, recv_exact(s, handshake.CHALLENGE.size), FAKE_RANK, nonce, 1, 0,
                binding, server_address=(self.host, self.port))
            s.sendall(proof)
            assert recv_exact(s, 1) == handshake.ACCEPT
        except BaseException:
            s.close()
            raise
        return s


def _hostile_handshake(rng: random.Random, templates: List[bytes]) -> bytes:
    """What an outsider sends where torchrpc's handshake is due."""
    choice = rng.randrange(4)
    if choice == 0:
        return rng.randbytes(rng.randint(1, 300))
    if choice == 1:  # a mutated HELLO, then a frame
        hello = bytearray(handshake.make_hello(rng.randrange(-5, 5), rng.randrange(8))[0])
        for _ in range(rng.randint(0, 3)):
            hello[rng.randrange(len(hello))] = rng.randrange(256)
        return bytes(hello) + rng.choice(templates)
    if choice == 2:  # a frame, no handshake
        return _mutate(rng, rng.choice(templates))[0]
    # a valid HELLO, a garbage proof, a frame
    return handshake.make_hello(0, 0)[0] + rng.randbytes(32) + rng.choice(templates)


def _corrupt(rng: random.Random, data: bytes) -> bytes:
    """``data`` (TLS records) with bits flipped, cut short, or random bytes spliced in."""
    out = bytearray(data)
    op = rng.randrange(3)
    if op == 0:
        for _ in range(rng.randint(1, 8)):
            out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
        return bytes(out)
    if op == 1:
        return bytes(out[:rng.randrange(len(out))])
    i = rng.randrange(len(out) + 1)
    return bytes(out[:i]) + rng.randbytes(rng.randint(1, 64)) + bytes(out[i:])


def _tls_step(tls_obj: ssl.SSLObject) -> None:
    try:
        tls_obj.do_handshake()
    except ssl.SSLWantReadError:
        pass  # it wrote what it has to say and waits for the peer


def _fuzz_tls_handshake(rng: random.Random, target: _Target) -> None:
    """Garbage before or inside the TLS handshake: random bytes, a mutated ClientHello, or
    a real ClientHello and, once the worker answered, a mutated or random second flight."""
    assert target.tls is not None
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls_obj = target.tls.wrap_bio(incoming, outgoing)
    _tls_step(tls_obj)
    client_hello = outgoing.read()
    s = target.raw()
    try:
        choice = rng.randrange(3)
        if choice == 0:
            s.sendall(rng.randbytes(rng.randint(1, 300)))
        elif choice == 1:
            s.sendall(_corrupt(rng, client_hello))
        else:
            s.sendall(client_hello)
            answer = b""
            while not answer:  # the worker's flight may come in several segments
                data = s.recv(65536)
                if not data:
                    return
                incoming.write(data)
                _tls_step(tls_obj)
                answer = outgoing.read()
            s.sendall(_corrupt(rng, answer) if rng.random() < 0.7
                      else rng.randbytes(rng.randint(1, 300)))
    except OSError:  # the worker dropped us, as it should
        pass
    finally:
        s.close()


def _fuzz_unauthenticated(rng: random.Random, target: _Target, templates: List[bytes], n: int,
                          check: Callable[[], None]) -> None:
    for i in range(n):
        if target.tls is not None and rng.random() < 0.4:
            _fuzz_tls_handshake(rng, target)
        else:
            # Over TLS, after a real TLS handshake (now and then without a client
            # certificate, which the worker refuses); garbage where torchrpc's begins.
            s = target.stream(anonymous=target.tls is not None and rng.random() < 0.1)
            _send_quietly(s, _hostile_handshake(rng, templates))
            s.close()
        if i % 100 == 99:
            check()


def _fuzz_authenticated(rng: random.Random, target: _Target, templates: List[bytes], n: int,
                        check: Callable[[], None]) -> int:
    """Send ``n`` frames; return how many memo bombs were left out."""
    # Per connection: a run of frames that keep it in step (intact or with their bodies
    # mutated), then usually one that may not (any mutation), then a new connection.
    # A legitimate call after each run also paces the fuzzer: it returns once the worker
    # has worked through the run (its pool is FIFO), so no backlog builds up.
    sent = 0
    skipped = 0
    while sent < n:
        s = target.authenticated()
        batch = []
        for _ in range(min(rng.randint(1, 40), n - sent)):
            base = rng.choice(templates)
            batch.append(base if rng.random() < 0.2 else _mutate(rng, base, in_step=True)[0])
        if rng.random() < 0.8 and len(batch) < n - sent:
            batch.append(_mutate(rng, rng.choice(templates))[0])
        skipped += sum(map(_is_memo_bomb, batch))
        batch = [f for f in batch if not _is_memo_bomb(f)] or [rng.choice(templates)]
        _send_quietly(s, b"".join(batch))
        _drain(s)
        s.close()
        sent += len(batch)
        check()
    return skipped


@pytest.mark.parametrize("transport", ["tcp", "unix",
                                       pytest.param("tls", marks=certs.needs_openssl)])
def test_fuzz_worker(groups, transport, request, record_property):
    pki = request.getfixturevalue("pki") if transport == "tls" else None
    group = groups.get("tls" if pki else "plain", pki)
    rng = random.Random(f"{SEED}-{transport}")
    agent = api.current_agent()
    host, port = agent.registry.addresses[1]
    target = _Target(transport, host, port, agent._transport._secret, pki)
    templates = _templates(rng)
    calls = [0]

    def check() -> None:
        assert rpc.rpc_sync("worker1", helpers.add, args=(calls[0], 1), timeout=20) == calls[0] + 1
        calls[0] += 1

    check()
    rss_before = rpc.rpc_sync("worker1", rh.peak_rss_kib)
    start = time.monotonic()
    n_unauth = ITERS * 6 // 100  # each costs a connection, ~5 ms here; frames are cheap
    _fuzz_unauthenticated(rng, target, templates, n_unauth, check)
    check()
    middle = time.monotonic()
    bombs = _fuzz_authenticated(rng, target, templates, ITERS - n_unauth, check)
    elapsed = time.monotonic() - start
    check()
    assert rpc.rpc_sync("worker1", helpers.nested_call, args=("worker0", 2)) == "worker1>worker0>worker1"
    target.authenticated().close()  # the fuzzed listener still takes new peers
    rss_after = rpc.rpc_sync("worker1", rh.peak_rss_kib)
    assert group.procs[1].poll() is None, "worker1 died"
    summary = (f"fuzz {transport}: seed {SEED}, {ITERS} hostile inputs ({n_unauth} "
               f"unauthenticated handshakes in {middle - start:.1f} s, {ITERS - n_unauth} "
               f"authenticated frames in {elapsed - (middle - start):.1f} s; {bombs} pickle "
               f"memo bombs left out) over {target.connections} connections in {elapsed:.1f} s; "
               f"{calls[0]} legitimate calls ok; worker1 peak RSS {rss_before // 1024} -> "
               f"{rss_after // 1024} MiB")
    print("\n" + summary)
    record_property("fuzz", summary)
    assert rss_after - rss_before < RSS_LIMIT_KIB, (rss_before, rss_after)
