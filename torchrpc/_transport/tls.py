"""TLS for links between workers (stdlib ``ssl``), safe for one reader and many writers.

Theory of operation. OpenSSL works on the socket itself (``ssl.SSLSocket``): it
reads records from the kernel, decrypts them straight into the reader's buffer (a
tensor's memory, for the bytes of a tensor) and encrypts a writer's buffers straight
onto the socket, with no Python code per record. Where the kernel offers TLS (Linux's
``tls`` module) OpenSSL hands the record layer to it (kernel TLS, see :func:`ktls`);
elsewhere, or where it cannot, it does the work itself, unseen by the callers.

A connection is read by its reader thread while other threads write to it, but one
OpenSSL connection object must not be used by two threads at once, and an
``ssl.SSLSocket`` has no lock of its own. So the socket is non-blocking and every
call into OpenSSL runs under one short lock; a call that would block
(``SSLWantReadError``/``SSLWantWriteError``) lets the lock go and waits for the
socket with ``poll`` outside it. No lock is held across a wait, so a writer never
waits for the peer to speak and the reader never waits for a writer's peer to read.
The reader waits on the socket only when OpenSSL holds nothing decrypted
(``pending()``): the rest of a record already taken from the kernel never shows in
``poll``, so waiting then would sleep on bytes that have arrived. (OpenSSL reads
from the socket no further than the end of the record it decrypts, so nothing else
of the stream can wait inside it.)
A second lock keeps writers' records in order; small buffers are joined into one
record, large ones are encrypted where they lie.

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

Ciphers: the TLS 1.3 suites are OpenSSL's defaults, AES-256-GCM first. Python 3.11
cannot choose TLS 1.3 suites per context (``set_ciphers`` reaches TLS 1.2 only), and
AES-128-GCM would save little where AES instructions run GCM at several GB/s, far
above what a Python reader moves; dropping to TLS 1.2 for it, or changing OpenSSL's
configuration for the whole process, would cost more than it saves.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import ipaddress
import logging
import select
import socket
import ssl
import struct
import threading
import time
from typing import Any, Dict, Optional, Sequence, Tuple

from ..errors import AuthenticationError

log = logging.getLogger(__name__)

_PLAIN_CHUNK = 1024 * 1024  # the most plaintext one locked call encrypts
_RECORD = 16 * 1024  # the most plaintext a TLS record carries
_JOIN = _RECORD  # buffers smaller than a record are joined, up to this much at once

# OpenSSL 3's SSL_OP_ENABLE_KTLS (ssl.OP_ENABLE_KTLS from Python 3.12 on): let OpenSSL
# hand the record layer to the kernel where the kernel's TLS module is there.
_OP_ENABLE_KTLS = getattr(ssl, "OP_ENABLE_KTLS", 1 << 3)
_SOL_TLS, _TLS_TX, _TLS_RX = 282, 1, 2  # linux/tls.h
_TCP_ULP = getattr(socket, "TCP_ULP", 31)


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
        if kernel_tls_available():
            ctx.options |= _OP_ENABLE_KTLS
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


def kernel_tls_available() -> bool:
    """Whether OpenSSL may hand TLS links to the kernel: OpenSSL 3 or later, and a
    kernel whose ``tls`` module is loaded (listed in ``tcp_available_ulp``). Elsewhere
    OpenSSL does the record layer itself; kernel TLS is never required."""
    if ssl.OPENSSL_VERSION_INFO < (3,):
        return False  # the option's bit means something else before OpenSSL 3
    try:
        with open("/proc/sys/net/ipv4/tcp_available_ulp") as f:
            return "tls" in f.read().split()
    except OSError:
        return False


def ktls(sock: Any) -> Tuple[bool, bool]:
    """Whether the kernel encrypts (send) and decrypts (receive) on the TCP socket
    ``sock``: (False, False) unless kernel TLS took the link over."""
    try:
        ulp = sock.getsockopt(socket.IPPROTO_TCP, _TCP_ULP, 16)
    except OSError:
        return False, False
    if ulp.rstrip(b"\0") != b"tls":
        return False, False

    def on(direction: int) -> bool:
        try:
            sock.getsockopt(_SOL_TLS, direction, 64)
            return True
        except OSError:
            return False
    return on(_TLS_TX), on(_TLS_RX)


def speaks_tls(host: str, port: int, timeout: float) -> bool:
    """Whether the listener at ``host:port`` answers a TLS ClientHello with a TLS
    handshake: what a worker whose links run over TLS does. Nothing is verified: the
    answer only tells a client without TLS material what it lacks."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw, \
                ctx.wrap_socket(raw, do_handshake_on_connect=False) as sock:
            sock.do_handshake()
            return True  # TLS 1.3: done before the server looks at our (missing) certificate
    except ssl.SSLError as exc:
        # An alert from the server (it wants a certificate) is TLS too; bytes that are no
        # TLS, or a close, are not.
        return "ALERT" in str(exc.reason or "").upper()
    except OSError:
        return False


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
    """A TLS session over a connected socket; see the module docs.

    It takes over ``sock`` (which is detached): close this object, not ``sock``."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, server_side: bool) -> None:
        # Waits follow the socket's timeout (the handshake's), and sends that make no
        # progress fail after its SO_SNDTIMEO, which a non-blocking socket ignores.
        self._timeout: Optional[float] = sock.gettimeout()
        self._send_timeout = _send_timeout(sock)
        sock.setblocking(False)
        self.ssl_object: ssl.SSLSocket = context.wrap_socket(
            sock, server_side=server_side, do_handshake_on_connect=False)
        self._fd = self.ssl_object.fileno()
        self._lock = threading.Lock()       # one thread in OpenSSL at a time
        self._send_lock = threading.Lock()  # keeps writers' records in order on the socket
        self._closed = False
        self.ktls = (False, False)  # (send, receive) done by the kernel; set after the handshake

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
            try:
                self.ssl_object.do_handshake()
                break
            except ssl.SSLWantReadError:
                events = select.POLLIN
            except ssl.SSLWantWriteError:
                events = select.POLLOUT
            except ssl.SSLEOFError as exc:
                raise ConnectionResetError("the peer closed the connection during the TLS "
                                           "handshake") from exc
            # A peer trickling bytes must not hold us for long: one deadline for it all.
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0 or not self._wait(events, left):
                raise TimeoutError("the TLS handshake did not finish by its deadline")
        self.ktls = ktls(self.ssl_object)
        if any(self.ktls):
            log.debug("kernel TLS on a link (send %s, receive %s)", *self.ktls)

    def _wait(self, events: int, timeout: Optional[float]) -> bool:
        """Wait until the socket is ready for ``events`` (or broke); False after
        ``timeout`` seconds (None: no limit)."""
        poller = select.poll()
        poller.register(self._fd, events)
        ms = None if timeout is None else max(int(timeout * 1000), 1)
        while True:
            try:
                return bool(poller.poll(ms))
            except InterruptedError:  # pragma: no cover - retried by Python since 3.5
                continue

    # -- receiving (the reader thread) ---------------------------------------------------------

    def recv_into(self, buffer: Any, nbytes: int = 0) -> int:
        """Receive into ``buffer`` (``nbytes`` at most): the records OpenSSL can decrypt
        without waiting, up to the buffer's end or a record shorter than the longest
        (the end of what a writer sent), or else wait for the next bytes."""
        view = memoryview(buffer).cast("B")
        n = nbytes or view.nbytes
        timeout = self._timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        lock, sslsock = self._lock, self.ssl_object
        with lock:
            buffered = sslsock.pending()
        if not buffered:
            # Nothing decrypted waits inside OpenSSL, which reads no further than the
            # record it decrypts: only the socket can bring more, so sleep on it first.
            self._await(select.POLLIN, deadline)
        got = 0
        while True:
            with lock:  # let go between records: a writer waits for one record at most
                try:
                    # Decrypted straight into the caller's buffer, a record at a time.
                    k = sslsock.read(n - got, view[got:] if got else view)
                except ssl.SSLWantReadError:
                    if got:
                        return got
                    events = select.POLLIN
                except ssl.SSLWantWriteError:
                    if got:
                        return got
                    events = select.POLLOUT
                except ssl.SSLZeroReturnError:
                    return got  # the peer closed the TLS session
                except ValueError:
                    if self._closed:  # closed by another thread
                        raise OSError(errno.EBADF, "the TLS socket is closed") from None
                    raise
                else:
                    got += k
                    if not k or got >= n or k < _RECORD:
                        return got
                    continue
            self._await(events, deadline)

    def _await(self, events: int, deadline: Optional[float]) -> None:
        """Wait for ``events`` on the socket; socket.timeout past ``deadline``."""
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0 or not self._wait(events, left):
            raise socket.timeout("timed out")

    def recv(self, n: int) -> bytes:
        buf = bytearray(n)
        k = self.recv_into(buf)
        return bytes(buf[:k])

    def pending(self) -> int:
        """Bytes OpenSSL has decrypted and no caller has read yet."""
        with self._lock:
            return self.ssl_object.pending()

    # -- sending (any thread) ------------------------------------------------------------------

    def sendmsg(self, parts: Sequence[Any]) -> int:
        """Encrypt and send every part; return the number of plaintext bytes (all of them)."""
        total = 0
        joined = bytearray()
        with self._send_lock:
            for part in parts:
                view = memoryview(part).cast("B")
                n = view.nbytes
                total += n
                if n < _JOIN:
                    joined += view  # a header, an envelope, a small tensor: one record
                    if len(joined) >= _JOIN:
                        self._write(joined)
                        joined = bytearray()
                    continue
                if joined:
                    self._write(joined)
                    joined = bytearray()
                for pos in range(0, n, _PLAIN_CHUNK):
                    self._write(view[pos:pos + _PLAIN_CHUNK])
            if joined:
                self._write(joined)
        return total

    def _write(self, data: Any) -> None:
        # OpenSSL finishes a write that would block when it is called again with the
        # same buffer, so the retries pass ``data`` itself.
        lock, write = self._lock, self.ssl_object.write
        while True:
            with lock:
                try:
                    write(data)
                    return
                except ssl.SSLWantWriteError:
                    events = select.POLLOUT
                except ssl.SSLWantReadError:
                    events = select.POLLIN
                except ValueError:
                    if self._closed:
                        raise OSError(errno.EBADF, "the TLS socket is closed") from None
                    raise
            if not self._wait(events, self._send_timeout):
                raise OSError(errno.EAGAIN, "no progress sending")  # as SO_SNDTIMEO reports it

    def sendall(self, data: Any) -> None:
        self.sendmsg([data])

    # -- the rest of the socket API the transport uses ------------------------------------------

    def settimeout(self, value: Optional[float]) -> None:
        self._timeout = value  # for recv_into; the socket itself stays non-blocking

    def setsockopt(self, *args: Any) -> None:
        self.ssl_object.setsockopt(*args)

    def fileno(self) -> int:
        return self.ssl_object.fileno()

    def getpeername(self) -> Any:
        return self.ssl_object.getpeername()

    def shutdown(self, how: int) -> None:
        # The socket's own shutdown, not SSLSocket.shutdown: that one drops the TLS
        # session, after which reads would return the stream's bytes undecrypted.
        socket.socket.shutdown(self.ssl_object, how)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self.ssl_object.close()


def _send_timeout(sock: socket.socket) -> Optional[float]:
    """The socket's SO_SNDTIMEO in seconds (None: none)."""
    try:
        sec, usec = struct.unpack("ll", sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                                                        struct.calcsize("ll")))
    except OSError:
        return None
    return sec + usec / 1e6 or None
