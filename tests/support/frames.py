"""Frames from bytes alone, parsed by the transport's own reader (sans I/O).

A worker reads frames with :meth:`~torchrpc._transport.connection.Connection.read_frame`
(the reader loop runs the same code): validate the header against the limits, the length
table, the envelope, the MAC trailer, then each buffer straight into fresh tensor memory
or, in shared memory, through the connection's receiver. :class:`FrameDecoder` drives
that very code with bytes handed to it, with no socket: it is fed bytes as they come and
returns every whole frame; fed a frame in pieces, it waits for the rest.

How: the connection reads from a link over the bytes fed so far, which raises
:class:`_NotYet` where they run out. The frame being read is then read again, from its
first byte, by a fresh connection once more bytes are fed (with a copy of the MAC state
as it was before the frame, since a tag advances the sequence). At the end of the
stream (:meth:`FrameDecoder.end`) the link reports end-of-stream as a closed socket does,
so a frame cut short is the reader's own "truncated frame" error.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, List, Optional, Union

import torch

from torchrpc import _wire
from torchrpc._transport import handshake
from torchrpc._transport.connection import Connection
from torchrpc.errors import ConnectionLostError, ProtocolError


class _NotYet(Exception):
    """The bytes fed so far end before the frame being read does."""


class _FedLink:
    """A link (``connection.Link``) whose receives hand out the fed bytes in order."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.pos = 0  # the next byte a receive hands out
        self.eof = False

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        dst = memoryview(buffer).cast("B")
        k = min(nbytes or len(dst), len(self.data) - self.pos)
        if not k:
            if self.eof:
                return 0
            raise _NotYet
        dst[:k] = self.data[self.pos:self.pos + k]
        self.pos += k
        return k

    def sendmsg(self, buffers: Any) -> int:
        raise BrokenPipeError("a fed link only receives")

    def shutdown(self, how: int) -> None:
        pass

    def close(self) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class ShmRef:
    """A buffer of a decoded frame that lies in shared memory (what :class:`ShmRefs`
    gives for it in place of the mapped segment)."""

    name: str
    size: int


class ShmRefs:
    """A stand-in for the connection's shared-memory receiver (and sender, for buffers
    sent back): it maps nothing and gives each reference as a :class:`ShmRef`."""

    def open(self, name: str, size: int) -> ShmRef:
        return ShmRef(name, size)

    returned = open

    def close(self) -> None:
        pass


@dataclasses.dataclass
class Frame:
    """A whole decoded frame: its header, envelope and buffers, as the reader gives them
    (a fresh uint8 tensor each; a :class:`ShmRef` for one in shared memory)."""

    header: _wire.Header
    envelope: bytes
    buffers: List[Union[torch.Tensor, ShmRef]]


class FrameDecoder:
    """Feed bytes, get whole frames, parsed by the transport's reader.

    Args:
        limits: the receiver's bounds (default: :class:`~torchrpc._wire.Limits`).
        mac: the receiving direction's MACs (``handshake.FrameMac``), for a stream of a
            connection that negotiated them; the decoder keeps its own copy.
        shm: accept buffers in shared memory, given as :class:`ShmRef` (without it, a
            frame with one is refused as on a connection without shared memory).

    A bad frame raises the reader's :class:`~torchrpc.errors.ProtocolError`; the stream
    is then unusable, as the connection would be closed.
    """

    def __init__(self, limits: Optional[_wire.Limits] = None,
                 mac: Optional[handshake.FrameMac] = None, shm: bool = False) -> None:
        self._limits = limits or _wire.Limits()
        self._mac = copy.copy(mac)  # the MAC state before the next frame
        self._shm = ShmRefs() if shm else None
        self._link = _FedLink()
        self._conn: Optional[Connection] = None
        self._start = 0  # where the next frame begins in the link's bytes

    def _connection(self) -> Connection:
        conn = Connection(self._link, 1, self._limits, _no_frames, _no_close, outbound=False)
        conn.mac_rx = copy.copy(self._mac)
        conn.shm_rx = conn.shm_tx = self._shm
        return conn

    def feed(self, data: Any) -> List[Frame]:
        """Take ``data``, the next bytes of the stream; the frames completed by them."""
        link = self._link
        del link.data[:self._start]
        link.pos -= self._start
        self._start = 0
        link.data += data
        return self._read()

    def end(self) -> List[Frame]:
        """The stream ends here: the frames still to read, or the reader's ProtocolError
        for a frame cut short."""
        self._link.eof = True
        return self._read()

    def _read(self) -> List[Frame]:
        link = self._link
        frames = []
        while self._start < len(link.data) or link.eof:
            conn = self._conn or self._connection()
            self._conn = conn
            try:
                header, envelope, buffers = conn.read_frame()
            except _NotYet:
                # Read the frame again from its start, with fresh read state.
                self._conn = None
                link.pos = self._start
                break
            except ConnectionLostError as exc:
                if isinstance(exc.__cause__, ProtocolError):
                    raise exc.__cause__  # the reader's own words, without the wrapper
                break  # end of stream between frames
            self._start = link.pos - conn.rx_buffered
            self._mac = copy.copy(conn.mac_rx)
            frames.append(Frame(header, bytes(envelope), list(buffers)))
        return frames

    @property
    def pending(self) -> int:
        """Bytes fed that do not yet form a whole frame."""
        return len(self._link.data) - self._start


def _no_frames(*args: Any) -> None:
    raise AssertionError("a fed connection's frames are read by FrameDecoder, not a reader")


def _no_close(*args: Any) -> None:
    pass


def macs_around(mac: Optional[handshake.FrameMac], head: bytes, envelope: bytes,
                data: List[Any]) -> bytes:
    """The stream bytes of a frame of ``head`` (with its length table), ``envelope`` and
    the stream bytes ``data`` of its buffers, as a sender with the MACs ``mac`` (None:
    without MACs) writes them: the seal in front of the tag, or its number there and its
    digest after the buffers with ``mac.trailer``. Advances ``mac``'s sequence."""
    body = b"".join(bytes(d) for d in data)
    if mac is None:
        return head + envelope + body
    if not (mac.buffers and _wire.frame.HEADER.unpack_from(head)[-1]):  # nothing sealed
        return head + envelope + mac.tag(head, envelope) + body
    if not mac.trailer:
        seal = mac.seal(data)
        return head + envelope + seal + mac.tag(head, envelope, seal) + body
    check = mac.open_seal()
    for d in data:
        check.update(d)
    return (head + envelope + check.number + mac.tag(head, envelope, check.number) + body
            + check.digest())
