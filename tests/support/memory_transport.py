"""An in-memory link: two connections back to back in one process, with no sockets.

:func:`socketpair` gives the two ends of a byte stream that behaves as a connected pair
of stream sockets does for a :class:`~torchrpc._transport.connection.Connection` (the
:class:`~torchrpc._transport.connection.Link` interface): bytes arrive in order,
``shutdown`` or ``close`` on one end wakes its own reader with end-of-stream and gives
the other end end-of-stream after the bytes already sent, and a send to an end whose
reader is gone raises ``BrokenPipeError``. A send copies its bytes, so the sender may
reuse its memory as soon as it returns. :class:`MemoryLink` joins two connections over
such a pair, each with a reader thread, for tests of everything above the sockets.

A test tool: no worker uses it (``tests/transport/test_transport_conformance.py`` runs
it beside the real links).
"""

from __future__ import annotations

import errno
import socket
import threading
from typing import Any, List, Optional, Sequence, Tuple

from torchrpc import _threads, _wire
from torchrpc._transport.connection import Connection
from torchrpc._transport.reader import CloseCallback, FrameCallback


class _Pipe:
    """The bytes on their way in one direction, and whether either end let go."""

    __slots__ = ("data", "eof", "gone")

    def __init__(self) -> None:
        self.data = bytearray()
        self.eof = False  # the writing end closed: the reader gets end-of-stream once empty
        self.gone = False  # the reading end closed: a write fails


class MemorySocket:
    """One end of an in-memory stream pair (see :func:`socketpair`)."""

    def __init__(self, cond: threading.Condition, inbox: _Pipe, outbox: _Pipe) -> None:
        self._cond = cond  # one for both ends: every change wakes whoever waits
        self._in = inbox
        self._out = outbox

    def sendmsg(self, buffers: Sequence[Any]) -> int:
        """Copy every buffer to the other end; the number of bytes sent."""
        with self._cond:
            if self._out.eof:
                raise BrokenPipeError(errno.EPIPE, "this end of the memory link is closed")
            if self._out.gone:
                raise BrokenPipeError(errno.EPIPE, "the other end of the memory link is closed")
            n = len(self._out.data)
            for b in buffers:
                self._out.data += b
            self._cond.notify_all()
            return len(self._out.data) - n

    def sendall(self, data: Any) -> None:
        self.sendmsg([data])

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        """Move up to ``nbytes`` (all of ``buffer`` if 0) waiting bytes into ``buffer``,
        waiting for some; 0 at end-of-stream."""
        dst = memoryview(buffer).cast("B")
        want = nbytes or len(dst)
        with self._cond:
            pipe = self._in
            while not pipe.data and not pipe.eof:
                if flags & getattr(socket, "MSG_DONTWAIT", 0):
                    raise BlockingIOError(errno.EAGAIN, "no bytes wait on the memory link")
                self._cond.wait()
            if pipe.gone:
                return 0
            k = min(want, len(pipe.data))
            dst[:k] = pipe.data[:k]
            del pipe.data[:k]
            return k

    def recv(self, n: int) -> bytes:
        buf = bytearray(n)
        return bytes(buf[:self.recv_into(buf)])

    def shutdown(self, how: int) -> None:
        """End the stream: this end's reader gets end-of-stream now, and the other end's
        after the bytes already sent."""
        with self._cond:
            if how in (socket.SHUT_WR, socket.SHUT_RDWR):
                self._out.eof = True
            if how in (socket.SHUT_RD, socket.SHUT_RDWR):
                self._in.gone = self._in.eof = True
            self._cond.notify_all()

    def close(self) -> None:
        self.shutdown(socket.SHUT_RDWR)

    def settimeout(self, value: Optional[float]) -> None:
        """Nothing to do: the link never blocks on the network."""

    def setsockopt(self, *args: Any) -> None:
        """Nothing to do: no kernel socket to tune."""


def socketpair() -> Tuple[MemorySocket, MemorySocket]:
    """The two ends of a new in-memory stream."""
    cond = threading.Condition()
    a_to_b, b_to_a = _Pipe(), _Pipe()
    return MemorySocket(cond, b_to_a, a_to_b), MemorySocket(cond, a_to_b, b_to_a)


class MemoryLink:
    """Two connections joined in memory, ``a`` (rank ``ranks[0]``'s, outbound) and ``b``
    (rank ``ranks[1]``'s), each read by a thread that :meth:`close` joins.

    Both report to the same ``on_frame`` and ``on_close``, which tell the two apart by
    the connection they are given.
    """

    def __init__(self, on_frame: FrameCallback, on_close: CloseCallback,
                 limits: Optional[_wire.Limits] = None, ranks: Tuple[int, int] = (0, 1)) -> None:
        limits = limits or _wire.Limits()
        sa, sb = socketpair()
        self.a = Connection(sa, ranks[1], limits, on_frame, on_close, outbound=True)
        self.b = Connection(sb, ranks[0], limits, on_frame, on_close, outbound=False)
        self._threads: List[threading.Thread] = []
        for conn, name in ((self.a, "a"), (self.b, "b")):
            self._threads.append(_threads.spawn(f"torchrpc-memory-{name}", conn.read_loop))

    def close(self, timeout: float = 10.0) -> None:
        """Close both connections and join their readers."""
        self.a.close()
        self.b.close()
        for t in self._threads:
            t.join(timeout)
