"""Frame layout: pure functions over bytes, no sockets.

These functions check each part of a frame as it comes; the one reader of whole frames
is the transport's (``_transport/reader.py``: the header, the length table, the
envelope, the MAC trailer, then each buffer straight into tensor memory). Tests feed
that reader bytes without a socket (``tests/support/frames.py``).

Every message on a connection is one frame::

    offset size  field
    0      4     magic        b"TRPC"
    4      1     version      1
    5      1     kind         a :class:`~torchrpc._wire.kinds.Kind` id
    6      2     flags        bit 0: ONEWAY (no reply), bit 1: SHM (buffers in shared memory),
                              bit 2: ONCE (a request that may arrive twice: run it once),
                              bit 3: MANY (see below), bit 4: STRIPED (below); other
                              bits are never set, and a receiver refuses a frame with one
    8      8     request id   unsigned, chosen by the requester, echoed by the reply
    16     4     envelope     length in bytes of the pickled envelope
    20     4     nbuffers     number of out-of-band buffers
    24     8*n   lengths      one unsigned 64-bit length per buffer
    ...          envelope     pickle protocol 5 bytes
    ...   24/8   seal         only with MACs, where buffers are sealed and n > 0 (below)
    ...   16     tag          only with MACs (below)
    ...          buffers      raw bytes of each buffer, back to back
    ...   16     digest       only where the seal trails the buffers and n > 0 (below)

MANY. A request on a connection whose opener reads the replies itself (a private
connection, see ``_transport/dial.py``) carries MANY when its sender has several
requests outstanding on that connection at once. The receiver then serves the
connection as it serves a shared one: a request that runs long hands the connection's
reading role on, so the requests behind it are not held up (``_agent/role.py``).
Without it, the receiver may let one request hold the connection while it runs, since
its sender waits for that very reply.

MACs. On a connection that negotiated them (plain TCP, ``_transport/handshake.py``),
every frame carries MACs between its envelope and its buffers: where buffers are sealed
(both sides offered it) and the frame has some, the seal of the buffers' bytes as they
follow on the stream, buffer by buffer, a buffer in shared memory by its reference;
then a 16-byte tag over an implicit sequence number, the header with its lengths, the
envelope and the seal's bytes before it. The seal is an 8-byte number and a 16-byte
digest. Where both sides offered the seal trailer (``FEATURE_SEAL_TRAILER``), only the
number precedes the tag and the digest follows the last buffer, so both sides MAC the
buffers while they travel; otherwise both precede the tag (24 bytes). The tag is checked
before any buffer is read, the digest once all of them are in, before the frame is
handed on. Frames without MACs have none of these.
What the MACs are is the transport's business (``handshake.FrameMac``); this layout
only says where they lie in a frame.

Shared memory. In a frame with the SHM flag, a length with bit 63 (:data:`SHM_BIT`)
set is a buffer that lies in a shared-memory segment instead of on the stream: the
low 63 bits are its size, and in its place the stream carries a
:data:`SHM_REF_SIZE`-byte reference, the segment's name in ASCII padded with NUL
bytes (:func:`pack_shm_ref`, :func:`parse_shm_ref`). What the name means is the
transport's business; the wire layer only checks its form. Without the SHM flag,
bit 63 is never set.

STRIPED. The buffers' bytes, taken as one run, are cut in two: the stream carries the
first part where the buffers lie, with its digest after it where the seal trails; the
rest travels, with a digest of its own, on a second socket of the connection (its
stripe, ``_transport/stripe.py``, which says where the cut falls). Never with SHM.

All integers are little-endian. A receiver validates magic, version, kind and
every length against its :class:`Limits` before it allocates or unpickles
anything; a frame that fails is a :class:`~torchrpc.errors.ProtocolError` and
the connection is closed.
"""

from __future__ import annotations

import dataclasses
import re
import struct
from typing import List, NamedTuple, Sequence

from ..errors import ProtocolError
from .kinds import KNOWN_KINDS

MAGIC = b"TRPC"
VERSION = 1
HEADER = struct.Struct("<4sBBHQII")
HEADER_SIZE = HEADER.size  # 24

