"""Socket helpers that both sides of a handshake use: exact reads by a deadline, socket
options, the peer's credentials on a Unix socket, and the local socket's name."""

from __future__ import annotations

import socket
import struct
import time
from typing import Optional, Tuple

from ..errors import AuthenticationError, ConnectionLostError

HANDSHAKE_TIMEOUT = 5.0  # seconds for a whole handshake, however its bytes trickle in

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def lost(what: str, exc: OSError, fix: str = "") -> ConnectionLostError:
    """Our error for an OS error on a link: ``what`` failed, and why (``exc``, its cause),
    then ``fix`` if given. Every OS error the transport reports passes through here."""
    error = ConnectionLostError(f"{what}: {exc}{fix}")
    error.__cause__ = exc
    return error


def recv_exact(sock: socket.socket, n: int, deadline: Optional[float] = None) -> bytes:
    """``n`` bytes of a handshake from ``sock``; AuthenticationError when the peer closes
    first or the bytes are not all there by ``deadline``."""
    data = bytearray()
    while len(data) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AuthenticationError(f"the handshake took longer than {HANDSHAKE_TIMEOUT:g} s "
                                          f"({len(data)} of {n} bytes arrived)")
            sock.settimeout(left)
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise AuthenticationError(f"peer closed during the handshake after {len(data)} bytes")
        data += chunk
    return bytes(data)


def tune(sock: socket.socket) -> None:
    """Turn off Nagle's algorithm on a TCP socket (nothing to do on a Unix socket)."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass  # a Unix socket (perhaps under TLS): no Nagle to turn off


def peer_credentials(sock: socket.socket) -> Tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket (``SO_PEERCRED``)."""
    pid, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                _UCRED.size))
    return pid, uid


def local_name(host: str, port: int) -> str:
    """The abstract Unix socket name of the worker listening on ``host:port``.

    Abstract names live in the network namespace, as TCP ports do, so the name is as
    unique as the TCP address it is derived from and vanishes with the process.
    """
    return f"\0torchrpc-{host}-{port}"
