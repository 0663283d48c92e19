"""Same-host shared memory for large buffers: a pool of reusable segments per connection.

Theory of operation. Two workers on one host (same boot, same IPC and mount
namespaces; see ``rendezvous.host_identity``) that both offered ``FEATURE_SHM`` in the
handshake move every buffer of at least ``threshold`` bytes through a shared segment
instead of the socket, where the receiver sees the sender's pids (below). The frame
then carries the segment's reference in the buffer's place (``_wire.frame``:
``SHM_BIT``, ``pack_shm_ref``).

A segment is a memfd: one header page, then the data. The sender of a connection owns
a pool of them (:class:`ShmSender`); the receiver maps each one once and keeps the
mapping (:class:`ShmReceiver`), so a segment used again costs neither a page
allocation nor a mapping:

* send: take a free segment big enough (or create one), mark it BUSY in its header,
  ``pwrite`` the buffer into it -- the one copy the sender makes -- and send its
  reference;
* receive: map the segment the first time its reference arrives; then wrap the data
  as a uint8 tensor, no copy. When the last tensor using that memory is freed, a
  finalizer marks the segment FREE in the shared header, and the sender may reuse it.
* send back: a buffer that lies in a segment the peer sent on this connection (an echo,
  or any reply that returns a received tensor or a view of it) is not copied: the
  frame carries a *return reference* (:func:`return_ref`: the segment's number and the
  buffer's offset). Before it sends one, the receiver counts the return in the
  segment's header (``_RETURNS``); the sender counts the returns it is done with, and
  reuses the segment only when every return it was sent is done and the receiver's
  own tensors are freed. A returned buffer must arrive as a copy would, owned by
  nobody else: the sender wraps it only once the receiver has freed its tensors on
  the segment (it waits for that about as long as copying would take, since the
  receiver usually frees them right after sending) and no other returned tensor is
  alive on it; otherwise it copies the bytes out.

The sender maps the data of a segment only when one comes back to it, so its own memory
does not grow with what it sends.

Segment states live in the header page, which both sides map: byte 0 is FREE or BUSY
(the sender sets BUSY before it sends, the receiver sets FREE when done), byte 1 is
RETIRED once the sender dropped the segment (idle, too small, or connection closed);
a receiver drops its mapping of a retired segment, and the memory goes back to the
system when the last tensor on it is freed.

Segments are memfds (anonymous files, ``memfd_create``): nothing is ever in
``/dev/shm``, and a segment's memory goes back to the system when the last process
that has it open or mapped is gone, however they die (all SIGKILLed at once
included). The sender seals every segment against shrinking and growing before it
sends its reference, and the receiver maps only a segment so sealed, of the size it
checked with ``fstat``: nobody can truncate a mapped segment, so a receiver never
meets SIGBUS. The reference a frame carries is the segment's name and the sender's
descriptor of it, ``<name>.<fd>``; the receiver opens ``/proc/<pid>/fd/<fd>`` (the
pid is in the name) and checks that the file it got is the memfd of that name.

A peer in another pid namespace cannot open this process's descriptors, so the
transport sends it no segments (its large buffers go over the socket), and a system
without memfds uses no shared memory at all (:func:`available`): no file is ever
created in ``/dev/shm``.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import threading
import time
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .. import _wire
from ..errors import ProtocolError

log = logging.getLogger(__name__)

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
                ctypes.memmove(self.data_address, addr, n)  # faster than pwrite
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
                seg.data_address = ctypes.addressof(ctypes.c_char.from_buffer(data)) + HEADER
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


class _InSegment:
    """A peer's segment as mapped by the receiver (header page and data)."""

    __slots__ = ("name", "number", "map", "capacity", "base", "returns", "__weakref__")

    def __init__(self, name: str) -> None:
        memfd = _MEMFD_REF.fullmatch(name)
        if memfd is None:
            raise ProtocolError(f"shared-memory reference {name!r} is not a torchrpc segment")
        try:
            fd = _open_memfd(memfd)
        except OSError as exc:
            raise ProtocolError(f"cannot open shared-memory segment {name}: {exc}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size <= HEADER:
                raise ProtocolError(f"shared-memory segment {name} is not a segment of this "
                                    f"user ({st.st_size} bytes, uid {st.st_uid})")
            if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _SEALS != _SEALS:
                # Mapping a file that can shrink under the mapping risks SIGBUS.
                raise ProtocolError(f"shared-memory segment {name} is not sealed against "
                                    f"shrinking and growing; refusing to map it")
            self.map = mmap.mmap(fd, st.st_size, flags=_MAP_FLAGS)
        except OSError as exc:
            raise ProtocolError(f"cannot map shared-memory segment {name}: {exc}") from exc
        finally:
            os.close(fd)
        self.name = name
        self.number = int(memfd.group(4))
        self.capacity = st.st_size - HEADER
        # Where the data lies in this process, to know a buffer sent back in it.
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.map)) + HEADER
        self.returns = ctypes.c_uint64.from_buffer(self.map, _RETURNS)

    @property
    def retired(self) -> bool:
        return self.map[_RETIRED] != 0


