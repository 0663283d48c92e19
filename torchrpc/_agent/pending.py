"""An outstanding request (:class:`Pending`) and what sending it again needs
(:class:`Resend`): the entries of the request table (requests.py), which the lanes and
the caller's side (calls.py) fill in."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from .._transport import Connection
from .futures import RpcFuture
from .retry import RetryPolicy
from .stats import PeerStats
from .worker import WorkerInfo


class Pending:
    """An outstanding request: the future of its reply and what failing or retrying it needs."""

    __slots__ = ("future", "dst", "what", "timeout", "states", "resend", "private", "on_failure",
                 "stats", "sent", "conn", "kind", "serving")

    def __init__(self, future: RpcFuture, dst: WorkerInfo, what: Any, timeout: float,
                 states: Optional[Dict[str, Any]], stats: Optional[PeerStats] = None,
                 sent: float = 0.0, private: Optional[Connection] = None,
                 kind: int = 0) -> None:
        self.future = future
        self.stats = stats  # the callee's counters (None for a request to this worker)
        self.sent = sent  # time.monotonic() when the request was made
        self.dst = dst
        self.what = what
        self.timeout = timeout
        self.states = states
        self.resend: Optional[Resend] = None
        # The private connection whose caller reads the reply itself (see private_lane.py).
        self.private = private
        # The shared connection its last attempt went out on: if that one breaks, the
        # request may be lost even while other connections to the peer stay open.
        self.conn: Optional[Connection] = None
        # Tells the call hooks with a state that the request failed here (see set_exception).
        self.on_failure: Optional[Callable[[], None]] = None
        self.kind = kind  # the message kind (for snapshots; see snapshot.py)
        # The entry of the request this call was made for, by the thread serving it (or
        # None): snapshots link chains by it (serving.py).
        self.serving: Optional[List[Any]] = None

    def set_exception(self, error: BaseException) -> None:
        """Fail the call with an error of this side (not a reply); wake a caller blocked
        reading a private connection."""
        if self.on_failure is not None:
            self.on_failure()
        if self.stats is not None:
            self.stats.errors_out += 1
        self.future.set_exception(error)
        if self.private is not None:
            self.private.close(error)


class Resend:
    """What a request with a retry policy needs to be sent again: the same frame."""

    __slots__ = ("policy", "attempt", "scheduled", "sent", "probing", "known", "deadline",
                 "kind", "flags", "env", "bufs", "keep")

    def __init__(self, policy: RetryPolicy, deadline: Optional[float], kind: int, flags: int,
                 env: bytes, bufs: Any, keep: Any) -> None:
        self.policy = policy
        self.attempt = 1
        self.scheduled = False  # the next attempt is due (a second failure must not add one)
        self.sent = False  # a send of it may have reached the callee (so ask before a resend)
        self.probing = False  # a probe asks the callee about it, unanswered (see Probes._probe_peer)
        self.known = False  # a probe's answer said the callee has it
        self.deadline = deadline
        self.kind = kind
        self.flags = flags
        self.env = env
        self.bufs = bufs
        self.keep = keep
