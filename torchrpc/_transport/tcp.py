"""TCP connections between workers: authenticated, framed, zero-copy for tensors.

One :class:`Connection` per socket. The thread that holds its reading role (the
transport's own thread at first; see ``read_frames`` for how the role moves)
parses frames with the wire layer and reads tensor buffers straight into freshly
allocated tensor memory (``recv_into``). Senders hand the header, envelope and
tensor memory to ``sendmsg`` as one scatter/gather list. Writes are combined: a
thread that finds the connection busy leaves its frame in the outbox and
returns; the thread that is writing flushes everything queued in one
``sendmsg``, so many small messages under load cost few system calls while a
lone message goes out at once.

Between two workers of one host that both offered ``FEATURE_SHM``, buffers of at
least ``shm_threshold`` bytes go through shared memory instead (``shm.py``): the
sender copies them into a segment and the frame carries the segment's name.

The transport knows no message meanings: it hands whole frames to the
``on_frame`` callback and reports a closed connection to ``on_close``, with the
exception when the connection broke rather than closed.
"""

from __future__ import annotations

import errno
import hmac
import logging
import mmap
import os
import socket
import ssl
import struct
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import _wire
from .._threads import Fatal, Guard
from ..errors import AuthenticationError, ConnectionLostError, ProtocolError, RpcTimeoutError
from . import handshake, shm, tls

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 5.0  # seconds for a whole handshake, however its bytes trickle in
# Handshakes served at once; a connection beyond this is closed before it is read.
MAX_HANDSHAKES = 64
# The accept loop's pause when the process is out of descriptors, doubling up to the last.
_ACCEPT_BACKOFF = (0.05, 1.0)
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_READ_CHUNK = 256 * 1024
_IOV_MAX = 512
_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)
# How many read_frames calls the current thread is in: a thread that serves frames never
# waits for outbox room (two workers' readers waiting on each other would deadlock).
_reading = threading.local()


def _spin_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1e6:
        log.warning("TORCHRPC_SPIN_US must be microseconds between 0 and 1e6, "
                    "got %r; using 200", text)
        value = 200.0
    return value / 1e6


# How long a private connection's reader polls: _SPIN normally; _SPIN_SPARE while the
# workers of this host leave CPUs spare (see set_spare_cpus); TORCHRPC_SPIN_US sets both.
_SPIN = _spin_seconds(os.environ.get("TORCHRPC_SPIN_US", "200"))
_SPIN_SPARE = _spin_seconds(os.environ.get("TORCHRPC_SPIN_US", "2000"))
_poll = _SPIN


def set_spare_cpus(spare: bool) -> None:
    """Tell the readers whether the workers on this host leave CPUs idle.

    Polling takes a CPU. Where the workers' compute threads already use every CPU, a
    poll that waits long slows down the computation it waits for, so the readers poll
    only briefly; where CPUs are spare, they poll for as long as a typical call takes.
    """
    global _poll
    _poll = _SPIN_SPARE if spare else _SPIN


_SPIN_MISSES = 3  # polls in a row that found nothing: stop polling ...
_SPIN_PROBE = 16  # ... but poll again at every 16th wait, to notice when it pays again

# What a frame callback raises to close its connection; anything else it raises is a bug
# that costs only the frame (logged, and the reader reads on).
_CLOSING = (OSError, ProtocolError, ConnectionLostError)

FrameCallback = Callable[["Connection", _wire.Header, bytes, List[torch.Tensor]],
                         Optional[Callable[[], None]]]
CloseCallback = Callable[["Connection", Optional[BaseException]], None]


class Releasable(list):
    """A keepalive list its sender gives away: :meth:`Connection.send` empties it as
    soon as the frame no longer needs the memory it keeps alive (every buffer staged
    into shared memory), so that memory is freed before the frame even leaves."""

    __slots__ = ()


