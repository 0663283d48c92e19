"""The callee's table of at-most-once requests (FLAG_ONCE): which arrived, which ran, and
the replies kept for a copy that arrives again (dispatch.py's module docs say why).

A request is remembered by (caller rank, request id) from its first arrival; once its
reply goes out, the reply is kept with it for :data:`KEEP` seconds, or until the caller
acknowledges it (:meth:`OnceTable.acknowledged`), and the request itself for as long, so
that a late copy is not run again. At most :data:`MAX` requests are remembered at once.
The table sends nothing: :class:`~torchrpc._agent.dispatch.Dispatch` sends what it returns.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Iterable, List, Optional, Tuple

from .._wire.probe import MISSING, REPLIED, RUNNING as STILL_RUNNING

KEEP = 60.0  # seconds a request is remembered after its reply went out
MAX = 8192  # requests remembered at once, at most

Key = Tuple[int, int]  # (caller rank, request id)
Reply = Tuple[int, bytes, Any, Any]  # kind, envelope, buffers, keepalive


class _Once:
    """One remembered request: while it runs and, with its reply, for KEEP seconds after."""

    __slots__ = ("done_at", "reply", "acked")

    def __init__(self) -> None:
        self.done_at: Optional[float] = None
        self.reply: Optional[Reply] = None
        self.acked = False  # the caller has the reply, which is no longer kept


class OnceTable:
    """One agent's remembered at-most-once requests, oldest first (``entries``, read
    without the lock by the reply path: a plain dict test)."""

    def __init__(self) -> None:
        self.entries: "collections.OrderedDict[Key, _Once]" = collections.OrderedDict()
        self._lock = threading.Lock()
        self.duplicates = 0  # requests that arrived again and were not run again

    def arrived(self, key: Key) -> Tuple[bool, Optional[Reply]]:
        """Whether request ``key`` arrives for the first time (then it is remembered); if
        not, the reply to send again, if it has one yet."""
        now = time.monotonic()
        with self._lock:
            once = self.entries.get(key)
            if once is None:
                self.entries[key] = _Once()
                self._trim(now)
                return True, None
            self.duplicates += 1
            return False, once.reply

    def _trim(self, now: float) -> None:
        """Under the lock: forget the oldest requests, those replied long ago and any
        beyond MAX."""
        table = self.entries
        while table:
            key, once = next(iter(table.items()))
            stale = once.done_at is not None and now - once.done_at > KEEP
            if not stale and len(table) <= MAX:
                return
            del table[key]

    def remember(self, key: Key, kind: int, env: bytes, bufs: Any, keep: Any) -> Any:
        """If request ``key`` may arrive again, keep its reply for it; return the keepalive
        to send with (a plain list: the kept reply must keep its memory)."""
        once = self.entries.get(key)
        if once is None:
            return keep
        keep = list(keep) if keep is not None else None
        with self._lock:
            once.reply = (kind, env, bufs, keep)
            once.done_at = time.monotonic()
        return keep

    def ran(self, key: Key) -> None:
        """A one-way request that may arrive again has run: forget it in KEEP seconds."""
        once = self.entries.get(key)
        if once is not None:
            once.done_at = time.monotonic()

    def acknowledged(self, rank: int, rids: Any) -> None:
        """Worker ``rank`` has the replies to its requests ``rids`` (a tuple, from a
        request's metadata): drop the copies kept for them. The requests stay remembered,
        so that a copy still on its way is not run again."""
        if type(rids) is not tuple:
            return
        table = self.entries
        with self._lock:
            for rid in rids:
                entry = table.get((rank, rid)) if type(rid) is int else None
                if entry is not None and entry.reply is not None:
                    entry.reply = None
                    entry.acked = True

    def kept(self) -> int:
        """How many replies are kept for requests that may arrive again."""
        with self._lock:
            return sum(1 for entry in self.entries.values() if entry.reply is not None)

    def status(self, rank: int, rids: Iterable[int]
               ) -> Tuple[List[Tuple[int, int]], List[Tuple[int, Reply]]]:
        """A probe of worker ``rank``: the status of each of ``rids`` (MISSING,
        STILL_RUNNING, REPLIED), and the kept replies to send again before the answer."""
        answers: List[Tuple[int, int]] = []
        replies: List[Tuple[int, Reply]] = []
        with self._lock:
            for rid in rids:
                once = self.entries.get((rank, rid))
                if once is None:
                    answers.append((rid, MISSING))
                elif once.acked:  # the caller had the reply already
                    answers.append((rid, REPLIED))
                elif once.reply is None:
                    answers.append((rid, STILL_RUNNING))
                else:
                    answers.append((rid, REPLIED))
                    replies.append((rid, once.reply))
        return answers, replies

    def forget(self, rank: int) -> None:
        """A new worker holds ``rank``: the request ids of an earlier one mean nothing now."""
        if self.entries:
            with self._lock:
                for key in [k for k in self.entries if k[0] == rank]:
                    del self.entries[key]
