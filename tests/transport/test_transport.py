"""The transport over real sockets and processes, with same-host shared memory on and off.

Every test that takes the ``group`` fixture runs twice: once with shared memory
(``enable_shm=True``, buffers from 64 KiB on go through memfds) and once over the
socket alone. Bare-transport tests (two transports in this process) cover what
decides whether shared memory is used. The leak and peak-RSS tests are in
``test_transport_lifecycle.py``.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import threading
import time
from typing import Any, List, Optional

import numpy as np
import pytest
import torch

import torchrpc.rpc as rpc
from torchrpc import _wire
from torchrpc._transport import handshake, links, shm
from torchrpc._wire import Kind
from torchrpc.errors import ProtocolError
from torchrpc.rpc import api

from ..support import helpers
from ..support import transport as th
from ..support.frames import macs_around
from ..support.group import running_group, wait_for
from ..wire.test_wire import DTYPES, Inner, Outer, assert_same, sample

THRESHOLD = 64 << 10
SMALL, LARGE = 1 << 10, 1 << 20  # bytes: below and above THRESHOLD


_FILE_SEGMENT = re.compile(r"torchrpc-(\d+)-(\d+)-[0-9a-f]+-\d+")


def torchrpc_segments(pids: Optional[List[int]] = None) -> List[str]:
    """Files in /dev/shm named as torchrpc segments, of the given creator pids if any:
    there must never be any (segments are memfds)."""
    out = []
    for name in os.listdir("/dev/shm"):
        m = _FILE_SEGMENT.fullmatch(name)
        if m and (pids is None or int(m.group(2)) in pids):
            out.append(name)
    return out


@pytest.fixture(scope="module", params=[True, False], ids=["shm", "socket"])
def group(request):
    opts = {"enable_shm": request.param, "shm_threshold": THRESHOLD}
    with running_group(3, threads=4, timeout=30.0, options=opts) as g:
        g.shm = request.param
        yield g
    # Everything a worker created was mapped (and so unlinked) or removed at close.
    assert not torchrpc_segments([os.getpid()] + [p.pid for p in g.procs.values()])


def _echo(x: Any, to: str = "worker1") -> Any:
    return rpc.rpc_sync(to, helpers.echo, args=(x,))


@pytest.mark.parametrize("nbytes", [SMALL, LARGE], ids=["small", "large"])
def test_every_dtype_and_layout_round_trips(group, nbytes):
    for dtype in DTYPES:
        itemsize = torch.empty((), dtype=dtype).element_size()
        x = sample(dtype, (4, nbytes // itemsize // 4), seed=itemsize)
        out = _echo((x, x.t(), x[:, 1::3], x[1:3]))
        assert_same(out[0], x)
        assert_same(out[1], x.t())
        assert_same(out[2], x[:, 1::3], strides=False)
        assert_same(out[3], x[1:3])
    n = nbytes // 4
    a = torch.randn(n)
    nested = {"outer": Outer("o", Inner(a, ("t",)), [a[: n // 2], None]),
              "zero": torch.empty(0, 3), "scalar": torch.tensor(2.5, dtype=torch.float64)}
    out = _echo(nested, "worker2")
    assert_same(out["outer"].inner.weight, a) and out["outer"].extras[1] is None
    assert_same(out["outer"].extras[0], a[: n // 2])
    assert out["zero"].shape == (0, 3) and out["scalar"].item() == 2.5
    i = torch.randint(0, 1000, (2, n // 16))
    coo = torch.sparse_coo_tensor(i, torch.randn(n // 16), (1000, 1000), check_invariants=True)
    back = _echo(coo)
    assert back.layout == torch.sparse_coo and torch.equal(back.to_dense(), coo.to_dense())


def test_shared_storages_stay_shared(group):
    x = torch.arange(float(LARGE // 4))
    a, b = _echo((x[: LARGE // 8], x[LARGE // 16:]))
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    a[LARGE // 16] = -1.0
    assert b[0].item() == -1.0


def test_large_buffers_use_shared_memory_only_when_enabled(group):
    x = torch.randn(LARGE // 4)
    back, where = rpc.rpc_sync("worker1", th.echo_where, args=(x,))
    assert torch.equal(back, x)
    conns = [c for c in api.current_agent()._transport.connections() if c.peer_rank == 1]
    if group.shm:
        assert th.is_segment(where), where
        # The reply came back in our own segment (copied out of it where the callee had
        # not freed its tensors on it yet: see shm.py).
        returned = rpc.rpc_sync("worker1", th.debug_counter,
                                args=("transport.shm_buffers_returned",))
        assert returned >= 1, returned
        assert any(c.shm_tx is not None and c.shm_tx.num_segments >= 1 for c in conns)
    else:
        assert "torchrpc" not in where and "torchrpc" not in th.mapping_of(back)
        assert all(c.shm_tx is None and c.shm_rx is None for c in conns)
    small, where = rpc.rpc_sync("worker1", th.echo_where, args=(torch.randn(SMALL // 4),))
    assert "torchrpc" not in where  # below the threshold: through the socket


def test_large_numpy_arrays_take_the_tensors_path(group):
    """Out of band, through shared memory where it is on, and received without a copy."""
    for a in (np.arange(LARGE // 8, dtype=np.float64),
              np.asfortranarray(np.arange(LARGE // 4, dtype=np.int32).reshape(256, -1))):
        a.flags.writeable = a.flags.f_contiguous  # one read-only, one writable
        back, where = rpc.rpc_sync("worker1", th.echo_where, args=(a,))
        assert back.tobytes() == a.tobytes() and back.strides == a.strides
        assert back.flags.writeable == a.flags.writeable
        if group.shm:  # and it came back through shared memory, as tensors do (above)
            assert th.is_segment(where), where
        else:
            assert "torchrpc" not in where and "torchrpc" not in th.mapping_of(back)


def test_segments_are_reused_but_never_while_in_use(group):
    kept = []
    for i in range(12):
        x = torch.full((LARGE // 4,), float(i))
        back = _echo(x)
        assert torch.equal(back, x)
        if i % 3 == 0:
            kept.append((i, back))  # these stay alive: their segments must not be reused
        del back
    for i, t in kept:
        assert torch.equal(t, torch.full((LARGE // 4,), float(i))), i
    tx, rx = th.shm_segments()
    if group.shm:
        # 4 held + a few in flight; without reuse there would be one per echo.
        assert 1 <= tx <= 8 and rx <= 8, (tx, rx)
        remote_tx, _ = rpc.rpc_sync("worker1", th.shm_segments)
        assert 1 <= remote_tx <= 8, remote_tx
    del kept


def test_a_tensor_the_callee_keeps_comes_back_as_a_copy(group):
    # Returned buffers go back into the caller's own segment; one the callee still
    # holds must arrive as a copy all the same, owned by nobody else.
    x = torch.full((LARGE // 4,), 7.0)
    seven = x.clone()
    rpc.rpc_sync("worker1", th.hold, args=("kept", x))
    r1 = rpc.rpc_sync("worker1", th.held, args=("kept",))
    r2 = rpc.rpc_sync("worker1", th.held, args=("kept",))
    r1 += 1
    assert torch.equal(r2, seven)
    assert torch.equal(rpc.rpc_sync("worker1", th.held, args=("kept",)), seven)
    rpc.rpc_sync("worker1", th.bump_held, args=("kept",))
    assert torch.equal(r2, seven) and torch.equal(r1, seven + 1)
    assert torch.equal(rpc.rpc_sync("worker1", th.held, args=("kept",)), seven + 1)
    # An echo comes back without a copy; changing it changes nothing on the callee.
    rpc.rpc_sync("worker1", th.drop_all)
    back = _echo(x)
    back -= 7
    assert torch.equal(x, seven) and not back.any()
    del r1, r2, back
    if group.shm:
        returned = rpc.rpc_sync("worker1", th.debug_counter,
                                args=("transport.shm_buffers_returned",))
        assert returned >= 4, returned


def test_concurrent_large_and_small_calls(group):
    def run(i: int) -> None:
        for j in range(6):
            n = (SMALL, LARGE, 3 * LARGE + 4)[(i + j) % 3] // 4
            x = torch.randint(0, 1 << 30, (n,), dtype=torch.int32)
            to = f"worker{1 + (i + j) % 2}"
            assert torch.equal(_echo(x, to), x)

    errors = helpers.run_in_threads(run, [(i,) for i in range(6)], timeout=120)
    assert not errors, errors[0]
    # Workers pass large tensors on to each other, too.
    x = torch.randn(LARGE // 4)
    assert torch.equal(rpc.rpc_sync("worker2", th.echo_via, args=("worker1", x)), x)


def test_requests_run_on_the_reader_yet_never_hold_up_the_connection(group):
    # A request runs on the thread that read it. One that blocks on something other
    # than an RPC keeps that thread, but the reading role moves on within a tick, so
    # the request it waits for (sent after it, on the same connection) gets through.
    key = f"flag-{group.shm}"
    waiting = rpc.rpc_async("worker1", th.wait_for_flag, args=(key, 10.0))
    time.sleep(0.05)
    start = time.monotonic()
    assert rpc.rpc_sync("worker1", th.set_flag, args=(key,)) is True
    assert waiting.wait() is True
    assert time.monotonic() - start < 1.0
    # A long request does not hold up short ones behind it for long either.
    slow = rpc.rpc_async("worker1", helpers.sleep_then, args=(1.0, "slow"))
    time.sleep(0.05)
    start = time.monotonic()
    assert rpc.rpc_sync("worker1", helpers.add, args=(1, 2)) == 3
    assert time.monotonic() - start < 0.5
    assert slow.wait() == "slow"


# ----------------------------------------------------------------------------------------
# Bare transports: who may use shared memory


def _Peer(rank: int, shm_on: bool = True, same_host: bool = True, same_pids: bool = True,
          copy_back: bool = False) -> th.Peer:
    """A bare transport that echoes CALL frames and records everything else."""
    return th.Peer(rank, shm_on=shm_on, same_host=same_host, same_pids=same_pids,
                   copy_back=copy_back, shm_threshold=THRESHOLD)


def _call(conn, peer: th.Peer, data: torch.Tensor) -> torch.Tensor:
    conn.send(Kind.CALL, 0, 1, b"e", [_wire.tensor_bytes(data)], data)
    header, _, bufs = peer.frames.get(timeout=20)
    assert header.kind == Kind.RESPONSE
    return bufs[0]


@pytest.mark.parametrize("a_shm, b_shm, same_host, same_pids, used", [
    (True, True, True, True, True),
    (True, True, False, True, False),  # peers on different hosts never try it
    (True, False, True, True, False),  # both must offer it
    (False, True, True, True, False),
    (True, True, True, False, False),  # a peer that cannot open our memfds gets none
])
def test_shared_memory_needs_both_sides_the_same_host_and_pids(a_shm, b_shm, same_host,
                                                               same_pids, used):
    a, b = _Peer(0, a_shm, same_host, same_pids), _Peer(1, b_shm, same_host, same_pids)
    try:
        conn = a.connect(b)
        before = torchrpc_segments([os.getpid()])
        data = torch.randint(0, 255, (LARGE,), dtype=torch.uint8)
        back = _call(conn, a, data)
        assert torch.equal(back, data)
        assert (conn.shm_tx is not None) == used
        # Sent to b in a segment of a's, and back in it (see shm.py: send back).
        assert (b.t.debug_info()["transport.shm_buffers_returned"] == 1) == used
        assert torchrpc_segments([os.getpid()]) == before == []  # never a file
    finally:
        a.close()
        b.close()


def _authentic(conn, head: bytes, envelope: bytes, data: bytes = b"") -> bytes:
    """A frame of ``head`` (with one buffer or more), ``envelope`` and the stream bytes
    ``data`` of its buffers, as the peer's own code would send it (with its MACs when the
    connection has them): bad content from a peer that holds the secret."""
    return macs_around(conn.mac_tx, head, envelope, [data])


def test_bad_shared_memory_references_close_only_that_connection():
    a, b = _Peer(0), _Peer(1)
    c = _Peer(2, shm_on=False)
    try:
        good = a.connect(b)
        assert torch.equal(_call(good, a, torch.ones(10, dtype=torch.uint8)), torch.ones(10))
        for bad_name in ["torchrpc-0-1-aa-404", "passwd", "torchrpc-..-x"]:
            conn = a.connect(b)
            head = _wire.pack_header(Kind.CALL, _wire.FLAG_SHM, 2, 1, [LARGE | _wire.SHM_BIT])
            ref = bad_name.encode().ljust(_wire.SHM_REF_SIZE, b"\0")
            conn.sock.sendall(_authentic(conn, head, b"e", ref))
            wait_for(f"the connection that named {bad_name!r} closes", lambda: conn.closed, 10)
        wait_for("b records a ProtocolError",
                 lambda: any(isinstance(why, ProtocolError) for why in b.closed), 10)
        # A peer that never negotiated shared memory is refused such frames.
        conn = a.connect(c)
        assert conn.shm_rx is None and conn.shm_tx is None
        head = _wire.pack_header(Kind.CALL, _wire.FLAG_SHM, 3, 1, [LARGE | _wire.SHM_BIT])
        conn.sock.sendall(_authentic(conn, head, b"e", _wire.pack_shm_ref("torchrpc-1-2-ab-3")))
        # Both ends: c records its reason a moment after a sees EOF.
        wait_for("both ends close", lambda: conn.closed and c.closed, 10)
        assert any("did not negotiate" in str(w) for w in c.closed), c.closed
        # The first connection is unaffected.
        assert torch.equal(_call(good, a, torch.full((LARGE,), 3, dtype=torch.uint8)),
                           torch.full((LARGE,), 3, dtype=torch.uint8))
    finally:
        for p in (a, b, c):
            p.close()


def test_senders_retire_idle_and_outgrown_segments():
    a, b = _Peer(0), _Peer(1, copy_back=True)
    try:
        conn = a.connect(b)
        for n in (LARGE, 4 * LARGE, 16 * LARGE):
            back = _call(conn, a, torch.zeros(n, dtype=torch.uint8))
            del back
        b_conn = next(iter(b.t._links._shm_conns))
        # A bigger segment retires the smaller free ones (the last may still have been
        # in use by the peer when the next was made).
        assert 1 <= conn.shm_tx.num_segments <= 2 and 1 <= b_conn.shm_tx.num_segments <= 2
        assert conn.shm_rx.num_segments <= 2 and b_conn.shm_rx.num_segments <= 2
        now = time.monotonic() + shm.IDLE_RETIRE + 1

        def retired() -> bool:
            conn.shm_tx.housekeeping(now)
            b_conn.shm_tx.housekeeping(now)
            return conn.shm_tx.num_segments == 0 and b_conn.shm_tx.num_segments == 0
        # Each segment is retired once the peer's reader has dropped its last buffers.
        wait_for("both senders retire every segment", retired, 10)
        a.t.housekeeping()
        b.t.housekeeping()
        assert conn.shm_rx.num_segments == 0 and b_conn.shm_rx.num_segments == 0
    finally:
        a.close()
        b.close()


def test_an_echo_goes_back_in_the_senders_own_segment_which_waits_for_both_sides():
    a, b = _Peer(0), _Peer(1)
    n = 16 * LARGE
    try:
        conn = a.connect(b)
        # Sent back, not copied: the reply lies in our own segment. (The sender copies
        # instead when the peer has not freed its tensors on it within about the time a
        # copy takes, which a busy machine may make it miss now and then.)
        for _ in range(10):
            first = _call(conn, a, torch.full((n,), 1, dtype=torch.uint8))
            assert torch.equal(first, torch.full((n,), 1, dtype=torch.uint8))
            (seg,) = conn.shm_tx._segments
            if seg.wrapped:
                break
            del first
        assert seg.wrapped == 1 and seg.returns.value == seg.released + 1
        where = th.mapping_of(first)
        assert th.is_segment(where) and seg.name.split(".")[0] in where, where
        b_conn = next(iter(b.t._links._shm_conns))
        assert b_conn.shm_tx is None or b_conn.shm_tx.num_segments == 0  # the peer made none
        # While the returned tensor lives, its segment is not reused: the next echo gets
        # another one, and the first keeps its bytes.
        second = _call(conn, a, torch.full((n,), 2, dtype=torch.uint8))
        assert conn.shm_tx.num_segments == 2
        assert torch.equal(first, torch.full((n,), 1, dtype=torch.uint8))
        del second
        assert not seg.free
        del first
        _wait(lambda: all(s.free for s in conn.shm_tx._segments), "both segments free")
        assert b.t.debug_info()["transport.shm_buffers_returned"] >= 2
        for i in range(5):  # reused from now on
            x = torch.full((n,), i, dtype=torch.uint8)
            assert torch.equal(_call(conn, a, x), x)
        assert conn.shm_tx.num_segments == 2
    finally:
        a.close()
        b.close()


def test_a_forged_return_reference_closes_the_connection():
    a, b = _Peer(0), _Peer(1)
    try:
        for forge in (lambda s: shm.return_ref(s.number + 1, 0),  # no segment of ours
                      lambda s: shm.return_ref(s.number, s.capacity),  # beyond its end
                      lambda s: shm.return_ref(s.number, 0)):  # nothing returned is due
            before = set(b.t._links._shm_conns)
            conn = a.connect(b)
            back = _call(conn, a, torch.zeros(LARGE, dtype=torch.uint8))
            del back
            (seg,) = conn.shm_tx._segments
            _wait(lambda: seg.free, "the echo's segment free again")
            (peer,) = set(b.t._links._shm_conns) - before
            closed = len(a.closed)
            head = _wire.pack_header(Kind.RESPONSE, _wire.FLAG_SHM, 9, 1,
                                     [LARGE | _wire.SHM_BIT])
            peer.sock.sendall(_authentic(peer, head, b"e", _wire.pack_shm_ref(forge(seg))))
            _wait(lambda: len(a.closed) > closed, "the connection closed")
            assert "return reference" in str(a.closed[-1]), a.closed[-1]
            assert conn.closed
    finally:
        a.close()
        b.close()


_wait = th.wait_for


def test_private_readers_stop_polling_when_polls_keep_missing():
    import socket

    from torchrpc._transport import connection, reader
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    conn = connection.Connection(a, 1, _wire.Limits(), lambda *args: None, lambda *args: None,
                                 outbound=True)
    conn.set_private(True)
    assert conn.spin
    frame = _wire.pack_header(Kind.RESPONSE, 0, 7, 2, []) + b"ok"

    def reply_after(seconds: float) -> None:
        threading.Timer(seconds, b.sendall, args=(frame,)).start()

    try:
        # Each answer comes long after a poll (200 us) has given up: misses pile up.
        for expected in range(1, reader._SPIN_MISSES + 1):
            reply_after(0.02)
            header, env, _ = conn.read_frame()
            assert header.request_id == 7 and env == b"ok"
            assert conn._misses == expected
        # Now the reader sleeps at once (no further miss is counted) ...
        reply_after(0.02)
        conn.read_frame()
        assert conn._misses == reader._SPIN_MISSES
        # ... until a probe (every _SPIN_PROBE-th wait) finds data at once: then it
        # polls again.
        waits = 0
        while conn._misses:
            b.sendall(frame)  # already there when the reader looks
            conn.read_frame()
            waits += 1
            assert waits <= reader._SPIN_PROBE
        assert waits > 1  # not the very next wait: only a probe
    finally:
        conn.close()
        b.close()


def test_private_readers_poll_longer_while_cpus_are_spare():
    import socket

    from torchrpc._transport import PollPolicy, connection
    short, long = 200e-6, 1.0  # long enough to be sure under load
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    conn = connection.Connection(a, 1, _wire.Limits(), lambda *args: None, lambda *args: None,
                                 outbound=True)
    conn.set_private(True)
    frame = _wire.pack_header(Kind.RESPONSE, 0, 7, 2, []) + b"ok"
    policy = conn.poll = PollPolicy(short, long)  # the connection's own: no agent changes it
    policy.set_spare_cpus(True)
    assert policy.seconds == long
    policy.set_spare_cpus(False)
    assert policy.seconds == short
    try:
        # An answer 50 ms after the wait began: beyond the short poll, within the long one.
        for spare, missed in ((False, 1), (True, 0)):
            policy.set_spare_cpus(spare)
            conn._misses = 0
            threading.Timer(0.05, b.sendall, args=(frame,)).start()
            header, env, _ = conn.read_frame()
            assert env == b"ok"
            assert conn._misses == missed, (spare, conn._misses)
    finally:
        conn.close()
        b.close()


def test_private_readers_poll_for_the_rest_of_a_frame_then_sleep():
    import socket

    from torchrpc._transport import PollPolicy, connection, reader
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    conn = connection.Connection(a, 1, _wire.Limits(), lambda *args: None, lambda *args: None,
                                 outbound=True)
    conn.set_private(True)
    gap = 0.1  # between a frame's first bytes and its rest
    # Envelopes that fit the read buffer, and one larger (read straight into its bytes).
    small, large = os.urandom(1000), os.urandom(2 * reader._READ_CHUNK + 3)
    try:
        for seconds, polls in ((1.0, True), (200e-6, False)):
            conn.poll = PollPolicy(seconds, seconds)
            for rid, env in enumerate((small, large)):
                frame = _wire.pack_header(Kind.RESPONSE, 0, rid, len(env), []) + env
                cut = _wire.HEADER_SIZE + 100
                b.sendall(frame[:cut])
                threading.Timer(gap, b.sendall, args=(frame[cut:],)).start()
                conn._misses = 0
                cpu = time.thread_time()
                header, got, _ = conn.read_frame()
                cpu = time.thread_time() - cpu
                assert header.request_id == rid and got == env
                assert conn._misses == 0  # a frame under way is no missed poll
                # Polling keeps this thread on its CPU through the gap; sleeping does not.
                if polls:
                    assert cpu > gap / 4, (len(env), cpu)
                else:
                    assert cpu < gap / 4, (len(env), cpu)
    finally:
        conn.close()
        b.close()


class _OnPath:
    """A party on the path between a client and a server (a TCP relay): after the
    handshake it applies ``alter`` to the client's bytes before passing them on.

    It stands where a port-forward would: ``server`` (a _Peer) publishes the relay's
    address as its own, so the handshake passes (a relay at an address the server did
    not publish fails it, tests/transport/test_relay.py)."""

    def __init__(self, server, alter) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()
        self._server = server.t.address
        server.t._links.address = self.address
        self._alter = alter
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _pump(self, src, dst, first: int = 0, alter=None) -> None:
        passed = b""
        while len(passed) < first:  # the handshake messages go through untouched
            chunk = src.recv(first - len(passed))
            if not chunk:
                return
            passed += chunk
            dst.sendall(chunk)
        while True:
            try:
                chunk = src.recv(1 << 16)
            except OSError:
                return
            if not chunk:
                return
            try:
                dst.sendall(alter(chunk) if alter else chunk)
            except OSError:
                return

    def _run(self) -> None:
        client, _ = self.listener.accept()
        server = socket.create_connection(self._server)
        back = threading.Thread(target=self._pump, args=(server, client), daemon=True)
        back.start()
        self._pump(client, server, handshake.HELLO.size + handshake.PROOF.size, self._alter)
        server.close()
        client.close()

    def close(self) -> None:
        self.listener.close()


def _flip_envelope_byte(chunk: bytes) -> bytes:
    i = _wire.HEADER_SIZE + 8  # the first frame's envelope (one buffer length first)
    return chunk[:i] + bytes([chunk[i] ^ 1]) + chunk[i + 1:] if len(chunk) > i else chunk


def _replay_first_frame(chunk: bytes) -> bytes:
    return chunk + chunk  # the frame (one write here) arrives twice


def _inject_a_frame(chunk: bytes) -> bytes:
    # A well-formed frame made by someone without the connection's keys goes first.
    return _wire.pack_header(Kind.CALL, 0, 9, 1, []) + b"x" + chunk


@pytest.mark.parametrize("alter", [_flip_envelope_byte, _replay_first_frame, _inject_a_frame])
def test_frames_altered_on_the_path_are_refused(alter):
    a, b = _Peer(0, shm_on=False, same_host=False), _Peer(1, shm_on=False, same_host=False)
    relay = _OnPath(b, alter)
    try:
        conn = a.t.connect(1, *relay.address, timeout=5)
        assert conn.mac_tx is not None  # plain TCP: every frame carries a MAC
        conn.send(Kind.CALL, 0, 1, b"e", [_wire.tensor_bytes(torch.ones(4))], None)
        wait_for("b closes the connection", lambda: b.closed, 10)
        assert any(isinstance(why, ProtocolError) and "failed authentication" in str(why)
                   for why in b.closed), b.closed
        if alter is not _replay_first_frame:  # a replay's first copy is genuine
            assert a.frames.empty()  # the server ran nothing of it
    finally:
        relay.close()
        a.close()
        b.close()


def test_frames_pass_a_faithful_relay():
    a, b = _Peer(0, shm_on=False, same_host=False), _Peer(1, shm_on=False, same_host=False)
    relay = _OnPath(b, None)
    try:
        conn = a.t.connect(1, *relay.address, timeout=5)
        for i in range(20):
            assert torch.equal(_call(conn, a, torch.full((i + 1,), i, dtype=torch.uint8)),
                               torch.full((i + 1,), i, dtype=torch.uint8))
        assert not b.closed
    finally:
        relay.close()


def test_segments_are_sealed_memfds_that_no_one_can_truncate():
    # A segment is no file in /dev/shm (it cannot outlive its processes), and its size is
    # sealed: a sender that truncated a mapped segment would crash the receiver (SIGBUS).
    a, b = _Peer(0), _Peer(1, copy_back=True)
    try:
        conn = a.connect(b)
        before = torchrpc_segments([os.getpid()])
        back = _call(conn, a, torch.full((LARGE,), 7, dtype=torch.uint8))
        assert th.is_segment(th.mapping_of(back))
        assert torchrpc_segments([os.getpid()]) == before == []
        segments = list(conn.shm_tx._segments)
        for seg in segments:
            seals = fcntl.fcntl(seg.fd, fcntl.F_GET_SEALS)
            assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
            with pytest.raises(PermissionError):
                os.ftruncate(seg.fd, shm.HEADER)
        assert int(back[-1]) == 7  # the receiver's mapping is whole
    finally:
        a.close()
        b.close()


def test_a_segment_that_could_shrink_is_refused_not_mapped():
    a, b = _Peer(0), _Peer(1)
    name = shm._names.next()
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)  # not sealed
    try:
        os.ftruncate(fd, shm.HEADER + LARGE)
        conn = a.connect(b)
        head = _wire.pack_header(Kind.CALL, _wire.FLAG_SHM, 2, 1, [LARGE | _wire.SHM_BIT])
        conn.sock.sendall(_authentic(conn, head, b"e", _wire.pack_shm_ref(f"{name}.{fd}")))
        wait_for("b refuses the segment", lambda: any("not sealed" in str(why) for why in b.closed),
                 10)
        assert any(isinstance(why, ProtocolError) and "not sealed" in str(why)
                   for why in b.closed), b.closed
        os.ftruncate(fd, 0)  # had it been mapped, reading it now would be SIGBUS
        good = a.connect(b)
        assert torch.equal(_call(good, a, torch.ones(LARGE, dtype=torch.uint8)),
                           torch.ones(LARGE, dtype=torch.uint8))
    finally:
        os.close(fd)
        a.close()
        b.close()


def test_tensors_go_inline_to_peers_on_plain_tcp_only_while_tiny():
    # A frame MAC on plain TCP covers the envelope, not the out-of-band buffers: tensors
    # to such a peer travel inline only up to MAC_INLINE_MAX; elsewhere up to the default.
    a, b = _Peer(0, same_host=False), _Peer(1, same_host=False)
    c, d = th.Peer(2, local_socket=True), th.Peer(3, local_socket=True)
    try:
        assert a.connect(b).mac_tx is not None
        wait_for("b registers the connection", lambda: 0 in b.t.inline_max, 10)
        assert a.t.inline_max == {1: links.MAC_INLINE_MAX} == {
            r + 1: n for r, n in b.t.inline_max.items()}
        assert c.connect(d, local=True).mac_tx is None
        wait_for("d accepts the connection", lambda: not d.accepted.empty(), 10)
        assert c.t.inline_max == {} and d.t.inline_max == {}
    finally:
        for peer in (a, b, c, d):
            peer.close()


def test_a_rank_reached_again_without_frame_macs_gets_the_default_inline_bound():
    # Rank 1 first over plain TCP, then (restarted on this host) over a Unix socket: the
    # small bound goes with the MACs.
    a = th.Peer(0, local_socket=True)
    far, near = _Peer(1, same_host=False), th.Peer(1, local_socket=True)
    try:
        assert a.connect(far).mac_tx is not None
        assert a.t.inline_max == {1: links.MAC_INLINE_MAX}
        assert a.connect(near, local=True).mac_tx is None
        assert a.t.inline_max == {}
    finally:
        for peer in (a, far, near):
            peer.close()
