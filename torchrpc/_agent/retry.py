"""When and how often a request is sent again (pure policy, no I/O).

A request is retried only when its connection failed: the message may not have
arrived, and sending it again is safe because the caller said so (a user
function marked ``@idempotent``, or an internal control message whose handler
tolerates duplicates). Never after a remote exception (the function ran) nor
after a timeout (it may still be running), and never to a worker that left.
Every attempt goes under the deadline of the first: retries never extend the
caller's timeout.
"""

from __future__ import annotations

import dataclasses

from ..errors import ConnectionLostError, WorkerLeftError


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Up to ``max_attempts`` sends, waiting ``initial_backoff * backoff_multiplier**k``
    seconds (at most ``max_backoff``) before the k-th resend."""

    max_attempts: int = 3
    initial_backoff: float = 0.05
    backoff_multiplier: float = 2.0
    max_backoff: float = 2.0

    def __post_init__(self) -> None:
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) \
                or self.max_attempts < 1:
            raise ValueError(f"max_attempts must be an int >= 1, got {self.max_attempts!r}")
        for name in ("initial_backoff", "max_backoff"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
        if isinstance(self.backoff_multiplier, bool) or \
                not isinstance(self.backoff_multiplier, (int, float)) or self.backoff_multiplier < 1:
            raise ValueError(f"backoff_multiplier must be a number >= 1, got "
                             f"{self.backoff_multiplier!r}")

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before sending attempt number ``attempt + 1`` (``attempt`` >= 1)."""
        return min(self.initial_backoff * self.backoff_multiplier ** (attempt - 1),
                   self.max_backoff)


def retryable(exc: BaseException) -> bool:
    """Whether a failed attempt may be sent again: a local connection failure only."""
    return (isinstance(exc, ConnectionLostError) and not isinstance(exc, WorkerLeftError)
            and getattr(exc, "remote_traceback", None) is None)
