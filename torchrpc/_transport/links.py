"""The table of one worker's links: its connections, the sockets and threads on the way
to them, and the settings that every link of the worker shares.

The acceptor (``accept.py``) and the dialer (``dial.py``) run the two sides of the
handshake; both hand a socket that passed it to :meth:`Links.open`, which makes the
:class:`~torchrpc._transport.connection.Connection`, gives it its frame MACs and
registers it, with shared memory set up when both sides offered it, and a stripe
expected when both offered one (``stripe.py``).
"""

from __future__ import annotations

import logging
import socket
import ssl
import struct
import threading
import time
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from .. import _threads, _wire
from .._threads import Fatal, Guard
from ..errors import ClosedError, ProtocolError
from . import handshake, shm, tls
from .connection import Connection
from .logbudget import LogBudget
from .reader import CloseCallback, FrameCallback
from .stripe import Stripes

log = logging.getLogger(__name__)

# The most tensor bytes a message to a peer whose frames carry MACs sends inside its
# envelope: the envelope's MAC (keyed BLAKE2b) costs more per byte than the seal of
# out-of-band buffers, or none where they are not sealed (docs/design.md, "Small tensors
# inside the envelope").
MAC_INLINE_MAX = 512


def over_tcp(sock: Any) -> bool:
    """Whether ``sock`` (a socket, or a TLS session over one) is a TCP socket."""
    raw = getattr(sock, "ssl_object", sock)
    return isinstance(raw, socket.socket) and raw.family in (socket.AF_INET, socket.AF_INET6)


def needs_frame_macs(conn: Connection) -> bool:
    """Whether frames on ``conn`` carry MACs: on plain TCP when both sides offered them (TLS
    protects its records itself; a Unix socket's peer is a process of this user)."""
    return bool(conn.features & handshake.FEATURE_FRAME_MAC) and \
        type(conn.sock) is socket.socket and conn.sock.family != socket.AF_UNIX


