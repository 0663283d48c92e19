"""A party between two workers: a relay that forwards the bytes to the worker the dialer
wanted fails the handshake, naming that worker; one that passes it (a port-forward the
worker published) and changes a tensor byte gets the frame refused, over plain TCP.

First with bare transports in this process over real sockets, then in a group of real
workers, where the dialer's table names the relay as a forged store record would.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import torchrpc.rpc as rpc
from torchrpc import _wire
from torchrpc._transport import handshake
from torchrpc._wire import Kind
from torchrpc.errors import AuthenticationError, ProtocolError

from ..support import frames, helpers, relay as rh
from ..support import transport as th
from ..support.group import running_group, wait_for

SIZE = 1 << 20


def _peer(rank: int, tensor_mac: bool = True) -> th.Peer:
    # Peers on "different hosts": plain TCP, no shared memory, so frames carry MACs.
    return th.Peer(rank, shm_on=False, same_host=False, tensor_mac=tensor_mac)


def _echo(conn, peer: th.Peer, data: torch.Tensor, rid: int = 1) -> torch.Tensor:
    conn.send(Kind.CALL, 0, rid, b"e", [_wire.tensor_bytes(data)], data)
    header, _, bufs = peer.frames.get(timeout=20)
    assert header.kind == Kind.RESPONSE and header.request_id == rid
    return bufs[0]


# -- bare transports ---------------------------------------------------------------------------

def test_a_relay_the_worker_did_not_publish_fails_the_handshake_naming_the_worker():
    a, b = _peer(0), _peer(1)
    relay = rh.Relay(b.t.address)
    try:
        with pytest.raises(AuthenticationError) as info:
            a.t.connect(1, *relay.address, timeout=5)
        host, port = relay.address
        assert f"failed authentication as rank 1 (incarnation 0) listening at {host}:{port}" \
            in str(info.value)
        assert relay.connections == 1
        # Another incarnation than the one the dialer means fails the same way.
        with pytest.raises(AuthenticationError, match="as rank 1 \\(incarnation 7\\)"):
            a.t.connect(1, *b.t.address, timeout=5, incarnation=7)
        # Dialed at its published address, the same worker passes.
        conn = a.connect(b)
        assert torch.equal(_echo(conn, a, rh.pattern_tensor(SIZE)), rh.pattern_tensor(SIZE))
    finally:
        relay.close()
        a.close()
        b.close()


@pytest.mark.parametrize("tensor_mac", [True, False])
def test_a_tensor_byte_changed_on_the_path_is_refused_unless_the_check_is_off(tensor_mac):
    a, b, c = _peer(0, tensor_mac), _peer(1, tensor_mac), _peer(2, tensor_mac)
    relay = rh.Relay(b.t.address, rh.flip_one_tensor_byte)
    b.t._links.address = relay.address  # b is behind a port-forward whose address it published
    try:
        conn = a.t.connect(1, *relay.address, timeout=5)
        assert conn.mac_tx is not None and conn.mac_tx.buffers is tensor_mac
        sent = rh.pattern_tensor(SIZE)
        if tensor_mac:
            conn.send(Kind.CALL, 0, 1, b"e", [_wire.tensor_bytes(sent)], sent)
            wait_for("b refuses the frame and closes", lambda: b.closed and conn.closed, 10)
            assert any(isinstance(why, ProtocolError)
                       and "tensor bytes of a frame from rank 0 failed authentication" in str(why)
                       for why in b.closed), b.closed
            assert a.frames.empty()  # nothing of it was echoed: the frame was never handed on
        else:
            got = _echo(conn, a, sent)  # the check off: the changed tensor arrives
            assert int((got != sent).sum()) == 1 and not b.closed
        # b keeps serving others, over plain TCP with the same MACs.
        other = c.t.connect(1, *relay.address, timeout=5)
        assert other.mac_tx.buffers is tensor_mac
        b.t._links.address = b.t.address
        direct = c.connect(b)
        assert torch.equal(_echo(direct, c, torch.arange(SIZE, dtype=torch.uint8)),
                           torch.arange(SIZE, dtype=torch.uint8))
    finally:
        relay.close()
        for p in (a, b, c):
            p.close()


@pytest.mark.parametrize("tensor_mac", [True, False])
def test_the_tampering_relay_changes_the_tensor_where_the_tag_ends_like_it(tensor_mac):
    # One frame's tag in 256 ends in a PATTERN byte, just before the tensor's run of them:
    # the relay's change must land in the tensor all the same, or the frame is refused for
    # its tag (and the call fails) where the tensor check is off.
    tensor = rh.pattern_tensor(2 * rh.RUN)
    head = _wire.pack_header(Kind.CALL, 0, 1, 1, [tensor.numel()])
    trailer = handshake.SEAL_DIGEST_SIZE if tensor_mac else 0
    for n in itertools.count():
        key = n.to_bytes(32, "little")
        stream = frames.macs_around(handshake.FrameMac(key, tensor_mac, True), head, b"e",
                                    [_wire.tensor_bytes(tensor)])
        if stream[-tensor.numel() - trailer - 1] == rh.PATTERN:
            break
    alter = rh.flip_one_tensor_byte()
    alter(bytes(handshake.HELLO.size + handshake.PROOF.size))
    decoder = frames.FrameDecoder(mac=handshake.FrameMac(key, tensor_mac, True))
    if tensor_mac:
        with pytest.raises(ProtocolError, match="tensor bytes of a frame from rank 1 failed"):
            decoder.feed(alter(stream))
    else:
        (frame,) = decoder.feed(alter(stream))
        assert int((frame.buffers[0] != tensor).sum()) == 1


def test_frames_with_and_without_buffers_pass_an_honest_port_forward():
    a, b = _peer(0), _peer(1)
    relay = rh.Relay(b.t.address)
    b.t._links.address = relay.address
    try:
        conn = a.t.connect(1, *relay.address, timeout=5)
        for rid, n in enumerate([0, 1, 7, 4096, SIZE + 3], 1):
            data = torch.randint(0, 255, (n,), dtype=torch.uint8)
            assert torch.equal(_echo(conn, a, data, rid), data)
        conn.send(Kind.CALL, 0, 99, b"e", [], None)  # no buffers: no seal
        header, _, bufs = a.frames.get(timeout=20)
        assert header.request_id == 99 and bufs == []
        # Several buffers, one of them empty, in one frame.
        parts = [torch.full((n,), n % 251, dtype=torch.uint8) for n in (5, 0, 70000)]
        conn.send(Kind.CALL, 0, 100, b"e", [_wire.tensor_bytes(p) for p in parts], parts)
        header, _, bufs = a.frames.get(timeout=20)
        assert [torch.equal(x, y) for x, y in zip(bufs, parts)] == [True] * 3
        assert not b.closed
    finally:
        relay.close()
        a.close()
        b.close()


# -- a group of workers ------------------------------------------------------------------------
#
# worker1 is the worker the relays stand in for. Each dialer (worker2, worker3, worker5)
# has never connected to worker1 before its test: a worker whose connection to it closed
# would be dialed back by worker1 and call over that connection instead. worker4 tells
# worker1 what to do.

@pytest.fixture(scope="module")
def group():
    # No shared memory: tensors between workers go over the stream. This process (worker0)
    # runs with the check off, the others with the default.
    with running_group(6, threads=4, timeout=30.0, options={"enable_shm": False},
                       self_options={"enable_shm": False, "tensor_mac": False}) as g:
        assert rpc.rpc_sync("worker4", rh.on, args=("worker1", helpers.add, (1, 2))) == 3
        yield g


def _target(fn, *args):
    """``fn(*args)`` on worker1, through worker4."""
    return rpc.rpc_sync("worker4", rh.on, args=("worker1", fn, args))


def _on(worker: str, fn, *args):
    """``fn(*args)`` on ``worker``."""
    return rpc.rpc_sync(worker, fn, args=args)


def _served(dialer: str) -> None:
    """worker1 still serves worker4, and ``dialer`` at worker1's own address."""
    assert _target(helpers.add, 20, 22) == 42
    kind, got = _on(dialer, rh.call, "worker1", torch.ones(3))
    assert kind == "ok" and torch.equal(got, torch.ones(3)), (kind, got)


