"""One authenticated socket to a peer worker: sending frames, and closing.

Senders hand the header, envelope and tensor memory to ``sendmsg`` as one scatter/gather
list. Writes are combined: a thread that finds the connection busy leaves its frame in
the outbox and returns; the thread that is writing flushes everything queued in one
``sendmsg``, so many small messages under load cost few system calls while a lone
message goes out at once.

Between two workers of one host that both offered ``FEATURE_SHM``, buffers of at least
``shm_threshold`` bytes go through shared memory instead (``shm.py``): the sender copies
them into a segment, or sends back a buffer that lies in one of the peer's, and the
frame carries a reference. On plain TCP each frame carries MACs (``handshake.FrameMac``):
after its envelope, the seal of its buffers (where they are covered) and its tag, then
the buffers. Where the seal trails the buffers (``handshake.FEATURE_SEAL_TRAILER``), only
its number precedes the tag: the writer MACs the buffers piece by piece as it writes
them and then writes the digest (``_write_sealing``); otherwise the sending thread seals
them before it queues the frame. Between hosts, a frame with many buffer bytes sends part
of them over the connection's second socket at the same time (``stripe.py``). Reading is
:class:`~torchrpc._transport.reader.FrameReader`'s.
"""

from __future__ import annotations

import errno
import operator
import socket
import threading
import time
from typing import Any, Callable, List, Optional, Protocol, Sequence, Tuple

from .. import _wire
from ..errors import ConnectionClosedError, RpcTimeoutError
from . import handshake, shm
from .stripe import Part, Stripe, split as stripe_split
from .reader import (_DONTWAIT, _SPIN, CloseCallback, FrameCallback, FrameReader, PollPolicy,
                     _reading)
from .sockets import lost

_IOV_MAX = 512


class Link(Protocol):
    """What a connection needs of its byte stream: a connected stream socket, a TLS
    session over one (``tls.TlsSocket``), or in tests an in-memory pair
    (``tests/support/memory_transport.py``). Every link passes
    ``tests/transport/test_transport_conformance.py``."""

    def sendmsg(self, buffers: Sequence[Any]) -> int:
        """Send from the buffers in order; the number of bytes sent."""

    def recv_into(self, buffer: Any, nbytes: int = 0) -> int:
        """Receive into ``buffer``, waiting for some bytes; 0 at end-of-stream."""

    def shutdown(self, how: int) -> None:
        """End the stream; a reader blocked in ``recv_into`` wakes with end-of-stream."""

    def close(self) -> None:
        """Let the stream's resources go."""


class Releasable(list):
    """A keepalive list its sender gives away: :meth:`Connection.send` empties it as
    soon as the frame no longer needs the memory it keeps alive (every buffer staged
    into shared memory), so that memory is freed before the frame even leaves."""

    __slots__ = ()


class _Sealing:
    """In a frame's parts, in place of its buffers: the buffers (``data``, as they go on
    the stream), which the writer seals with ``seal`` as it writes them, and after which
    it writes the seal's digest (``handshake.FEATURE_SEAL_TRAILER``). In a striped frame
    (``stripe.py``), ``data`` is the first part (``seal`` None where buffers are not
    sealed) and ``stripe`` the stripe and the second part, which the writer hands over
    before it writes the first and waits for once the batch is written."""

    __slots__ = ("seal", "data", "stripe")

    def __init__(self, seal: Optional[handshake.Seal], data: List[Any],
                 stripe: Optional[Tuple[Stripe, Part]] = None) -> None:
        self.seal = seal
        self.data = data
        self.stripe = stripe


