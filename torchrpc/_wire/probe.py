"""The at-most-once probe: pure functions over bytes, no sockets.

Before a caller sends a request with the ONCE flag again after its connection failed, it
asks the callee which of its request ids the callee has (a ``Kind.ONCE_PROBE`` frame);
the callee answers with a status per id (a ``Kind.ONCE_STATUS`` frame). Both are one-way
frames with request id 0 and no buffers, and their envelopes are raw integers, not
pickles, so the callee answers on its reading thread::

    ONCE_PROBE   envelope  n * 8 bytes  request ids, unsigned 64-bit
    ONCE_STATUS  envelope  n * 9 bytes  per id: the request id (8 bytes), its status (1 byte)

All integers are little-endian; ``n`` is 1 to :data:`MAX_PROBE_IDS`. The statuses:

- :data:`MISSING`: the callee never got the request (or forgot it): send it again.
- :data:`RUNNING`: it has the request and no reply yet; the reply comes when it is done.
- :data:`REPLIED`: it has the request and sent its reply again, on the same connection,
  just before this answer.
"""

from __future__ import annotations

import struct
from typing import List, Sequence, Tuple

from ..errors import ProtocolError

MISSING = 0
RUNNING = 1
REPLIED = 2
_STATUSES = (MISSING, RUNNING, REPLIED)

MAX_PROBE_IDS = 4096  # ids in one probe; a caller with more sends several

_ID = struct.Struct("<Q")
_ENTRY = struct.Struct("<QB")


def pack_probe(ids: Sequence[int]) -> bytes:
    """The envelope of a probe for request ids ``ids``."""
    if not 0 < len(ids) <= MAX_PROBE_IDS:
        raise ValueError(f"a probe asks for 1 to {MAX_PROBE_IDS} request ids, got {len(ids)}")
    return struct.pack(f"<{len(ids)}Q", *ids)


def parse_probe(data: bytes | bytearray | memoryview) -> Tuple[int, ...]:
    """The request ids of a probe's envelope; ProtocolError if malformed."""
    n, extra = divmod(len(data), _ID.size)
    if extra or not 0 < n <= MAX_PROBE_IDS:
        raise ProtocolError(f"malformed ONCE_PROBE envelope of {len(data)} bytes: expected "
                            f"1 to {MAX_PROBE_IDS} request ids of {_ID.size} bytes each")
    return struct.unpack(f"<{n}Q", data)


def pack_status(answers: Sequence[Tuple[int, int]]) -> bytes:
    """The envelope of the answer to a probe: ``(request id, status)`` pairs."""
    if not 0 < len(answers) <= MAX_PROBE_IDS:
        raise ValueError(f"an answer covers 1 to {MAX_PROBE_IDS} request ids, "
                         f"got {len(answers)}")
    return b"".join(_ENTRY.pack(rid, status) for rid, status in answers)


def parse_status(data: bytes | bytearray | memoryview) -> List[Tuple[int, int]]:
    """The ``(request id, status)`` pairs of an answer's envelope; ProtocolError if
    malformed."""
    n, extra = divmod(len(data), _ENTRY.size)
    if extra or not 0 < n <= MAX_PROBE_IDS:
        raise ProtocolError(f"malformed ONCE_STATUS envelope of {len(data)} bytes: expected "
                            f"1 to {MAX_PROBE_IDS} entries of {_ENTRY.size} bytes each")
    answers = list(_ENTRY.iter_unpack(data))
    for rid, status in answers:
        if status not in _STATUSES:
            raise ProtocolError(f"unknown ONCE_STATUS status {status} for request {rid}")
    return answers
