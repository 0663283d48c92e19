"""Reading frames off a connection: the reading role, polling, and zero-copy receives.

Reading is a role, not a thread. Whichever thread runs :meth:`FrameReader.read_frames`
holds it. The ``on_frame`` callback may return a callable: it has arranged for another
thread to go on reading (``read_frames()`` again), so this one stops, touches no read
state any more and runs the callable instead. The agent uses this to run a request on
the thread that read it, instead of waking a pool thread for it (leader/follower).

:meth:`FrameReader._next_frame` is the one parser of whole frames, for the reader loop
and for :meth:`FrameReader.read_frame` alike: it checks each part with the wire layer
(``_wire/frame.py`` has the layout) and the frame's MACs with the connection's
``mac_rx``; tensor buffers are read straight into freshly allocated tensor memory
(``recv_into``), piece by piece where they are sealed, each piece MAC'd as it comes, and
buffers in shared memory are wrapped where they lie (``shm.py``).
Tests drive it without a socket, over a link that hands it bytes they feed
(``tests/support/frames.py``).
"""

from __future__ import annotations

import hmac
import logging
import mmap
import socket
import threading
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from .. import _wire
from .._threads import Guard
from ..errors import ConnectionLostError, ProtocolError
from . import handshake, shm
from .sockets import HANDSHAKE_TIMEOUT, lost
from .stripe import Part, Stripe, split as stripe_split, transfer


log = logging.getLogger(__name__)

_READ_CHUNK = 256 * 1024
_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)
# How many read_frames calls the current thread is in: a thread that serves frames never
# waits for outbox room (two workers' readers waiting on each other would deadlock).
_reading = threading.local()


DEFAULT_SPIN_US = 200.0  # how long a private connection's reader polls, in microseconds ...
DEFAULT_SPIN_SPARE_US = 2000.0  # ... and while the workers of this host leave CPUs spare


def spin_seconds(spin_us: Optional[float]) -> Tuple[float, float]:
    """How long readers poll, in seconds, normally and while CPUs are spare: ``spin_us``
    (the ``spin_us`` option) for both when set, else the defaults."""
    if spin_us is None:
        return DEFAULT_SPIN_US / 1e6, DEFAULT_SPIN_SPARE_US / 1e6
    return spin_us / 1e6, spin_us / 1e6


# How long a private connection's reader polls by default: _SPIN normally; _SPIN_SPARE
# while the workers of this host leave CPUs spare (see PollPolicy, which an agent builds
# from its spin_us option).
_SPIN, _SPIN_SPARE = spin_seconds(None)


class PollPolicy:
    """How long the readers of private connections poll before they block.

    Polling takes a CPU. Where the workers' compute threads already use every CPU, a
    poll that waits long slows down the computation it waits for, so the readers poll
    only briefly; where CPUs are spare, they poll for as long as a typical call takes;
    and where the host runs more workers than it has CPUs, not at all, since every poll
    then takes the CPU of another worker that has work. ``crowded``: how long they poll
    then (0 unless the ``spin_us`` option says otherwise). The agent owns one and hands
    it to its connections (``Connection.poll``).
    """

    __slots__ = ("seconds", "short", "spare", "crowded")

    def __init__(self, short: Optional[float] = None, spare: Optional[float] = None,
                 crowded: float = 0.0) -> None:
        self.short = _SPIN if short is None else short
        self.spare = _SPIN_SPARE if spare is None else spare
        self.crowded = crowded
        self.seconds = self.short  # read by the readers on every wait that polls

    @classmethod
    def from_option(cls, spin_us: Optional[float]) -> "PollPolicy":
        """The policy of the ``spin_us`` option: when set, polls last that long on any
        host; unset, the defaults, and no polls on a crowded host."""
        short, spare = spin_seconds(spin_us)
        return cls(short, spare, 0.0 if spin_us is None else short)

    def for_host(self, threads: int, workers: int, cpus: int) -> None:
        """Poll as a host with ``workers`` workers (of ``threads`` torch threads each,
        as this one has) on ``cpus`` usable CPUs allows."""
        workers = max(workers, 1)
        self.set_spare_cpus(threads * workers <= cpus, workers > cpus)

    def set_spare_cpus(self, spare: bool, crowded: bool = False) -> None:
        """Tell the readers whether the workers on this host leave CPUs idle, and
        whether there are more workers than CPUs (``crowded``)."""
        self.seconds = self.crowded if crowded else self.spare if spare else self.short


_SPIN_MISSES = 3  # polls in a row that found nothing: stop polling ...
_SPIN_PROBE = 16  # ... but poll again at every 16th wait, to notice when it pays again

