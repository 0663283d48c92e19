"""A connection's stripe (``_transport/stripe.py``) over real sockets: bare transports in
this process on loopback TCP, as two workers on different hosts (no shared memory).
test_two_namespaces.py carries striped frames across a veth pair and flips a bit on the
stripe.

A stripe attaches only to a connection of the same rank that its handshake names, once;
frames below the threshold, or to a peer that offers no stripe, use the connection alone;
a stripe that breaks in the middle of a frame closes its connection on both sides, and
the frame reaches nobody; a stripe that comes before its connection is registered
waits for it, and one lost while it opens (refused, or given up by its dialer) leaves
its connection with one socket on both sides.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time

import pytest
import torch

from torchrpc import _wire
from torchrpc._transport import dial, handshake
from torchrpc._wire import Kind

from ..support import transport as th

PIECE = handshake.STREAM_PIECE
STRIPE = 2 * PIECE


@contextlib.contextmanager
def _peers(*thresholds: int):
    """Peers of ranks 0, 1, ... offering stripes from these thresholds (0: none)."""
    peers = [th.Peer(rank, same_host=False, stripe_threshold=t)
             for rank, t in enumerate(thresholds)]
    try:
        yield peers
    finally:
        for p in peers:
            p.close()


def _striped(a: th.Peer, b: th.Peer, private: bool = False):
    """a's connection to b and b's side of it, once both have their stripe."""
    conn = a.connect(b, private=private)
    accepted = b.accepted.get(timeout=10)
    th.wait_for(lambda: conn.stripe is not None and accepted.stripe is not None,
             "the stripe to attach on both sides")
    assert accepted.stripe.usable()  # a's READY was read: b's frames may use it too
    return conn, accepted


def _echo(conn, peer: th.Peer, tensors, rid: int = 1):
    conn.send(Kind.CALL, 0, rid, b"e", [_wire.tensor_bytes(t) for t in tensors], tensors)
    header, _, bufs = peer.frames.get(timeout=60)
    assert header.kind == Kind.RESPONSE and header.request_id == rid
    return header, bufs


def _data(n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8)


def test_only_frames_of_the_threshold_and_more_take_the_stripe():
    with _peers(STRIPE, STRIPE) as (a, b):
        conn, accepted = _striped(a, b)
        small, large = _data(STRIPE - 1), _data(3 * PIECE + 7)
        header, (back,) = _echo(conn, a, [small])
        assert torch.equal(back, small) and not header.flags & _wire.FLAG_STRIPED
        assert conn.stripe.sent == accepted.stripe.sent == 0
        header, (back, back_small) = _echo(conn, a, [large, small], rid=2)
        assert torch.equal(back, large) and torch.equal(back_small, small)
        assert header.flags & _wire.FLAG_STRIPED
        second = large.numel() + small.numel() - PIECE * 2  # cut at 2 whole pieces
        assert conn.stripe.sent == accepted.stripe.received == second
        assert accepted.stripe.sent == conn.stripe.received == second
        assert not a.closed and not b.closed


@pytest.mark.parametrize("thresholds", [(STRIPE, 0), (0, STRIPE)], ids=["b-none", "a-none"])
def test_a_peer_that_offers_no_stripe_gets_one_socket(thresholds):
    with _peers(*thresholds) as (a, b):
        conn = a.connect(b)
        accepted = b.accepted.get(timeout=10)
        assert conn.stripe_threshold == accepted.stripe_threshold == 0
        data = _data(4 * PIECE)
        header, (back,) = _echo(conn, a, [data])
        assert torch.equal(back, data) and not header.flags & _wire.FLAG_STRIPED
        assert conn.stripe is None and accepted.stripe is None


@pytest.mark.parametrize("same_pids", [True, False])
def test_shared_memory_or_else_a_stripe_carries_large_buffers_on_one_host(same_pids):
    # Two workers of one host over TCP that both offer shared memory: where the peer sees
    # this process's pids, its segments carry large buffers and no stripe is opened; in
    # another pid namespace it cannot open them, and the stripe carries them instead.
    peers = [th.Peer(rank, shm_on=True, same_host=True, same_pids=same_pids,
                     stripe_threshold=STRIPE) for rank in (0, 1)]
    a, b = peers
    try:
        conn = a.connect(b)  # the stripe, if any, is attached before connect() returns
        accepted = b.accepted.get(timeout=10)
        data = _data(3 * PIECE)
        header, (back,) = _echo(conn, a, [data])
        assert torch.equal(back, data)
        if same_pids:
            assert conn.stripe is None and header.flags & _wire.FLAG_SHM
            assert not header.flags & _wire.FLAG_STRIPED
        else:
            assert conn.stripe is not None and accepted.stripe is not None
            assert header.flags & _wire.FLAG_STRIPED and not header.flags & _wire.FLAG_SHM
            # cut at its half, rounded down to a whole piece: one piece, and two on the stripe
            assert conn.stripe.sent == accepted.stripe.received == 2 * PIECE
    finally:
        for p in peers:
            p.close()


class _Named:
    """Stands for a connection in dial_stripe: the rank and server nonce it names."""

    def __init__(self, peer_rank: int, nonce: bytes) -> None:
        self.peer_rank = peer_rank
        self.nonces = (b"", nonce)
        self.closed = False


@pytest.mark.parametrize("case", ["unknown-nonce", "other-rank", "second-stripe"])
def test_a_stripe_that_names_no_free_connection_of_its_rank_is_refused(case, caplog):
    with _peers(STRIPE, STRIPE, STRIPE) as (a, b, c):
        conn, accepted = _striped(a, b)
        stripe = accepted.stripe
        dialer, nonce = {"unknown-nonce": (a, os.urandom(handshake.NONCE)),
                         "other-rank": (c, conn.nonces[1]),
                         "second-stripe": (a, conn.nonces[1])}[case]
        caplog.set_level(logging.INFO, logger="torchrpc")
        dial.dial_stripe(dialer.t._links, _Named(1, nonce), *b.t.address, timeout=5)
        th.wait_for(lambda: any("opened a stripe that names no connection of its own here"
                             in r.getMessage() for r in caplog.records), "b to refuse it")
        assert any("opened no stripe" in r.getMessage() for r in caplog.records)
        assert accepted.stripe is stripe and not stripe.closed  # the real one stays
        data = _data(4 * PIECE)
        _, (back,) = _echo(conn, a, [data])
        assert torch.equal(back, data) and not a.closed and not b.closed


def test_a_stripe_that_comes_before_its_connection_is_registered_waits_for_it(monkeypatch):
    # a opens the stripe as soon as it has the ACCEPT; b registers the connection later.
    with _peers(STRIPE, STRIPE) as (a, b):
        stripes = b.t._links.stripes
        expect = stripes.expect

        def late(conn):
            time.sleep(1.0)
            expect(conn)
        monkeypatch.setattr(stripes, "expect", late)
        conn, accepted = _striped(a, b)
        data = _data(4 * PIECE)
        header, (back,) = _echo(conn, a, [data])
        assert torch.equal(back, data) and header.flags & _wire.FLAG_STRIPED
        assert conn.stripe.sent == accepted.stripe.sent == 2 * PIECE
        assert not a.closed and not b.closed


@pytest.mark.parametrize("case", ["refused", "given-up"])
def test_a_stripe_lost_while_it_opens_leaves_one_socket_on_both_sides(case, caplog,
                                                                      monkeypatch):
    # refused: b finds no connection the stripe may join. given-up: b answers the
    # stripe's handshake after a has stopped waiting; b has attached it then, and must
    # not send on it.
    with _peers(STRIPE, STRIPE) as (a, b):
        stripes = b.t._links.stripes
        parent = stripes.parent

        def refuse(rank, nonce, deadline):
            return None

        def late(rank, nonce, deadline):
            time.sleep(1.5)
            return parent(rank, nonce, deadline)
        monkeypatch.setattr(stripes, "parent", refuse if case == "refused" else late)
        caplog.set_level(logging.INFO, logger="torchrpc")
        conn = a.t.connect(1, *b.t.address, timeout=1.0)  # a waits 1 s for the ACCEPT
        accepted = b.accepted.get(timeout=10)
        assert conn.stripe is None
        assert any("opened no stripe" in r.getMessage() for r in caplog.records)
        if case == "refused":
            th.wait_for(lambda: any("opened a stripe that names no connection of its own"
                                    in r.getMessage() for r in caplog.records), "b to refuse it")
            assert accepted.stripe is None
        else:
            th.wait_for(lambda: accepted.stripe is not None and accepted.stripe.closed,
                        "b's side of the stripe to close unused")
            assert any("instead of saying it has the stripe" in r.getMessage()
                       for r in caplog.records)
        # Large frames both ways over the connection alone, which stays open.
        data = _data(4 * PIECE)
        header, (back,) = _echo(conn, a, [data])
        assert torch.equal(back, data) and not header.flags & _wire.FLAG_STRIPED
        assert not conn.closed and not accepted.closed and not a.closed and not b.closed


@pytest.mark.parametrize("side", ["receiver", "sender"])
def test_a_stripe_that_breaks_mid_frame_closes_its_connection(side):
    with _peers(STRIPE, STRIPE) as (a, b):
        conn, accepted = _striped(a, b)
        broken = accepted if side == "receiver" else conn
        broken.stripe.link.shutdown(socket.SHUT_RDWR)
        data = _data(64 << 20)
        try:
            conn.send(Kind.CALL, 0, 1, b"e", [_wire.tensor_bytes(data)], data)
        except Exception:  # noqa: BLE001 - the sender may see its stripe fail first
            pass
        th.wait_for(lambda: conn.closed and accepted.closed, "both ends to close", 30)
        assert a.frames.empty() and b.frames.empty()
        assert conn.stripe.closed and accepted.stripe.closed
        assert b.closed and a.closed  # each end was told why


def test_closing_the_transport_ends_every_stripe_thread_at_once():
    with _peers(STRIPE, STRIPE) as (a, b):
        # private: no thread reads a's side, which would close it when its socket shuts
        conn, accepted = _striped(a, b, private=True)
        data = _data(3 * PIECE)  # one way only (b answers no RESPONSE): a's sending
        # thread and b's receiving one run, the other two never start
        conn.send(Kind.RESPONSE, 0, 1, b"e", [_wire.tensor_bytes(data)], data)
        _, _, (got,) = b.frames.get(timeout=30)
        assert torch.equal(got, data) and accepted.stripe.received == 2 * PIECE
        for peer in (a, b):
            started = time.monotonic()
            assert peer.t.close(timeout=10) == []  # no thread left running
            assert time.monotonic() - started < 5
        assert conn.stripe.closed and accepted.stripe.closed