def _open_memfd(ref: "re.Match[str]") -> int:
    """Open the memfd a reference names, through its sender's descriptor table; OSError
    if it is not there, or is not that memfd (the descriptor was reused meanwhile)."""
    name, ns, pid, fd = ref.group(1), ref.group(2), ref.group(3), ref.group(5)
    if ns != str(pid_namespace()):
        raise OSError(f"the segment's creator is in another pid namespace ({ns})")
    mine = os.open(f"/proc/{int(pid)}/fd/{int(fd)}", os.O_RDWR | os.O_CLOEXEC)
    try:
        target = os.readlink(f"/proc/self/fd/{mine}")
    except OSError:
        os.close(mine)
        raise
    if target != f"/memfd:{name} (deleted)":
        os.close(mine)
        raise OSError(f"descriptor {fd} of process {pid} is {target!r}, not that segment")
    return mine


def return_ref(number: int, offset: int) -> str:
    """The name in a return reference: segment ``number`` of the receiver, at ``offset``."""
    return f"r-{number}-{offset}"


def is_return_ref(name: str) -> bool:
    return name.startswith("r-")


def _address(buf: Any) -> Optional[int]:
    """The address of a buffer that views a whole ctypes array (as the encoder's buffers
    of tensor storage do), else None."""
    obj = getattr(buf, "obj", None)
    if isinstance(obj, ctypes.Array) and buf.nbytes == ctypes.sizeof(obj):
        return ctypes.addressof(obj)
    return None


def _release(segment: _InSegment) -> None:
    # The last tensor on this segment's data was freed (in any thread): hand it back.
    segment.map[_STATE] = FREE


class ShmReceiver:
    """The receiving side of one connection: maps the peer's segments, wraps them as tensors.

    Only the connection's reader calls :meth:`open`; finalizers may run in any thread.
    """

    def __init__(self, stats: Optional[Stats] = None) -> None:
        self._segments: Dict[str, _InSegment] = {}
        self._lock = threading.Lock()
        self._stats = stats or Stats()

    def open(self, name: str, size: int) -> torch.Tensor:
        """The ``size`` bytes of segment ``name`` as a uint8 tensor sharing its memory."""
        with self._lock:
            seg = self._segments.get(name)
        if seg is None:
            self.housekeeping()  # the sender retires old segments before it makes a new one
            seg = _InSegment(name)
            with self._lock:
                self._segments[name] = seg
        if size > seg.capacity:
            raise ProtocolError(f"buffer of {size} bytes exceeds shared-memory segment {name} "
                                f"of {seg.capacity} bytes")
        view = memoryview(seg.map)[HEADER:HEADER + size]
        if not size:
            return torch.empty((0,), dtype=torch.uint8)
        tensor = torch.frombuffer(view, dtype=torch.uint8)
        self._stats.buffers_received += 1
        self._stats.bytes_received += size
        # torch holds ``view`` until the storage is freed: then the segment is free again.
        weakref.finalize(view, _release, seg).atexit = False
        return tensor

    def pass_back(self, buffers: Sequence[Any], lengths: List[int], threshold: int
                  ) -> Tuple[List[Any], List[int], List[_InSegment]]:
        """Send back without copying each buffer of at least ``threshold`` bytes that lies
        in a segment the peer sent: its return reference replaces it, and the return is
        counted in the segment. Returns the parts, the length table and the segments
        returned into, which go to :meth:`unreturn` if the frame cannot be sent."""
        parts = list(buffers)
        used: List[_InSegment] = []
        if not self._segments:
            return parts, lengths, used
        for i, n in enumerate(lengths):
            if n < threshold or n & _wire.SHM_BIT:
                continue
            addr = _address(parts[i])
            if addr is None:
                continue
            with self._lock:
                seg = next((s for s in self._segments.values()
                            if s.base <= addr and addr + n <= s.base + s.capacity), None)
                if seg is None or seg.retired:
                    continue
                seg.returns.value += 1
            parts[i] = _wire.pack_shm_ref(return_ref(seg.number, addr - seg.base))
            lengths[i] = n | _wire.SHM_BIT
            used.append(seg)
            self._stats.buffers_returned += 1
        return parts, lengths, used

    def unreturn(self, used: Sequence[_InSegment]) -> None:
        """The frame that would have sent ``used`` back was not sent: uncount the returns."""
        with self._lock:
            for seg in used:
                seg.returns.value -= 1

    def housekeeping(self) -> None:
        """Drop the mappings of segments the sender retired."""
        with self._lock:
            for name in [n for n, s in self._segments.items() if s.retired]:
                del self._segments[name]

    @property
    def num_segments(self) -> int:
        return len(self._segments)

    def close(self) -> None:
        """Drop every mapping; memory still used by tensors stays until they are freed."""
        with self._lock:
            self._segments.clear()
