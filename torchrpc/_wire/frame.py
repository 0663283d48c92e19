"""Frame layout: pure functions over bytes, no sockets.

Every message on a connection is one frame::

    offset size  field
    0      4     magic        b"TRPC"
    4      1     version      1
    5      1     kind         a :class:`~torchrpc._wire.kinds.Kind` id
    6      2     flags        bit 0: ONEWAY (no reply), bit 1: SHM (buffers in shared memory)
    8      8     request id   unsigned, chosen by the requester, echoed by the reply
    16     4     envelope     length in bytes of the pickled envelope
    20     4     nbuffers     number of out-of-band buffers
    24     8*n   lengths      one unsigned 64-bit length per buffer
    ...          envelope     pickle protocol 5 bytes
    ...          buffers      raw bytes of each buffer, back to back

All integers are little-endian. A receiver validates magic, version, kind and
every length against its :class:`Limits` before it allocates or unpickles
anything; a frame that fails is a :class:`~torchrpc.errors.ProtocolError` and
the connection is closed.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import List, Sequence

from ..errors import ProtocolError
from .kinds import KNOWN_KINDS

MAGIC = b"TRPC"
VERSION = 1
HEADER = struct.Struct("<4sBBHQII")
HEADER_SIZE = HEADER.size  # 24

FLAG_ONEWAY = 1
FLAG_SHM = 2
_KNOWN_FLAGS = FLAG_ONEWAY | FLAG_SHM

DEFAULT_MAX_MESSAGE_SIZE = 2 << 30  # 2 GiB
DEFAULT_MAX_BUFFERS = 1 << 16


@dataclasses.dataclass(frozen=True)
class Limits:
    """Bounds a receiver enforces on every frame before allocating."""

    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
    max_buffers: int = DEFAULT_MAX_BUFFERS

    def __post_init__(self) -> None:
        if self.max_message_size <= 0:
            raise ValueError(f"max_message_size must be positive, got {self.max_message_size}")
        if self.max_buffers <= 0:
            raise ValueError(f"max_buffers must be positive, got {self.max_buffers}")


@dataclasses.dataclass(frozen=True)
class Header:
    """The fixed part of a frame, already validated."""

    kind: int
    flags: int
    request_id: int
    envelope_len: int
    nbuffers: int

    @property
    def oneway(self) -> bool:
        return bool(self.flags & FLAG_ONEWAY)


def pack_header(kind: int, flags: int, request_id: int, envelope_len: int,
                lengths: Sequence[int]) -> bytes:
    """Return the header and the buffer length table of a frame."""
    head = HEADER.pack(MAGIC, VERSION, kind, flags, request_id, envelope_len, len(lengths))
    if not lengths:
        return head
    return head + struct.pack(f"<{len(lengths)}Q", *lengths)


def parse_header(data: bytes | bytearray | memoryview, limits: Limits) -> Header:
    """Parse and validate the first :data:`HEADER_SIZE` bytes of a frame."""
    if len(data) < HEADER_SIZE:
        raise ProtocolError(f"truncated frame header: {len(data)} of {HEADER_SIZE} bytes")
    magic, version, kind, flags, rid, env_len, nbufs = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise ProtocolError(f"unsupported frame version {version}, this worker speaks {VERSION}")
    if kind not in KNOWN_KINDS:
        raise ProtocolError(f"unknown message kind {kind}")
    if flags & ~_KNOWN_FLAGS:
        raise ProtocolError(f"unknown frame flags {flags:#x}")
    if env_len > limits.max_message_size:
        raise ProtocolError(
            f"envelope of {env_len} bytes exceeds max_message_size {limits.max_message_size}")
    if nbufs > limits.max_buffers:
        raise ProtocolError(f"{nbufs} buffers exceed the limit of {limits.max_buffers}")
    return Header(kind, flags, rid, env_len, nbufs)


def parse_lengths(data: bytes | bytearray | memoryview, header: Header,
                  limits: Limits) -> List[int]:
    """Parse the buffer length table that follows the header and check the total size."""
    need = 8 * header.nbuffers
    if len(data) < need:
        raise ProtocolError(f"truncated length table: {len(data)} of {need} bytes")
    lengths = list(struct.unpack_from(f"<{header.nbuffers}Q", data)) if need else []
    total = header.envelope_len + sum(lengths)
    if total > limits.max_message_size:
        raise ProtocolError(
            f"frame of {total} bytes exceeds max_message_size {limits.max_message_size}")
    return lengths


@dataclasses.dataclass
class Frame:
    """A whole decoded frame: header, envelope bytes and buffers."""

    header: Header
    envelope: bytes
    buffers: List[bytes]


class FrameDecoder:
    """Incremental frame decoder over a byte stream (sans I/O).

    Feed it bytes as they arrive; it returns every complete frame. The transport
    uses the same :func:`parse_header` and :func:`parse_lengths` but reads large
    buffers straight into tensor memory; this decoder is for tests, tools and
    fuzzing.
    """

    def __init__(self, limits: Limits | None = None) -> None:
        self._limits = limits or Limits()
        self._buf = bytearray()

    def feed(self, data: bytes) -> List[Frame]:
        self._buf += data
        frames = []
        while True:
            frame = self._next()
            if frame is None:
                return frames
            frames.append(frame)

    def _next(self) -> Frame | None:
        buf = self._buf
        if len(buf) < HEADER_SIZE:
            return None
        header = parse_header(buf, self._limits)
        table_end = HEADER_SIZE + 8 * header.nbuffers
        if len(buf) < table_end:
            return None
        lengths = parse_lengths(memoryview(buf)[HEADER_SIZE:table_end], header, self._limits)
        end = table_end + header.envelope_len + sum(lengths)
        if len(buf) < end:
            return None
        pos = table_end + header.envelope_len
        envelope = bytes(buf[table_end:pos])
        buffers = []
        for n in lengths:
            buffers.append(bytes(buf[pos:pos + n]))
            pos += n
        del buf[:end]
        return Frame(header, envelope, buffers)

    @property
    def pending(self) -> int:
        """Bytes received that do not yet form a whole frame."""
        return len(self._buf)
