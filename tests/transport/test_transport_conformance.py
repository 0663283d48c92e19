"""What every link must do, run over every link: TCP, a Unix socket, TLS, TCP with
same-host shared memory, and the in-memory pair.

Each test gets a :class:`Pair`: two connections back to back, ``a`` (the dialer's) and
``b`` (the acceptor's), with what arrives at each and how each closed. Frames arrive in
order and intact in both directions, from several threads at once; a close from either
side is seen by the other as a lost connection; a send after close raises the closed
error; a peer that vanishes in the middle of a frame is reported, not waited for; the
buffers a link hands over stay valid when the sender reuses its memory; and an OS error of
the link reaches the owner as a lost connection caused by it.
"""

from __future__ import annotations

import errno
import queue
import shutil
import socket
from typing import Any, Dict, List, Tuple

import pytest
import torch

from torchrpc import _wire
from torchrpc._transport import Connection
from ..support.memory_transport import MemoryLink
from torchrpc._wire import Kind
from torchrpc.errors import ClosedError, ConnectionLostError, ProtocolError

from ..support import helpers, certs
from ..support import transport as th

LINKS = ["tcp", "unix", "tls", "shm", "memory"]
THRESHOLD = 64 << 10  # bytes from which the shm link puts a buffer in shared memory
SIZES = [0, 1, 1000, THRESHOLD, (5 << 20) + 3]  # buffer sizes, down to empty and up to MBs
ENVELOPES = [0, 10, 5000, 300 << 10]  # both sides of the header's 4 KiB split and the read chunk


class Pair:
    """Two connections back to back; ``frames[conn]`` gets (header, envelope, buffers)
    for each frame that arrives at ``conn``, ``closed[conn]`` each of its close reasons."""

    def __init__(self, a: Connection, b: Connection, frames: Dict[Connection, "queue.Queue"],
                 closed: Dict[Connection, List[Any]], stop: Any) -> None:
        self.a, self.b = a, b
        self.frames = frames
        self.closed = closed
        self._stop = stop
        self.kind = ""  # which link (one of LINKS)

    def other(self, conn: Connection) -> Connection:
        return self.b if conn is self.a else self.a

    def close(self) -> None:
        self._stop()


def _transport_pair(kind: str, pki: Dict[str, str]) -> Pair:
    options: Dict[str, Any] = {"echo": False}
    if kind == "tls":
        options["tls_contexts"] = th.tls_contexts(pki)
    elif kind == "unix":
        options["local_socket"] = True
    elif kind == "shm":
        options.update(shm_on=True, shm_threshold=THRESHOLD)
    dialer, acceptor = th.Peer(0, **options), th.Peer(1, **options)
    try:
        a = dialer.connect(acceptor, local=kind == "unix")
        b = acceptor.accepted.get(timeout=10)
    except BaseException:
        dialer.close()
        acceptor.close()
        raise
    if kind == "unix":
        assert a.sock.family == socket.AF_UNIX
    elif kind == "tls":
        assert type(a.sock).__name__ == "TlsSocket"

    def stop() -> None:
        dialer.close()
        acceptor.close()
    return Pair(a, b, {a: dialer.frames, b: acceptor.frames},
                {a: dialer.closed, b: acceptor.closed}, stop)


