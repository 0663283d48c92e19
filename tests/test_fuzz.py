"""Fuzzing a worker's port with random and mutated frames.

Unauthenticated clients send random bytes and mutated handshakes and frames; an
authenticated client (it has the job secret) sends mutated frames after a real
handshake. The worker must never crash, its memory must stay bounded, and
legitimate calls must keep succeeding throughout.

The suite runs the short form (``TORCHRPC_FUZZ_ITERS``, default 10,000 frames, a
few seconds). For a long run::

    TORCHRPC_FUZZ_ITERS=1000000 TORCHRPC_FUZZ_SEED=7 python -m pytest tests/test_fuzz.py -s
"""

from __future__ import annotations

import io
import os
import pickletools
import random
import select
import socket
import struct
import time
from typing import Callable, List, Tuple

import pytest
import torch

import torchrpc.rpc as rpc
from torchrpc import _wire
from torchrpc._transport import handshake
from torchrpc._wire import Kind
from torchrpc.rpc import api

from . import helpers, robust_helpers as rh
from .group import running_group

ITERS = int(os.environ.get("TORCHRPC_FUZZ_ITERS", "10000"))
SEED = int(os.environ.get("TORCHRPC_FUZZ_SEED", str(random.randrange(1 << 30))))
# RSS growth allowed over the whole run; the worker allocates nothing for a length it was
# only told about, so this is about caches and fragmentation, not about the frames.
RSS_LIMIT_KIB = 256 * 1024
_SAFE_KINDS = [int(k) for k in Kind if k not in (Kind.GOODBYE,)]


# The authenticated fuzzer claims to be worker2, a real member that only listens: worker1
# sends its (error) replies to fuzzed requests there, not to rank 0, which does the
# fuzzing and the legitimate calls.
FAKE_RANK = 2


@pytest.fixture(scope="module", autouse=True)
def group():
    with running_group(3, threads=4, timeout=30.0) as g:
        # A real connection both ways, so the fake peer is never worker1's only link to 2.
        assert rpc.rpc_sync("worker2", helpers.nested_call, args=("worker1", 1)) == "worker2>worker1"
        assert rpc.rpc_sync("worker1", helpers.nested_call, args=("worker2", 1)) == "worker1>worker2"
        yield g


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
    except OSError:
        return False
    return True


def _recv_exact(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


class _Target:
    def __init__(self, host: str, port: int, secret: bytes) -> None:
        self.host, self.port, self.secret = host, port, secret
        self.connections = 0

    def raw(self) -> socket.socket:
        self.connections += 1
        s = socket.create_connection((self.host, self.port), timeout=5)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s

    def authenticated(self) -> socket.socket:
        s = self.raw()
        hello, nonce = handshake.make_hello(FAKE_RANK, 0)
        s.sendall(hello)
        proof, _, _ = handshake.answer_challenge(
            self.secret, _recv_exact(s, handshake.CHALLENGE.size), FAKE_RANK, nonce, 1)
        s.sendall(proof)
        assert _recv_exact(s, 1) == handshake.ACCEPT
        return s


def _send_quietly(s: socket.socket, data: bytes) -> bool:
    try:
        s.sendall(data)
        return True
    except OSError:
        return False


def _fuzz_unauthenticated(rng: random.Random, target: _Target, templates: List[bytes], n: int) -> None:
    for _ in range(n):
        choice = rng.randrange(4)
        if choice == 0:
            data = rng.randbytes(rng.randint(1, 300))
        elif choice == 1:  # a mutated HELLO, then a frame
            hello = bytearray(handshake.make_hello(rng.randrange(-5, 5), rng.randrange(4))[0])
            for _ in range(rng.randint(0, 3)):
                hello[rng.randrange(len(hello))] = rng.randrange(256)
            data = bytes(hello) + rng.choice(templates)
        elif choice == 2:  # a frame, no handshake
            data = _mutate(rng, rng.choice(templates))[0]
        else:  # a valid HELLO, a garbage proof, a frame
            data = handshake.make_hello(0, 0)[0] + rng.randbytes(32) + rng.choice(templates)
        s = target.raw()
        _send_quietly(s, data)
        s.close()


def _fuzz_authenticated(rng: random.Random, target: _Target, templates: List[bytes], n: int,
                        check: Callable[[], None]) -> int:
    """Send ``n`` frames; return how many memo bombs were left out."""
    # Per connection: a run of frames that keep it in step (intact or with their bodies
    # mutated), then usually one that may not (any mutation), then a new connection.
    # A legitimate call after each run also paces the fuzzer: it returns once the worker
    # has worked through the run (its pool is FIFO), so no backlog builds up.
    sent = 0
    skipped = [0]
    while sent < n:
        s = target.authenticated()
        batch = []
        for _ in range(min(rng.randint(1, 40), n - sent)):
            base = rng.choice(templates)
            batch.append(base if rng.random() < 0.2 else _mutate(rng, base, in_step=True)[0])
        if rng.random() < 0.8 and len(batch) < n - sent:
            batch.append(_mutate(rng, rng.choice(templates))[0])
        skipped[0] += sum(map(_is_memo_bomb, batch))
        batch = [f for f in batch if not _is_memo_bomb(f)] or [rng.choice(templates)]
        _send_quietly(s, b"".join(batch))
        _drain(s)
        s.close()
        sent += len(batch)
        check()
    return skipped[0]


def test_fuzz_worker_port(group):
    rng = random.Random(SEED)
    agent = api.current_agent()
    host, port = agent._addresses[1]
    target = _Target(host, port, agent._transport._secret)
    templates = _templates(rng)
    calls = [0]

    def check() -> None:
        assert rpc.rpc_sync("worker1", helpers.add, args=(calls[0], 1), timeout=20) == calls[0] + 1
        calls[0] += 1

    check()
    rss_before = rpc.rpc_sync("worker1", rh.peak_rss_kib)
    start = time.monotonic()
    n_unauth = ITERS * 6 // 100  # each costs a connection, ~5 ms here; frames are cheap
    _fuzz_unauthenticated(rng, target, templates, n_unauth)
    check()
    middle = time.monotonic()
    bombs = _fuzz_authenticated(rng, target, templates, ITERS - n_unauth, check)
    elapsed = time.monotonic() - start
    print(f"\nfuzz: {n_unauth} unauthenticated in {middle - start:.1f} s, "
          f"{ITERS - n_unauth} authenticated in {elapsed - (middle - start):.1f} s "
          f"({bombs} pickle memo bombs left out)")
    check()
    assert rpc.rpc_sync("worker1", helpers.nested_call, args=("worker0", 2)) == "worker1>worker0>worker1"
    rss_after = rpc.rpc_sync("worker1", rh.peak_rss_kib)
    assert group.procs[1].poll() is None, "worker1 died"
    print(f"\nfuzz: seed {SEED}, {ITERS} frames over {target.connections} connections in "
          f"{elapsed:.1f} s; {calls[0]} legitimate calls ok; worker1 peak RSS {rss_before // 1024} -> "
          f"{rss_after // 1024} MiB")
    assert rss_after - rss_before < RSS_LIMIT_KIB, (rss_before, rss_after)
