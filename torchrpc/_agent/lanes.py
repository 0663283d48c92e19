"""The ways a reply travels back to its caller (*lanes*), and the one function that picks
one for a call (``Lanes``, held as ``agent.lanes``).

Theory of operation. Every request takes one path (:meth:`Calls.start
<torchrpc._agent.calls.Calls.start>`): a lane is picked, the request is encoded and
entered in the pending table, the lane sends it, and the caller gets its future. Which
lane depends on what the caller will do with the reply (:class:`Expect`) and on the
peer; :meth:`Lanes.pick` alone decides:

- the **shared lane** (:class:`SharedLane`): the shared connection to the peer, whose
  reading thread completes the future. Every call can take it, and takes it where no
  other lane fits (a retry, TLS, the worker itself, too many parked replies, ...).
- the **private lane** (:class:`~torchrpc._agent.private_lane.PrivateLane`): a
  connection of its own, whose reply the thread that waits on the future reads itself
  (no reader thread is woken, no GIL is handed over twice). ``rpc_sync`` takes it
  (:attr:`Expect.WAIT`); an ``rpc_async`` (:attr:`Expect.FUTURE`) and RRef creation
  (:attr:`Expect.FOLLOWED`) *park* their reply in it, for whoever waits first.
- the **burst lane** (:class:`~torchrpc._agent.bursts.Bursts`): a thread's second
  ``rpc_async`` to a worker whose first is parked makes that connection the thread's
  burst connection, which carries its calls to the worker from then on; the thread reads
  their replies in batches.

A lane (:class:`~torchrpc._agent.route.Lane`) has two methods: ``send`` (the request
is entered; send it and arrange how its reply is read) and ``release`` (encoding failed:
give back what ``pick`` reserved). The send-and-resend bookkeeping of every lane is
:meth:`Calls.transmit <torchrpc._agent.calls.Calls.transmit>`; the lanes whose replies a
waiting thread reads share one reading loop,
:func:`~torchrpc._agent.route.read_replies`. The future decides who reads: its
``_claim`` (futures.py) reads the reply on the thread that waits, or on the pool when
someone asks whether it is done or adds a callback. Nothing above the agent, nor the
transport, knows lanes exist.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional

import torch

from .._transport import PollPolicy
from .bursts import Bursts
from .cpus import usable_cpus as _usable_cpus
from .lifecycle import RUNNING, Lifecycle
from .pool import WorkerPool
from .private import PrivateConnections
from .private_lane import MAX_PARKED, PrivateLane
from .retry import RetryPolicy
from .route import Expect, Route, Sender
from .worker import WorkerInfo

if TYPE_CHECKING:
    from .pending import Pending

__all__ = ["Expect", "Lanes", "Route", "SharedLane"]


class SharedLane:
    """The shared connection to the peer, read by the connection's reading thread."""

    def __init__(self, calls: Sender) -> None:
        self._calls = calls
        self.route = Route(self)

    def send(self, route: Route, rid: int, p: "Pending", kind: int, flags: int, env: bytes,
             bufs: Any, keep: Any) -> None:
        self._calls.transmit(None, rid, p, kind, flags, env, bufs, keep)

    def release(self, route: Route, dst: WorkerInfo) -> None:
        pass


class Lanes:
    """One agent's lanes, and the choice among them.

    ``calls``: the caller's side, which sends and completes requests; ``private``: the
    private connections at rest; ``spin_us``: the option (how long readers of private
    connections poll); ``pending``: the request table, read only; ``pool``: the worker
    pool, which reads the replies nobody claims; ``lifecycle``: whether the agent runs.
    """

    def __init__(self, calls: Sender, private: PrivateConnections, spin_us: Optional[float],
                 pending: Dict[int, "Pending"], pool: WorkerPool, lifecycle: Lifecycle) -> None:
        # handed to every private connection (Connections.on_connect); the spin_us option
        self.poll = PollPolicy.from_option(spin_us)
        self.private = private
        self.shared = SharedLane(calls)
        self.private_lane = PrivateLane(calls, private, pending, pool)
        self.bursts = Bursts(calls, private, self.private_lane, pending, pool,
                             lambda: lifecycle.state is RUNNING)

    @property
    def num_parked(self) -> int:
        """Parked requests whose reply is not read yet (a debug_info counter)."""
        return self.private_lane.num_parked

    def pick(self, dst: WorkerInfo, expect: int, retry: Optional[RetryPolicy],
             timeout: float, after: Any = None) -> Route:
        """The lane of a call to ``dst`` whose caller does ``expect`` with the reply.
        ``after``: the future of an earlier call to ``dst`` whose reply is parked; a
        :attr:`Expect.WAIT` call then goes out on its connection, if it may, and its
        thread reads both replies."""
        if expect == Expect.ANY:
            return self.shared.route
        private, lane = self.private, self.private_lane
        if expect == Expect.WAIT:
            # With retry, an attempt that fails on the connection is sent again on the
            # shared one, and its reply read there (see Requests.fail).
            if after is not None:
                route = lane.after(after, timeout)
                if route is not None:
                    return route
            conn = private.checkout(dst)
            if conn is not None:
                return (lane.routes.get(conn) or lane.routes_of(conn))[Expect.WAIT]
            return self.shared.route
        if expect == Expect.FUTURE:
            if retry is not None:
                return self.shared.route
            burst = self.bursts.of(dst)
            if burst is not None:
                return self.bursts.route(burst)
            # It parks only on an idle private connection (it never waits for one to open)
            # and while no other reply from its worker is parked: a burst of calls to one
            # worker would otherwise take a connection, and a reading thread on both
            # sides, each.
            if private.has_idle(dst.id):
                if lane.num_parked < MAX_PARKED and not lane.parked_to(dst.id):
                    conn = private.checkout(dst, opens=False)
                    if conn is not None:
                        return (lane.routes.get(conn) or lane.routes_of(conn))[Expect.FUTURE]
                if private.has_idle(dst.id):
                    return self.shared.route
            self.bursts.went_shared(dst)
            return self.shared.route
        # Expect.FOLLOWED
        if lane.num_parked < MAX_PARKED:
            conn = private.checkout(dst)
            if conn is not None:
                return (lane.routes.get(conn) or lane.routes_of(conn))[Expect.FOLLOWED]
        return self.shared.route

    def tick(self, now: float) -> None:
        """Timer: read the replies nobody claimed for a tick (parked ones, bursts'); give
        back the burst connections of threads that ended."""
        self.private_lane.drain_parked(now)
        self.private_lane.forget_closed()
        self.bursts.tick(now)

    def check_cpus(self, workers: int) -> None:
        """Timer: have readers poll as the ``workers`` on this host and its CPUs allow."""
        self.poll.for_host(torch.get_num_threads(), workers, _usable_cpus())

    def clear(self) -> None:
        """The agent stops: forget the idle connections, parked requests and bursts."""
        self.private.clear()
        self.private_lane.clear()
        self.bursts.clear()