class Connection(FrameReader):
    """One authenticated socket to a peer worker."""

    def __init__(self, sock: Link, peer_rank: int, limits: _wire.Limits,
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
        self._outbox_sealing = False  # whether a frame in _outbox has a _Sealing part
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
        # side that opened it: whoever uses it there reads its frames (read_frame).
        self.private = False
        # Whether readers poll a moment before they block (see _spin_recv): on private
        # connections, where one blocked caller waits for its reply and the callee's
        # reader for the caller's next request.
        self.spin = False
        # How long they poll: the agent's policy, handed over when the connection opens.
        self.poll = PollPolicy()
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
        # Between hosts, the second socket once attached (stripe.py), the buffer bytes from
        # which a frame uses it (0: none does), and the event a reader waits for it on.
        self.stripe: Optional[Stripe] = None
        self.stripe_threshold = 0
        self._stripe_ready: Optional[threading.Event] = None

    def expect_stripe(self, threshold: int) -> None:
        """The connection may get a stripe: frames of ``threshold`` buffer bytes or more use it."""
        self.stripe_threshold = threshold
        self._stripe_ready = threading.Event()

    def attach_stripe(self, stripe: Stripe) -> bool:
        """Give the connection its stripe; False (and the stripe closed) where it is
        closed or has one already."""
        with self._lock:
            ok = not self._closed and self.stripe is None and self._stripe_ready is not None
            if ok:
                self.stripe = stripe
        if ok:
            self._stripe_ready.set()
        else:
            stripe.close()
        return ok

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
        lengths = list(map(len, buffers))
        staged = None
        if self.shm_decider is not None:
            self.shm_decider(self)
        returned: Sequence[Any] = ()  # no list made on the path of a frame without shm
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
        stripe = self.stripe
        if stripe is not None:
            total = sum(lengths) if lengths and not flags & _wire.FLAG_SHM else 0
            if total and total >= self.stripe_threshold and stripe.usable():
                flags |= _wire.FLAG_STRIPED
            else:
                stripe = None
        head = _wire.pack_header(kind, flags, request_id, len(envelope), lengths)
        parts = [head + envelope] if len(envelope) < 4096 else [head, envelope]
        size = len(head) + len(envelope)
        if lengths:
            data = [b for b in buffers if len(b)]
            size += sum(_wire.SHM_REF_SIZE if n & _wire.SHM_BIT else n for n in lengths)
        else:
            data = []
        mac = self.mac_tx
        seal = b""
        sealing = mac is not None and mac.trailer and bool(lengths)
        if stripe is not None:  # see stripe.py: the writer hands the second part over
            first, second = stripe_split(data, total)
            if sealing:
                entry = _Sealing(mac.open_seal(), first)
                seal = entry.seal.number
                entry.stripe = (stripe, Part(second, mac.stripe_seal(seal)))
            else:
                entry = _Sealing(None, first, (stripe, Part(second, None)))
            data = [entry]
            sealing = True
        elif sealing:  # the writer seals the buffers as it writes them (see _write)
            data = [_Sealing(mac.open_seal(), data)]
            seal = data[0].seal.number
        elif mac is not None and mac.buffers and lengths:
            seal = mac.seal(data)  # before the lock, by the sending thread
        with self._lock:
            if self._writing and self.max_outbox and self._outbox \
                    and self._outbox_bytes + size > self.max_outbox \
                    and not getattr(_reading, "depth", 0):
                self._wait_for_room(size, staged, returned)
            if self._closed:
                self._unsend(staged, returned)
                raise ConnectionClosedError(
                    f"connection to rank {self.peer_rank} is closed"
                    + (f": {self._close_reason}" if self._close_reason else ""))
            if mac is not None:  # tagged in outbox order, the order frames leave in
                parts.append(seal + mac.tag(head, envelope, seal) if seal
                             else mac.tag(head, envelope))
            parts.extend(data)
            if self._writing:
                self._outbox.append((parts, keepalive))
                self._outbox_bytes += size
                self._outbox_sealing |= sealing
                return
            self._writing = True
        # Nobody writes and nothing waits (a writer empties the outbox before it stops):
        # this frame goes out now, without the outbox; what others queue meanwhile, after.
        if self._write(parts, sealing):
            self._drain()

    def _unsend(self, staged: Any, returned: Any) -> None:
        """A frame that was to carry shared-memory buffers is not sent: undo them."""
        if staged:
            self.shm_tx.unstage(staged)
        if returned:
            self.shm_rx.unreturn(returned)

    def _wait_for_room(self, size: int, staged: Any, returned: Any) -> None:
        """Under _lock: wait until a frame of ``size`` bytes fits in the outbox (back-
        pressure on a peer that reads slower than we send), or raise after send_timeout."""
        deadline = time.monotonic() + self.send_timeout if self.send_timeout > 0 else None
        while not self._closed and self._writing and self._outbox \
                and self._outbox_bytes + size > self.max_outbox:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                self._unsend(staged, returned)
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
                sealing, self._outbox_sealing = self._outbox_sealing, False
                if self._room_waiters:
                    self._room.notify_all()
            if not self._write([p for parts, _ in batch for p in parts], sealing):
                return

    def _write(self, iov: List[Any], sealing: bool = False) -> bool:
        """As the writer: write ``iov`` whole (with ``sealing``, some of its entries are
        a frame's buffers to seal as they go, see :class:`_Sealing`); on failure stop
        writing, close the connection and return False."""
        try:
            if sealing:
                self._write_sealing(iov)
            else:
                self._write_all(iov)
            self.last_send = time.monotonic()
            return True
        except OSError as exc:
            with self._lock:
                self._writing = False
            if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):  # SO_SNDTIMEO expired
                error = lost(f"send to rank {self.peer_rank} made no progress for "
                             f"{self.send_timeout:g} s (send_timeout): the peer does "
                             f"not read", exc)
            else:
                error = lost(f"send to rank {self.peer_rank} failed", exc)
            self.close(error)
            return False
        except Exception as exc:  # noqa: BLE001 - a buffer could not be sealed (the
            # frame is cut short on the stream): the connection cannot go on
            with self._lock:
                self._writing = False
            self.close(exc)
            return False

    def _write_all(self, iov: List[Any]) -> None:
        sock, i = self.sock, 0
        while i < len(iov):
            sent = sock.sendmsg(iov[i:i + _IOV_MAX] if i or len(iov) > _IOV_MAX else iov)
            while sent:
                n = len(iov[i])
                if sent >= n:
                    sent -= n
                    i += 1
                else:
                    iov[i] = memoryview(iov[i])[sent:]
                    sent = 0

    def _write_sealing(self, iov: List[Any]) -> None:
        # Each _Sealing entry's second part, if it has one, goes to its stripe first;
        # then the entry becomes its buffers in pieces, then the seal's digest.
        parts: List[Tuple[Stripe, Part]] = []
        try:
            _write_entries(self._write_all, iov, parts)
        except BaseException:
            for stripe, _ in parts:  # a stripe blocked on a peer that reads no more
                stripe.close()
            raise
        finally:
            for _, part in parts:  # its views point into the frame's tensors
                part.done.wait()
        for _, part in parts:
            part.wait()

    # -- closing -------------------------------------------------------------------------------

    # Read through a C getter: checked on every call's path.
    closed = property(operator.attrgetter("_closed"), doc="Whether the connection is closed.")

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
        if self.stripe is not None:
            self.stripe.close()
        if self.shm_tx is not None:
            self.shm_tx.close()
        if self.shm_rx is not None:
            self.shm_rx.close()
        self._on_close(self, reason)


