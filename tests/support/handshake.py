"""Talking to a worker's listener by hand, as a hostile or a legitimate peer would."""

from __future__ import annotations

import socket

from torchrpc._transport import handshake


def recv_exact(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def authenticate(host: str, port: int, secret: bytes, claim_rank: int, server_rank: int,
                 timeout: float = 5.0, incarnation: int = 0,
                 server_incarnation: int = 0) -> socket.socket:
    """Pass the handshake with ``secret`` (as process ``incarnation`` of ``claim_rank``,
    with process ``server_incarnation`` of ``server_rank`` listening at ``host:port``);
    the open, authenticated socket."""
    s = socket.create_connection((host, port), timeout=timeout)
    hello, nonce = handshake.make_hello(claim_rank, 0, incarnation)
    s.sendall(hello)
    proof, _, _ = handshake.answer_challenge(
        secret, recv_exact(s, handshake.CHALLENGE.size), claim_rank, nonce, server_rank,
        client_incarnation=incarnation, server_incarnation=server_incarnation,
        server_address=(host, port))
    s.sendall(proof)
    assert recv_exact(s, 1) == handshake.ACCEPT
    return s