class Links:
    """One worker's connections, and the sockets and threads the transport started.

    ``features`` are those this worker offers in every handshake; ``same_host(rank)``
    and ``same_pids(rank)`` decide, on a connection's first send, whether its large
    buffers go through shared memory (see :meth:`register`).
    """

    def __init__(self, rank: int, secret: bytes, limits: _wire.Limits, features: int,
                 on_connect: Callable[[Connection], None], on_frame: FrameCallback,
                 on_close: CloseCallback, tls_contexts: Optional[tls.TlsContexts] = None,
                 shm_threshold: int = 0, same_host: Optional[Callable[[int], bool]] = None,
                 same_pids: Optional[Callable[[int], bool]] = None,
                 send_timeout: float = 0.0, max_outbox: int = 0, max_private: int = 0,
                 incarnation: int = 0, on_fatal: Optional[Fatal] = None,
                 connection_type: Callable[..., Connection] = Connection,
                 stripe_threshold: int = 0) -> None:
        self.rank = rank
        # What makes a connection: Connection, or a subclass (the tests' fault injection).
        self.connection_type = connection_type
        self.secret = secret
        self.limits = limits
        self.features = features
        self.incarnation = incarnation  # sent in every HELLO (see handshake.py)
        # The address this worker listens at, as it publishes it: its handshakes prove it
        # (set by the acceptor once it listens).
        self.address: Tuple[str, int] = ("", 0)
        self.tls = tls_contexts
        self.on_connect = on_connect
        self._on_frame = on_frame
        self._on_close = on_close
        self._on_fatal = on_fatal  # an accept loop that cannot go on reports here
        self.rejects = LogBudget()
        self.shm_threshold = shm_threshold
        self.same_host = same_host
        # Whether a peer sees this process's pids (so can open its memfds; see shm.py).
        self.same_pids = same_pids
        self.send_timeout = send_timeout  # see Connection.send_timeout and bound()
        self.max_outbox = max_outbox
        self.max_private = max_private  # private connections accepted per peer (0: any)
        # Private connections per peer admitted by a handshake but not yet registered: the
        # bound counts them, so handshakes that run at once cannot all pass it.
        self._private_pending: Dict[int, int] = {}
        self._shm_conns: "weakref.WeakSet[Connection]" = weakref.WeakSet()
        self._every_conn: "weakref.WeakSet[Connection]" = weakref.WeakSet()
        self._shm_stats = shm.Stats()
        # The stripes of connections between hosts (stripe.py; threshold 0: none).
        self.stripes = Stripes(rank, stripe_threshold, self.spawn, self.forget)
        # rank -> the most tensor bytes a message to it carries inline, where not
        # _wire.INLINE_MAX.
        self.inline_max: Dict[int, int] = {}
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._sockets: set[Any] = set()
        self._closing = False

    # -- threads and sockets -------------------------------------------------------------------

    def spawn(self, target: Callable[..., None], name: str, *args: Any,
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
        # Started under the lock: close() never sees a thread it cannot join yet, and
        # none starts once close() took its list.
        with self._lock:
            if self._closing:
                raise ClosedError(f"cannot start thread {name}: the transport is shut down")
            t = _threads.spawn(name, run)
            self._threads.add(t)
        return t

    def spawn_loop(self, loop: Callable[..., None], name: str, *args: Any) -> threading.Thread:
        """Start thread ``name`` running ``loop(guard, *args)``; if it cannot go on, the
        owner hears of it (``on_fatal``)."""
        guard = Guard(f"the thread {name}", self._on_fatal)
        return self.spawn(loop, name, guard, *args, guard=guard)

    def track(self, sock: Any) -> bool:
        """Count ``sock`` among the sockets :meth:`close` shuts; False (and nothing
        counted) once the transport is closing."""
        with self._lock:
            if self._closing:
                return False
            self._sockets.add(sock)
        return True

    def forget(self, sock: Any) -> None:
        with self._lock:
            self._sockets.discard(sock)

    @property
    def closing(self) -> bool:
        return self._closing

    def bound(self, sock: Any) -> None:
        """Give a connected socket its send deadline: a send that makes no progress for
        send_timeout fails (SO_SNDTIMEO: the kernel's clock, no cost per send)."""
        if self.send_timeout > 0:
            sec = int(self.send_timeout)
            usec = int((self.send_timeout - sec) * 1e6)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                                struct.pack("ll", sec, usec))
            except OSError as exc:
                log.debug("no send timeout on a socket: %s", exc)

    def wrap_tls(self, sock: socket.socket, server_side: bool) -> tls.TlsSocket:
        """The TLS session that takes ``sock`` over, tracked in its place (the caller
        closes it, as it would have closed ``sock``)."""
        assert self.tls is not None
        wrapped = tls.TlsSocket(sock, self.tls.server if server_side else self.tls.client,
                                server_side)
        with self._lock:
            self._sockets.discard(sock)
            self._sockets.add(wrapped)
        return wrapped

    def secure(self, wrapped: tls.TlsSocket, server_side: bool, address: str,
               deadline: Optional[float] = None) -> bytes:
        """Run the TLS handshake of ``wrapped`` (by ``deadline``, if given) and check the
        identity of the peer at ``address``; return the session's binding."""
        assert self.tls is not None
        wrapped.do_handshake(deadline)
        ctx = self.tls.server if server_side else self.tls.client
        if not server_side or ctx.verify_mode == ssl.CERT_REQUIRED:
            tls.check_identity(wrapped.peer_certificate(), self.tls.identity, address)
        return wrapped.binding(self.tls.certificate_hash, server_side)

    # -- connections ---------------------------------------------------------------------------

    def open(self, sock: Any, peer_rank: int, outbound: bool, features: int,
             nonces: Tuple[bytes, bytes], ranks: Tuple[int, int]) -> Connection:
        """The connection on ``sock``, which passed the handshake with ``features``
        agreed; ``nonces`` and ``ranks`` are the (client's, server's), from which its
        frame MACs are keyed. Registered, before anyone hears of it."""
        conn = self.connection_type(sock, peer_rank, self.limits, self._on_frame,
                                    self._closed, outbound=outbound)
        conn.features = features
        conn.nonces = nonces  # (the client's, the server's): a stripe names it by the latter
        conn.set_private(bool(features & handshake.FEATURE_PRIVATE))
        if needs_frame_macs(conn):
            c2s, s2c = handshake.frame_keys(self.secret, nonces[0], nonces[1], *ranks)
            tx, rx = (c2s, s2c) if outbound else (s2c, c2s)
            buffers = bool(features & handshake.FEATURE_TENSOR_MAC)
            trailer = bool(features & handshake.FEATURE_SEAL_TRAILER)
            conn.mac_tx = handshake.FrameMac(tx, buffers, trailer)
            conn.mac_rx = handshake.FrameMac(rx, buffers, trailer)
            self.inline_max[peer_rank] = MAC_INLINE_MAX
        else:
            # This rank is reached without MACs now (a worker restarted on this host).
            self.inline_max.pop(peer_rank, None)
        if features & handshake.FEATURE_STRIPE and over_tcp(sock):
            self.stripes.expect(conn)
        self.register(conn)
        return conn

    def register(self, conn: Connection) -> None:
        """Count ``conn`` among the connections and set up its shared memory."""
        conn.send_timeout = self.send_timeout
        conn.max_outbox = self.max_outbox
        with self._lock:
            self._every_conn.add(conn)
        if not conn.features & handshake.FEATURE_SHM:
            return
        conn.shm_rx = shm.ShmReceiver(stats=self._shm_stats)
        if self.shm_threshold > 0 and self.same_host is not None:
            conn.shm_decider = self._decide_shm_tx
        with self._lock:
            self._shm_conns.add(conn)

    def _decide_shm_tx(self, conn: Connection) -> None:
        with conn._lock:
            if conn.shm_decider is None:
                return
            conn.shm_decider = None
            if self.shares_memory(conn) and not conn.closed:
                conn.shm_tx = shm.ShmSender(self.shm_threshold, stats=self._shm_stats)

    def shares_memory(self, conn: Connection) -> bool:
        """Whether ``conn``'s large buffers go through shared memory: both ends offered
        it and the peer shares this host and sees this process's pids (a peer that does
        not cannot open its memfds). Those that do not go over the socket, and between
        hosts a stripe may carry them (see dial.py)."""
        rank = conn.peer_rank
        return bool(conn.features & handshake.FEATURE_SHM) and self.shm_threshold > 0 \
            and self.same_host is not None and self.same_host(rank) \
            and (self.same_pids is None or self.same_pids(rank))

    def reserve_private(self, rank: int) -> int:
        """Take one of ``rank``'s private connection slots here, or raise
        ConnectionRefusedError when its open and admitted ones already fill the bound.
        Returns the rank to hand to release_private once the connection is registered."""
        with self._lock:
            pending = self._private_pending.get(rank, 0)
            n = pending + sum(1 for c in self._every_conn if c.private and not c.outbound
                              and c.peer_rank == rank and not c.closed)
            if n >= self.max_private:
                raise ConnectionRefusedError(
                    f"rank {rank} already has {self.max_private} private connections "
                    f"here (max_private_connections)")
            self._private_pending[rank] = pending + 1
        return rank

    def release_private(self, rank: Optional[int]) -> None:
        """Give back a slot reserve_private took (None: none was taken)."""
        if rank is None:
            return
        with self._lock:
            left = self._private_pending.get(rank, 0) - 1
            if left > 0:
                self._private_pending[rank] = left
            else:
                self._private_pending.pop(rank, None)

    def connections(self) -> List[Connection]:
        """Every open connection, shared and private (for counters and tests)."""
        with self._lock:  # a WeakSet iterates in Python: adding to it meanwhile would raise
            conns = list(self._every_conn)
        return [c for c in conns if not c.closed]

    def debug_info(self) -> Dict[str, Any]:
        """Shared-memory counters (``transport.shm_*``) and the stripes'
        (``transport.stripe*``)."""
        info: Dict[str, Any] = {"transport.shm_enabled": bool(self.features & handshake.FEATURE_SHM)}
        info.update(self._shm_stats.as_dict())
        info.update(self.stripes.stats.as_dict())
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

    def _closed(self, conn: Connection, reason: Optional[BaseException]) -> None:
        # Whatever fails here, the owner must still hear that the connection closed.
        guard = Guard(f"closing the connection of rank {self.rank} to rank {conn.peer_rank}",
                      limit=None)
        self.forget(conn.sock)
        if isinstance(reason, ProtocolError):
            self.rejects.warn("rank %d closed its connection with rank %d: %s",
                              self.rank, conn.peer_rank, reason)
        with guard:
            self._on_close(conn, reason)

    # -- closing -------------------------------------------------------------------------------

    def close(self, listeners: Iterable[Any], timeout: float) -> List[str]:
        """Refuse new sockets, close ``listeners`` and then every socket, join every
        thread started here (``timeout`` seconds at most for all of them together), and
        close every connection; the names of the threads still running."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._closing = True
            sockets = list(self._sockets)
        for listener in listeners:
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
            conns = list(self._every_conn)
        self.stripes.close(conns)  # a stripe's thread may wait for a part that never comes
        with self._lock:
            threads: List[Optional[threading.Thread]] = list(self._threads)
        stuck = _threads.join(threads, deadline)
        with self._lock:
            conns = list(self._every_conn)
        for conn in conns:  # those without a reader (a caller's idle private ones) too:
            conn.close()    # their sockets and shared-memory segments would leak
        return stuck