class Connection:
    """One authenticated socket to a peer worker."""

    def __init__(self, sock: socket.socket, peer_rank: int, limits: _wire.Limits,
                 on_frame: FrameCallback, on_close: CloseCallback, outbound: bool) -> None:
        self.sock = sock
        self.peer_rank = peer_rank
        self.outbound = outbound
        self._limits = limits
        self._on_frame = on_frame
        self._on_close = on_close
        self._lock = threading.Lock()
        self._outbox: List[Any] = []
        self._outbox_bytes = 0  # stream bytes of the frames in _outbox
        self._room = threading.Condition(self._lock)  # _outbox got emptier, or closed
        self._room_waiters = 0  # threads in _wait_for_room: only they need a notify
        self._writing = False
        # Bounds, set by the transport: bytes that may wait in the outbox before a sender
        # waits for room (0: no bound), and how long it waits (0: as long as it takes).
        self.max_outbox = 0
        self.send_timeout = 0.0
        self._closed = False
        self._close_reason: Optional[BaseException] = None
        # Same-host shared memory (see shm.py), set up by the transport after the handshake.
        self.shm_tx: Optional[shm.ShmSender] = None
        self.shm_rx: Optional[shm.ShmReceiver] = None
        # Decides shm_tx on the first send: a connection may be accepted before this
        # worker knows which peers share its host.
        self.shm_decider: Optional[Callable[["Connection"], None]] = None
        # The read buffer and the unconsumed bytes in it, [_rstart, _rend): state of the
        # reading role, which moves between threads (see read_frames).
        self._rmv: Optional[memoryview] = None
        self._rstart = self._rend = 0
        # A private connection (handshake.FEATURE_PRIVATE) has no reader of its own on the
        # client side: the thread that made the call reads the reply (read_frame).
        self.private = False
        # Whether readers poll a moment before they block (see _spin_recv): on private
        # connections, where one blocked caller waits for its reply and the callee's
        # reader for the caller's next request.
        self.spin = False
        # Polls that ended without data in a row, and waits so far: a connection whose
        # polls keep missing (the answer takes longer than the poll, or the next call
        # comes much later) stops polling, and tries again every _SPIN_PROBE-th wait.
        self._misses = 0
        self._waits = 0
        # When bytes last came in and last went out (monotonic); the agent's heartbeat
        # sends on idle connections and closes silent ones.
        self.last_recv = self.last_send = time.monotonic()
        # The frames' MACs of each direction, on plain TCP (handshake.FEATURE_FRAME_MAC).
        self.mac_tx: Optional[handshake.FrameMac] = None
        self.mac_rx: Optional[handshake.FrameMac] = None

    def set_private(self, private: bool) -> None:
        """Mark the connection private (or not), and so whether its readers poll."""
        self.private = private
        self.spin = private and bool(_SPIN and _DONTWAIT) and type(self.sock) is socket.socket

    # -- sending -------------------------------------------------------------------------------

    def send(self, kind: int, flags: int, request_id: int, envelope: bytes,
             buffers: Sequence[memoryview], keepalive: Any = None) -> None:
        """Queue one frame; write it now unless another thread is already writing.

        With shared memory, large buffers are copied into segments here, by the
        calling thread, and the frame carries their names instead.
        """
        lengths = [len(b) for b in buffers]
        staged = None
        if self.shm_decider is not None:
            self.shm_decider(self)
        returned: List[Any] = []
        if self.shm_tx is not None and buffers:
            if self.shm_rx is not None:
                buffers, lengths, returned = self.shm_rx.pass_back(buffers, lengths,
                                                                   self.shm_tx.threshold)
            buffers, lengths, staged = self.shm_tx.stage(buffers, lengths)
            if staged or returned:
                flags |= _wire.FLAG_SHM
                # The frame carries only references now: the tensors need not wait for it.
                if type(keepalive) is Releasable \
                        and len(staged) + len(returned) == sum(1 for n in lengths if n):
                    keepalive.clear()
        head = _wire.pack_header(kind, flags, request_id, len(envelope), lengths)
        parts = [head + envelope] if len(envelope) < 4096 else [head, envelope]
        size = len(head) + len(envelope)
        if lengths:
            data = [b for b in buffers if len(b)]
            size += sum(_wire.SHM_REF_SIZE if n & _wire.SHM_BIT else n for n in lengths)
        else:
            data = []
        with self._lock:
            if self._writing and self.max_outbox and self._outbox \
                    and self._outbox_bytes + size > self.max_outbox \
                    and not getattr(_reading, "depth", 0):
                self._wait_for_room(size, staged, returned)
            if self._closed:
                if staged:
                    self.shm_tx.unstage(staged)
                if returned:
                    self.shm_rx.unreturn(returned)
                raise ConnectionLostError(
                    f"connection to rank {self.peer_rank} is closed"
                    + (f": {self._close_reason}" if self._close_reason else ""))
            if self.mac_tx is not None:  # tagged in outbox order, the order frames leave in
                parts.append(self.mac_tx.tag(head, envelope))
            parts.extend(data)
            self._outbox.append((parts, keepalive))
            self._outbox_bytes += size
            if self._writing:
                return
            self._writing = True
        self._drain()

    def _wait_for_room(self, size: int, staged: Any, returned: Any) -> None:
        """Under _lock: wait until a frame of ``size`` bytes fits in the outbox (back-
        pressure on a peer that reads slower than we send), or raise after send_timeout."""
        deadline = time.monotonic() + self.send_timeout if self.send_timeout > 0 else None
        while not self._closed and self._writing and self._outbox \
                and self._outbox_bytes + size > self.max_outbox:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                if staged:
                    self.shm_tx.unstage(staged)
                if returned:
                    self.shm_rx.unreturn(returned)
                raise RpcTimeoutError(
                    f"send to rank {self.peer_rank} timed out after {self.send_timeout:g} s "
                    f"waiting for room: {self._outbox_bytes} bytes wait in its outbox "
                    f"(max_outbox_bytes is {self.max_outbox}) while the peer reads slower "
                    f"than this worker sends; raise send_timeout or max_outbox_bytes")
            self._room_waiters += 1
            try:
                self._room.wait(left)
            finally:
                self._room_waiters -= 1

    @property
    def outbox_bytes(self) -> int:
        """Bytes of frames waiting in the outbox (for counters and tests)."""
        return self._outbox_bytes

    def _drain(self) -> None:
        while True:
            with self._lock:
                batch = self._outbox
                if not batch or self._closed:
                    self._writing = False
                    if self._room_waiters:
                        self._room.notify_all()
                    return
                self._outbox = []
                self._outbox_bytes = 0
                if self._room_waiters:
                    self._room.notify_all()
            iov = [p for parts, _ in batch for p in parts]
            try:
                self._sendall(iov)
                self.last_send = time.monotonic()
            except OSError as exc:
                with self._lock:
                    self._writing = False
                if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):  # SO_SNDTIMEO expired
                    why = (f"send to rank {self.peer_rank} made no progress for "
                           f"{self.send_timeout:g} s (send_timeout): the peer does not read")
                else:
                    why = f"send to rank {self.peer_rank} failed: {exc}"
                self.close(ConnectionLostError(why))
                return

    def _sendall(self, iov: List[Any]) -> None:
        sock = self.sock
        i = 0
        while i < len(iov):
            sent = sock.sendmsg(iov[i:i + _IOV_MAX])
            while sent:
                n = len(iov[i])
                if sent >= n:
                    sent -= n
                    i += 1
                else:
                    iov[i] = memoryview(iov[i])[sent:]
                    sent = 0

    # -- receiving -----------------------------------------------------------------------------
    #
    # Reading is a role, not a thread. Whichever thread runs read_frames() holds it. The
    # on_frame callback may return a callable: it has arranged for another thread to go
    # on reading (read_frames() again), so this one stops, touches no read state any more
    # and runs the callable instead. The agent uses this to run a request on the thread
    # that read it, instead of waking a pool thread for it (leader/follower).

    def read_loop(self) -> None:
        """Read frames until the connection ends or the reading role is handed on; in that
        case, run what the frame callback returned."""
        work = self.read_frames()
        if work is not None:
            work()

    def read_frames(self) -> Optional[Callable[[], None]]:
        """Hold the reading role: read frames until the connection ends (report the close
        once and return None) or the frame callback hands the role on (return its work)."""
        error: Optional[BaseException] = None
        _reading.depth = getattr(_reading, "depth", 0) + 1
        try:
            return self._read_frames()
        except _CLOSING as exc:
            error = exc  # a ProtocolError (bad or truncated frame) is logged by the transport
        except Exception as exc:  # noqa: BLE001 - reading itself failed: where the next
            # frame starts is unknown, so the connection closes
            log.exception("the reader of the connection to rank %s failed; the "
                          "connection closes", self.peer_rank)
            error = exc
        finally:
            _reading.depth -= 1
        self.close(error)
        return None

    @property
    def rx_buffered(self) -> int:
        """Bytes read from the socket that no frame has consumed yet (reader only)."""
        return self._rend - self._rstart

    def _fill(self, n: int) -> None:
        # Make n bytes available at self._rstart in the read buffer.
        start, end, mv = self._rstart, self._rend, self._rmv
        if end - start >= n:
            return
        if start and (len(mv) - start < n):
            mv[:end - start] = mv[start:end]
            end -= start
            start = 0
        recv_into = self.sock.recv_into
        spin = 0.0
        if start == end and self.spin:
            self._waits += 1
            if self._misses < _SPIN_MISSES or self._waits % _SPIN_PROBE == 0:
                spin = _poll
        while end - start < n:
            if spin:
                k = self._spin_recv(mv[end:], spin)
                spin = 0.0
            else:
                k = recv_into(mv[end:])
            if k == 0:
                self._rstart, self._rend = start, end
                if end > start:
                    raise ProtocolError(f"truncated frame: the peer closed the connection "
                                        f"after {end - start} of {n} bytes")
                raise ConnectionLostError("peer closed the connection")
            end += k
            self.last_recv = time.monotonic()
        self._rstart, self._rend = start, end

    def _spin_recv(self, dst: memoryview, seconds: float) -> int:
        # Poll without blocking for a moment before sleeping in recv. A thread that
        # sleeps leaves its CPU idle, and on virtual machines in particular the first
        # tens of microseconds after an idle CPU is woken run several times slower;
        # a reply or next request usually comes within the moment.
        # Polling costs a CPU that other threads and processes may need, so a connection
        # whose polls keep missing stops polling (see _fill).
        recv_into = self.sock.recv_into
        until = time.perf_counter() + seconds
        while True:
            try:
                k = recv_into(dst, 0, _DONTWAIT)
            except BlockingIOError:
                if time.perf_counter() > until:
                    self._misses += 1
                    return recv_into(dst)
            else:
                self._misses = 0
                return k

    def _take_into(self, dst: memoryview) -> None:
        # Fill dst from the read buffer, then straight from the socket.
        start, mv = self._rstart, self._rmv
        n = len(dst)
        have = min(n, self._rend - start)
        if have:
            dst[:have] = mv[start:start + have]
            self._rstart = start + have
        got = have
        while got < n:
            k = self.sock.recv_into(dst[got:])
            if k == 0:
                raise ProtocolError("truncated frame: the peer closed the connection "
                                    "in the middle of a frame")
            got += k
            self.last_recv = time.monotonic()

    def _take_bytes(self, n: int) -> bytearray:
        # Grow with what arrives, so a length claimed in a header allocates nothing
        # until the peer actually sends the bytes.
        out = bytearray()
        while len(out) < n:
            old = len(out)
            out.extend(bytes(min(n - old, max(old, _READ_CHUNK))))
            tail = memoryview(out)[old:]
            try:
                self._take_into(tail)
            finally:
                tail.release()
        return out

    def _read_frames(self) -> Optional[Callable[[], None]]:
        next_frame = self._next_frame
        on_frame = self._on_frame
        while True:
            header, envelope, buffers = next_frame()
            try:
                work = on_frame(self, header, envelope, buffers)
            except _CLOSING:
                raise
            except Exception as exc:  # noqa: BLE001 - the frame was read whole: read on
                Guard(f"the reader of the connection to rank {self.peer_rank}",
                      limit=None).failed(exc)
                work = None
            if work is not None:
                return work  # another thread reads on: touch nothing here any more
            # Hold nothing of this frame while waiting for the next: its memory (or its
            # shared-memory segment) must be free as soon as the receiver is done with it.
            envelope = buffers = None

    def read_frame(self) -> Tuple[_wire.Header, bytes, List[torch.Tensor]]:
        """Read one frame on the calling thread (private connections, which have no
        reader: their caller reads its own reply). A broken connection is closed and
        its error raised."""
        try:
            return self._next_frame()
        except (OSError, ProtocolError, ConnectionLostError) as exc:
            self.close(exc)
            raise ConnectionLostError(f"connection to rank {self.peer_rank} broke: {exc}") \
                from exc

    def _next_frame(self) -> Tuple[_wire.Header, bytes, List[torch.Tensor]]:
        limits = self._limits
        if self._rmv is None:
            # An anonymous mapping, not a bytearray (which zeroes every page): a page costs
            # memory only once data lands on it, so idle connections cost next to nothing.
            self._rmv = memoryview(mmap.mmap(-1, _READ_CHUNK))
        mv = self._rmv
        fill = self._fill
        if self._rstart == self._rend:
            self._rstart = self._rend = 0
        fill(_wire.HEADER_SIZE)
        start = self._rstart
        mac = self.mac_rx
        header = _wire.parse_header(mv[start:start + _wire.HEADER_SIZE], limits)
        # What the MAC covers is copied before later reads may move the buffer's bytes.
        head = bytes(mv[start:start + _wire.HEADER_SIZE]) if mac is not None else b""
        self._rstart = start = start + _wire.HEADER_SIZE
        lengths: Sequence[int] = ()
        if header.nbuffers:
            table = 8 * header.nbuffers
            if table <= len(mv):
                fill(table)
                start = self._rstart
                raw: Any = mv[start:start + table]
                self._rstart = start + table
            else:
                raw = bytearray(table)
                self._take_into(memoryview(raw))
            lengths = _wire.parse_lengths(raw, header, limits)
            if mac is not None:
                head += bytes(raw)
        n = header.envelope_len
        if n <= len(mv):
            fill(n)
            start = self._rstart
            envelope = bytes(mv[start:start + n])
            self._rstart = start + n
        else:
            envelope = self._take_bytes(n)
        if mac is not None:
            size = handshake.FRAME_MAC_SIZE
            fill(size)
            start = self._rstart
            tag = bytes(mv[start:start + size])
            self._rstart = start + size
            if not hmac.compare_digest(tag, mac.tag(head, envelope)):
                raise ProtocolError(f"a frame from rank {self.peer_rank} failed authentication "
                                    f"(altered, replayed, reordered or injected on the way); "
                                    f"the connection is closed")
        buffers = []
        for size in lengths:
            if size & _wire.SHM_BIT:
                if self.shm_rx is None:
                    raise ProtocolError("a shared-memory buffer on a connection that did "
                                        "not negotiate shared memory")
                fill(_wire.SHM_REF_SIZE)
                start = self._rstart
                name = _wire.parse_shm_ref(mv[start:start + _wire.SHM_REF_SIZE])
                self._rstart = start + _wire.SHM_REF_SIZE
                if shm.is_return_ref(name):  # a buffer of ours, sent back
                    if self.shm_tx is None:
                        raise ProtocolError("a shared-memory buffer sent back on a connection "
                                            "that sent none")
                    buffers.append(self.shm_tx.returned(name, size & ~_wire.SHM_BIT))
                else:
                    buffers.append(self.shm_rx.open(name, size & ~_wire.SHM_BIT))
                continue
            tensor, view = _wire.new_buffer(size)
            if size:
                self._take_into(view)
            buffers.append(tensor)
        return header, envelope, buffers

    # -- closing -------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, reason: Optional[BaseException] = None) -> None:
        """Close the socket; report to ``on_close`` once, with ``reason`` if it broke."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._close_reason = reason
            self._outbox = []
            self._outbox_bytes = 0
            self._room.notify_all()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        if self.shm_tx is not None:
            self.shm_tx.close()
        if self.shm_rx is not None:
            self.shm_rx.close()
        self._on_close(self, reason)


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
        """Stop listening, close every socket and join every thread the transport started."""
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
            t.join(timeout)
        with self._lock:
            conns = list(self._every_conn)
        for conn in conns:  # those without a reader (a caller's idle private ones) too:
            conn.close()    # their sockets and shared-memory segments would leak
