"""The receiving side of a shared-memory link: the peer's segments mapped once and
wrapped as tensors, and buffers sent back into them (see ``shm.py``)."""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import re
import stat
import threading
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .. import _wire
from ..errors import ProtocolError
from .segments import (_MAP_FLAGS, _MEMFD_REF, _RETIRED, _RETURNS, _SEALS, _STATE, FREE,
                       HEADER, Stats, _address, data_address, pid_namespace, return_ref)


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
        self.base = data_address(self.map)
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

