"""A connection's second socket (its *stripe*): the bytes of a large frame travel over two
TCP streams at once.

Theory of operation. A Python thread that moves a tensor through one socket copies
every byte between the kernel and tensor memory itself, so one stream between hosts
moves what one CPU copies; two streams, each with its own thread, let two CPUs copy
(BENCHMARKS.md, "Two hosts"). A connection over TCP whose two sides offered
``handshake.FEATURE_STRIPE`` gets one more socket: its dialer opens a second handshake
marked ``FEATURE_STRIPE_SOCKET``, which names the connection by the server's nonce of
that connection's handshake (``dial.dial_stripe``, ``accept.py``); the server attaches
it to the connection of that nonce, which must be the same rank's. Unix sockets take
none, nor does a TCP connection whose large buffers go through shared memory
(``Links.shares_memory``): where a peer on this host cannot open this process's
segments (another pid namespace), the stripe carries them.

A stripe may come before the server has registered the connection it names (the
dialer opens it as soon as it has that connection's ACCEPT): the server announces the
connection's nonce before it sends that ACCEPT (:meth:`Stripes.announce`), and a stripe
naming it waits until it is registered. Either side may still lose the stripe while it
opens: the server refuses one that names no open connection of the dialer's (closed
meanwhile, say), and the dialer gives up on one whose ACCEPT is late. Neither breaks
the connection, which then goes on with one socket on both ends. So a side sends
striped frames only once it knows the other has the stripe: the dialer once it has the
ACCEPT (the server attached the stripe before it sent that), the server once it has
read the dialer's ``handshake.READY``, the first byte on the stripe
(:meth:`Stripe.await_ready`); a dialer that gave up closes the socket instead, and the
server's side of the stripe closes unused.

A frame whose out-of-band buffers hold at least the connection's ``stripe_threshold``
bytes travels striped (``_wire.FLAG_STRIPED``, which the frame's tag covers): the
buffers' bytes, taken as one run, are cut in two by :func:`split`; the first part
follows the envelope on the connection as any frame's buffers do, while the stripe's
sending thread writes the second, and the peer's receiving thread reads it into its
place in the same tensors. The stripe carries nothing else, and its parts go in the
order of their frames (a connection has one writer and one reader at a time, and each
hands its stripe the parts in frame order), so it needs no framing. Where the frames'
MACs cover their buffers, each part has a seal of its own under the frame's number
(``handshake.FrameMac.stripe_seal``), its digest following the part on its stream.

Whoever hands the stripe a part waits for it (:meth:`Part.wait`) before the frame is
done, on every path: the part's views point into tensors that only the frame keeps.
"""

from __future__ import annotations

import hmac
import logging
import queue
import socket
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..errors import ConnectionLostError, ProtocolError
from . import handshake
from .sockets import HANDSHAKE_TIMEOUT

log = logging.getLogger(__name__)

# The cut between a striped frame's two parts falls on a multiple of this many bytes, so
# that each part is whole pieces of the seal but its last.
ALIGN = handshake.STREAM_PIECE


def split(views: Sequence[Any], total: int) -> Tuple[List[memoryview], List[memoryview]]:
    """The two parts of a striped frame's buffers ``views`` (``total`` bytes): views of
    its first bytes, up to half of ``total`` rounded down to :data:`ALIGN`, and of the
    rest. Sender and receiver cut alike."""
    cut = total // 2 // ALIGN * ALIGN
    first: List[memoryview] = []
    second: List[memoryview] = []
    at = 0
    for buf in views:
        view = memoryview(buf)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        n = len(view)
        if at + n <= cut:
            first.append(view)
        elif at >= cut:
            second.append(view)
        else:
            first.append(view[:cut - at])
            second.append(view[cut - at:])
        at += n
    return first, second


def transfer(views: Sequence[memoryview], seal: Optional[handshake.Seal],
             move: Callable[[memoryview], None]) -> int:
    """Move a part's ``views`` with ``move``, piece by piece, each piece MAC'd with
    ``seal`` (if any) once it has crossed: going out, while the network carries it;
    coming in, while it is still in the CPU's cache. The pieces are the seal's (of
    :data:`ALIGN` bytes without one), from the start of each view, as both ends walk a
    part so that both seal the same pieces. Returns the bytes moved."""
    step = seal.piece if seal is not None else ALIGN
    for view in views:
        for i in range(0, len(view), step):
            piece = view[i:i + step]
            move(piece)
            if seal is not None:
                seal.update(piece)
    return sum(map(len, views))


class Part:
    """One part of a striped frame, handed to the stripe: the views it fills or sends,
    and the seal of their bytes (None where buffers are not sealed)."""

    __slots__ = ("views", "seal", "done", "error")

    def __init__(self, views: List[memoryview], seal: Optional[handshake.Seal]) -> None:
        self.views = views
        self.seal = seal
        self.done = threading.Event()
        self.error: Optional[BaseException] = None

    def wait(self) -> None:
        """Wait until the stripe's thread is done with the part; raise what failed it."""
        self.done.wait()
        if self.error is not None:
            raise self.error