# What a frame callback raises to close its connection; anything else it raises is a bug
# that costs only the frame (logged, and the reader reads on).
_CLOSING = (OSError, ProtocolError, ConnectionLostError)

# Called with the connection (the FrameReader's Connection) and the frame's parts.
FrameCallback = Callable[["FrameReader", _wire.Header, bytes, List[torch.Tensor]],
                         Optional[Callable[[], None]]]
CloseCallback = Callable[["FrameReader", Optional[BaseException]], None]


class FrameReader:
    """The reading half of :class:`~torchrpc._transport.connection.Connection`.

    A mixin rather than a part the connection holds: the reader's hot path reads the
    connection's own attributes (``sock``, ``spin``, the read buffer, ``mac_rx``,
    ``shm_rx``), which :class:`Connection` sets up, with no indirection.
    """


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
        except OSError as exc:
            error = lost(f"connection to rank {self.peer_rank} broke", exc)
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

    def _fill(self, n: int, at_start: bool = False) -> None:
        # Make n bytes available at self._rstart in the read buffer. ``at_start``: the
        # header of the next frame, which may be long in coming; the rest of a frame is
        # on its way once its first bytes came (see _recv_rest).
        start, end, mv = self._rstart, self._rend, self._rmv
        if end - start >= n:
            return
        if start and (len(mv) - start < n):
            mv[:end - start] = mv[start:end]
            end -= start
            start = 0
        recv_into = self.sock.recv_into
        waiting = at_start and start == end
        spin = 0.0
        if waiting and self.spin:
            self._waits += 1
            if self._misses < _SPIN_MISSES or self._waits % _SPIN_PROBE == 0:
                spin = self.poll.seconds
        while end - start < n:
            if waiting:
                k = self._spin_recv(mv[end:], spin) if spin else recv_into(mv[end:])
                waiting = False
            elif self.spin:
                k = self._recv_rest(mv[end:])
            else:
                k = recv_into(mv[end:])
            if k == 0:
                self._rstart, self._rend = start, end
                if end > start or not at_start:  # not at_start: a frame has begun
                    raise ProtocolError(f"truncated frame: the peer closed the connection "
                                        f"after {end - start} of {n} bytes")
                raise ConnectionLostError("peer closed the connection")
            end += k
            self.last_recv = time.monotonic()
        self._rstart, self._rend = start, end

    def _spin_recv(self, dst: memoryview, seconds: float, count: bool = True) -> int:
        # Poll without blocking for a moment before sleeping in recv. A thread that
        # sleeps leaves its CPU idle, and on virtual machines in particular code run
        # right after an idle CPU is woken runs slowly;
        # a reply or next request usually comes within the moment.
        # Polling costs a CPU that other threads and processes may need, so a connection
        # whose polls keep missing stops polling (see _fill); ``count``: whether this
        # poll's outcome counts toward that.
        recv_into = self.sock.recv_into
        until = time.perf_counter() + seconds
        while True:
            try:
                k = recv_into(dst, 0, _DONTWAIT)
            except BlockingIOError:
                if time.perf_counter() > until:
                    if count:
                        self._misses += 1
                    return recv_into(dst)
            else:
                if count:
                    self._misses = 0
                return k

    def _recv_rest(self, dst: memoryview) -> int:
        # The rest of a frame whose first bytes came: its sender is writing it now, so
        # poll for it rather than sleep, for as long as a wait for a frame would. These
        # polls do not count as misses: the frame's own start decides whether waits poll.
        seconds = self.poll.seconds
        return self._spin_recv(dst, seconds, False) if seconds else self.sock.recv_into(dst)

    def _take_into(self, dst: memoryview, poll: bool = True) -> None:
        # Fill dst from the read buffer, then straight from the socket; ``poll``: poll
        # for the rest where the connection polls (see _recv_rest).
        start, mv = self._rstart, self._rmv
        n = len(dst)
        have = min(n, self._rend - start)
        if have:
            dst[:have] = mv[start:start + have]
            self._rstart = start + have
        got = have
        recv = self._recv_rest if self.spin and poll else self.sock.recv_into
        while got < n:
            k = recv(dst[got:])
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

    def route_frames(self, on_frame: FrameCallback) -> None:
        """Deliver this connection's frames to ``on_frame`` instead (call it before
        the first frame is read)."""
        self._on_frame = on_frame

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
        except OSError as exc:
            error = lost(f"connection to rank {self.peer_rank} broke", exc)
            self.close(error)
            raise error from exc
        except (ProtocolError, ConnectionLostError) as exc:
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
        fill(_wire.HEADER_SIZE, True)
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
            if self._rend - self._rstart < n:
                fill(n)
            start = self._rstart
            envelope = bytes(mv[start:start + n])
            self._rstart = start + n
        else:
            envelope = self._take_bytes(n)
        check: Optional[handshake.Seal] = None  # of the buffers' bytes, where sealed
        sealed_digest = b""
        if mac is not None:
            sealed = mac.front if header.nbuffers else 0
            size = sealed + handshake.FRAME_MAC_SIZE
            fill(size)
            start = self._rstart
            seal = bytes(mv[start:start + sealed])
            tag = bytes(mv[start + sealed:start + size])
            self._rstart = start + size
            if not hmac.compare_digest(tag, mac.tag(head, envelope, seal)):
                raise ProtocolError(f"a frame from rank {self.peer_rank} failed authentication "
                                    f"(altered, replayed, reordered or injected on the way); "
                                    f"the connection is closed")
            if sealed:
                check, sealed_digest = mac.unseal(seal)
        if header.flags & _wire.FLAG_STRIPED and lengths:
            if check is not None and not mac.trailer:
                raise ProtocolError("a striped frame whose seal precedes its buffers")
            return header, envelope, _take_striped(self, lengths, check)
        buffers = []
        for size in lengths:
            if size & _wire.SHM_BIT:
                if self.shm_rx is None:
                    raise ProtocolError("a shared-memory buffer on a connection that did "
                                        "not negotiate shared memory")
                fill(_wire.SHM_REF_SIZE)
                start = self._rstart
                ref = mv[start:start + _wire.SHM_REF_SIZE]
                if check is not None:
                    check.update(ref)
                name = _wire.parse_shm_ref(ref)
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
            if check is not None:
                # MAC'd piece by piece as it comes, while the network brings the next.
                # The sender MACs its pieces too, so they come with gaps between them:
                # polling through each would spend a CPU for as long as the sender MACs
                # (and take it from the sender where both share a host), so the reader
                # waits in the kernel instead.
                step = check.piece
                for i in range(0, size, step):
                    piece = view[i:i + step]
                    self._take_into(piece, False)
                    check.update(piece)
            elif size:
                self._take_into(view)
            buffers.append(tensor)
        if check is not None:
            self._check_seal(check, sealed_digest if not mac.trailer else None)
        return header, envelope, buffers

    def _check_seal(self, check: handshake.Seal, digest: Optional[bytes]) -> None:
        # Checked once every byte is in place, before anyone sees the frame; ``digest``
        # None: it trails the buffers, and is read now.
        if digest is None:
            self._fill(handshake.SEAL_DIGEST_SIZE)
            start = self._rstart
            digest = bytes(self._rmv[start:start + handshake.SEAL_DIGEST_SIZE])
            self._rstart = start + handshake.SEAL_DIGEST_SIZE
        if not hmac.compare_digest(check.digest(), digest):
            raise ProtocolError(f"the tensor bytes of a frame from rank {self.peer_rank} failed "
                                f"authentication (altered on the way); the connection is "
                                f"closed")


