"""Listening and accepting: the server side of the handshake.

Each listener (TCP, and the abstract Unix socket for same-host peers) has an accept loop
on a thread of its own; each accepted socket gets a thread that runs the handshake and,
once the peer is authenticated and admitted, becomes the connection's reader.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
import time
from typing import Any, Callable, List, Optional

from .._threads import Guard
from ..errors import AuthenticationError
from . import handshake
from .links import Links
from .sockets import HANDSHAKE_TIMEOUT, local_name, lost, peer_credentials, recv_exact, tune

log = logging.getLogger(__name__)

# Handshakes served at once; a connection beyond this is closed before it is read.
MAX_HANDSHAKES = 64
# The accept loop's pause when the process is out of descriptors, doubling up to the last.
_ACCEPT_BACKOFF = (0.05, 1.0)
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class Acceptor:
    """Listens on ``host:port`` (and, with ``local_socket``, on the Unix socket named
    after that address) and serves the handshake of every peer that connects.

    ``admit(rank, incarnation)`` returns None to accept an authenticated peer, else
    why not.
    """

    def __init__(self, links: Links, host: str, port: int, local_socket: bool = False,
                 admit: Optional[Callable[[int, int], Optional[str]]] = None) -> None:
        self._links = links
        self._admit = admit
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((host, port))
        except OSError as exc:
            self._listener.close()
            raise lost(f"cannot listen on {host}:{port}", exc,
                       "; set TORCHRPC_LISTEN_ADDR or the 'listen_addr' option to an "
                       "address of this machine") from exc
        self._listener.listen(128)
        self.address = self._listener.getsockname()[:2]
        links.address = self.address
        # Same-host peers connect through a Unix socket instead: the same handshake and
        # frames, at a fraction of loopback TCP's cost per system call.
        self.local: Optional[socket.socket] = None
        if local_socket and hasattr(socket, "AF_UNIX"):
            self.local = self._listen_local(local_name(*self.address))
        rank = links.rank
        links.spawn_loop(self._accept_loop, f"torchrpc-accept-{rank}", self._listener)
        if self.local is not None:
            links.spawn_loop(self._accept_loop, f"torchrpc-accept-local-{rank}", self.local)

    @property
    def listeners(self) -> List[socket.socket]:
        """The listening sockets, for the transport to close."""
        return [s for s in (self._listener, self.local) if s is not None]

    @staticmethod
    def _listen_local(name: str) -> Optional[socket.socket]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(name)
            sock.listen(128)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                # Nobody else may hold the name of this worker's TCP address: someone took it
                # first. Peers that dial it find another owner and refuse it (dial.py).
                log.error("the local socket name of this worker (%r) is taken by "
                          "another process, perhaps of another user squatting it; same-host "
                          "peers refuse it and use TCP", name)
            else:
                log.info("no local socket (%s); same-host peers use TCP", exc)
            sock.close()
            return None
        return sock

    def _accept_loop(self, guard: Guard, listener: socket.socket) -> None:
        backoff = [0.0]
        while guard.ok:
            with guard:
                if not self._accept_one(listener, backoff):
                    return

    def _accept_one(self, listener: socket.socket, backoff: List[float]) -> bool:
        """Accept one connection and start its handshake; False once the listener closed.

        ``backoff`` holds the current pause after running out of descriptors."""
        links = self._links
        try:
            sock, addr = listener.accept()
        except OSError as exc:
            if links.closing or listener.fileno() < 0:
                return False
            if exc.errno not in _OUT_OF_RESOURCES:
                raise  # unexpected: the guard logs it and the loop goes on
            # Out of descriptors (a flood, or a busy process): pause and try again; the
            # kernel keeps new peers in the backlog meanwhile.
            backoff[0] = min(max(backoff[0] * 2, _ACCEPT_BACKOFF[0]), _ACCEPT_BACKOFF[1])
            links.rejects.warn("rank %d cannot accept connections: %s; trying "
                               "again in %.2f s", links.rank, exc, backoff[0])
            time.sleep(backoff[0])
            return True
        backoff[0] = 0.0
        if not self._handshakes.acquire(blocking=False):
            links.rejects.warn("rank %d refused a connection from %s: %d "
                               "handshakes are in progress", links.rank, addr, MAX_HANDSHAKES)
            sock.close()
            return True
        if not links.track(sock):
            self._handshakes.release()
            sock.close()
            return False
        try:
            links.spawn(self._serve, f"torchrpc-conn-{links.rank}", sock, addr)
        except BaseException:
            self._handshakes.release()
            links.forget(sock)
            sock.close()
            if links.closing:
                return False  # closed since track(): no thread starts now
            raise
        return True

    def _serve(self, sock: socket.socket, addr: Any) -> None:
        links = self._links
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT
        reserved: Optional[int] = None  # the peer whose private slot this handshake holds
        announced = b""  # the server nonce of a connection its stripe may wait for

        def release() -> None:  # once the connection is registered, or never will be
            links.release_private(reserved)
            links.stripes.settle(announced)

        try:
            links.bound(sock)
            sock.settimeout(HANDSHAKE_TIMEOUT)
            if sock.family == socket.AF_UNIX:
                pid, uid = peer_credentials(sock)
                if uid != os.getuid():  # workers of one job on one host run as one user
                    raise AuthenticationError(f"a process of another user (pid {pid}, uid "
                                              f"{uid}) connected to the local socket")
            binding = b""
            if links.tls is not None:
                # A client on the Unix socket is on this host, which its certificate must name.
                sock = links.wrap_tls(sock, True)
                binding = links.secure(sock, True, addr[0] if isinstance(addr, tuple)
                                       else self.address[0], deadline)
            hello = handshake.parse_hello(recv_exact(sock, handshake.HELLO.size, deadline))
            # This worker proves its rank, incarnation and address as it published them.
            challenge, nonce = handshake.make_challenge(links.secret, hello, links.rank,
                                                        links.features, binding,
                                                        links.incarnation, links.address)
            sock.sendall(challenge)
            handshake.check_proof(links.secret, recv_exact(sock, handshake.PROOF.size, deadline),
                                  hello, nonce, links.rank, links.features, binding,
                                  links.incarnation, links.address)
            refused = self._admit(hello.rank, hello.incarnation) if self._admit else None
            if refused is not None:
                raise ConnectionRefusedError(refused)
            parent = None
            if hello.features & handshake.FEATURE_STRIPE_SOCKET:
                # The stripe of a connection (stripe.py), named by its server nonce.
                parent = links.stripes.parent(hello.rank, recv_exact(sock, handshake.NONCE,
                                                                     deadline), deadline)
                if parent is None:
                    raise AuthenticationError(f"rank {hello.rank} opened a stripe that names "
                                              f"no connection of its own here")
            if hello.features & handshake.FEATURE_PRIVATE and links.max_private:
                # Refused before ACCEPT: the dialer's call goes over the shared connection.
                reserved = links.reserve_private(hello.rank)
            if parent is None and hello.features & links.features & handshake.FEATURE_STRIPE:
                # Its stripe may come as soon as the dialer has the ACCEPT, before this
                # thread has registered the connection: it waits for that.
                announced = links.stripes.announce(nonce)
            sock.sendall(handshake.ACCEPT)
            sock.settimeout(None)
            tune(sock)
        except (OSError, AuthenticationError) as exc:
            release()
            links.rejects.warn("rank %d dropped a connection from %s that failed the "
                               "handshake: %s", links.rank, addr, exc)
            links.forget(sock)
            sock.close()
            return
        except BaseException:  # unexpected: the thread's guard logs it; drop the socket
            release()
            links.forget(sock)
            sock.close()
            raise
        finally:
            self._handshakes.release()
        if parent is not None:  # after ACCEPT: nothing of a frame may precede it
            # Where parent closed meanwhile, sock goes too; else this thread waits for the
            # dialer to say it has the stripe before frames from here use it (stripe.py).
            stripe = links.stripes.attach(parent, sock)
            if stripe is not None:
                stripe.await_ready()
            return
        try:
            conn = links.open(sock, hello.rank, False, hello.features & links.features,
                              (hello.nonce, nonce), (hello.rank, links.rank))
        finally:
            release()  # registered with its stripe expected, or not
        links.on_connect(conn)
        conn.read_loop()
