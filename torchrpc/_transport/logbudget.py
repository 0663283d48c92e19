"""A rate limit on warnings, so that a flood of rejected peers cannot flood the log."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger(__name__)


class LogBudget:
    """At most ``burst`` warnings per ``period`` seconds, then one line counting the rest
    (``what`` names them), so that a flood cannot flood the log."""

    def __init__(self, burst: int = 20, period: float = 60.0,
                 what: str = "rejected connections") -> None:
        self._what = what
        self._burst = burst
        self._period = period
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._count = 0
        self._dropped = 0

    def warn(self, msg: str, *args: Any) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._start > self._period:
                if self._dropped:
                    log.warning("%d more %s in the last %.0f s were not logged",
                                self._dropped, self._what, now - self._start)
                self._start, self._count, self._dropped = now, 0, 0
            if self._count >= self._burst:
                self._dropped += 1
                return
            self._count += 1
        log.warning(msg, *args)