def _memory_pair() -> Pair:
    frames: Dict[int, "queue.Queue"] = {0: queue.Queue(), 1: queue.Queue()}
    closed: Dict[int, List[Any]] = {0: [], 1: []}
    # The connection to rank 1 is a's: what it receives and how it closes is side 0's.
    link = MemoryLink(lambda conn, h, env, bufs: frames[1 - conn.peer_rank].put((h, bytes(env), bufs)),
                      lambda conn, why: closed[1 - conn.peer_rank].append(why))
    return Pair(link.a, link.b, {link.a: frames[0], link.b: frames[1]},
                {link.a: closed[0], link.b: closed[1]}, link.close)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Dict[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command line tool to make certificates")
    return certs.make_pki(tmp_path_factory.mktemp("pki"), ("ca",),
                                (("worker", "ca", "IP:127.0.0.1"),))


@pytest.fixture(params=LINKS)
def pair(request):
    if request.param == "memory":
        p = _memory_pair()
    else:
        p = _transport_pair(request.param,
                            request.getfixturevalue("pki") if request.param == "tls" else {})
    p.kind = request.param
    yield p
    p.close()


def _payload(rid: int, size: int) -> torch.Tensor:
    """Bytes that tell frames and positions apart."""
    return (torch.arange(size, dtype=torch.int64) * 7 + rid).to(torch.uint8)


def _send(conn: Connection, kind: int, rid: int, envelope: bytes,
          buffers: List[torch.Tensor], flags: int = 0) -> None:
    conn.send(kind, flags, rid, envelope, [_wire.tensor_bytes(b) for b in buffers], buffers)


def _receive(pair: Pair, conn: Connection, timeout: float = 30.0) -> Tuple[Any, bytes, List]:
    return pair.frames[conn].get(timeout=timeout)


@pytest.mark.parametrize("direction", ["a_to_b", "b_to_a"])
def test_frames_arrive_in_order_and_intact(pair, direction):
    src, dst = (pair.a, pair.b) if direction == "a_to_b" else (pair.b, pair.a)
    sent = []
    rid = 0
    for n_env in ENVELOPES:
        for size in SIZES:
            rid += 1
            env = bytes(range(256)) * (n_env // 256) + bytes(n_env % 256)
            bufs = [_payload(rid, size)]
            kind, flags = ((Kind.CALL, _wire.FLAG_ONEWAY), (Kind.RESPONSE, 0))[rid % 2]
            _send(src, kind, rid, env, bufs, flags)
            sent.append((kind, flags, rid, env, bufs))
    rid += 1
    mixed = [_payload(rid, n) for n in (0, 5, THRESHOLD + 1, 0, 2 << 20, 3)]
    _send(src, Kind.CALL, rid, b"several", mixed)  # several buffers, empty ones among them
    sent.append((Kind.CALL, 0, rid, b"several", mixed))
    _send(src, Kind.RESPONSE, rid + 1, b"", [])  # nothing but a header
    sent.append((Kind.RESPONSE, 0, rid + 1, b"", []))
    for kind, flags, rid, env, bufs in sent:
        header, got_env, got = _receive(pair, dst)
        assert (header.kind, header.flags & ~_wire.FLAG_SHM, header.request_id) == (kind, flags, rid)
        assert got_env == env and header.envelope_len == len(env)
        assert len(got) == len(bufs) == header.nbuffers
        for g, b in zip(got, bufs):
            assert g.dtype == torch.uint8 and torch.equal(g, b), (rid, len(b))
    if pair.kind == "shm":
        assert src.shm_tx is not None  # the large buffers went through shared memory
    assert pair.frames[dst].empty() and not pair.closed[dst]


def test_both_directions_at_once_from_several_threads(pair):
    threads, frames = 4, 12
    sizes = [0, 10, THRESHOLD + 5, 1 << 20]

    def send(side: int, i: int) -> None:
        conn = (pair.a, pair.b)[side]
        for j in range(frames):
            rid = (side * threads + i) * 1000 + j
            _send(conn, Kind.CALL, rid, f"{rid}".encode(), [_payload(rid, sizes[(i + j) % 4])])

    errors = helpers.run_in_threads(send, [(s, i) for s in (0, 1) for i in range(threads)],
                                    timeout=120)
    assert not errors, errors[0]
    for side, dst in ((0, pair.b), (1, pair.a)):
        last: Dict[int, int] = {}
        for _ in range(threads * frames):
            header, env, bufs = _receive(pair, dst)
            rid = header.request_id
            sender, j = divmod(rid, 1000)
            assert sender // threads == side and env == f"{rid}".encode()
            assert j == last.get(sender, -1) + 1, "frames of one thread arrive in its order"
            last[sender] = j
            assert torch.equal(bufs[0], _payload(rid, sizes[(sender % threads + j) % 4]))
        assert pair.frames[dst].empty()


@pytest.mark.parametrize("closer", ["a", "b"])
def test_a_close_is_seen_by_the_other_side_as_a_lost_connection(pair, closer):
    conn = pair.a if closer == "a" else pair.b
    peer = pair.other(conn)
    _send(conn, Kind.CALL, 1, b"last", [_payload(1, 100)])
    conn.close()
    assert pair.closed[conn] == [None]  # closed here, not broken
    th.wait_for(lambda: pair.closed[peer], "the other side to see the close")
    (why,) = pair.closed[peer]
    assert isinstance(why, ConnectionLostError) and not isinstance(why, ClosedError), why
    assert peer.closed
    header, env, _ = _receive(pair, peer)  # what was sent before the close still arrives
    assert (header.request_id, env) == (1, b"last")


def test_a_send_after_close_raises_the_closed_error(pair):
    pair.a.close()
    th.wait_for(lambda: pair.b.closed, "the other side to close")
    for conn in (pair.a, pair.b):
        with pytest.raises(ClosedError, match=f"connection to rank {conn.peer_rank} is closed"):
            _send(conn, Kind.CALL, 2, b"late", [_payload(2, 10)])
        with pytest.raises(ConnectionLostError):  # what callers of a connection catch
            _send(conn, Kind.CALL, 3, b"", [])
    assert pair.frames[pair.a].empty() and pair.frames[pair.b].empty()


def test_a_peer_vanishing_mid_frame_is_reported_as_broken_not_waited_for(pair):
    head = _wire.pack_header(Kind.CALL, 0, 7, 1000, [1 << 20])
    pair.a.sock.sendmsg([head, b"x" * 10])  # the header and 10 of the envelope's 1000 bytes
    pair.a.close()
    th.wait_for(lambda: pair.closed[pair.b], "the truncated frame to be reported")
    (why,) = pair.closed[pair.b]
    assert isinstance(why, ProtocolError) and "truncated frame" in str(why), why
    assert pair.frames[pair.b].empty()


def test_buffers_handed_over_stay_valid_when_the_sender_reuses_its_memory(pair):
    data = torch.zeros((2 << 20,), dtype=torch.uint8)
    kept = []
    for i in range(6):
        data.fill_(i)
        _send(pair.a, Kind.CALL, i, b"", [data])  # the same memory every time
        kept.append(_receive(pair, pair.b)[2][0])
        data.fill_(255)  # reused at once
    for i, got in enumerate(kept):
        assert got.min().item() == got.max().item() == i, i


class _FailingSends:
    """A link whose sends fail with an OS error; everything else is the wrapped link's."""

    def __init__(self, link: Any) -> None:
        self._link = link

    def sendmsg(self, buffers: Any) -> int:
        raise BrokenPipeError(errno.EPIPE, "the link is gone")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._link, name)


def test_an_os_error_becomes_a_lost_connection_caused_by_it(pair):
    pair.a.sock = _FailingSends(pair.a.sock)
    _send(pair.a, Kind.CALL, 1, b"doomed", [])  # the sender's error closes the connection
    th.wait_for(lambda: pair.closed[pair.a], "the failed send to close the connection")
    (why,) = pair.closed[pair.a]
    assert isinstance(why, ConnectionLostError) and isinstance(why.__cause__, BrokenPipeError)
    assert str(why).startswith(f"send to rank {pair.a.peer_rank} failed: ")
    th.wait_for(lambda: pair.closed[pair.b], "the other side to see the close")
    assert isinstance(pair.closed[pair.b][0], ConnectionLostError)