def test_the_option_reaches_the_transport(group):
    assert not rh.offers_tensor_mac()  # tensor_mac=False here
    assert rpc.rpc_sync("worker4", rh.offers_tensor_mac)  # the default elsewhere


def test_a_joiner_led_to_a_relay_fails_to_connect_naming_the_worker(group):
    worker1 = tuple(_target(rh.publish_address, None))
    relay = rh.Relay(worker1)
    try:
        assert rpc.rpc_sync("worker2", rh.point_at, args=("worker1", relay.address)) == 0
        kind, text = rpc.rpc_sync("worker2", rh.call, args=("worker1", torch.ones(3)))
        assert relay.connections >= 1
        assert kind == "ConnectionLostError", (kind, text)
        assert "cannot reach worker worker1 (rank 1)" in text, text
        assert "failed authentication as rank 1" in text and "relay" in text, text
    finally:
        rpc.rpc_sync("worker2", rh.point_at, args=("worker1", None))
        relay.close()
    _served("worker2")


@pytest.mark.parametrize("dialer", ["worker3", "worker5"])
def test_a_tensor_changed_by_a_relay_fails_the_call_naming_the_worker(group, dialer):
    checked = dialer == "worker3"  # worker5 offers no MAC over tensor bytes, as with
    rpc.rpc_sync(dialer, rh.offer_tensor_mac, args=(checked,))  # tensor_mac=False
    worker1 = tuple(_target(rh.publish_address, None))
    relay = rh.Relay(worker1, rh.flip_one_tensor_byte)
    sent = rh.pattern_tensor(SIZE)
    try:
        # worker1 behind a port-forward it published: the handshake through it passes.
        _target(rh.publish_address, relay.address)
        assert _on(dialer, rh.point_at, "worker1", relay.address) == 0
        _target(rh.warnings_logged, True)
        kind, got = _on(dialer, rh.call, "worker1", sent)
        assert relay.connections >= 1
        if checked:
            assert kind == "ConnectionLostError", (kind, got)
            assert "worker worker1 (rank 1)" in got, got
            # worker1 refused the frame for its tensor bytes, and closed the connection.
            wait_for("worker1 logs why", lambda: any(
                f"tensor bytes of a frame from rank {dialer[-1]} failed authentication" in m
                for m in _target(rh.warnings_logged)), 10)
        else:  # the check off: the call passes with one byte changed
            assert kind == "ok", (kind, got)
            assert int((got != sent).sum()) == 1
    finally:
        _target(rh.publish_address, None)
        _on(dialer, rh.point_at, "worker1", None)
        _on(dialer, rh.offer_tensor_mac, True)
        relay.close()
    _served(dialer)
    # Untouched, the same tensor passes.
    kind, got = _on(dialer, rh.call, "worker1", sent)
    assert kind == "ok" and torch.equal(got, sent)
