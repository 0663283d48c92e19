"""TLS for links between workers (stdlib ``ssl``), safe for one reader and many writers.

Theory of operation. A connection is read by its reader thread while other
threads write to it, but one OpenSSL connection object must not be used by two
threads at once, and an ``ssl.SSLSocket`` has no lock of its own. So the TLS
state machine runs over memory BIOs (``ssl.SSLObject``): the reader pulls
ciphertext from the socket itself and decrypts it under a short lock; a writer
encrypts under the same lock and sends the ciphertext outside it, holding a
second lock that keeps records in order. No lock is held across a blocking
receive, so a writer never waits for the peer to speak.

:class:`TlsSocket` offers the part of the socket API the transport uses
(``recv``, ``recv_into``, ``sendall``, ``sendmsg``, ``settimeout``, ...), so a
connection does not know whether it runs over TLS. The HMAC handshake of the
job secret still runs inside TLS: TLS protects the bytes, the secret proves
membership in the job.

Certificates: every worker listens, so every worker has a certificate
(``certfile``/``keyfile``). Peers are verified against ``cafile`` (or the
system's trust store). Host names are not checked, since workers address each
other by IP address; any certificate signed by the job's CA is accepted.
"""

from __future__ import annotations

import dataclasses
import socket
import ssl
import threading
from typing import Any, Optional, Sequence

_CIPHER_CHUNK = 256 * 1024  # ciphertext read from the socket at once
_PLAIN_CHUNK = 1024 * 1024  # plaintext encrypted at once by a writer


@dataclasses.dataclass(frozen=True)
class TlsContexts:
    """The two contexts of a worker: one to accept peers, one to connect to them."""

    server: ssl.SSLContext
    client: ssl.SSLContext


def make_contexts(certfile: str, keyfile: Optional[str], cafile: Optional[str],
                  require_client_cert: bool) -> TlsContexts:
    """Build both contexts from the option values; ValueError naming a bad option."""
    def load(ctx: ssl.SSLContext) -> None:
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.options |= ssl.OP_NO_RENEGOTIATION
        try:
            ctx.load_cert_chain(certfile, keyfile)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"tls_certfile={certfile!r} / tls_keyfile={keyfile!r}: cannot "
                             f"load the certificate and key: {exc}") from exc
        try:
            if cafile:
                ctx.load_verify_locations(cafile)
            else:
                ctx.load_default_certs()
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"tls_cafile={cafile!r}: cannot load the CA certificates: "
                             f"{exc}") from exc

    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    load(server)
    server.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_NONE
    server.num_tickets = 0  # no session tickets: nothing for the reader to answer later
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    load(client)
    client.check_hostname = False
    client.verify_mode = ssl.CERT_REQUIRED
    return TlsContexts(server, client)


class TlsSocket:
    """A TLS session over a connected socket; see the module docs."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, server_side: bool) -> None:
        self._sock = sock
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self.ssl_object = context.wrap_bio(self._in, self._out, server_side=server_side)
        self._lock = threading.Lock()       # guards the SSLObject and both BIOs
        self._send_lock = threading.Lock()  # keeps ciphertext records in order on the socket
        self._cipher = memoryview(bytearray(_CIPHER_CHUNK))  # the reader's receive buffer

    def do_handshake(self) -> None:
        """Run the TLS handshake (one thread, before the connection is shared)."""
        while True:
            with self._lock:
                try:
                    self.ssl_object.do_handshake()
                    done = True
                except ssl.SSLWantReadError:
                    done = False
                out = self._out.read()
            if out:
                self._sock.sendall(out)
            if done:
                return
            data = self._sock.recv(_CIPHER_CHUNK)
            if not data:
                raise ConnectionResetError("the peer closed the connection during the TLS "
                                           "handshake")
            with self._lock:
                self._in.write(data)

    # -- receiving (the reader thread) ---------------------------------------------------------

    def recv_into(self, buffer: Any, nbytes: int = 0) -> int:
        view = memoryview(buffer)
        n = nbytes or view.nbytes
        while True:
            with self._lock:
                try:
                    return self.ssl_object.read(n, view)
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLZeroReturnError:
                    return 0  # the peer closed the TLS session
            k = self._sock.recv_into(self._cipher)
            if not k:
                return 0
            with self._lock:
                self._in.write(self._cipher[:k])

    def recv(self, n: int) -> bytes:
        buf = bytearray(n)
        k = self.recv_into(buf)
        return bytes(buf[:k])

    # -- sending (any thread) ------------------------------------------------------------------

    def sendmsg(self, parts: Sequence[Any]) -> int:
        """Encrypt and send every part; return the number of plaintext bytes (all of them)."""
        total = 0
        with self._send_lock:
            for part in parts:
                view = memoryview(part).cast("B")
                for pos in range(0, view.nbytes, _PLAIN_CHUNK):
                    with self._lock:
                        self.ssl_object.write(view[pos:pos + _PLAIN_CHUNK])
                        out = self._out.read()
                    self._sock.sendall(out)
                total += view.nbytes
        return total

    def sendall(self, data: Any) -> None:
        self.sendmsg([data])

    # -- the rest of the socket API the transport uses ------------------------------------------

    def settimeout(self, value: Optional[float]) -> None:
        self._sock.settimeout(value)

    def setsockopt(self, *args: Any) -> None:
        self._sock.setsockopt(*args)

    def fileno(self) -> int:
        return self._sock.fileno()

    def getpeername(self) -> Any:
        return self._sock.getpeername()

    def shutdown(self, how: int) -> None:
        self._sock.shutdown(how)

    def close(self) -> None:
        self._sock.close()