FLAG_ONEWAY = 1
FLAG_SHM = 2
FLAG_ONCE = 4
FLAG_MANY = 8  # its sender has several requests outstanding on the connection (see above)
FLAG_STRIPED = 16  # its buffers' bytes travel partly over its connection's stripe
_KNOWN_FLAGS = FLAG_ONEWAY | FLAG_SHM | FLAG_ONCE | FLAG_MANY | FLAG_STRIPED

SHM_BIT = 1 << 63
SHM_REF_SIZE = 64
_SHM_NAME = re.compile(rb"[A-Za-z0-9_][A-Za-z0-9._-]{0,63}")

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


class Header(NamedTuple):
    """The fixed part of a frame, already validated.

    A named tuple rather than a frozen dataclass: one is built for every frame, and a
    tuple is the cheaper of the two to build.
    """

    kind: int
    flags: int
    request_id: int
    envelope_len: int
    nbuffers: int

    @property
    def oneway(self) -> bool:
        return bool(self.flags & FLAG_ONEWAY)


# Builds a Header from a tuple in C: the named tuple's own constructor is Python code.
_new_tuple = tuple.__new__


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
    if flags & FLAG_STRIPED and flags & FLAG_SHM:
        raise ProtocolError("a frame both striped and in shared memory")
    if env_len > limits.max_message_size:
        raise ProtocolError(
            f"envelope of {env_len} bytes exceeds max_message_size {limits.max_message_size}")
    if nbufs > limits.max_buffers:
        raise ProtocolError(f"{nbufs} buffers exceed the limit of {limits.max_buffers}")
    return _new_tuple(Header, (kind, flags, rid, env_len, nbufs))


def parse_lengths(data: bytes | bytearray | memoryview, header: Header,
                  limits: Limits) -> List[int]:
    """Parse the buffer length table that follows the header and check the total size.

    In a frame with the SHM flag, entries of buffers in shared memory keep
    :data:`SHM_BIT`; their size is ``n & ~SHM_BIT``.
    """
    n = header.nbuffers
    need = 8 * n
    if len(data) < need:
        raise ProtocolError(f"truncated length table: {len(data)} of {need} bytes")
    if not n:
        return []
    table = _TABLES[n] if n < len(_TABLES) else struct.Struct(f"<{n}Q")
    lengths = list(table.unpack_from(data))
    total = header.envelope_len
    shm = header.flags & FLAG_SHM
    for n in lengths:
        if n & SHM_BIT:
            if not shm:
                raise ProtocolError("a buffer length has the shared-memory bit set in a frame "
                                    "without the SHM flag")
            n &= ~SHM_BIT
        total += n
    if total > limits.max_message_size:
        raise ProtocolError(
            f"frame of {total} bytes exceeds max_message_size {limits.max_message_size}")
    return lengths


_TABLES = [struct.Struct(f"<{n}Q") for n in range(16)]


def pack_shm_ref(name: str) -> bytes:
    """The :data:`SHM_REF_SIZE`-byte reference to the shared-memory segment ``name``."""
    raw = name.encode("ascii")
    if not _SHM_NAME.fullmatch(raw):
        raise ValueError(f"invalid shared-memory segment name {name!r}: use 1 to "
                         f"{SHM_REF_SIZE} letters, digits, '.', '_' or '-', not starting "
                         f"with '.' or '-'")
    return raw.ljust(SHM_REF_SIZE, b"\0")


def parse_shm_ref(data: bytes | bytearray | memoryview) -> str:
    """The segment name in a shared-memory reference; ProtocolError if malformed."""
    if len(data) != SHM_REF_SIZE:
        raise ProtocolError(f"truncated shared-memory reference: {len(data)} of "
                            f"{SHM_REF_SIZE} bytes")
    raw = bytes(data).rstrip(b"\0")
    if not _SHM_NAME.fullmatch(raw):
        raise ProtocolError(f"malformed shared-memory reference {bytes(data)[:SHM_REF_SIZE]!r}")
    return raw.decode("ascii")