class Stats:
    """Counters of one transport's stripes, open and closed (``transport.stripe_*``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.opened = self.sent = self.received = 0

    def add(self, opened: int = 0, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self.opened += opened
            self.sent += sent
            self.received += received

    def as_dict(self) -> Dict[str, int]:
        with self._lock:
            return {"transport.stripes_opened": self.opened,
                    "transport.stripe_bytes_sent": self.sent,
                    "transport.stripe_bytes_received": self.received}


class Stripe:
    """The second socket of a connection, with a thread that sends parts on it and one
    that receives them, each started with its first part. ``link`` is its socket (plain
    or TLS, after the handshake); ``spawn(target, name)`` starts a thread that the
    transport joins when it closes; ``forget(link)``: the transport stops tracking the
    socket once it is closed; ``stats``: the transport's counters; ``ready``: the peer
    has the stripe too (the dialer's side), else it says so first (:meth:`await_ready`)."""

    def __init__(self, link: Any, peer_rank: int, spawn: Callable[[Callable[[], None], str], Any],
                 forget: Callable[[Any], None], name: str, stats: Stats,
                 ready: bool = True) -> None:
        self.link = link
        self._stats = stats
        self.peer_rank = peer_rank
        self._spawn = spawn
        self._forget = forget
        self._name = name
        self._out: "queue.SimpleQueue[Optional[Part]]" = queue.SimpleQueue()
        self._in: "queue.SimpleQueue[Optional[Part]]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._started: set = set()  # the queues whose thread was started
        self._running = 0  # threads not ended: the last to end after close closes the socket
        self._ready = ready  # the peer has the stripe: frames from here may use it
        self._settled = threading.Event()  # ready, or closed
        if ready:
            self._settled.set()
        self.sent = self.received = 0  # bytes of parts (for counters and tests)

    def usable(self) -> bool:
        """Whether a frame may go out striped now: the stripe is open and the peer has it.
        Until the peer's READY is read, wait for it (for a handshake's time at most)."""
        if not self._settled.is_set():
            self._settled.wait(HANDSHAKE_TIMEOUT)
        return self._ready and not self._closed

    def await_ready(self) -> None:
        """The accepting side, on the thread that accepted the stripe: read the dialer's
        ``handshake.READY``, after which frames from here may use the stripe. Where the
        dialer gave up on it (closed its socket) or anything else comes, the stripe closes
        unused, and its connection goes on with one socket. Returns once read, or once the
        stripe closed."""
        with self._lock:
            if self._closed:
                return
            self._running += 1  # the socket stays open while this thread reads it
        why = "closed it"
        try:
            got = self.link.recv(len(handshake.READY))
        except OSError as exc:
            got, why = b"", str(exc)
        if got and got != handshake.READY:
            why = f"sent {got!r}"
        with self._lock:
            self._running -= 1
            ready = got == handshake.READY and not self._closed
            self._ready = ready
            release = self._closed and self._running == 0
        self._settled.set()
        if release:
            self._release()
        elif not ready:
            log.info("%s: rank %d %s instead of saying it has the stripe; the stripe "
                     "closes unused, and large frames use its connection alone", self._name,
                     self.peer_rank, why)
            self.close()

    def send(self, part: Part) -> Part:
        """Queue ``part`` to go out after the parts queued before it."""
        return self._hand(self._out, self._send, "tx", part)

    def receive(self, part: Part) -> Part:
        """Queue ``part`` to be filled from the stream after the parts queued before it."""
        return self._hand(self._in, self._receive, "rx", part)

    def _hand(self, parts: "queue.SimpleQueue[Optional[Part]]", work: Callable[[Part], None],
              which: str, part: Part) -> Part:
        with self._lock:
            if self._closed:
                part.error = self._gone()
                part.done.set()
                return part
            parts.put(part)
            start = which not in self._started
            if start:
                self._started.add(which)
                self._running += 1
        if start:
            try:
                self._spawn(lambda: self._loop(parts, work), f"{self._name}-{which}")
            except BaseException as exc:  # noqa: BLE001 - the transport is closing
                with self._lock:
                    self._running -= 1
                part.error = exc  # the only part of its queue: no thread takes it
                part.done.set()
                self.close()
        return part

    def _gone(self) -> ConnectionLostError:
        return ConnectionLostError(f"the stripe of the connection to rank {self.peer_rank} "
                                   f"is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close the socket; the parts queued or under way fail, and the threads end."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._out.put(None)
            self._in.put(None)
            idle = self._running == 0
        self._settled.set()
        try:
            self.link.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if idle:
            self._release()

    def _release(self) -> None:
        # Once no thread uses the socket: a descriptor closed under a thread in a call
        # could be reused by another socket meanwhile.
        self.link.close()
        self._forget(self.link)

    def _loop(self, parts: "queue.SimpleQueue[Optional[Part]]",
              work: Callable[[Part], None]) -> None:
        try:
            while True:
                part = parts.get()
                if part is None:
                    return
                try:
                    if self._closed:
                        raise self._gone()
                    work(part)
                except BaseException as exc:  # noqa: BLE001 - the waiter raises it
                    part.error = exc
                    self.close()
                finally:
                    part.done.set()
        finally:
            with self._lock:  # a thread ends only after close()
                self._running -= 1
                last = self._running == 0
            if last:
                self._release()

    def _send(self, part: Part) -> None:
        seal, link = part.seal, self.link
        n = transfer(part.views, seal, lambda piece: _send_all(link, piece))
        if seal is not None:
            _send_all(self.link, memoryview(seal.digest()))
        self.sent += n
        self._stats.add(sent=n)

    def _receive(self, part: Part) -> None:
        if not self._settled.is_set():  # the dialer's READY comes first on the stream
            self._settled.wait()
            if self._closed:
                raise self._gone()
        seal, link = part.seal, self.link
        n = transfer(part.views, seal, lambda piece: _recv_all(link, piece))
        if seal is not None:
            got = bytearray(handshake.SEAL_DIGEST_SIZE)
            _recv_all(self.link, memoryview(got))
            if not hmac.compare_digest(seal.digest(), bytes(got)):
                raise ProtocolError(f"the tensor bytes of a frame from rank {self.peer_rank} "
                                    f"failed authentication (altered on the way, on the "
                                    f"connection's stripe); the connection is closed")
        self.received += n
        self._stats.add(received=n)


def _send_all(link: Any, view: memoryview) -> None:
    while len(view):
        view = view[link.sendmsg([view]):]


def _recv_all(link: Any, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = link.recv_into(view[got:])
        if k == 0:
            raise ProtocolError("truncated frame: the peer closed the connection's stripe "
                                "in the middle of a frame")
        got += k


class Stripes:
    """The stripes of one transport's connections: which connections may get one, the
    connections accepted here that a stripe's dialer may name (by their handshake's
    server nonce), and the counters. ``threshold``: the buffer bytes from which a frame
    uses a stripe (0: this worker offers none); ``spawn`` and ``forget`` as for
    :class:`Stripe`."""

    def __init__(self, rank: int, threshold: int,
                 spawn: Callable[[Callable[[], None], str], Any],
                 forget: Callable[[Any], None]) -> None:
        self.rank = rank
        self.threshold = threshold
        self.stats = Stats()
        self._spawn = spawn
        self._forget = forget
        self._lock = threading.Lock()
        self._registered = threading.Condition(self._lock)  # a connection left _coming
        self._parents: "weakref.WeakValueDictionary[bytes, Any]" = weakref.WeakValueDictionary()
        # The server nonces of connections accepted here but not yet registered: a stripe
        # naming one may come as soon as its dialer has the ACCEPT, and waits for it.
        self._coming: set = set()

    def announce(self, nonce: bytes) -> bytes:
        """The connection of server nonce ``nonce`` is about to be accepted here (before
        its ACCEPT): a stripe that names it waits until :meth:`settle`. Returns ``nonce``."""
        with self._lock:
            self._coming.add(nonce)
        return nonce

    def settle(self, nonce: bytes) -> None:
        """The connection announced as ``nonce`` is registered (:meth:`expect`), or never
        will be; nothing where ``nonce`` is empty."""
        if nonce:
            with self._lock:
                self._coming.discard(nonce)
                self._registered.notify_all()

    def expect(self, conn: Any) -> None:
        """``conn``, over TCP, negotiated stripes: it may get one."""
        mac = conn.mac_tx  # a seal in front of the buffers cannot be split
        if not self.threshold or (mac is not None and mac.buffers and not mac.trailer):
            return
        conn.expect_stripe(self.threshold)
        if not conn.outbound:
            with self._lock:
                self._parents[conn.nonces[1]] = conn

    def parent(self, rank: int, nonce: bytes, deadline: float) -> Optional[Any]:
        """The connection accepted here from ``rank`` whose handshake's server nonce was
        ``nonce``, open and still without a stripe; None if there is none (by
        ``deadline``, a ``time.monotonic()``, where it is still being accepted)."""
        with self._lock:
            while nonce in self._coming:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._registered.wait(left)
            conn = self._parents.get(nonce)
        if conn is None or conn.peer_rank != rank or conn.closed or conn.stripe is not None:
            return None
        return conn

    def attach(self, conn: Any, sock: Any) -> Optional[Stripe]:
        """Make ``sock``, which passed a stripe's handshake, the stripe of ``conn``
        (on the accepting side, ready once the dialer says so: :meth:`Stripe.await_ready`);
        None (and ``sock`` closed and forgotten) where ``conn`` is closed or has one
        already."""
        side = "out" if conn.outbound else "in"
        stripe = Stripe(sock, conn.peer_rank, self._spawn, self._forget,
                        f"torchrpc-stripe-{self.rank}-{conn.peer_rank}-{side}", self.stats,
                        ready=conn.outbound)
        if not conn.attach_stripe(stripe):
            return None
        self.stats.add(opened=1)
        return stripe

    @staticmethod
    def close(conns: Sequence[Any]) -> None:
        """Close the stripes of ``conns`` (the transport closes)."""
        for conn in conns:
            if conn.stripe is not None:
                conn.stripe.close()
