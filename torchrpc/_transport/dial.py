"""Dialing: the client side of the handshake, over TCP or a same-host Unix socket."""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Optional

from ..errors import AuthenticationError, ConnectionLostError
from . import handshake
from .connection import Connection
from .links import Links
from .sockets import HANDSHAKE_TIMEOUT, local_name, lost, peer_credentials, recv_exact, tune

log = logging.getLogger(__name__)


def dial(links: Links, peer_rank: int, host: str, port: int, timeout: float,
         local: bool = False, private: bool = False, incarnation: int = 0) -> Connection:
    """Open, authenticate and start a connection to ``peer_rank`` at ``host:port``;
    with ``local`` (the peer shares this host), through its Unix socket. The peer must
    prove it is process ``incarnation`` of that rank, listening at that address as it
    published it (see ``handshake.py``); a relay or another process there cannot.

    A ``private`` connection gets no reader: whoever sends a request on it reads
    the reply with :meth:`Connection.read_frame`. Over TCP to a peer of another host
    where both offer stripes, the connection's stripe is opened before it is returned
    (:func:`dial_stripe`).
    """
    offer = links.features if private else links.features & ~handshake.FEATURE_PRIVATE
    sock, features, nonces, server_rank = _handshake(links, peer_rank, host, port, timeout,
                                                     local, offer, incarnation)
    conn = links.open(sock, peer_rank, True, features & offer, nonces, (links.rank, server_rank))
    links.on_connect(conn)
    if not conn.private:
        try:
            links.spawn(conn.read_loop, f"torchrpc-conn-{links.rank}-{peer_rank}")
        except Exception as exc:  # no thread to read it: the connection is useless
            error = ConnectionLostError(f"cannot start a reader for the connection to "
                                        f"{host}:{port}: {exc}")
            conn.close(error)
            raise error from exc
    # Where shared memory carries the large buffers, no stripe.
    if conn.stripe_threshold and not links.shares_memory(conn):  # before the first frame
        dial_stripe(links, conn, host, port, timeout, incarnation)
    return conn


def dial_stripe(links: Links, conn: Connection, host: str, port: int, timeout: float,
                incarnation: int = 0) -> None:
    """Open the stripe of ``conn`` (see ``stripe.py``): one more handshake with the same
    peer, which names ``conn`` by its server nonce. Where it fails, ``conn`` goes on
    without one (logged)."""
    offer = (links.features & ~(handshake.FEATURE_PRIVATE | handshake.FEATURE_STRIPE)) \
        | handshake.FEATURE_STRIPE_SOCKET
    try:
        sock, _, _, _ = _handshake(links, conn.peer_rank, host, port, timeout, False, offer,
                                   incarnation, conn.nonces[1])
    except (ConnectionLostError, AuthenticationError) as exc:
        if not conn.closed and not links.closing:
            log.info("rank %d opened no stripe of its connection to rank %d (large frames "
                     "use that connection alone): %s", links.rank, conn.peer_rank, exc)
        return
    links.stripes.attach(conn, sock)  # where conn closed meanwhile, the socket goes too


def _handshake(links: Links, peer_rank: int, host: str, port: int, timeout: float,
               local: bool, offer: int, incarnation: int, parent: bytes = b""):
    """The client's side of the handshake on a new socket to ``host:port``: the
    authenticated socket, the server's features, the (client's, server's) nonces and
    the server's rank. ``parent``: the socket is the stripe of the connection whose
    server nonce that is, which the client names after its PROOF."""
    sock = connect_local(host, port, timeout) if local else None
    if sock is None:
        try:
            sock = socket.create_connection((host, port), timeout=min(timeout, HANDSHAKE_TIMEOUT))
        except OSError as exc:
            raise lost(f"cannot connect to {host}:{port}", exc) from exc
    if not links.track(sock):
        sock.close()
        raise ConnectionLostError("the transport is shut down")
    try:
        links.bound(sock)
        binding = b""
        if links.tls is not None:
            sock = links.wrap_tls(sock, False)
            binding = links.secure(sock, False, host,
                                   time.monotonic() + min(timeout, HANDSHAKE_TIMEOUT))
        hello, nonce = handshake.make_hello(links.rank, offer, links.incarnation)
        sock.sendall(hello)
        challenge = recv_exact(sock, handshake.CHALLENGE.size)
        proof, server_rank, features = handshake.answer_challenge(
            links.secret, challenge, links.rank, nonce, peer_rank, offer, binding,
            links.incarnation, incarnation, (host, port))
        sock.sendall(proof + parent)
        if recv_exact(sock, 1) != handshake.ACCEPT:
            raise AuthenticationError("the peer refused the handshake")
        if parent:  # the server's frames may use the stripe from now on (stripe.py)
            sock.sendall(handshake.READY)
        sock.settimeout(None)
        tune(sock)
    except (OSError, AuthenticationError) as exc:
        links.forget(sock)
        sock.close()
        if isinstance(exc, AuthenticationError):
            raise
        raise lost(f"handshake with {host}:{port} failed", exc) from exc
    return sock, features, (nonce, handshake.CHALLENGE.unpack(challenge)[2]), server_rank


def connect_local(host: str, port: int, timeout: float) -> Optional[socket.socket]:
    """A Unix socket connected to the local socket of the worker at ``host:port``, or
    None when it has none or another user's process holds its name."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(min(timeout, HANDSHAKE_TIMEOUT))
    try:
        sock.connect(local_name(host, port))
    except OSError as exc:
        log.debug("no local socket for %s:%d (%s); using TCP", host, port, exc)
        sock.close()
        return None
    pid, uid = peer_credentials(sock)
    if uid != os.getuid():
        log.error("the local socket of the worker at %s:%d is held by process "
                  "%d of uid %d, not by this user: refused (a squatter); using TCP",
                  host, port, pid, uid)
        sock.close()
        return None
    return sock
