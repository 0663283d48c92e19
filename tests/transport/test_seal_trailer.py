"""The seal of a frame's tensor bytes behind them (``handshake.FEATURE_SEAL_TRAILER``),
over real sockets: bare transports in this process on loopback TCP, as two workers on
different hosts (no shared memory, so every frame carries MACs).

A byte changed on the path is refused before the frame reaches anyone; a peer that does
not offer the feature gets today's layout (the seal in front of the tag); large tensors
and tensors around the seal's piece size arrive intact, alone, several to a frame, and
in frames that several threads send at once (the writer seals them in one batch).
test_two_namespaces.py runs the same checks across a veth pair between two network
namespaces.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from torchrpc import _wire
from torchrpc._transport import handshake
from torchrpc._wire import Kind
from torchrpc.errors import ConnectionClosedError, ProtocolError

from ..support import relay as rh
from ..support import transport as th
from ..support.group import wait_for

PIECE = handshake.STREAM_PIECE


def _peer(rank: int, trailer: bool = True) -> th.Peer:
    peer = th.Peer(rank, shm_on=False, same_host=False)
    if not trailer:  # a worker that does not know the feature
        peer.t._links.features &= ~handshake.FEATURE_SEAL_TRAILER
    return peer


@contextlib.contextmanager
def _pair(a_trailer: bool = True, b_trailer: bool = True):
    """Peers 0 and 1, closed when done; either may not know the trailer feature."""
    a, b = _peer(0, a_trailer), _peer(1, b_trailer)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _echo(conn, peer: th.Peer, tensors, rid: int = 1):
    conn.send(Kind.CALL, 0, rid, b"e", [_wire.tensor_bytes(t) for t in tensors], tensors)
    header, _, bufs = peer.frames.get(timeout=60)
    assert header.kind == Kind.RESPONSE and header.request_id == rid
    return bufs


@pytest.mark.parametrize("a_trailer,b_trailer", [(True, True), (True, False), (False, True)])
def test_the_seal_trails_the_buffers_only_where_both_offer_it(a_trailer, b_trailer):
    with _pair(a_trailer, b_trailer) as (a, b):
        conn = a.connect(b)
        both = a_trailer and b_trailer
        accepted = b.accepted.get(timeout=10)
        for mac in (conn.mac_tx, conn.mac_rx, accepted.mac_tx, accepted.mac_rx):
            assert mac.buffers and mac.trailer is both
            assert mac.front == (handshake.SEAL_NUMBER_SIZE if both else handshake.SEAL_SIZE)
        data = torch.randint(0, 255, (3 * PIECE + 5,), dtype=torch.uint8)
        (back,) = _echo(conn, a, [data])
        assert torch.equal(back, data)
        assert not a.closed and not b.closed


@pytest.mark.parametrize("trailer", [True, False], ids=["trailer", "in-front"])
@pytest.mark.parametrize("where", ["first-piece", "piece-edge", "last-byte"])
def test_a_changed_tensor_byte_is_refused_and_never_delivered(trailer, where):
    with _pair(trailer, trailer) as (a, b):
        n = 4 * PIECE
        at = {"first-piece": 100, "piece-edge": 2 * PIECE - 1, "last-byte": n - 1}[where]
        flipped: list = []
        relay = rh.Relay(b.t.address, rh.flip_at(rh.first_tensor_byte(at, trailer), flipped))
        b.t._links.address = relay.address  # b is behind a port-forward it published
        try:
            conn = a.t.connect(1, *relay.address, timeout=5)
            assert conn.mac_tx.trailer is trailer
            sent = torch.randint(0, 255, (n,), dtype=torch.uint8)
            conn.send(Kind.CALL, 0, 1, b"e", [_wire.tensor_bytes(sent)], sent)
            wait_for("b refuses the frame and closes", lambda: b.closed and conn.closed, 20)
            assert flipped
            assert any(isinstance(why, ProtocolError)
                       and "tensor bytes of a frame from rank 0 failed authentication" in str(why)
                       for why in b.closed), b.closed
            assert a.frames.empty() and b.frames.empty()  # the frame reached nobody
            with pytest.raises(ConnectionClosedError):
                conn.send(Kind.CALL, 0, 2, b"e", [], None)
        finally:
            relay.close()


@pytest.mark.parametrize("trailer", [True, False], ids=["trailer", "in-front"])
def test_a_64_mb_tensor_roundtrips_intact(trailer):
    with _pair(trailer, trailer) as (a, b):
        conn = a.connect(b)
        data = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8)
        (back,) = _echo(conn, a, [data])
        assert torch.equal(back, data)
        assert not a.closed and not b.closed


def test_tensors_around_the_piece_size_roundtrip_alone_together_and_from_many_threads():
    sizes = [1, PIECE - 1, PIECE, PIECE + 1, 2 * PIECE, 2 * PIECE + 3]
    with _pair() as (a, b):
        conn = a.connect(b)
        assert conn.mac_tx.trailer
        tensors = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in sizes]
        for rid, t in enumerate(tensors, 1):
            (back,) = _echo(conn, a, [t], rid)
            assert torch.equal(back, t), len(t)
        # All in one frame, with an empty one between them.
        together = tensors[:3] + [torch.empty(0, dtype=torch.uint8)] + tensors[3:]
        back = _echo(conn, a, together, 100)
        assert [torch.equal(x, y) for x, y in zip(back, together)] == [True] * len(together)
        # Frames with and without buffers from several threads at once: they queue in
        # the outbox while one is written, and the writer seals each in its batch.
        small = [torch.full((k,), k, dtype=torch.uint8) for k in range(1, 9)]
        sent = {}

        def send(i: int) -> None:
            for j in range(20):
                rid = 1000 + 100 * i + j
                parts = [small[j % 8], tensors[(i + j) % len(tensors)]] if j % 3 else []
                sent[rid] = parts
                conn.send(Kind.CALL, 0, rid, b"e", [_wire.tensor_bytes(p) for p in parts],
                          parts)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for _ in range(len(sent)):
            header, _, bufs = a.frames.get(timeout=60)
            want = sent.pop(header.request_id)
            assert [torch.equal(x, y) for x, y in zip(bufs, want)] == [True] * len(want)
            assert len(bufs) == len(want)
        assert not sent and not a.closed and not b.closed


def test_a_buffer_the_writer_cannot_seal_closes_the_connection():
    with _pair() as (a, b):
        conn = a.connect(b)
        strided = memoryview(bytes(range(64)))[::2]  # not contiguous: no MAC takes it
        conn.send(Kind.CALL, 0, 1, b"e", [strided], None)
        wait_for("the connection closes", lambda: conn.closed, 10)
        assert any(isinstance(why, BufferError) for why in a.closed), a.closed
        with pytest.raises(ConnectionClosedError):
            conn.send(Kind.CALL, 0, 2, b"e", [], None)
        # Another connection to the same peer is unaffected.
        other = a.connect(b)
        data = torch.arange(PIECE + 7, dtype=torch.int64).to(torch.uint8)
        (back,) = _echo(other, a, [data], 3)
        assert torch.equal(back, data)
