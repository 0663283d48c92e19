"""The transport: listens for authenticated peers and connects to them.

One :class:`~torchrpc._transport.connection.Connection` per socket (sending in
``connection.py``, reading in ``reader.py``). The transport knows no message meanings:
it hands whole frames to the ``on_frame`` callback and reports a closed connection to
``on_close``, with the exception when the connection broke rather than closed.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import ssl
import struct
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

from .. import _wire
from .._threads import Fatal, Guard
from ..errors import AuthenticationError, ConnectionLostError, ProtocolError
from . import handshake, shm, tls
from .connection import Connection
from .reader import CloseCallback, FrameCallback

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 5.0  # seconds for a whole handshake, however its bytes trickle in
# Handshakes served at once; a connection beyond this is closed before it is read.
MAX_HANDSHAKES = 64
# The accept loop's pause when the process is out of descriptors, doubling up to the last.
_ACCEPT_BACKOFF = (0.05, 1.0)
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def _recv_exact(sock: socket.socket, n: int, deadline: Optional[float] = None) -> bytes:
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


class LogBudget:
    """At most ``burst`` warnings per ``period`` seconds, then one line counting the rest
    (``what`` names them), so that a flood cannot flood the log."""

    def __init__(self, burst: int = 20, period: float = 60.0,
                 what: str = "rejected connections") -> None:
        self._what = what
        self._burst = burst
        self._period = period
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._count = 0
        self._dropped = 0

    def warn(self, msg: str, *args: Any) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._start > self._period:
                if self._dropped:
                    log.warning("%d more %s in the last %.0f s were not logged",
                                self._dropped, self._what, now - self._start)
                self._start, self._count, self._dropped = now, 0, 0
            if self._count >= self._burst:
                self._dropped += 1
                return
            self._count += 1
        log.warning(msg, *args)


def _tune(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass  # a Unix socket (perhaps under TLS): no Nagle to turn off


def _needs_frame_macs(conn: Connection) -> bool:
    """Whether frames on ``conn`` carry MACs: on plain TCP when both sides offered them (TLS
    protects its records itself; a Unix socket's peer is a process of this user)."""
    return bool(conn.features & handshake.FEATURE_FRAME_MAC) and \
        type(conn.sock) is socket.socket and conn.sock.family != socket.AF_UNIX


_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


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


class Transport:
    """Listens for authenticated peers and opens connections to them.

    ``on_connect(conn)`` is called for every authenticated connection, inbound or
    outbound, before its first frame is delivered.

    With ``FEATURE_SHM`` in ``features``, a connection whose peer offered it too
    accepts buffers in shared memory, and sends its own buffers of at least
    ``shm_threshold`` bytes that way when ``same_host(peer_rank)`` says the peer
    shares this machine and ``same_pids(peer_rank)`` that it sees this process's pids.
    """

    def __init__(self, rank: int, secret: bytes, limits: _wire.Limits,
                 on_connect: Callable[[Connection], None], on_frame: FrameCallback,
                 on_close: CloseCallback, host: str, port: int = 0, features: int = 0,
                 tls_contexts: Optional[tls.TlsContexts] = None, shm_threshold: int = 0,
                 same_host: Optional[Callable[[int], bool]] = None,
                 local_socket: bool = False, on_fatal: Optional[Fatal] = None,
                 same_pids: Optional[Callable[[int], bool]] = None,
                 send_timeout: float = 0.0, max_outbox: int = 0,
                 max_private: int = 0, incarnation: int = 0,
                 admit: Optional[Callable[[int, int], Optional[str]]] = None) -> None:
        self.rank = rank
        self.incarnation = incarnation  # sent in every HELLO (see handshake.py)
        # admit(rank, incarnation): None to accept an authenticated peer, else why not.
        self._admit = admit
        self._on_fatal = on_fatal  # an accept loop that cannot go on reports here
        self._tls = tls_contexts
        self._rejects = LogBudget()
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._secret = secret
        self._limits = limits
        self._on_connect = on_connect
        self._on_frame = on_frame
        self._on_close = on_close
        if features & handshake.FEATURE_SHM and shm_threshold < 1:
            raise ValueError(f"shm_threshold must be at least 1 byte, got {shm_threshold}; "
                             f"to keep buffers off shared memory, set enable_shm=False")
        if features & handshake.FEATURE_SHM and not shm.available():
            features &= ~handshake.FEATURE_SHM  # no memfds: no shared memory (see shm.py)
        self._features = features | handshake.FEATURE_PRIVATE | handshake.FEATURE_FRAME_MAC
        self._shm_threshold = shm_threshold
        self._same_host = same_host
        # Whether a peer sees this process's pids (so can open its memfds; see shm.py).
        self._same_pids = same_pids
        self._send_timeout = send_timeout  # see Connection.send_timeout and _bound
        self._max_outbox = max_outbox
        self._max_private = max_private  # private connections accepted per peer (0: any)
        # Private connections per peer admitted by a handshake but not yet registered: the
        # bound counts them, so handshakes that run at once cannot all pass it.
        self._private_pending: Dict[int, int] = {}
        self._shm_conns: "weakref.WeakSet[Connection]" = weakref.WeakSet()
        self._every_conn: "weakref.WeakSet[Connection]" = weakref.WeakSet()
        self._shm_stats = shm.Stats()
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._sockets: set[socket.socket] = set()
        self._closing = False
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((host, port))
        except OSError as exc:
            self._listener.close()
            raise ConnectionLostError(
                f"cannot listen on {host}:{port}: {exc}; set TORCHRPC_LISTEN_ADDR or the "
                f"'listen_addr' option to an address of this machine") from exc
        self._listener.listen(128)
        self.address = self._listener.getsockname()[:2]
        # Same-host peers connect through a Unix socket instead: the same handshake and
        # frames, at a fraction of loopback TCP's cost per system call.
        self._local: Optional[socket.socket] = None
        if local_socket and hasattr(socket, "AF_UNIX"):
            self._local = self._listen_local(local_name(*self.address))
        self._accept_thread = self._spawn_loop(self._accept_loop, f"torchrpc-accept-{rank}",
                                               self._listener)
        if self._local is not None:
            self._spawn_loop(self._accept_loop, f"torchrpc-accept-local-{rank}", self._local)

    @staticmethod
    def _listen_local(name: str) -> Optional[socket.socket]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(name)
            sock.listen(128)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                # Nobody else may hold the name of this worker's TCP address: someone took it
                # first. Peers that dial it find another owner and refuse it (_connect_local).
                log.error("the local socket name of this worker (%r) is taken by "
                          "another process, perhaps of another user squatting it; same-host "
                          "peers refuse it and use TCP", name)
            else:
                log.info("no local socket (%s); same-host peers use TCP", exc)
            sock.close()
            return None
        return sock

    def _spawn(self, target: Callable[..., None], name: str, *args: Any,
               guard: Optional[Guard] = None) -> threading.Thread:
        """Start thread ``name`` running ``target(*args)`` under ``guard`` (by default
        one that logs whatever escapes); :meth:`close` joins it."""
        guard = guard or Guard(f"thread {name}")

        def run() -> None:
            try:
                guard.call(target, *args)
            finally:
                with self._lock:
                    self._threads.discard(threading.current_thread())
        t = threading.Thread(target=run, name=name, daemon=True)
        with self._lock:
            self._threads.add(t)
        try:
            t.start()
        except BaseException:
            with self._lock:
                self._threads.discard(t)
            raise
        return t

    def _spawn_loop(self, loop: Callable[..., None], name: str, *args: Any) -> threading.Thread:
        """Start thread ``name`` running ``loop(guard, *args)``; if it cannot go on, the
        owner hears of it (``on_fatal``)."""
        guard = Guard(f"the thread {name}", self._on_fatal)
        return self._spawn(loop, name, guard, *args, guard=guard)

    def _accept_loop(self, guard: Guard, listener: socket.socket) -> None:
        backoff = [0.0]
        while guard.ok:
            with guard:
                if not self._accept_one(listener, backoff):
                    return

    def _accept_one(self, listener: socket.socket, backoff: List[float]) -> bool:
        """Accept one connection and start its handshake; False once the listener closed.

        ``backoff`` holds the current pause after running out of descriptors."""
        try:
            sock, addr = listener.accept()
        except OSError as exc:
            with self._lock:
                if self._closing or listener.fileno() < 0:
                    return False
            if exc.errno not in _OUT_OF_RESOURCES:
                raise  # unexpected: the guard logs it and the loop goes on
            # Out of descriptors (a flood, or a busy process): pause and try again; the
            # kernel keeps new peers in the backlog meanwhile.
            backoff[0] = min(max(backoff[0] * 2, _ACCEPT_BACKOFF[0]), _ACCEPT_BACKOFF[1])
            self._rejects.warn("rank %d cannot accept connections: %s; trying "
                               "again in %.2f s", self.rank, exc, backoff[0])
            time.sleep(backoff[0])
            return True
        backoff[0] = 0.0
        if not self._handshakes.acquire(blocking=False):
            self._rejects.warn("rank %d refused a connection from %s: %d "
                               "handshakes are in progress", self.rank, addr, MAX_HANDSHAKES)
            sock.close()
            return True
        with self._lock:
            if self._closing:
                self._handshakes.release()
                sock.close()
                return False
            self._sockets.add(sock)
        try:
            self._spawn(self._serve, f"torchrpc-conn-{self.rank}", sock, addr)
        except BaseException:
            self._handshakes.release()
            self._forget(sock)
            sock.close()
            raise
        return True

    def _serve(self, sock: socket.socket, addr: Any) -> None:
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT
        reserved: Optional[int] = None  # the peer whose private slot this handshake holds
        try:
            self._bound(sock)
            sock.settimeout(HANDSHAKE_TIMEOUT)
            if sock.family == socket.AF_UNIX:
                pid, uid = peer_credentials(sock)
                if uid != os.getuid():  # workers of one job on one host run as one user
                    raise AuthenticationError(f"a process of another user (pid {pid}, uid "
                                              f"{uid}) connected to the local socket")
            binding = b""
            if self._tls is not None:
                # A client on the Unix socket is on this host, which its certificate must name.
                sock, binding = self._secure(sock, True, addr[0] if isinstance(addr, tuple)
                                             else self.address[0], deadline)
            hello = handshake.parse_hello(_recv_exact(sock, handshake.HELLO.size, deadline))
            challenge, nonce = handshake.make_challenge(self._secret, hello, self.rank,
                                                        self._features, binding)
            sock.sendall(challenge)
            handshake.check_proof(self._secret, _recv_exact(sock, handshake.PROOF.size, deadline),
                                  hello, nonce, self.rank, self._features, binding)
            refused = self._admit(hello.rank, hello.incarnation) if self._admit else None
            if refused is not None:
                raise ConnectionRefusedError(refused)
            if hello.features & handshake.FEATURE_PRIVATE and self._max_private:
                # Refused before ACCEPT: the dialer's call goes over the shared connection.
                reserved = self._reserve_private(hello.rank)
            sock.sendall(handshake.ACCEPT)
            sock.settimeout(None)
            _tune(sock)
        except (OSError, AuthenticationError) as exc:
            self._release_private(reserved)
            self._rejects.warn("rank %d dropped a connection from %s that failed the "
                               "handshake: %s", self.rank, addr, exc)
            self._forget(sock)
            sock.close()
            return
        except BaseException:  # unexpected: the thread's guard logs it; drop the socket
            self._release_private(reserved)
            self._forget(sock)
            sock.close()
            raise
        finally:
            self._handshakes.release()
        try:
            conn = Connection(sock, hello.rank, self._limits, self._on_frame, self._closed_cb,
                              outbound=False)
            conn.features = hello.features & self._features
            conn.set_private(bool(hello.features & handshake.FEATURE_PRIVATE))
            if _needs_frame_macs(conn):
                c2s, s2c = handshake.frame_keys(self._secret, hello.nonce, nonce, hello.rank,
                                                self.rank)
                conn.mac_tx, conn.mac_rx = handshake.FrameMac(s2c), handshake.FrameMac(c2s)
            self._register(conn)
        finally:
            self._release_private(reserved)
        self._on_connect(conn)
        conn.read_loop()

    def connect(self, peer_rank: int, host: str, port: int, timeout: float,
                local: bool = False, private: bool = False) -> Connection:
        """Open, authenticate and start a connection to ``peer_rank`` at ``host:port``;
        with ``local`` (the peer shares this host), through its Unix socket if it has one.

        A ``private`` connection gets no reader: whoever sends a request on it reads
        the reply with :meth:`Connection.read_frame`.
        """
        sock = self._connect_local(host, port, timeout) if local and self._local else None
        if sock is None:
            try:
                sock = socket.create_connection((host, port),
                                                timeout=min(timeout, HANDSHAKE_TIMEOUT))
            except OSError as exc:
                raise ConnectionLostError(f"cannot connect to {host}:{port}: {exc}") from exc
        with self._lock:
            if self._closing:
                sock.close()
                raise ConnectionLostError("the transport is shut down")
            self._sockets.add(sock)
        try:
            self._bound(sock)
            binding = b""
            if self._tls is not None:
                sock, binding = self._secure(sock, False, host)
            offer = self._features if private else self._features & ~handshake.FEATURE_PRIVATE
            hello, nonce = handshake.make_hello(self.rank, offer, self.incarnation)
            sock.sendall(hello)
            challenge = _recv_exact(sock, handshake.CHALLENGE.size)
            proof, server_rank, features = handshake.answer_challenge(
                self._secret, challenge, self.rank, nonce, peer_rank, offer, binding,
                self.incarnation)
            sock.sendall(proof)
            if _recv_exact(sock, 1) != handshake.ACCEPT:
                raise AuthenticationError("the peer refused the handshake")
            sock.settimeout(None)
            _tune(sock)
        except (OSError, AuthenticationError) as exc:
            self._forget(sock)
            sock.close()
            if isinstance(exc, AuthenticationError):
                raise
            raise ConnectionLostError(f"handshake with {host}:{port} failed: {exc}") from exc
        conn = Connection(sock, peer_rank, self._limits, self._on_frame, self._closed_cb,
                          outbound=True)
        conn.features = features & offer
        conn.set_private(bool(conn.features & handshake.FEATURE_PRIVATE))
        if _needs_frame_macs(conn):
            c2s, s2c = handshake.frame_keys(self._secret, nonce,
                                            handshake.CHALLENGE.unpack(challenge)[2], self.rank,
                                            server_rank)
            conn.mac_tx, conn.mac_rx = handshake.FrameMac(c2s), handshake.FrameMac(s2c)
        self._register(conn)
        self._on_connect(conn)
        if not conn.private:
            try:
                self._spawn(conn.read_loop, f"torchrpc-conn-{self.rank}-{peer_rank}")
            except Exception as exc:  # no thread to read it: the connection is useless
                error = ConnectionLostError(f"cannot start a reader for the connection to "
                                            f"{host}:{port}: {exc}")
                conn.close(error)
                raise error from exc
        return conn

    @staticmethod
    def _connect_local(host: str, port: int, timeout: float) -> Optional[socket.socket]:
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

    def _secure(self, sock: socket.socket, server_side: bool, address: str,
                deadline: Optional[float] = None) -> Tuple[tls.TlsSocket, bytes]:
        """Run the TLS handshake on ``sock`` (by ``deadline``, if given) and check the
        identity of the peer at ``address``; return the TLS socket that replaces it and
        the session's binding."""
        assert self._tls is not None
        ctx = self._tls.server if server_side else self._tls.client
        wrapped = tls.TlsSocket(sock, ctx, server_side)
        with self._lock:
            self._sockets.discard(sock)
            self._sockets.add(wrapped)
        try:
            wrapped.do_handshake(deadline)
            if not server_side or ctx.verify_mode == ssl.CERT_REQUIRED:
                tls.check_identity(wrapped.peer_certificate(), self._tls.identity, address)
        except BaseException:
            # The caller forgets and closes the plain socket; the session must go too, or
            # every failed handshake would keep its buffers here until shutdown.
            self._forget(wrapped)
            raise
        return wrapped, wrapped.binding(self._tls.certificate_hash, server_side)

    @property
    def secure(self) -> bool:
        """Whether every link runs over TLS."""
        return self._tls is not None

    def connections(self) -> List[Connection]:
        """Every open connection, shared and private (for counters and tests)."""
        with self._lock:  # a WeakSet iterates in Python: adding to it meanwhile would raise
            conns = list(self._every_conn)
        return [c for c in conns if not c.closed]

    def _bound(self, sock: Any) -> None:
        """Give a connected socket its send deadline: a send that makes no progress for
        send_timeout fails (SO_SNDTIMEO: the kernel's clock, no cost per send)."""
        if self._send_timeout > 0:
            sec = int(self._send_timeout)
            usec = int((self._send_timeout - sec) * 1e6)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                                struct.pack("ll", sec, usec))
            except OSError as exc:
                log.debug("no send timeout on a socket: %s", exc)

    def _reserve_private(self, rank: int) -> int:
        """Take one of ``rank``'s private connection slots here, or raise
        ConnectionRefusedError when its open and admitted ones already fill the bound.
        Returns the rank to hand to _release_private once the connection is registered."""
        with self._lock:
            pending = self._private_pending.get(rank, 0)
            n = pending + sum(1 for c in self._every_conn if c.private and not c.outbound
                              and c.peer_rank == rank and not c.closed)
            if n >= self._max_private:
                raise ConnectionRefusedError(
                    f"rank {rank} already has {self._max_private} private connections "
                    f"here (max_private_connections)")
            self._private_pending[rank] = pending + 1
        return rank

    def _release_private(self, rank: Optional[int]) -> None:
        """Give back a slot _reserve_private took (None: none was taken)."""
        if rank is None:
            return
        with self._lock:
            left = self._private_pending.get(rank, 0) - 1
            if left > 0:
                self._private_pending[rank] = left
            else:
                self._private_pending.pop(rank, None)

    def _register(self, conn: Connection) -> None:
        """Count ``conn`` among the transport's connections and set up its shared memory."""
        conn.send_timeout = self._send_timeout
        conn.max_outbox = self._max_outbox
        with self._lock:
            self._every_conn.add(conn)
        if not conn.features & handshake.FEATURE_SHM:
            return
        conn.shm_rx = shm.ShmReceiver(stats=self._shm_stats)
        if self._shm_threshold > 0 and self._same_host is not None:
            conn.shm_decider = self._decide_shm_tx
        with self._lock:
            self._shm_conns.add(conn)

    def _decide_shm_tx(self, conn: Connection) -> None:
        with conn._lock:
            if conn.shm_decider is None:
                return
            conn.shm_decider = None
            # A peer that cannot see this process's pids cannot open its memfds: its
            # large buffers go over the socket.
            if self._same_host(conn.peer_rank) and not conn.closed and (
                    self._same_pids is None or self._same_pids(conn.peer_rank)):
                conn.shm_tx = shm.ShmSender(self._shm_threshold, stats=self._shm_stats)

    def debug_info(self) -> Dict[str, Any]:
        """Shared-memory counters (``transport.shm_*``)."""
        info: Dict[str, Any] = {"transport.shm_enabled": bool(self._features & handshake.FEATURE_SHM)}
        info.update(self._shm_stats.as_dict())
        return info

    def housekeeping(self) -> None:
        """Let shared-memory segments that nobody used for a while go (call now and then)."""
        now = time.monotonic()
        with self._lock:
            conns = list(self._shm_conns)
        for conn in conns:
            if conn.shm_tx is not None:
                conn.shm_tx.housekeeping(now)
            if conn.shm_rx is not None:
                conn.shm_rx.housekeeping()

    def _forget(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(sock)

    def _closed_cb(self, conn: Connection, reason: Optional[BaseException]) -> None:
        # Whatever fails here, the owner must still hear that the connection closed.
        guard = Guard(f"closing the connection of rank {self.rank} to rank {conn.peer_rank}",
                      limit=None)
        self._forget(conn.sock)
        if isinstance(reason, ProtocolError):
            self._rejects.warn("rank %d closed its connection with rank %d: %s",
                               self.rank, conn.peer_rank, reason)
        with guard:
            self._on_close(conn, reason)

    def close(self, timeout: float = 10.0) -> None:
        """Stop listening, close every socket and join every thread the transport started,
        waiting ``timeout`` seconds at most for all of them together."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._closing = True
            sockets = list(self._sockets)
        for listener in (self._listener, self._local):
            if listener is None:
                continue
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self._lock:
            threads = [t for t in self._threads if t is not threading.current_thread()]
        for t in threads:
            t.join(max(deadline - time.monotonic(), 0.0))
        with self._lock:
            conns = list(self._every_conn)
        for conn in conns:  # those without a reader (a caller's idle private ones) too:
            conn.close()    # their sockets and shared-memory segments would leak
