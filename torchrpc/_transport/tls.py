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
(``certfile``/``keyfile``). Peers are verified against ``cafile``, the job's own
CA, which is required (the system's trust store would admit any certificate a
public CA ever signed). Then each side checks the peer's identity
(:func:`check_identity`): the certificate must carry the job's identity when one
is configured, else name the address the peer is reached at or connects from.
Finally the HMAC handshake is bound to the session through the server
certificate's hash (:meth:`TlsSocket.binding`), so a party holding some other
certificate of the CA cannot relay it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import mmap
import socket
import ssl
import threading
import time
from typing import Any, Dict, Optional, Sequence

from ..errors import AuthenticationError

_CIPHER_CHUNK = 256 * 1024  # ciphertext read from the socket at once
_PLAIN_CHUNK = 1024 * 1024  # plaintext encrypted at once by a writer


@dataclasses.dataclass(frozen=True)
class TlsContexts:
    """The two contexts of a worker: one to accept peers, one to connect to them."""

    server: ssl.SSLContext
    client: ssl.SSLContext
    certificate_hash: bytes = b""  # SHA-256 of this worker's certificate (DER): the binding
    identity: Optional[str] = None  # what every peer's certificate must name, if set


def make_contexts(certfile: str, keyfile: Optional[str], cafile: Optional[str],
                  require_client_cert: bool, identity: Optional[str] = None) -> TlsContexts:
    """Build both contexts from the option values; ValueError naming a bad option."""
    if not cafile:
        raise ValueError("tls_cafile is required when TLS is on (tls_certfile is set): peers "
                         "are verified against the job's own CA, never the system's trust "
                         "store; pass the PEM file of the CA that signed the workers' "
                         "certificates")

    def load(ctx: ssl.SSLContext) -> None:
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.options |= ssl.OP_NO_RENEGOTIATION
        try:
            ctx.load_cert_chain(certfile, keyfile)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"tls_certfile={certfile!r} / tls_keyfile={keyfile!r}: cannot "
                             f"load the certificate and key: {exc}") from exc
        try:
            ctx.load_verify_locations(cafile)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"tls_cafile={cafile!r}: cannot load the CA certificates: "
                             f"{exc}") from exc

    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    load(server)
    server.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_NONE
    server.num_tickets = 0  # no session tickets: nothing for the reader to answer later
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    load(client)
    client.check_hostname = False  # check_identity does it, for IP addresses too
    client.verify_mode = ssl.CERT_REQUIRED
    return TlsContexts(server, client, hashlib.sha256(_first_certificate(certfile)).digest(),
                       identity)


def _first_certificate(certfile: str) -> bytes:
    """The DER bytes of the first certificate in a PEM file."""
    with open(certfile) as f:
        pem = f.read()
    end = "-----END CERTIFICATE-----"
    start = pem.find("-----BEGIN CERTIFICATE-----")
    if start < 0 or pem.find(end, start) < 0:
        raise ValueError(f"tls_certfile={certfile!r}: no PEM certificate in the file")
    return ssl.PEM_cert_to_DER_cert(pem[start:pem.find(end, start) + len(end)] + "\n")


def _names(cert: Dict[str, Any]) -> "tuple[list, list]":
    """(host names and URIs, IP addresses) a decoded certificate carries."""
    names, ips = [], []
    for kind, value in cert.get("subjectAltName", ()):
        if kind in ("DNS", "URI"):
            names.append(value)
        elif kind == "IP Address":
            ips.append(value.strip())
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                names.append(value)
    return names, ips


def check_identity(cert: Optional[Dict[str, Any]], identity: Optional[str],
                   address: Optional[str]) -> None:
    """Raise :class:`AuthenticationError` unless the peer's verified certificate ``cert``
    names ``identity`` (when set) or else the IP ``address`` the peer is at."""
    if not cert:
        raise AuthenticationError("the peer presented no certificate; TLS peers must "
                                  "present one signed by the job's CA")
    names, ips = _names(cert)
    if identity is not None:
        if identity in names:
            return
        raise AuthenticationError(f"the peer's certificate does not carry the job identity "
                                  f"{identity!r} (it names {names + ips}); issue the workers' "
                                  f"certificates with it as a DNS or URI subject alternative "
                                  f"name, or set tls_identity to what they carry")
    if address is None:
        return
    try:
        want = ipaddress.ip_address(address)
    except ValueError:
        want = None
    if want is not None and any(_same_ip(ip, want) for ip in ips):
        return
    for name in names:
        if name == address or (want is not None and _resolves_to(name, want)):
            return
    raise AuthenticationError(f"the peer's certificate does not name its address {address} "
                              f"(it names {names + ips}); add it as a subject alternative name "
                              f"of the certificate, or give every worker's certificate one job "
                              f"identity and set tls_identity")


def _same_ip(text: str, want: "ipaddress._BaseAddress") -> bool:
    try:
        return ipaddress.ip_address(text) == want
    except ValueError:
        return False


def _resolves_to(name: str, want: "ipaddress._BaseAddress") -> bool:
    if "/" in name or "*" in name:
        return False  # a URI or a wildcard is no host to look up
    try:
        infos = socket.getaddrinfo(name, None)
    except (OSError, UnicodeError):
        return False
    return any(_same_ip(info[4][0], want) for info in infos)


class TlsSocket:
    """A TLS session over a connected socket; see the module docs."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, server_side: bool) -> None:
        self._sock = sock
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self.ssl_object = context.wrap_bio(self._in, self._out, server_side=server_side)
        self._lock = threading.Lock()       # guards the SSLObject and both BIOs
        self._send_lock = threading.Lock()  # keeps ciphertext records in order on the socket
        # An anonymous mapping, not a bytearray: no page costs memory before data lands on it,
        # so an unauthenticated peer makes this worker allocate nothing of it.
        self._cipher = memoryview(mmap.mmap(-1, _CIPHER_CHUNK))

    def binding(self, own_certificate_hash: bytes, server_side: bool) -> bytes:
        """The SHA-256 of the server's certificate, as this side of the session sees it."""
        if server_side:
            return own_certificate_hash
        return hashlib.sha256(self.ssl_object.getpeercert(True) or b"").digest()

    def peer_certificate(self) -> Optional[Dict[str, Any]]:
        """The peer's verified certificate, decoded (None if it sent none)."""
        return self.ssl_object.getpeercert() or None

    def do_handshake(self, deadline: Optional[float] = None) -> None:
        """Run the TLS handshake (one thread, before the connection is shared); past the
        ``time.monotonic()`` ``deadline``, if given, raise TimeoutError."""
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
            if deadline is not None:  # a peer trickling bytes must not hold us for long
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the TLS handshake did not finish by its deadline")
                self._sock.settimeout(left)
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