def _write_entries(write_all: Callable[[List[Any]], None], iov: List[Any],
                   parts: List[Tuple[Stripe, Part]]) -> None:
    """As the writer: write ``iov`` with ``write_all``, its :class:`_Sealing` entries as their
    pieces and digests; each entry's stripe part, if any, handed to its stripe first and
    added to ``parts``."""
    # Once a piece's worth is gathered, it goes out, and is then MAC'd while the
    # network carries it (the piece is still in the CPU's cache, fresh from the
    # kernel's copy); a frame's last piece is MAC'd first and goes out with the
    # digest, so a frame of one piece or less leaves in one call, with the frames
    # queued around it.
    run: List[Any] = []
    unsealed: List[Any] = []  # the pieces of the current frame's buffers in run
    gathered = 0
    for entry in iov:
        if type(entry) is not _Sealing:
            run.append(entry)
            continue
        if entry.stripe is not None:
            stripe, part = entry.stripe
            parts.append((stripe, stripe.send(part)))
        seal = entry.seal
        step = seal.piece if seal is not None else handshake.STREAM_PIECE
        data = entry.data
        for k, buf in enumerate(data, 1 - len(data)):  # k == 0: the last buffer
            view = memoryview(buf)
            if view.format != "B" or view.ndim != 1:
                view = view.cast("B")
            n = len(view)
            for i in range(0, n, step):
                piece = view[i:i + step]
                run.append(piece)
                unsealed.append(piece)
                gathered += len(piece)
                if gathered >= step and (k or i + step < n):
                    write_all(run)
                    if seal is not None:
                        for piece in unsealed:
                            seal.update(piece)
                    run, unsealed, gathered = [], [], 0
        if seal is not None:
            for piece in unsealed:
                seal.update(piece)
            run.append(seal.digest())
        unsealed = []
    write_all(run)
