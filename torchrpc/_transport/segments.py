"""What both ends of a shared-memory link share: segment layout and names, return
references, and counters (the theory of operation is in ``shm.py``)."""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import re
import secrets
import threading
from typing import Any, Dict, Optional

PREFIX = "torchrpc-"
HEADER = 4096  # the data starts one page into the file, page aligned
FREE, BUSY = 0, 1
_STATE, _RETIRED = 0, 1  # header byte offsets
_RETURNS = 8  # header offset of a uint64: returns sent back by the receiver (aligned)
IDLE_RETIRE = 10.0  # seconds a free segment is kept for reuse
MAX_FREE = 8  # free segments kept per connection
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
# A memfd segment's reference: its name, then the sender's descriptor of it.
_MEMFD_REF = re.compile(r"(torchrpc-(\d+)-(\d+)-[0-9a-f]+-(\d+))\.(\d+)")
# A return reference: the number of one of the receiver's own segments, and an offset.
_RETURN_REF = re.compile(r"r-(\d{1,18})-(\d{1,18})")
MEMFD = hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS")
_SEALS = (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) if MEMFD else 0
_PWRITE_MAX = 1 << 30
# Bytes per second of a copy, roughly: a returned buffer waits about as long as copying it
# would take for the receiver to free its own tensors on it (see the module docs).
_COPY_RATE = 5e9


def pid_namespace() -> int:
    """The inode of this process's pid namespace (0 if unknown): pids mean the same
    process only within one."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


class _Names:
    """Unique segment names of this process: ``torchrpc-<pidns>-<pid>-<token>-<n>``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = -1
        self._n = 0
        self._prefix = ""

    def next(self) -> str:
        with self._lock:
            pid = os.getpid()
            if pid != self._pid:  # a forked child must not reuse its parent's names
                self._pid = pid
                self._prefix = f"{PREFIX}{pid_namespace()}-{pid}-{secrets.token_hex(4)}-"
            self._n += 1
            return f"{self._prefix}{self._n}"


_names = _Names()


def available() -> bool:
    """Whether this system has sealable memfds, which every segment is."""
    return MEMFD


def _capacity(n: int) -> int:
    """Round ``n`` up so that segments get reused across similar sizes (<= 12.5% slack)."""
    step = max(1 << max(n.bit_length() - 4, 0), 1 << 16)
    return -(-n // step) * step


def process_state(pid: int) -> Optional[str]:
    """The state letter of process ``pid`` in ``/proc`` (``R``, ``S``, ``T``, ``Z``, ...),
    or None if there is no such process or it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode("ascii", "replace")
    except (OSError, IndexError):
        return None


class Stats:
    """Counters of one transport's shared-memory traffic (updated under the GIL)."""

    def __init__(self) -> None:
        self.buffers_sent = 0
        self.bytes_sent = 0
        self.buffers_received = 0
        self.bytes_received = 0
        self.segments_created = 0
        self.buffers_returned = 0  # buffers sent back into the peer's own segments

    def as_dict(self) -> Dict[str, int]:
        return {f"transport.shm_{k}": v for k, v in vars(self).items()}


def return_ref(number: int, offset: int) -> str:
    """The name in a return reference: segment ``number`` of the receiver, at ``offset``."""
    return f"r-{number}-{offset}"


def is_return_ref(name: str) -> bool:
    return name.startswith("r-")


def data_address(segment_map: mmap.mmap) -> int:
    """Where the data of a mapped segment (the whole file, header first) lies here."""
    return ctypes.addressof(ctypes.c_char.from_buffer(segment_map)) + HEADER


def _address(buf: Any) -> Optional[int]:
    """The address of a buffer that views a whole ctypes array (as the encoder's buffers
    of tensor storage do), else None."""
    obj = getattr(buf, "obj", None)
    if isinstance(obj, ctypes.Array) and buf.nbytes == ctypes.sizeof(obj):
        return ctypes.addressof(obj)
    return None

