"""The RPC agent: the one layer with threads and I/O above the transport.

Theory of operation. An :class:`Agent` composes its parts (see docs/design.md, "The
agent's parts"): the transport (listener plus one or more connections per peer, opened
lazily on first use and shared by both directions) and the table of those connections
(connections.py), the table of the group's workers (registry.py), the caller's side of
requests (calls.py) and the table of outstanding requests with their deadlines
(requests.py), the lanes a reply travels back by (lanes.py) and the routing of
incoming frames (inbound.py), a timer thread that runs every part's periodic duties, failing expired
requests first (scheduler.py), heartbeats and lost-peer decisions (liveness.py), and a
worker pool that runs incoming requests. Frames arrive on the thread that holds a
connection's reading role (inbound.py, role.py). A reply (``RESPONSE`` or ``ERROR``) is decoded
there and completes the pending future; a request is decoded and dispatched by message
kind to a registered handler (dispatch.py). Upper layers (RRefs, distributed autograd)
plug in by registering handlers for their kinds and *call hooks* that add metadata to
requests and see the tensors that cross (hooks.py); the agent never imports them. A
handler's exception goes back to the caller as a ``RemoteErrorInfo`` (remote_error.py).

Lifecycle: ``new`` -> ``running`` -> ``stopping`` -> ``stopped``, a state machine
(lifecycle.py) driven by the shutdown protocol (shutdown.py). Graceful shutdown runs the upper
layers' shutdown hooks, waits for this worker's outstanding requests, meets every
worker at store barriers (once when all have stopped calling, once when all
replies are out), says GOODBYE to its peers and closes. A connection that breaks
without a GOODBYE fails, at once, every request pending on that worker with an
error naming it.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

from .. import _threads, _wire
from .._threads import Guard
from .._transport import Connection, Transport
from .._wire import Kind
from ..errors import NotInitializedError, RpcError, ThreadFailedError
from . import debug, process_exit, startup
from .._rendezvous.rendezvous import Plan
from .calls import Calls
from .connections import Connections
from .coroutines import CoroutineRunner
from .cpus import SpinGuard
from .debug import TimeoutReports
from .dispatch import Dispatch
from .futures import RpcFuture
from .hooks import CallHook, Extensions, MessageContext
from .inbound import Inbound
from .lanes import Expect, Lanes
from .lifecycle import RUNNING, Lifecycle
from .liveness import Liveness
from .pool import WorkerPool
from .private import PrivateConnections
from .probes import Probes
from .registry import Registry, left_error
from .requests import Requests
from .retry import RetryPolicy
from .scheduler import TICK, Scheduler
from .settings import Settings
from .shutdown import Parts as ShutdownParts, Shutdown
from .snapshot import OBSERVERS, Observers, take as take_snapshot
from .stats import Traffic
from .worker import WorkerInfo

log = logging.getLogger(__name__)
_CALL = Kind.CALL  # looked up once: a member's lookup on the enum class is slow


class Agent:
    """A worker's RPC agent. Built by a backend's init handler; see module docs."""

    def __init__(self, store: Any, name: str, rank: int, world_size: Optional[int],
                 settings: Settings, connection_type: Callable[..., Connection] = Connection
                 ) -> None:
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.settings = settings
        # What the transport makes connections with (the faulty backend's fail frames).
        self.connection_type = connection_type
        self.store = store
        self.default_timeout = settings.rpc_timeout
        self._limits = _wire.Limits(max_message_size=settings.max_message_size)
        self._lock = threading.Lock()
        self._pool = WorkerPool(settings.num_worker_threads, f"torchrpc-{name}")
        self.pool = self._pool  # runs incoming requests and callbacks (pool.py)
        # The timer: every part's periodic duties, and callbacks due later (scheduler.py).
        self.scheduler = Scheduler(self._pool)
        self.timeout_reports = TimeoutReports(name, self._pool, self.debug_info, self.request,
                                              settings.log_debug_info_on_timeout)
        self.lifecycle = Lifecycle()  # lifecycle.py: only the shutdown protocol enters states
        self.requests = _new_requests(self)  # outstanding requests, deadlines (requests.py)
        self._hooks: List[CallHook] = []
        # Hooks asked about every request served, not only those that carry their key.
        self.serve_all: List[CallHook] = []
        self._shutdown_hooks: List[Callable[[Optional[float]], None]] = []
        self._stop_hooks: List[Callable[[float], None]] = []
        # Layer name ("rref", "autograd") -> counters of that layer.
        self._debug_sources: Dict[str, Callable[[], Dict[str, Any]]] = {}
        # Upper layers keep their per-agent objects here, each under its owner's Slot.
        self.extensions = Extensions()
        # Elastic membership (world_size=None): see torchrpc._rendezvous.membership.
        self.elastic = world_size is None
        self.traffic = Traffic(self._lock)  # the traffic counters by peer (stats.py)
        # Runs the coroutines of ``async def`` targets (its loop starts with the first one).
        self.coroutines = CoroutineRunner(name, self._pool)
        self._next_tick = 0.0  # when the timer's housekeeping is due next
        self._transport: Optional[Transport] = None
        # The workers of the group, membership and device maps (registry.py).
        self.registry = Registry(name, rank, self.elastic, dict(settings.device_maps), self._lock,
                                 self.start_thread, self.lifecycle, lambda: self.store,
                                 self.traffic.forget, self.fail, lambda: self._transport)
        timeout = lambda: self.default_timeout  # noqa: E731 - rpc._set_rpc_timeout changes it
        # The connections by peer, and the peers whose connections broke (connections.py).
        self.connections = Connections(name, self._lock, self.lifecycle, self.registry,
                                       self.requests, timeout, lambda: self._transport)
        # Serving requests: the handlers by kind, replies, at most once (dispatch.py).
        self.dispatch = Dispatch(name, self._pool, self.coroutines,
                                 functools.partial(MessageContext, self), self._hooks,
                                 self.serve_all, self.traffic.by_rank, self.connections.send,
                                 timeout, settings.max_queued_requests, self.scheduler)
        # Sending and completing requests (calls.py), by the lanes replies take (lanes.py).
        self.calls = _new_calls(self)
        self.lanes = self.calls.lanes
        # An OpenMP team parked while this host's CPUs are crowded (cpus.py).
        self.omp = SpinGuard(f"torchrpc-omp-{name}")
        self.liveness = Liveness(  # heartbeats and lost peers (liveness.py)
            name, self.elastic, settings.heartbeat_interval, settings.heartbeat_timeout,
            self._lock, self.start_thread, self.lifecycle, self.registry, self.connections,
            self.requests, self.lanes.private, self._pool, lambda: self.store,
            lambda: self.failure)
        self.connections.attach(self.liveness, self.lanes.private, self.lanes.poll)
        # Incoming frames to the request table, the peers or serving; reading roles.
        self.inbound = Inbound(name, self._pool, self.scheduler, self.lifecycle, self.registry,
                               self.dispatch, self.calls.on_reply, self.calls.probes.on_status,
                               self.requests.fail_peer, self.liveness.heard_beat,
                               self.traffic.by_rank, self.traffic.new,
                               settings.max_queued_requests)
        self.shutdown_protocol = Shutdown(_stopping(self), self.lifecycle)
        self.registry.attach(self.liveness, self.requests.fail_peer, self.connections.of,
                             (self.connections.forget_lost, self.shutdown_protocol.forget),
                             (self.dispatch.once.forget,))
        _schedule_duties(self)
        process_exit.track(self)  # stopped at the interpreter's exit if it still runs then

    # -- start -----------------------------------------------------------------------------------

    def start(self, plan: Plan) -> "Agent":
        """Rendezvous with the group under ``plan``, start listening and the timer;
        return self."""
        startup.start(_starting(self), plan, self._limits)
        return self

    def _adopt(self, transport: Transport) -> None:  # startup hands the agent its transport
        self._transport = transport
        for part in (self.dispatch, self.calls, self.lanes.private):  # they send with it
            part.adopt(transport)

    @property
    def transport(self) -> Optional[Transport]:
        """The transport, once :meth:`start` has made it."""
        return self._transport

    def start_thread(self, role: str, loop: Callable[[Guard], None]) -> threading.Thread:
        """Start background thread ``role`` running ``loop(guard)``; if it cannot go on,
        the agent fails."""
        guard = Guard(f"the {role} thread of {self.name}", self.fail)
        return _threads.start(f"torchrpc-{role}-{self.name}", guard, loop, guard)

    @property
    def failure(self) -> Optional[ThreadFailedError]:
        """Set when a background thread cannot go on (see fail): every API call raises it."""
        return self.shutdown_protocol.failure

    def fail(self, error: ThreadFailedError) -> None:
        """A background thread cannot go on: fail every pending call with ``error``, and
        make every later API call raise it (until ``shutdown``; see shutdown.py)."""
        self.shutdown_protocol.fail(error)

    def check_running(self) -> None:
        """Raise unless the agent runs (and no background thread has failed)."""
        self.check_failure()
        state = self.lifecycle.state
        if state is not RUNNING:
            raise NotInitializedError(
                f"RPC agent of {self.name!r} is {state.value}; call init_rpc() first")

    def check_failure(self) -> None:
        """Raise :attr:`failure` if a background thread could not go on."""
        if self.shutdown_protocol.failure is not None:
            self.shutdown_protocol.raise_failure()

    # -- the group (registry.py) -------------------------------------------------------------------

    @property
    def worker_info(self) -> WorkerInfo:
        return self.registry.worker_info

    def has_left(self, rank: int) -> bool:
        """Whether worker ``rank`` has shut down and told this worker so."""
        return self.registry.has_left(rank)

    def worker_infos(self) -> List[WorkerInfo]:
        return self.registry.worker_infos()

    def resolve(self, to: Any) -> WorkerInfo:
        """A WorkerInfo from a name, a rank or a WorkerInfo; ValueError naming an unknown one."""
        return self.registry.resolve(to)

    # -- plug-in points ----------------------------------------------------------------------------

    def register_handler(self, kind: int, handler: Callable[[WorkerInfo, Any], Any]) -> None:
        """Serve requests of ``kind`` with ``handler(src, payload)`` on the worker pool.

        The handler returns the reply value, or an :class:`AsyncResult`.
        """
        self.dispatch.register_handler(kind, handler)

    def add_call_hook(self, hook: CallHook) -> None:
        self._hooks.append(hook)

    def add_shutdown_hook(self, hook: Callable[[Optional[float]], None]) -> None:
        """``hook(deadline)`` runs first in a graceful shutdown (settle control messages)."""
        self._shutdown_hooks.append(hook)

    def add_stop_hook(self, hook: Callable[[float], None]) -> None:
        """``hook(until)`` runs in every shutdown, graceful or not, before connections
        close; ``until`` (a ``time.monotonic()``) bounds what it waits for."""
        self._stop_hooks.append(hook)

    def add_loss_hook(self, hook: Callable[[WorkerInfo, RpcError], None]) -> None:
        """``hook(worker, error)`` runs on a pool thread once ``worker`` is lost: its
        connections broke (or it went silent) and connecting again failed. Upper layers
        drop what they keep for it; ``error`` names it."""
        self.liveness.loss_hooks.append(hook)

    def add_tick_hook(self, hook: Callable[[], None],
                      pending: Optional[Callable[[], bool]] = None) -> None:
        """``hook()`` runs on the timer thread at every tick; it must be quick and not
        block. Ticks come ``TICK`` apart, and ``LENT_TICK`` apart while ``pending()``
        (if given) says the hook has work queued (see scheduler.py)."""
        self.scheduler.add_tick_hook(hook, pending)

    # torch's RpcAgent methods, for code that calls rpc._get_current_rpc_agent().

    def get_worker_info(self, worker_name: Optional[str] = None) -> WorkerInfo:
        """The :class:`WorkerInfo` of ``worker_name``, or of this worker."""
        return self.worker_info if worker_name is None else self.resolve(worker_name)

    def get_worker_infos(self) -> List[WorkerInfo]:
        """Every worker's :class:`WorkerInfo`, ordered by id."""
        return self.worker_infos()

    def get_debug_info(self) -> Dict[str, Any]:
        """The agent's own counters (torch's agent debug info; no RRef or autograd keys)."""
        return self.debug_info("agent")

    def get_num_worker_threads(self) -> int:
        """The size of the worker thread pool the options asked for."""
        return self.settings.num_worker_threads

    def add_debug_source(self, layer: str, source: Callable[[], Dict[str, Any]]) -> None:
        """Make ``source()``'s counters part of :meth:`debug_info`, under ``layer``."""
        self._debug_sources[layer] = source

    def debug_info(self, layer: Optional[str] = None) -> Dict[str, Any]:
        """Counters of the agent and every layer; of one layer when ``layer`` is given
        (``"agent"`` for the agent's and the transport's own; see debug.py)."""
        return debug.debug_info(functools.partial(_counters, self), self._debug_sources,
                                self.peer_stats, layer)

    def peer_stats(self) -> Dict[str, Dict[str, Any]]:
        """Traffic counters by peer name (see :func:`~torchrpc._agent.debug.peer_stats`)."""
        with self._lock:
            names = {rank: w.name for rank, w in self.registry.workers.items()}
        return debug.peer_stats(self.traffic.items(), names)

    # -- requests (calls.py, lanes.py) ---------------------------------------------------------

    def call(self, dst: WorkerInfo, func: Any, args: Sequence[Any], kwargs: Dict[str, Any],
             timeout: float, retry: Optional[RetryPolicy] = None,
             expect: int = Expect.ANY) -> Any:
        """Run ``func(*args, **kwargs)`` on ``dst``; a future of its result (see request)."""
        if self.shutdown_protocol.failure is not None or self.lifecycle.state is not RUNNING:
            self.check_running()  # raises
        return self.calls.start(dst, _CALL, (func, args, kwargs), timeout, func, False, retry,
                                expect)

    def request(self, dst: WorkerInfo, kind: int, payload: Any, timeout: float,
                what: Any = None, oneway: bool = False,
                retry: Optional[RetryPolicy] = None, expect: int = Expect.ANY,
                after: Any = None, on_done: Optional[Callable[[Any], None]] = None) -> Any:
        """Send a request of ``kind``; a future of the handler's reply.

        ``expect`` (an :class:`~torchrpc._agent.lanes.Expect`) says what the caller does
        with the reply: wait for it at once (``WAIT``: the future is waited on at once,
        and handed to nobody), hold the future (``FUTURE``), or nothing while a blocking
        call to the same worker follows (``FOLLOWED``, with ``on_done``); the agent picks
        how the reply travels from it. ``after``: the future of an earlier ``FOLLOWED``
        or ``FUTURE`` request to ``dst``, whose reply a ``WAIT`` request may read with its
        own. ``on_done(future)`` runs once the future completes. Pickling errors raise
        here, before anything is sent; connection errors and timeouts complete the future.

        With ``retry``, a send that fails on the connection (so the message may not
        have arrived) is sent again after a backoff, as the same frame with the same
        request id, up to ``retry.max_attempts`` sends, all under the one deadline
        ``timeout``; whichever reply comes first completes the future. Remote errors
        and timeouts are never retried. A one-way request with ``retry`` completes
        once a send succeeds, and shutdown waits for it like for a reply. The handler
        must tolerate receiving the message twice.
        """
        if self.shutdown_protocol.failure is not None or self.lifecycle.state is not RUNNING:
            self.check_running()  # raises
        return self.calls.start(dst, kind, payload, timeout, what, oneway, retry, expect,
                                after, on_done)

    def request_many(self, dsts: Sequence[WorkerInfo], kind: int, payload: Any, timeout: float,
                     what: Any = None, retry: Optional[RetryPolicy] = None) -> List[RpcFuture]:
        """:meth:`request` to each of ``dsts``; a future per destination, in order.

        The payload is pickled once and the same frame goes to every destination, unless
        what it holds depends on the peer (an RRef argument, a distributed autograd
        context, the profiler): then each destination gets its own encoding. Errors of
        the first encoding raise here, before anything is sent; later ones fail only
        their destination's future.
        """
        self.check_running()
        return self.calls.request_many(dsts, kind, payload, timeout, what, retry)

    def request_sync(self, dst: WorkerInfo, kind: int, payload: Any, timeout: float,
                     what: Any = None, retry: Optional[RetryPolicy] = None,
                     after: Any = None) -> Any:
        """:meth:`request` with ``Expect.WAIT``, and wait for the reply."""
        return self.request(dst, kind, payload, timeout, what, retry=retry,
                            expect=Expect.WAIT, after=after).wait()

    def call_later(self, delay: float, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the worker pool in ``delay`` seconds; dropped at shutdown."""
        self.scheduler.call_later(delay, fn, *args)

    def mark_ready(self) -> None:
        """Start serving requests (``init_rpc`` calls this once every layer is installed)."""
        self.inbound.mark_ready()

    # -- shutdown (shutdown.py) --------------------------------------------------------------------

    def shutdown(self, graceful: bool = True, timeout: float = 0,
                 meet: Optional[Callable[[], None]] = None) -> None:
        """Stop the agent; with ``graceful``, first meet every worker (see shutdown.py).
        ``meet`` runs once every worker has reached shutdown; if it raises, the agent
        stops at once and its error is raised as it is."""
        self.shutdown_protocol.shutdown(graceful, timeout, meet)

    def check_peers(self, barrier: Optional[str] = None) -> None:
        """Raise :class:`ShutdownError` naming any worker that is gone (see
        :meth:`Shutdown.check_peers`)."""
        self.shutdown_protocol.check_peers(barrier)

    def probe(self, ranks: Iterable[int]) -> None:
        """Connect to each of ``ranks`` not known lost or gone; one that cannot be reached
        is gone (:meth:`check_peers` then names it)."""
        self.shutdown_protocol.probe(ranks)


def _new_requests(agent: Agent) -> Requests:
    """The request table, handed what it uses (the caller's side sends again, late bound:
    it is made after the table)."""
    scheduler = agent.scheduler
    return Requests(agent.name, agent.rank, scheduler.cv, scheduler.lock, agent.lifecycle,
                    agent.timeout_reports, lambda peer: peer in agent.liveness.declared,
                    scheduler.call_later, lambda *a: agent.calls.transmit(*a),
                    lambda *a: agent.calls.probes.later(*a))


def _new_calls(agent: Agent) -> Calls:
    """The caller's side of requests, with its lanes and probes, handed what they use."""
    settings, registry, connections = agent.settings, agent.registry, agent.connections
    pending, pool = agent.requests.pending, agent._pool
    private = PrivateConnections(agent.rank, settings.max_private_connections,
                                 agent.lifecycle, registry, connections, left_error,
                                 lambda: agent.default_timeout)
    return Calls(
        agent.name, settings.max_pending_requests, pool, agent.requests, connections.to,
        registry.left, left_error, agent._hooks, agent.traffic.by_rank, agent.traffic.new,
        functools.partial(MessageContext, agent),
        functools.partial(Lanes, private=private, spin_us=settings.spin_us, pending=pending,
                          pool=pool, lifecycle=agent.lifecycle),
        functools.partial(Probes, name=agent.name, pending=pending, shared_to=connections.to,
                          call_later=agent.scheduler.call_later))


def _starting(agent: Agent) -> startup.Parts:
    """What starting uses of ``agent`` (startup.py)."""
    return startup.Parts(
        agent.name, agent.rank, agent.world_size, agent.elastic, agent.settings, agent.store,
        agent.registry, agent.connections, agent.inbound, agent.liveness, agent.scheduler,
        agent.lanes.private.max, agent.connection_type, agent.start_thread, agent.fail,
        agent.shutdown_protocol.enter, functools.partial(setattr, agent, "store"),
        agent._adopt, functools.partial(_observers, agent))


def _observers(agent: Agent, secret: bytes) -> Observers:
    """The gate that keeps observers' connections out of ``agent``'s tables and answers
    their snapshots (snapshot.py), installed where ``snapshot()`` in this process finds it."""
    connections = agent.connections
    return agent.extensions.install(OBSERVERS, Observers(
        agent.name, functools.partial(take_snapshot, agent), connections.on_connect,
        connections.on_close, secret))


def _stopping(agent: Agent) -> ShutdownParts:
    """What the shutdown protocol uses of ``agent`` (shutdown.py)."""
    return ShutdownParts(
        agent.name, agent.rank, agent.world_size, agent.elastic, agent._lock, agent.registry,
        agent.connections, agent.requests, agent.scheduler, agent.liveness, agent.coroutines,
        agent.pool, agent.lanes.clear, lambda: agent.store,
        functools.partial(setattr, agent, "store", None), lambda: agent._transport,
        agent.debug_info, agent._shutdown_hooks, agent._stop_hooks)


def _schedule_duties(agent: Agent) -> None:
    """Register the agent's own tick hooks (scheduler.py), before any upper layer's."""
    scheduler, lanes = agent.scheduler, agent.lanes
    role = agent.inbound.role
    agent.add_stop_hook(agent.omp.stop)
    scheduler.add_tick_hook(lambda: agent.requests.expire_due(scheduler.now, scheduler.failed))
    scheduler.add_tick_hook(lambda: role.check_lent(scheduler.now), pending=role.lends_shared)
    scheduler.add_tick_hook(lambda: lanes.tick(scheduler.now))
    scheduler.add_tick_hook(functools.partial(_housekeeping, agent))
    scheduler.add_tick_hook(lambda: agent.liveness.check(scheduler.now))


def _housekeeping(agent: Agent) -> None:
    """Timer, every TICK: the pool's progress check, the transport's housekeeping, how
    long private connections poll, and OpenMP's waits on a crowded host."""
    now = agent.scheduler.now
    if now >= agent._next_tick:
        agent._next_tick = now + TICK
        agent.pool.check_progress()
        if agent._transport is not None:
            agent._transport.housekeeping()
            workers = agent.registry.workers_on_this_host()
            agent.lanes.check_cpus(workers)
            agent.omp.check(workers)


def _counters(agent: Agent) -> Dict[str, Any]:
    """The agent's own counters and its transport's (the ``agent.*`` keys of
    :meth:`debug_info`)."""
    pool, probes, transport = agent.pool, agent.calls.probes, agent.transport
    info: Dict[str, Any] = {
        "agent.num_pending_requests": len(agent.requests.pending),
        "agent.thread_pool_size": agent.settings.num_worker_threads,
        "agent.num_threads_started": pool.num_threads,
        "agent.num_idle_threads": pool.num_threads - pool.num_pending,
        "agent.num_queued_tasks": pool.num_pending,
        "agent.num_connections": agent.connections.count(),
        "agent.num_private_connections": agent.lanes.private.num_idle(),
        "agent.num_parked": agent.lanes.num_parked,
        "agent.num_heartbeat_timeouts": agent.liveness.heartbeat_timeouts,
        "agent.num_duplicate_requests": agent.dispatch.once.duplicates,
        "agent.num_remembered_requests": len(agent.dispatch.once.entries),
        "agent.num_kept_replies": agent.dispatch.once.kept(),
        "agent.num_once_probes": probes.sent,
        "agent.num_resends_avoided": probes.resends_avoided,
        "agent.num_resends_after_probe": probes.resends_after_probe,
        "agent.max_outbox_bytes_queued": max(
            (c.outbox_bytes for c in transport.connections()), default=0)
        if transport is not None else 0,
        "agent.state": agent.lifecycle.state.value if agent.failure is None else "failed",
    }
    if transport is not None:
        info.update(transport.debug_info())
    return info
