"""One end of a link between two network namespaces, for
tests/transport/test_two_namespaces.py: bare transports (:class:`transport.Peer`) on this
namespace's address, driven by one JSON command per line on stdin, each answered by one JSON
line on stdout.

``python -m tests.support.ns_link HOST PKI`` (``PKI``: the certificate paths of
``certs.make_pki`` as JSON, for TLS). Commands, by ``op``:

- ``listen``: a new peer (rank 1) on HOST, over TLS with ``use_tls``, that echoes CALL frames
  (with ``echo``) or keeps every frame; with ``flip`` it is reached through a relay on HOST
  that flips one bit of the dialer's byte at that offset (:func:`relay.flip_at`; of its
  ``flip_nth`` connection only, if given), and it publishes the relay's address, as a
  worker behind a port-forward does. Answers ``port``.
- ``listen``, ``echo`` and ``send`` take ``stripe``: the peers offer stripes for frames of
  that many buffer bytes (``_transport/stripe.py``); a dialer then waits for its stripe
  before it sends.
- ``echo``: from a new peer (rank 0) on HOST, dial ``host``:``port`` and echo tensors of
  ``sizes`` bytes one at a time, then all in one frame, then from ``threads`` threads at once.
  Answers whether each came back equal, and what the connection is.
- ``send``: dial ``host``:``port``, send one tensor of ``n`` bytes, and wait up to ``wait``
  seconds for the connection to close. Answers whether it closed and whether a reply came.
- ``report``: what the listening peers saw: why their connections closed, and how many frames
  they kept.
- ``quit``.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from typing import Any, Dict, List, Optional

import torch

from torchrpc import _wire
from torchrpc._transport import tls
from torchrpc._wire import Kind

from . import helpers
from . import relay as rh
from . import transport as th


class End:
    """The peers and relays this process made, and the commands that use them."""

    def __init__(self, host: str, pki: Dict[str, str]) -> None:
        self.host = host
        self.pki = pki
        self.peers: List[th.Peer] = []
        self.relays: List[rh.Relay] = []

    def _peer(self, rank: int, use_tls: bool, echo: bool = True, stripe: int = 0) -> th.Peer:
        contexts = th.tls_contexts(self.pki) if use_tls else None
        peer = th.Peer(rank, same_host=False, tls_contexts=contexts, echo=echo, host=self.host,
                       stripe_threshold=stripe)
        self.peers.append(peer)
        return peer

    def _connect(self, me: th.Peer, host: str, port: int, stripe: int) -> Any:
        conn = me.t.connect(1, host, port, timeout=10)
        deadline = time.monotonic() + 20
        while stripe and conn.stripe is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return conn

    def listen(self, use_tls: bool = False, echo: bool = True, flip: int = -1,
               flip_nth: Optional[int] = None, stripe: int = 0) -> Dict[str, Any]:
        peer = self._peer(1, use_tls, echo, stripe)
        if flip < 0:
            return {"port": peer.t.address[1]}
        relay = rh.Relay(peer.t.address, rh.flip_at(flip, [], flip_nth), host=self.host)
        self.relays.append(relay)
        peer.t._links.address = relay.address  # behind a port-forward it published
        return {"port": relay.address[1]}

    def echo(self, host: str, port: int, sizes: List[int], threads: int = 1,
             use_tls: bool = False, stripe: int = 0) -> Dict[str, Any]:
        me = self._peer(0, use_tls, stripe=stripe)
        conn = self._connect(me, host, port, stripe)
        gen = torch.Generator().manual_seed(port)
        tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in sizes]
        sent: Dict[int, List[torch.Tensor]] = {}

        def send(rid: int, parts: List[torch.Tensor]) -> None:
            sent[rid] = parts
            conn.send(Kind.CALL, 0, rid, b"e", [_wire.tensor_bytes(p) for p in parts], parts)

        def send_five(i: int) -> None:
            for j in range(5):
                send(1000 + 100 * i + j, [tensors[(i + j) % len(tensors)]])

        equal = True
        for rid, t in enumerate(tensors, 1):  # one at a time
            send(rid, [t])
            equal = self._check(me, sent) and equal
        send(100, tensors)  # all in one frame
        equal = self._check(me, sent) and equal
        errors = helpers.run_in_threads(send_five, [(i,) for i in range(threads)])
        if errors:
            raise errors[0]
        for _ in range(len(sent)):
            equal = self._check(me, sent) and equal
        sock = getattr(conn.sock, "ssl_object", conn.sock)  # TLS: the SSLSocket on it
        striped = None
        if conn.stripe is not None:
            ssock = getattr(conn.stripe.link, "ssl_object", conn.stripe.link)
            striped = {"sent": conn.stripe.sent, "received": conn.stripe.received,
                       "local": ssock.getsockname()[0], "remote": ssock.getpeername()[0]}
        return {"equal": equal, "left": len(sent), "closed": [repr(c) for c in me.closed],
                "stripe": striped,
                "tls": isinstance(conn.sock, tls.TlsSocket),
                "trailer": bool(conn.mac_tx is not None and conn.mac_tx.trailer),
                "local": sock.getsockname()[0], "remote": sock.getpeername()[0]}

    @staticmethod
    def _check(me: th.Peer, sent: Dict[int, List[torch.Tensor]]) -> bool:
        header, _, bufs = me.frames.get(timeout=120)
        want = sent.pop(header.request_id)
        return (header.kind == Kind.RESPONSE and len(bufs) == len(want)
                and all(torch.equal(x, y) for x, y in zip(bufs, want)))

    def send(self, host: str, port: int, n: int, wait: float = 20.0,
             stripe: int = 0) -> Dict[str, Any]:
        me = self._peer(0, False, stripe=stripe)
        conn = self._connect(me, host, port, stripe)
        data = torch.randint(0, 256, (n,), dtype=torch.uint8)
        conn.send(Kind.CALL, 0, 1, b"e", [_wire.tensor_bytes(data)], data)
        deadline = time.monotonic() + wait
        while not conn.closed and time.monotonic() < deadline:
            time.sleep(0.01)
        return {"closed": conn.closed, "replies": me.frames.qsize(),
                "striped": conn.stripe is not None}

    def report(self) -> Dict[str, Any]:
        listening = [p for p in self.peers if p.t.rank == 1]
        return {"closed": [f"{type(why).__name__}: {why}" for p in listening for why in p.closed],
                "kept": sum(p.frames.qsize() for p in listening)}

    def close(self) -> None:
        for r in self.relays:
            r.close()
        for p in self.peers:
            p.close()


def main(host: str, pki: str) -> None:
    end = End(host, json.loads(pki))
    print(json.dumps({"ready": host}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        if op == "quit":
            break
        try:
            answer = getattr(end, op)(**command)
        except Exception:  # noqa: BLE001 - the test reads it
            answer = {"error": traceback.format_exc()}
        print(json.dumps(answer), flush=True)
    end.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
