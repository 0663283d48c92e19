"""Per-peer traffic counters of an agent (``peers`` in ``rpc.get_debug_info()``).

Theory of operation. Every request and reply passes through a few places of the agent,
and each adds to the counters of its peer there: a handful of integer additions and, for
a completed call, one float stored in a preallocated ring of the last :data:`RING`
latencies. Nothing is sorted, locked or allocated on that path; percentiles are computed
only when someone asks (:meth:`PeerStats.as_dict`). The counters are updated without a
lock, so under heavy concurrent traffic to one peer an addition may rarely be lost: they
are for looking at, not for accounting.
"""

from __future__ import annotations

import threading
from array import array
from typing import Any, Dict, List, Tuple

RING = 1024  # latencies kept per peer; a power of two, so the slot is a mask away
_MASK = RING - 1


class PeerStats:
    """The counters of one peer, both directions.

    ``calls_out``/``calls_in`` count requests of every kind (user calls and the RRef and
    autograd messages of the layers above), ``bytes_*`` the envelopes and tensor buffers
    of requests and replies, ``errors_out`` calls of this worker to the peer that failed
    (remote error, timeout, lost connection), ``errors_in`` requests of the peer that
    raised here, ``timeouts`` the calls to it that timed out.
    """

    __slots__ = ("calls_out", "calls_in", "bytes_out", "bytes_in", "errors_out", "errors_in",
                 "timeouts", "_latency", "_completed")

    def __init__(self) -> None:
        self.calls_out = 0
        self.calls_in = 0
        self.bytes_out = 0
        self.bytes_in = 0
        self.errors_out = 0
        self.errors_in = 0
        self.timeouts = 0
        self._latency = array("d", bytes(8 * RING))  # seconds, a ring: slot n & _MASK
        self._completed = 0  # replies whose latency went into the ring

    def latency(self, seconds: float) -> None:
        """Record the round trip of one call answered by the peer."""
        n = self._completed
        self._latency[n & _MASK] = seconds
        self._completed = n + 1

    def as_dict(self) -> Dict[str, Any]:
        """The counters, and p50/p99 of the last :data:`RING` latencies in milliseconds
        (None before the first reply)."""
        n = min(self._completed, RING)
        recent = sorted(self._latency[:n])  # the ring's order does not matter here
        return {
            "calls_out": self.calls_out, "calls_in": self.calls_in,
            "bytes_out": self.bytes_out, "bytes_in": self.bytes_in,
            "errors_out": self.errors_out, "errors_in": self.errors_in,
            "timeouts": self.timeouts, "replies": self._completed,
            "latency_p50_ms": _percentile(recent, 0.50),
            "latency_p99_ms": _percentile(recent, 0.99),
        }


class Traffic:
    """The counters of one agent's peers, by rank: made on first use (:meth:`new`),
    dropped when another worker takes the rank (:meth:`forget`, under ``lock``). The
    request path reads :attr:`by_rank` without the lock."""

    def __init__(self, lock: "threading.Lock") -> None:
        self._lock = lock  # the agent's: the registry forgets a rank's counters under it
        self.by_rank: Dict[int, PeerStats] = {}

    def new(self, rank: int) -> PeerStats:
        """The counters of peer ``rank``, made on first use."""
        with self._lock:  # two first calls to a peer may race here
            return self.by_rank.setdefault(rank, PeerStats())

    def forget(self, rank: int) -> None:
        """Under the lock: another worker holds ``rank`` now."""
        self.by_rank.pop(rank, None)

    def items(self) -> List[Tuple[int, PeerStats]]:
        """The counters by rank, as they are now."""
        with self._lock:
            return list(self.by_rank.items())


def _percentile(ordered: Any, q: float) -> Any:
    """The nearest-rank ``q`` quantile of ``ordered`` in milliseconds; None if empty."""
    if not ordered:
        return None
    rank = max(int(q * len(ordered) + 0.999999) - 1, 0)
    return round(ordered[min(rank, len(ordered) - 1)] * 1000.0, 3)


def nbytes(buffers: Any) -> int:
    """Bytes of a frame's out-of-band buffers (memoryviews going out, tensors coming in)."""
    total = 0
    for b in buffers:
        total += b.nbytes
    return total
