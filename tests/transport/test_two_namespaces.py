"""Tensor bytes across a real link: two network namespaces joined by a veth pair
(benchmarks/netns.py), a bare transport in each (tests/support/ns_link.py), nothing shared
between them but the wire. Over TCP the seal trails the tensor bytes, piece by piece
(``handshake.FEATURE_SEAL_TRAILER``); over TLS, OpenSSL works on the socket
(``tls.TlsSocket``). Large frames between peers that offer stripes travel over two
sockets at once (``_transport/stripe.py``). A bit flipped on the link, on either socket,
is refused and never delivered.

One process per namespace serves the module. Needs root and the ``ip`` tool (skips
otherwise), and the openssl command line tool for the certificates.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from typing import Any, Dict

import pytest

from benchmarks.netns import HostPair, list_namespaces, unavailable
from torchrpc._transport import handshake

from ..support import certs
from ..support import relay as rh
from ..support.group import ROOT, worker_env

pytestmark = [pytest.mark.skipif(unavailable() is not None, reason=str(unavailable())),
              certs.needs_openssl]

PIECE = handshake.STREAM_PIECE
SIZES = [1, PIECE - 1, PIECE, PIECE + 1, 2 * PIECE + 3, 64 << 20]


class _End:
    """A ``tests.support.ns_link`` process in one namespace, asked one command at a time."""

    def __init__(self, pair: HostPair, side: str, host: str, pki: Dict[str, str]) -> None:
        argv = pair.command(side, [sys.executable, "-m", "tests.support.ns_link", host,
                                   json.dumps(pki)])
        self.host = host
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=worker_env(0, 2), text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def ready(self) -> None:
        assert self._answer(120) == {"ready": self.host}

    def _answer(self, timeout: float) -> Dict[str, Any]:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"no answer from {self.proc.args} in {timeout} s"
        line = self.proc.stdout.readline()
        assert line, f"{self.proc.args} ended: {self.proc.wait()}"
        return json.loads(line)

    def ask(self, op: str, timeout: float = 180.0, **kwargs: Any) -> Dict[str, Any]:
        self.proc.stdin.write(json.dumps({"op": op, **kwargs}) + "\n")
        self.proc.stdin.flush()
        answer = self._answer(timeout)
        assert "error" not in answer, answer["error"]
        return answer

    def quit(self) -> int:
        try:
            self.proc.stdin.write('{"op": "quit"}\n')
            self.proc.stdin.close()
            return self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            return self.proc.wait()


@pytest.fixture(scope="module")
def link(tmp_path_factory):
    pair = HostPair("trpct")
    pair.create()
    ends = []
    try:
        pki = certs.make_pki(tmp_path_factory.mktemp("pki"), ("ca",), (
            ("worker", "ca", f"IP:{pair.addr_a},IP:{pair.addr_b}"),))
        ends = [_End(pair, "a", pair.addr_a, pki), _End(pair, "b", pair.addr_b, pki)]
        for end in ends:
            end.ready()
        yield pair, ends[0], ends[1]
        codes = [end.quit() for end in ends]
        assert codes == [0, 0], codes
    finally:
        for end in ends:
            if end.proc.poll() is None:
                end.proc.kill()
                end.proc.wait()
        pair.destroy()
    assert not {pair.a, pair.b} & list_namespaces()


@pytest.mark.parametrize("use_tls", [False, True], ids=["tcp", "tls"])
def test_tensors_around_the_piece_size_cross_the_link_intact(link, use_tls):
    pair, a, b = link
    port = b.ask("listen", use_tls=use_tls)["port"]
    got = a.ask("echo", host=pair.addr_b, port=port, sizes=SIZES, threads=4, use_tls=use_tls)
    assert got["equal"] and got["left"] == 0 and got["closed"] == [], got
    assert (got["local"], got["remote"]) == (pair.addr_a, pair.addr_b), got
    assert got["tls"] is use_tls
    assert got["trailer"] is not use_tls  # TLS carries its own integrity: no seal
    assert b.ask("report")["closed"] == []


@pytest.mark.parametrize("where", ["first-piece", "piece-edge", "last-byte"])
def test_a_bit_flipped_on_the_link_is_refused_and_never_delivered(link, where):
    pair, a, b = link
    n = 4 * PIECE
    at = {"first-piece": 100, "piece-edge": 2 * PIECE - 1, "last-byte": n - 1}[where]
    before = b.ask("report")
    port = b.ask("listen", echo=False, flip=rh.first_tensor_byte(at))["port"]
    sent = a.ask("send", host=pair.addr_b, port=port, n=n)
    assert sent == {"closed": True, "replies": 0, "striped": False}, sent
    new, kept = _closes_after(b, before)
    assert any(why.startswith("ProtocolError") and
               "tensor bytes of a frame from rank 0 failed authentication" in why
               for why in new), new
    assert kept == before["kept"] == 0  # the frame reached nobody


def _closes_after(b: _End, before: Dict[str, Any]):
    """The reasons b's listening peers closed for since ``before`` (a report), waited
    for, and the frames they keep."""
    deadline = time.monotonic() + 20  # b's close is told after a sees the link go
    while True:
        after = b.ask("report")
        new = after["closed"][len(before["closed"]):]
        if new or time.monotonic() > deadline:
            return new, after["kept"]
        time.sleep(0.1)


STRIPE = 2 * PIECE  # frames of this many buffer bytes and more take the stripe
STRIPE_SIZES = [STRIPE - 1, STRIPE, 4 * PIECE + 1, 5 * PIECE + 3, 64 << 20]


@pytest.mark.parametrize("use_tls", [False, True], ids=["tcp", "tls"])
def test_large_frames_cross_the_link_over_two_sockets_intact(link, use_tls):
    pair, a, b = link
    before = b.ask("report")["closed"]  # of the tests before this one
    port = b.ask("listen", use_tls=use_tls, stripe=STRIPE)["port"]
    got = a.ask("echo", host=pair.addr_b, port=port, sizes=STRIPE_SIZES, threads=4,
                use_tls=use_tls, stripe=STRIPE)
    assert got["equal"] and got["left"] == 0 and got["closed"] == [], got
    stripe = got["stripe"]
    assert stripe is not None, got
    assert (stripe["local"], stripe["remote"]) == (pair.addr_a, pair.addr_b), got
    # Each striped frame's second part, one way and back (the cut falls on a piece at or
    # below the middle): the frames one at a time, all in one, five from each of 4 threads.
    def second(n: int) -> int:
        return n - n // 2 // PIECE * PIECE if n >= STRIPE else 0
    sizes = STRIPE_SIZES
    want = sum(map(second, sizes)) + second(sum(sizes)) + sum(
        second(sizes[(i + j) % len(sizes)]) for i in range(4) for j in range(5))
    assert stripe["sent"] == stripe["received"] == want, got
    assert b.ask("report")["closed"] == before


def test_a_bit_flipped_on_the_stripe_is_refused_and_never_delivered(link):
    pair, a, b = link
    n = 4 * PIECE  # cut at 2 pieces: the stripe carries the last two
    before = b.ask("report")
    # The stripe is the relay's second connection; after its handshake it carries the
    # nonce that names the connection, then the second part.
    port = b.ask("listen", echo=False, flip=handshake.NONCE + PIECE + 5, flip_nth=1,
                 stripe=STRIPE)["port"]
    sent = a.ask("send", host=pair.addr_b, port=port, n=n, stripe=STRIPE)
    assert sent == {"closed": True, "replies": 0, "striped": True}, sent
    new, kept = _closes_after(b, before)
    assert any(why.startswith("ProtocolError") and
               "tensor bytes of a frame from rank 0 failed authentication" in why
               and "stripe" in why for why in new), new
    assert kept == before["kept"] == 0