def _take_striped(reader: "FrameReader", lengths: Sequence[int],
                  check: Optional[handshake.Seal]) -> List[torch.Tensor]:
    """The buffers of a striped frame (stripe.py) whose header and envelope ``reader``
    has read: the stripe's thread reads the second part of their bytes while this one
    reads the first; each part's seal is checked."""
    stripe = _await_stripe(reader)
    buffers, views = [], []
    for size in lengths:
        tensor, view = _wire.new_buffer(size)
        buffers.append(tensor)
        if size:
            views.append(view)
    first, second = stripe_split(views, sum(lengths))
    part = stripe.receive(Part(second, None if check is None
                               else reader.mac_rx.stripe_seal(check.number)))
    try:
        transfer(first, check, lambda piece: reader._take_into(piece, False))
        if check is not None:
            reader._check_seal(check, None)
    except BaseException:
        stripe.close()  # its thread must be done with the tensors before they go
        part.done.wait()
        raise
    part.wait()
    return buffers


def _await_stripe(reader: "FrameReader") -> Stripe:
    """``reader``'s stripe. The dialer attaches it once the server has: a striped frame
    may come first, on the dialer's side."""
    ready = reader._stripe_ready
    if reader.stripe is None and ready is not None:
        ready.wait(HANDSHAKE_TIMEOUT)
    if reader.stripe is None:
        raise ProtocolError(f"a striped frame from rank {reader.peer_rank} on a connection "
                            f"without a stripe")
    return reader.stripe
