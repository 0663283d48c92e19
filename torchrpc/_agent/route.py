"""What every lane shares: what the caller does with a reply (:class:`Expect`), a lane
picked for one call (:class:`Route`), the interface of a lane (:class:`Lane`), what a lane
needs of the caller's side (:class:`Sender`), and the one reading loop of the lanes whose
replies a waiting thread reads (:func:`read_replies`). See lanes.py for the lanes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, List, Optional, Protocol, Set

import torch

from .._transport import Connection
from .._wire import Header, Kind
from ..errors import RpcError
from .worker import WorkerInfo

if TYPE_CHECKING:
    from .pending import Pending

# Plain ints: looking a member up on the enum class costs more than the comparison.
_RESPONSE, _ERROR = int(Kind.RESPONSE), int(Kind.ERROR)


class Expect:
    """What the caller does with the reply: with the peer, this picks the call's lane."""

    ANY = 0  # nothing in particular (a callback, or a future handed out)
    WAIT = 1  # the caller waits for it at once (rpc_sync, RRef.to_here)
    FUTURE = 2  # the caller holds the future and usually waits on it soon (rpc_async)
    FOLLOWED = 3  # nobody waits, but a blocking call to the same worker follows (remote())


class Route:
    """A lane picked for one call, and what it reserved for it (a connection, a burst).
    Made once per connection and kind of call where it holds nothing of one call's (see
    :meth:`PrivateLane.routes <torchrpc._agent.private_lane.PrivateLane.routes>`)."""

    __slots__ = ("lane", "conn", "held", "sync", "inline")

    def __init__(self, lane: Any, conn: Optional[Connection] = None, held: Any = None,
                 sync: bool = False, inline: bool = False) -> None:
        self.lane = lane
        # The private connection whose reader the caller is: a deadline or a lost peer
        # closes it, which wakes that reader (see Pending.set_exception).
        self.conn = conn
        self.held = held
        self.sync = sync  # the future is a SyncFuture (nobody but its caller sees it)
        self.inline = inline  # the call's on_done runs where the future completes


class Lane(Protocol):
    """How a request goes out and how its reply comes back."""

    def send(self, route: Route, rid: int, p: "Pending", kind: int, flags: int, env: bytes,
             bufs: Any, keep: Any) -> None:
        """Request ``rid`` is entered: send it (:meth:`Sender.transmit`) and arrange how
        its reply is read (the future's ``_claim``, or nothing: a reader thread's)."""

    def release(self, route: Route, dst: WorkerInfo) -> None:
        """The request was never made (encoding failed): give back what the route holds."""


class Sender(Protocol):
    """What the lanes need of the caller's side of requests (calls.py's ``Calls``)."""

    def transmit(self, conn: Optional[Connection], rid: int, p: "Pending", kind: int,
                 flags: int, env: bytes, bufs: Any, keep: Any) -> bool:
        """Send (again) request ``rid``; whether it went (if not, it is failed or retried)."""

    def on_reply(self, conn: Connection, header: Header, envelope: bytes,
                 buffers: List[torch.Tensor]) -> None:
        """Complete a request with its reply."""

    def request_lost(self, rid: int, dst: WorkerInfo, exc: BaseException) -> None:
        """Request ``rid``'s connection failed: retry or fail it."""


class IdleConnections(Protocol):
    """What the lanes need of the private connections at rest (private.py's
    ``PrivateConnections``)."""

    def usable(self, dst: WorkerInfo) -> bool:
        """Whether calls to ``dst`` may use private connections."""

    def has_idle(self, rank: int) -> bool:
        """Whether a private connection to ``rank`` waits to be used."""

    def checkout(self, dst: WorkerInfo, opens: bool = True) -> Optional[Connection]:
        """An idle private connection to ``dst``, or with ``opens`` a new one; or None
        (also where calls to ``dst`` may not use one)."""

    def checkin(self, dst: WorkerInfo, conn: Connection, carried: Optional["Pending"] = None
                ) -> None:
        """``conn``, to ``dst``, is free again (and request ``carried``, answered, lets go
        of it)."""


def read_replies(conn: Connection, calls: Sender, waiting: Optional[Set[int]] = None,
                 free: Optional[Callable[[], None]] = None,
                 more: Optional[Callable[[], Any]] = None,
                 took: Optional[Callable[[Header], None]] = None,
                 settled: Optional[Callable[[Header], None]] = None) -> Optional[RpcError]:
    """The reading loop of the lanes whose replies a waiting thread reads: read frames
    from ``conn`` until the requests ``waiting`` are answered, or while ``more()``. For
    each reply: ``took(header)`` (the lane's bookkeeping), and, for the last of
    ``waiting``, ``free()`` (the lane gives the connection back, for the caller's next
    call), both before the caller wakes; then complete its request, then
    ``settled(header)``. If the connection breaks, return its error (the requests of
    ``waiting`` left are the ones it took with it); else None."""
    read_frame, on_reply = conn.read_frame, calls.on_reply
    while waiting if more is None else more():
        try:
            header, envelope, buffers = read_frame()
        except RpcError as exc:  # broken, or closed by a deadline, a lost peer, shutdown
            return _without_frames(exc)
        kind = header.kind
        if kind == _RESPONSE or kind == _ERROR:
            if took is not None:
                took(header)
            if waiting is not None:
                rid = header.request_id
                if rid in waiting:
                    waiting.discard(rid)
                    if not waiting:
                        free()
            on_reply(conn, header, envelope, buffers)
            if settled is not None:
                settled(header)
        # Nothing else is sent to a caller on these connections; ignore anything else.
        envelope = buffers = None
    return None


def _without_frames(exc: RpcError) -> RpcError:
    """``exc`` and the errors chained to it, without their tracebacks: whoever fails
    requests with it may keep it, and a traceback's frames (each holding its caller's)
    would keep the reading loop's requests, and what they name, alive with it."""
    seen = set()
    chained: List[Optional[BaseException]] = [exc]
    while chained:
        e = chained.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        chained += (e.__cause__, e.__context__)
    return exc
