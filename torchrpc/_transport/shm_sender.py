"""The sending side of a shared-memory link: a pool of segments per connection (see
``shm.py`` for the theory of operation)."""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import threading
import time
import weakref
from typing import Any, List, Optional, Sequence, Tuple

import torch

from .. import _wire
from ..errors import ProtocolError
from .segments import (_COPY_RATE, _MAP_FLAGS, _PWRITE_MAX, _RETURN_REF, _RETURNS, _SEALS,
                       _STATE, _RETIRED, BUSY, FREE, HEADER, IDLE_RETIRE, MAX_FREE, Stats,
                       _address, _capacity, _names, data_address)

log = logging.getLogger(__name__)


class _OutSegment:
    """A segment of the sender's pool: its memfd and a mapping of its header page only."""

    __slots__ = ("name", "number", "fd", "capacity", "header", "last_used", "writing",
                 "data", "data_address", "returns", "released", "wrapped")

    def __init__(self, capacity: int) -> None:
        name = _names.next()
        self.number = int(name.rsplit("-", 1)[1])
        self.capacity = capacity
        self.data: Optional[mmap.mmap] = None  # mapped when a buffer comes back in it
        self.data_address = 0
        self.released = 0  # returns done with here (see the module docs)
        self.wrapped = 0  # 1 while a returned tensor wraps the segment here
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        self.name = f"{name}.{self.fd}"
        try:
            # Reserve every page now: running out of memory fails here, not later in a write.
            os.posix_fallocate(self.fd, 0, HEADER + capacity)
            # Its size is fixed from now on (see the module docs).
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS | fcntl.F_SEAL_SEAL)
            self.header = mmap.mmap(self.fd, HEADER)
        except BaseException:
            os.close(self.fd)
            raise
        self.returns: Any = ctypes.c_uint64.from_buffer(self.header, _RETURNS)
        self.header[_STATE] = BUSY
        self.last_used = time.monotonic()
        self.writing = True  # a thread is between _take and _written: don't close the fd

    @property
    def free(self) -> bool:
        return self.header[_STATE] == FREE and self.returns.value == self.released

    def write(self, data: memoryview) -> None:
        n = len(data)
        if self.data is not None:  # mapped here already (a buffer came back in it)
            addr = _address(data)
            if addr is not None:
                ctypes.memmove(self.data_address, addr, n)  # a plain copy, no system call
                return
        pos = 0
        while pos < n:
            pos += os.pwrite(self.fd, data[pos:pos + _PWRITE_MAX], HEADER + pos)

    def retire(self) -> None:
        """Tell the receiver to drop its mapping; close our side (a mapping of the data
        goes when the last tensor that came back in it is freed)."""
        self.returns = None  # the header's export, which would keep it from closing
        try:
            self.header[_RETIRED] = 1
            self.header.close()
        except (ValueError, BufferError):
            pass
        self.data = None
        os.close(self.fd)


class ShmSender:
    """The sending side of one connection: stages large buffers into pooled segments."""

    def __init__(self, threshold: int, stats: Optional[Stats] = None) -> None:
        if threshold < 1:
            raise ValueError(f"shm_threshold must be at least 1 byte, got {threshold}")
        self.threshold = threshold
        self._lock = threading.Lock()
        self._segments: List[_OutSegment] = []
        self._closed = False
        self._broken = False
        self._stats = stats or Stats()
        self._release_lock = threading.Lock()

    def stage(self, buffers: Sequence[Any], lengths: List[int]
              ) -> Tuple[List[Any], List[int], List[_OutSegment]]:
        """Copy every buffer of at least ``threshold`` bytes into a segment.

        Returns the parts to send in their place (a reference for each staged buffer),
        the length table (``SHM_BIT`` set for staged ones) and the segments used, which
        the caller passes to :meth:`unstage` if the frame cannot be sent.
        """
        parts = list(buffers)
        used: List[_OutSegment] = []
        for i, n in enumerate(lengths):
            if n < self.threshold or n & _wire.SHM_BIT or self._broken:
                continue
            seg = self._take(n)
            if seg is None:
                continue
            try:
                seg.write(parts[i])
            except OSError as exc:
                self._give_up(exc)
                self._written(seg, ok=False)
                continue
            if not self._written(seg, ok=True):
                continue  # closed meanwhile: the frame will not be sent either
            parts[i] = _wire.pack_shm_ref(seg.name)
            lengths[i] = n | _wire.SHM_BIT
            used.append(seg)
            self._stats.buffers_sent += 1
            self._stats.bytes_sent += n
        return parts, lengths, used

    def unstage(self, used: Sequence[_OutSegment]) -> None:
        """The frame that would have carried ``used`` was not sent: free them again."""
        for seg in used:
            try:
                seg.header[_STATE] = FREE
            except ValueError:
                pass  # retired meanwhile

    def returned(self, ref: str, size: int) -> torch.Tensor:
        """The ``size`` bytes that return reference ``ref`` names in one of this sender's
        segments, as a uint8 tensor on that memory (no copy); ProtocolError if ``ref``
        names nothing this sender sent back to it."""
        match = _RETURN_REF.fullmatch(ref)
        if match is None:
            raise ProtocolError(f"malformed shared-memory return reference {ref!r}")
        number, offset = int(match.group(1)), int(match.group(2))
        with self._lock:
            seg = next((s for s in self._segments if s.number == number), None)
            if seg is None or seg.returns is None:
                raise ProtocolError(f"shared-memory return reference {ref!r} names no segment "
                                    f"this worker sent on the connection")
            if not 0 < size <= seg.capacity - offset or seg.returns.value <= seg.released:
                raise ProtocolError(f"shared-memory return reference {ref!r} of {size} bytes "
                                    f"does not fit segment {seg.name} of {seg.capacity} bytes, "
                                    f"or was not counted as returned")
            if seg.data is None:
                data = mmap.mmap(seg.fd, HEADER + seg.capacity, flags=_MAP_FLAGS)
                seg.data_address = data_address(data)
                seg.data = data  # last: write() looks at it, then at the address
            view = memoryview(seg.data)[HEADER + offset:HEADER + offset + size]
        self._stats.buffers_received += 1
        self._stats.bytes_received += size
        header = seg.header
        until = time.perf_counter() + size / _COPY_RATE
        while header[_STATE] != FREE and time.perf_counter() < until:
            pass  # the receiver frees its tensors right after it sends, mostly
        tensor = torch.frombuffer(view, dtype=torch.uint8)
        with self._release_lock:
            exclusive = header[_STATE] == FREE and not seg.wrapped
            if exclusive:
                seg.wrapped = 1
        if not exclusive:
            tensor = tensor.clone()
            del view
            self._release_return(seg, wrapped=0)
            return tensor
        weakref.finalize(view, self._release_return, seg, 1).atexit = False
        return tensor

    def _release_return(self, seg: _OutSegment, wrapped: int) -> None:
        # A return is done with: copied out, or the last tensor on it freed (any thread).
        with self._release_lock:
            seg.released += 1
            seg.wrapped -= wrapped

    def _take(self, n: int) -> Optional[_OutSegment]:
        now = time.monotonic()
        with self._lock:
            if self._closed:
                return None
            best = None
            for seg in self._segments:
                if seg.capacity >= n and seg.free and (best is None or seg.capacity < best.capacity):
                    best = seg
            if best is not None:
                best.header[_STATE] = BUSY
                best.last_used = now
                best.writing = True
                return best
        try:
            seg = _OutSegment(_capacity(n))
        except OSError as exc:
            self._give_up(exc)
            return None
        self._stats.segments_created += 1
        with self._lock:
            if self._closed:
                seg.retire()
                return None
            # Free segments smaller than this one would only pin memory now.
            self._retire_where(lambda s: s.capacity < seg.capacity and s.free)
            self._segments.append(seg)
        return seg

    def _give_up(self, exc: OSError) -> None:
        if not self._broken and not self._closed:
            self._broken = True
            log.warning("shared memory failed (%s); large buffers on this "
                        "connection go through the socket from now on", exc)

    def _written(self, seg: _OutSegment, ok: bool) -> bool:
        """The write into ``seg`` is over; retire it if it failed or the sender closed."""
        with self._lock:
            seg.writing = False
            if ok and not self._closed:
                return True
            if seg in self._segments:
                self._segments.remove(seg)
        seg.retire()
        return False

    def _retire_where(self, cond: Any) -> None:
        keep = []
        for seg in self._segments:
            if cond(seg):
                seg.retire()
            else:
                keep.append(seg)
        self._segments = keep

    def housekeeping(self, now: float) -> None:
        """Retire free segments idle for :data:`IDLE_RETIRE` s, and all but :data:`MAX_FREE`."""
        with self._lock:
            if self._closed:
                return
            self._retire_where(lambda s: s.free and now - s.last_used > IDLE_RETIRE)
            free = sorted((s for s in self._segments if s.free), key=lambda s: s.last_used)
            extra = set(map(id, free[:max(0, len(free) - MAX_FREE)]))
            if extra:
                self._retire_where(lambda s: id(s) in extra)

    @property
    def num_segments(self) -> int:
        return len(self._segments)

    def close(self) -> None:
        """Retire every segment (the connection is closed)."""
        with self._lock:
            self._closed = True
            segments = [s for s in self._segments if not s.writing]  # writers retire the rest
            self._segments = [s for s in self._segments if s.writing]
        for seg in segments:
            seg.retire()

