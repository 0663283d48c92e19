"""The RPC agent: the one layer with threads and I/O above the transport.

Theory of operation. An :class:`Agent` owns a transport (listener plus one or
more connections per peer, opened lazily on first use and shared by both
directions), the table of the group's workers (registry.py), a table of
outstanding requests with their deadlines (requests.py), a timer thread that runs
every part's periodic duties, failing expired requests first (scheduler.py),
heartbeats and lost-peer decisions (liveness.py), and a worker pool that runs
incoming requests. Frames arrive on the thread that holds a connection's reading
role (see "Theory of operation (reading)" below). A reply (``RESPONSE`` or
``ERROR``) is decoded there and completes the pending future; a request is decoded
and dispatched by message kind to a registered handler, on the reading thread
itself (which lends its reading role to another thread if the request blocks or
runs long) or, when it arrives on a thread outside the pool, on a pool thread.
Upper layers (RRefs, distributed autograd) plug in by registering handlers for
their kinds and *call hooks* that add metadata to requests and see the tensors
that cross (hooks.py); the agent never imports them. A handler's exception goes
back to the caller as a ``RemoteErrorInfo`` (remote_error.py).

Lifecycle: ``new`` -> ``running`` -> ``stopping`` -> ``stopped``, a state machine
driven by the shutdown protocol (shutdown.py). Graceful shutdown runs the upper
layers' shutdown hooks, waits for this worker's outstanding requests, meets every
worker at store barriers (once when all have stopped calling, once when all
replies are out), says GOODBYE to its peers and closes. A connection that breaks
without a GOODBYE fails, at once, every request pending on that worker with an
error naming it.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .. import _threads, _wire
from .._threads import Guard
from .._transport import Connection, Transport, handshake
from .._transport.reader import set_spare_cpus
from .._transport.tls import TlsContexts, make_contexts
from .._wire import Kind
from .._wire.probe import MISSING
from ..errors import (ConnectionLostError, NotInitializedError, RpcError, SerializationError,
                      ThreadFailedError, WorkerLeftError)
from . import membership, rendezvous
from .coroutines import CoroutineRunner
from .current import current_agent
from .dispatch import Dispatch
from .futures import RpcFuture, fresh_error, mark_reader_thread, new_future
from .hooks import CallHook, MessageContext, combine, describe
from .liveness import Liveness
from .pool import WorkerPool, current_pool
from .registry import Registry
from .remote_error import rebuild_error
from .requests import Pending, Requests, Resend
from .retry import RetryPolicy
from .scheduler import LENT_TICK, TICK, Scheduler
from .secret import discard_local as discard_local_secret
from .shutdown import NEW, RUNNING, STOPPED, STOPPING, Shutdown, State
from .stats import PeerStats, nbytes
from .worker import WorkerInfo

log = logging.getLogger(__name__)

# A request running on its reading thread for longer than this hands the reading role on.
INLINE_LIMIT = 0.01
_MAX_PARKED = 8  # requests whose reply may wait unread in a private connection at once
# How long a caller waits to ask again about an at-most-once request that the callee
# said it has (its reply may have been lost with the connection it left on).
_RECHECK = 1.0
_REPORT_TIMEOUT = 5.0  # seconds a callee has to send its debug info after a timeout
_inline = threading.local()  # .conn: the connection whose reading role this thread lends


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class Parked:
    """A request sent on a private connection whose reply waits there unread (see
    :meth:`Agent.request_parked`)."""

    __slots__ = ("conn", "rid", "deadline", "since")

    def __init__(self, conn: Connection, rid: int, deadline: Optional[float]) -> None:
        self.conn = conn
        self.rid = rid
        self.deadline = deadline
        self.since = time.monotonic()


class Agent:
    """A worker's RPC agent. Built by a backend's init handler; see module docs."""

    def __init__(self, store: Any, name: str, rank: int, world_size: int, options: Any) -> None:
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.options = options
        self.store = store
        self.default_timeout = float(options.rpc_timeout)
        self._limits = _wire.Limits(
            max_message_size=int(getattr(options, "max_message_size", _wire.frame.DEFAULT_MAX_MESSAGE_SIZE)))
        self._lock = threading.Lock()
        self._conns: Dict[int, Connection] = {}
        self._all_conns: Dict[int, List[Connection]] = {}
        self._connect_locks: Dict[int, threading.Lock] = {}
        self._private: Dict[int, List[Connection]] = {}  # idle private connections by rank
        self._parked: Dict[int, Parked] = {}  # unclaimed parked requests by request id
        self._num_parked = 0  # parked requests whose reply is not read yet
        self._rid = itertools.count(1)
        self._pool = WorkerPool(int(options.num_worker_threads), f"torchrpc-{name}")
        self._pool.on_block = self._lend_out  # a request that blocks gives up reading
        # The timer: every part's periodic duties, and callbacks due later (scheduler.py).
        self.scheduler = Scheduler(self._pool)
        # outstanding requests and their deadlines (a new earliest one wakes the timer)
        self.requests = Requests(self, self.scheduler.cv)
        # Serving requests: the handlers by kind, replies, at most once (dispatch.py).
        self.dispatch = Dispatch(self)
        self._hooks: List[CallHook] = []
        # Hooks asked about every request served, not only those that carry their key.
        self.serve_all: List[CallHook] = []
        self._shutdown_hooks: List[Callable[[Optional[float]], None]] = []
        self._stop_hooks: List[Callable[[], None]] = []
        # Layer name ("rref", "autograd") -> counters of that layer.
        self._debug_sources: Dict[str, Callable[[], Dict[str, Any]]] = {}
        # Upper layers keep their per-agent state here, by name ("rref", "autograd", ...).
        self.extensions: Dict[str, Any] = {}
        self._lost: Dict[int, str] = {}  # rank -> why it seems lost (connections broke, silent)
        # The lifecycle state (shutdown.py): read as a plain attribute, with ``is``, on
        # the request path; written only by the shutdown protocol's transitions.
        self._state: State = NEW
        self.shutdown_protocol = Shutdown(self)
        self._ready = threading.Event()
        # Elastic membership (world_size=None): see torchrpc._agent.membership.
        self.elastic = world_size is None
        # The workers of the group, membership and device maps (registry.py).
        self.registry = Registry(self, dict(getattr(options, "device_maps", None) or {}))
        # Runs the coroutines of ``async def`` targets (its loop starts with the first one).
        self.coroutines = CoroutineRunner(name, self._pool)
        self._lent: Dict[Connection, float] = {}  # reading roles lent to inline requests
        self._next_tick = 0.0  # when the timer's housekeeping is due next
        self._transport: Optional[Transport] = None
        # heartbeats and lost peers (see liveness.py)
        self.liveness = Liveness(self, float(getattr(options, "heartbeat_interval", 0.0)),
                                 float(getattr(options, "heartbeat_timeout", 0.0)))
        # bounds (see the README's options table; 0: none)
        self._max_pending = int(getattr(options, "max_pending_requests", 0))
        self._max_private = int(getattr(options, "max_private_connections", 1 << 30))
        self._max_queued = int(getattr(options, "max_queued_requests", 0))
        # rank -> its open private connections, both ways (they take part in liveness)
        self._private_conns: Dict[int, List[Connection]] = {}
        self._private_opening: Dict[int, int] = {}  # rank -> private connections being opened
        # Caller side: rank -> ids of requests whose next attempt asks that peer first
        # (one probe for all of them; see _probe_later), and what the probes did.
        self._probe_due: Dict[int, List[int]] = {}
        self._probe_lock = threading.Lock()
        self._probes = 0  # probe frames sent
        self._resends_avoided = 0  # requests a probe found delivered, not sent again
        self._resends_after_probe = 0  # requests a probe found missing, sent again
        # rank -> traffic counters of that peer (the "peers" of debug_info; see stats.py).
        self._peer_stats: Dict[int, PeerStats] = {}
        # log_debug_info_on_timeout: ranks whose debug info is being fetched after a timeout.
        self._log_on_timeout = bool(getattr(options, "log_debug_info_on_timeout", False))
        self._timeout_reports: set[int] = set()
        # Set when a background thread cannot go on (see fail): every API call raises it.
        self.failure: Optional[ThreadFailedError] = None
        self._schedule_duties()

    # -- start -----------------------------------------------------------------------------------

    def start(self, timeout: float) -> "Agent":
        """Rendezvous with the group, start listening and the timer; return self."""
        store, rank, registry = self.store, self.rank, self.registry
        host = rendezvous.listen_host(self.options.init_method, getattr(self.options, "listen_addr", None))
        if self.elastic:
            secret = membership.join(store, self.name, rank, timeout,
                                     membership.outlives_rank0(self.options.init_method),
                                     registry.incarnation)
        else:
            secret = rendezvous.claim(store, self.name, rank, self.world_size, timeout)
        try:
            self._transport = Transport(rank, secret, self._limits, self._on_connect,
                                        self._on_frame, self._on_close, host,
                                        on_fatal=self.fail,
                                        tls_contexts=self._tls_contexts(),
                                        features=self._features(),
                                        shm_threshold=int(getattr(self.options, "shm_threshold", 0)),
                                        same_host=registry.same_host,
                                        same_pids=registry.same_pids,
                                        send_timeout=float(getattr(self.options,
                                                                   "send_timeout", 0.0)),
                                        max_outbox=int(getattr(self.options,
                                                               "max_outbox_bytes", 0)),
                                        max_private=self._max_private,
                                        local_socket=bool(getattr(self.options, "enable_uds",
                                                                  False)),
                                        incarnation=registry.incarnation,
                                        admit=registry.admit if self.elastic else None)
        except ValueError as exc:
            rendezvous.fail(store, f"worker {self.name!r} (rank {rank}): {exc}")
            raise
        except RpcError as exc:
            raise rendezvous.fail(store, f"worker {self.name!r} (rank {rank}): {exc}") from exc
        try:
            # Peers watch this worker for silence only if they know it sends heartbeats.
            facts: Dict[str, Any] = {"heartbeat_interval": self.liveness.interval}
            device_maps = registry.published_device_maps()
            if device_maps is not None:
                facts["device_maps"] = device_maps
            if self.elastic:
                membership.announce(store, self.name, rank, self._transport.address, facts,
                                    registry.incarnation)
                registry.log = membership.EventLog(store)
                infos = membership.EventLog.members(registry.log.poll())
            else:
                infos = rendezvous.publish(store, self.name, rank, self.world_size,
                                           self._transport.address, timeout, facts)
                discard_local_secret()  # every rank has joined, so has read it
        except BaseException:
            self._transport.close()
            raise
        for r, info in infos.items():
            registry.add(r, info)
        self.shutdown_protocol.enter(RUNNING)
        self.scheduler.start(self._start_thread)
        if self.elastic:
            registry.follow()
        self.liveness.start()
        log.info("worker %s (rank %d of %s) listening on %s:%d%s", self.name, rank,
                 self.world_size, *self._transport.address,
                 " (TLS)" if getattr(self.options, "tls_certfile", None) else "")
        return self

    def _start_thread(self, role: str, loop: Callable[[Guard], None]) -> threading.Thread:
        """Start background thread ``role`` running ``loop(guard)``; if it cannot go on,
        the agent fails."""
        guard = Guard(f"the {role} thread of {self.name}", self.fail)
        return _threads.start(f"torchrpc-{role}-{self.name}", guard, loop, guard)

    def fail(self, error: ThreadFailedError) -> None:
        """A background thread cannot go on: fail every pending call with ``error``, and
        make every later API call raise it (until ``shutdown``)."""
        if self.failure is not None or (self._state is not RUNNING
                                        and self._state is not STOPPING):
            return
        self.failure = ThreadFailedError(
            f"the RPC agent of {self.name} has failed: {error}; call rpc.shutdown() and "
            f"init_rpc() again")
        self.failure.__cause__ = error.__cause__
        log.error("%s", self.failure)
        self.requests.fail_all(lambda p: self.failure)

    def check_failure(self) -> None:
        """Raise :attr:`failure` if a background thread could not go on."""
        if self.failure is not None:
            self._raise_failure()

    def _raise_failure(self) -> None:
        """Raise a copy of :attr:`failure` (a copy: raising one object again and again
        would grow its traceback)."""
        error = ThreadFailedError(str(self.failure))
        raise error from self.failure.__cause__

    def _features(self) -> int:
        return handshake.FEATURE_SHM if getattr(self.options, "enable_shm", False) else 0

    def _spare_cpus(self) -> bool:
        """Whether the workers on this host, computing with torch's thread count each,
        leave CPUs idle (assuming they all compute with as many threads as this one)."""
        local = self.registry.workers_on_this_host()
        return torch.get_num_threads() * max(local, 1) <= _usable_cpus()

    def _tls_contexts(self) -> Optional[TlsContexts]:
        opts = self.options
        if not getattr(opts, "tls_certfile", None):
            return None
        return make_contexts(opts.tls_certfile, opts.tls_keyfile, opts.tls_cafile,
                             opts.tls_require_client_cert, getattr(opts, "tls_identity", None))

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

    def add_stop_hook(self, hook: Callable[[], None]) -> None:
        """``hook()`` runs in every shutdown, graceful or not, before connections close."""
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
        return int(self.options.num_worker_threads)

    def add_debug_source(self, layer: str, source: Callable[[], Dict[str, Any]]) -> None:
        """Make ``source()``'s counters part of :meth:`debug_info`, under ``layer``."""
        self._debug_sources[layer] = source

    def debug_info(self, layer: Optional[str] = None) -> Dict[str, Any]:
        """Counters of the agent and every layer; of one layer when ``layer`` is given
        (``"agent"`` for the agent's and the transport's own)."""
        if layer is not None and layer != "agent":
            source = self._debug_sources.get(layer)
            return source() if source is not None else {}
        with self._lock:
            num_connections = sum(len(v) for v in self._all_conns.values())
            num_private = sum(len(v) for v in self._private.values())
        info: Dict[str, Any] = {
            "agent.num_pending_requests": len(self.requests.pending),
            "agent.thread_pool_size": int(self.options.num_worker_threads),
            "agent.num_threads_started": self._pool.num_threads,
            "agent.num_idle_threads": self._pool.num_threads - self._pool.num_pending,
            "agent.num_queued_tasks": self._pool.num_pending,
            "agent.num_connections": num_connections,
            "agent.num_private_connections": num_private,
            "agent.num_parked": self._num_parked,
            "agent.num_heartbeat_timeouts": self.liveness.heartbeat_timeouts,
            "agent.num_duplicate_requests": self.dispatch.duplicates,
            "agent.num_remembered_requests": len(self.dispatch.once),
            "agent.num_once_probes": self._probes,
            "agent.num_resends_avoided": self._resends_avoided,
            "agent.num_resends_after_probe": self._resends_after_probe,
            "agent.max_outbox_bytes_queued": max(
                (c.outbox_bytes for c in self._transport.connections()), default=0)
            if self._transport is not None else 0,
            "agent.state": self._state.value if self.failure is None else "failed",
        }
        if self._transport is not None:
            info.update(self._transport.debug_info())
        if layer is None:
            for source in self._debug_sources.values():
                info.update(source())
            info["peers"] = self.peer_stats()
        elif "agent" in self._debug_sources:  # counters upper layers keep for the agent
            info.update(self._debug_sources["agent"]())
        return info

    def peer_stats(self) -> Dict[str, Dict[str, Any]]:
        """Traffic counters by peer name: calls, bytes and errors both ways, and the p50
        and p99 latency of the last calls (see :class:`~torchrpc._agent.stats.PeerStats`)."""
        with self._lock:
            stats = list(self._peer_stats.items())
            names = {rank: w.name for rank, w in self.registry.workers.items()}
        return {names.get(rank, f"rank{rank}"): s.as_dict() for rank, s in sorted(stats)}

    def _new_stats(self, rank: int) -> PeerStats:
        with self._lock:  # two first calls to a peer may race here
            return self._peer_stats.setdefault(rank, PeerStats())

    def _report_timeout(self, dst: WorkerInfo, what: Any, timeout: float) -> None:
        """log_debug_info_on_timeout: log this worker's debug info and, when it answers
        within a few seconds, the callee's; on the pool, so the timer never waits for it.
        One report per callee at a time, so a burst of timeouts logs once."""
        if dst.id in self._timeout_reports:
            return
        self._timeout_reports.add(dst.id)
        try:
            self._pool.submit(self._log_timeout, dst, what, timeout)
        except RuntimeError:  # the pool has stopped: so has the agent
            self._timeout_reports.discard(dst.id)

    def _log_timeout(self, dst: WorkerInfo, what: Any, timeout: float) -> None:
        log.warning("%s: the call to %s of %s timed out after %g s; debug info of %s: %s",
                    self.name, dst.name, describe(what), timeout, self.name,
                    _as_json(self.debug_info()))

        def answered(fut: torch.futures.Future) -> None:
            self._timeout_reports.discard(dst.id)
            try:
                info = fut.wait()
            except Exception as exc:  # noqa: BLE001 - best effort: say why there is none
                log.warning("%s: no debug info from %s after its call timed out: %s",
                            self.name, dst.name, exc)
            else:
                log.warning("%s: debug info of %s, whose call timed out: %s", self.name,
                            dst.name, _as_json(info))

        try:
            fut = self.request(dst, Kind.CALL, (debug_info_here, (), {}), _REPORT_TIMEOUT,
                               what=debug_info_here)
        except Exception as exc:  # noqa: BLE001 - best effort, as above
            self._timeout_reports.discard(dst.id)
            log.warning("%s: cannot ask %s for its debug info: %s", self.name, dst.name, exc)
            return
        fut.add_done_callback(answered)

    @property
    def pool(self) -> WorkerPool:
        return self._pool

    # -- requests ----------------------------------------------------------------------------------

    def call(self, dst: WorkerInfo, func: Any, args: Sequence[Any], kwargs: Dict[str, Any],
             timeout: float, retry: Optional[RetryPolicy] = None) -> RpcFuture:
        """Run ``func(*args, **kwargs)`` on ``dst``; a future of its result."""
        return self.request(dst, Kind.CALL, (func, args, kwargs), timeout, what=func,
                            retry=retry)

    def request(self, dst: WorkerInfo, kind: int, payload: Any, timeout: float,
                what: Any = None, oneway: bool = False,
                retry: Optional[RetryPolicy] = None) -> RpcFuture:
        """Send a request of ``kind``; a future of the handler's reply.

        Pickling errors raise here, before anything is sent. Connection errors and
        timeouts complete the future with the error.

        With ``retry``, a send that fails on the connection (so the message may not
        have arrived) is sent again after a backoff, as the same frame with the same
        request id, up to ``retry.max_attempts`` sends, all under the one deadline
        ``timeout``; whichever reply comes first completes the future. Remote errors
        and timeouts are never retried. A one-way request with ``retry`` completes
        once a send succeeds, and shutdown waits for it like for a reply. The handler
        must tolerate receiving the message twice.
        """
        self._check_running()
        rid, p, flags, env, bufs, keep = self._new_request(dst, kind, payload, timeout, what,
                                                           oneway, retry)
        self._attempt(rid, p, kind, flags, env, bufs, keep)
        return p.future

    def request_many(self, dsts: Sequence[WorkerInfo], kind: int, payload: Any, timeout: float,
                     what: Any = None, retry: Optional[RetryPolicy] = None) -> List[RpcFuture]:
        """:meth:`request` to each of ``dsts``; a future per destination, in order.

        The payload is pickled once and the same frame goes to every destination, unless
        what it holds depends on the peer (an RRef argument, a distributed autograd
        context, the profiler): then each destination gets its own encoding. Errors of
        the first encoding raise here, before anything is sent; later ones fail only
        their destination's future.
        """
        self._check_running()
        futures: List[RpcFuture] = []
        shared: List[Tuple[bytes, Any, Any]] = []
        for i, dst in enumerate(dsts):
            try:
                rid, p, flags, env, bufs, keep = self._new_request(
                    dst, kind, payload, timeout, what, retry=retry,
                    encoded=shared[0] if shared else None, share=shared if i == 0 else None)
            except BaseException as exc:  # noqa: BLE001 - the first raises, others fail alone
                if i == 0:
                    raise
                failed = new_future(self._pool)
                failed.set_exception(fresh_error(exc))
                futures.append(failed)
                continue
            self._attempt(rid, p, kind, flags, env, bufs, keep)
            futures.append(p.future)
        return futures

    def _new_request(self, dst: WorkerInfo, kind: int, payload: Any, timeout: float, what: Any,
                     oneway: bool = False, retry: Optional[RetryPolicy] = None,
                     private: Optional[Connection] = None,
                     encoded: Optional[Tuple[bytes, Any, Any]] = None,
                     share: Optional[List[Tuple[bytes, Any, Any]]] = None) -> Tuple[Any, ...]:
        """Encode a request and enter it in the pending table (unless one-way).

        ``encoded``: an encoding of ``payload`` made for another destination, used unless
        a call hook has something to add for this one. ``share``: a list that gets this
        encoding if it depends on nothing of ``dst`` (see :meth:`request_many`).
        """
        # The protocols' at-most-once messages are not refused: losing them would lose state.
        once = retry is not None and retry.max_attempts > 1 and kind != Kind.CALL
        waiting = len(self.requests.pending)
        if self._max_pending and waiting >= self._max_pending and not oneway and not once:
            raise RpcError(
                f"too many outstanding RPCs: {waiting} requests of {self.name} wait "
                f"for replies (max_pending_requests is {self._max_pending}); wait for some "
                f"of them before sending {describe(what)} to {dst.name}, or raise the option")
        meta = send_hook = states = None
        if self._hooks:
            meta, send_hook, states = self._outgoing(dst, kind)
        ctx = MessageContext(self, dst, kind, replied=not oneway)
        if encoded is not None and meta is None and send_hook is None and states is None:
            env, bufs, keep = encoded
        else:
            try:
                env, bufs, keep = _wire.encode(payload, ctx, send_hook, meta,
                                               _wire.PAYLOAD_NAMES.get(kind, "payload"))
            except BaseException:
                if states is not None:
                    self._request_failed(dst, states)
                raise
            if share is not None and meta is None and send_hook is None and states is None \
                    and not ctx.per_peer and not ctx.on_settled and ctx.gates is None:
                share.append((env, bufs, keep))
        rid = next(self._rid)
        flags = _wire.FLAG_ONEWAY if oneway else 0
        now = time.monotonic()
        stats = self._peer_stats.get(dst.id) or self._new_stats(dst.id)
        stats.calls_out += 1
        stats.bytes_out += len(env) + nbytes(bufs) if bufs else len(env)
        p = Pending(new_future(self._pool), dst, what, timeout, states, stats, now)
        if states is not None:
            p.on_failure = functools.partial(self._request_failed, dst, states)
        if ctx.on_settled:
            # Inline, wherever the future completes: these are short bookkeeping steps.
            torch.futures.Future.add_done_callback(
                p.future, functools.partial(_run_all, ctx.on_settled))
        p.private = private
        deadline = now + timeout if timeout > 0 else None
        if retry is not None and retry.max_attempts > 1:
            if once:  # internal: the callee runs it once; @idempotent may rerun
                flags |= _wire.FLAG_ONCE
            p.resend = Resend(retry, deadline, kind, flags, env, bufs, keep)
        if not oneway or p.resend is not None:
            self.requests.add(rid, p, deadline)
        return rid, p, flags, env, bufs, keep

    # -- private connections -------------------------------------------------------------------
    #
    # A blocking call (rpc_sync, RRef.to_here) would otherwise cost two thread switches on
    # the way back: the connection's reader takes the reply and wakes the caller, and the
    # GIL goes back and forth between them. Instead it goes out on a private connection,
    # used by this one call at a time, and the calling thread reads the reply from the
    # socket itself. The call still sits in the pending table, so deadlines, lost workers
    # and shutdown fail it like any other; failing it closes the private connection,
    # which wakes the caller blocked on it (Pending.set_exception).

    private_calls = True
    """Whether blocking calls use private connections (the fault-injecting agent's sends
    must all go through ``_send``, so it turns them off)."""

    def request_sync(self, dst: WorkerInfo, kind: int, payload: Any, timeout: float,
                     what: Any = None, retry: Optional[RetryPolicy] = None,
                     after: Optional[Parked] = None) -> Any:
        """:meth:`request` and wait for the reply; the calling thread reads it itself.

        With ``after`` (a request to ``dst`` parked by :meth:`request_parked`), the
        request goes out on the parked request's connection if it is still unclaimed and
        this call's deadline is not earlier than the parked one's; this thread then reads
        both replies.
        """
        self._check_running()
        conn = None
        also: Tuple[int, ...] = ()
        if after is not None and self._claim(after, timeout):
            conn, also = after.conn, (after.rid,)
        elif self._private_ok(dst):
            # With retry, an attempt that fails on the connection is sent again on the
            # shared one, and its reply read there (see _fail).
            conn = self._checkout_private(dst)
        if conn is None:
            return self.request(dst, kind, payload, timeout, what=what, retry=retry).wait()
        rid, p, sent = self._send_private(conn, also, dst, kind, payload, timeout, what, retry)
        if sent:
            self._read_blocking(conn, rid, p, also)
        return p.future.wait()

    def _private_ok(self, dst: WorkerInfo) -> bool:
        """Whether calls to ``dst`` may use private connections (under TLS there is one
        connection per peer)."""
        return self.private_calls and dst.id != self.rank and not self._transport.secure

    def _send_private(self, conn: Connection, also: Tuple[int, ...], dst: WorkerInfo, kind: int,
                      payload: Any, timeout: float, what: Any,
                      retry: Optional[RetryPolicy] = None) -> Tuple[int, Pending, bool]:
        """Enter a request and send it on private connection ``conn`` (which carries the
        parked requests ``also``); the request id, its pending record, and whether it was
        sent (if not, it has failed or gone to retry, and ``conn`` was released)."""
        try:
            rid, p, flags, env, bufs, keep = self._new_request(dst, kind, payload, timeout, what,
                                                               retry=retry, private=conn)
        except BaseException:
            self._release_private(dst, conn, also)
            raise
        r = p.resend
        was_sent = r is not None and r.sent
        if r is not None:
            r.sent = True  # from here the frame may arrive, even if the connection breaks
        try:
            conn.send(kind, flags, rid, env, bufs, keep)
        except RpcError as exc:  # raised before the frame was queued: it did not go
            if r is not None:
                r.sent = was_sent
            self.send_failed(kind, rid, dst, exc)
            self._release_private(dst, conn, also)
            return rid, p, False
        return rid, p, True

    def _read_blocking(self, conn: Connection, rid: int, p: Pending,
                       also: Tuple[int, ...] = ()) -> None:
        """:meth:`_read_reply`, as a blocked thread in the eyes of the pool."""
        pool = current_pool()
        if pool is None:
            self._read_reply(conn, rid, p, also)
        else:
            with pool.blocking():
                self._read_reply(conn, rid, p, also)

    def _read_reply(self, conn: Connection, rid: int, p: Pending,
                    also: Tuple[int, ...] = ()) -> None:
        """Read replies from private connection ``conn`` until request ``rid`` and the
        requests ``also`` (sent on it before) are answered; then give ``conn`` back."""
        waiting = {rid, *also}
        while waiting:
            try:
                header, envelope, buffers = conn.read_frame()
            except RpcError as exc:  # broken, or closed because a call failed already
                for r in waiting:
                    self._request_lost(r, p.dst, exc)
                if also:
                    self._unpark()
                return
            if header.request_id in waiting and (header.kind == Kind.RESPONSE
                                                 or header.kind == Kind.ERROR):
                waiting.discard(header.request_id)
                if not waiting:
                    p.private = None
                    if also:
                        self._unpark()
                    self._checkin_private(p.dst, conn)
                self._on_reply(conn, header, envelope, buffers)
            # Nothing else is sent on a private connection; ignore what a peer sends anyway.
            envelope = buffers = None

    # -- parked requests -----------------------------------------------------------------------
    #
    # RRef creation (remote()) gets a reply that nobody waits for, and usually a to_here()
    # right after it. The creation is sent on a private connection and its reply left in
    # the socket ("parked"): a request_sync(after=...) to the same worker goes out on that
    # connection and its thread reads both replies, so no reader thread wakes up for the
    # first. A parked request nobody claims within a tick or two of the timer is read by a
    # pool thread (_drain). At most _MAX_PARKED requests are parked at once; beyond that,
    # and wherever private connections are not used, request_parked is plain request.

    def request_parked(self, dst: WorkerInfo, kind: int, payload: Any, timeout: float,
                       what: Any = None) -> Tuple[RpcFuture, Optional[Parked]]:
        """:meth:`request`, parking the reply for a later :meth:`request_sync` to read; the
        future of the reply, and the parked request (None if it was sent the usual way)."""
        self._check_running()
        conn = None
        if self._num_parked < _MAX_PARKED and self._private_ok(dst):
            conn = self._checkout_private(dst)
        if conn is None:
            return self.request(dst, kind, payload, timeout, what=what), None
        rid, p, sent = self._send_private(conn, (), dst, kind, payload, timeout, what)
        if not sent:
            return p.future, None
        parked = Parked(conn, rid, time.monotonic() + timeout if timeout > 0 else None)
        with self._lock:
            self._num_parked += 1
        self._parked[rid] = parked
        return p.future, parked

    def _claim(self, parked: Parked, timeout: float) -> bool:
        """Take ``parked`` over for a request with ``timeout``, if still unclaimed. A
        request that may time out first does not: its timeout would close the connection
        under the parked request."""
        if timeout > 0 and (parked.deadline is None
                            or time.monotonic() + timeout < parked.deadline):
            return False
        return self._parked.pop(parked.rid, None) is not None

    def _unpark(self) -> None:
        with self._lock:
            self._num_parked -= 1

    def _release_private(self, dst: WorkerInfo, conn: Connection, also: Tuple[int, ...]) -> None:
        """A claimed parked connection carries no new request after all: read the parked
        reply on the pool; a plain private connection goes back to the free list."""
        if also:
            self._pool.submit(self._drain, conn, also[0])
        else:
            self._checkin_private(dst, conn)

    def _drain_parked(self, now: float) -> None:
        """Timer: unclaimed parked requests older than a tick get their reply read."""
        if not self._parked:
            return
        for rid in list(self._parked):  # the keys: one C-level copy, see docs/design.md
            parked = self._parked.get(rid)
            if parked is not None and now - parked.since > LENT_TICK \
                    and self._parked.pop(rid, None) is not None:
                try:
                    self._pool.submit(self._drain, parked.conn, rid)
                except RuntimeError:
                    self._unpark()  # shutting down: the pending call is failed there

    def _drain(self, conn: Connection, rid: int) -> None:
        """Read the reply of parked request ``rid`` (claimed by this thread) from ``conn``."""
        p = self.requests.pending.get(rid)
        if p is None:  # failed already (which closed the connection)
            self._unpark()
            return
        self._read_blocking(conn, rid, p, (rid,))

    def wait_parked(self, future: RpcFuture, parked: Optional[Parked]) -> Any:
        """Wait for the reply of a :meth:`request_parked` request: this thread reads it
        if it is still parked."""
        if parked is not None and self._parked.pop(parked.rid, None) is not None:
            self._drain(parked.conn, parked.rid)
        return future.wait()

    def _checkout_private(self, dst: WorkerInfo) -> Optional[Connection]:
        if dst.id in self.registry.left:  # it said GOODBYE: nothing sent now is answered
            raise self._left_error(dst)
        free = self._private.get(dst.id)
        while free:
            try:
                conn = free.pop()
            except IndexError:
                break
            if not conn.closed:
                return conn
        self._connection(dst)  # checks the worker; the shared connection carries heartbeats
        with self._lock:  # a slot is taken before connecting: callers race here
            opened = self._private_opening.get(dst.id, 0) + sum(
                1 for c in self._private_conns.get(dst.id, ()) if c.outbound and not c.closed)
            if opened >= self._max_private:
                return None  # max_private_connections: this call goes over the shared one
            self._private_opening[dst.id] = self._private_opening.get(dst.id, 0) + 1
        registry = self.registry
        host, port = registry.addresses[dst.id]
        try:
            conn = self._transport.connect(dst.id, host, port, self.default_timeout or 30.0,
                                           local=registry.same_host(dst.id), private=True)
        except RpcError:
            return None  # the shared connection reports what is wrong
        finally:
            with self._lock:  # registered in _private_conns by now (_on_connect)
                self._private_opening[dst.id] -= 1
        return conn if conn.private else None

    def _checkin_private(self, dst: WorkerInfo, conn: Connection) -> None:
        if not conn.closed and self._state is RUNNING:
            free = self._private.get(dst.id)
            if free is None:
                with self._lock:  # keys change under the lock only (debug_info iterates)
                    free = self._private.setdefault(dst.id, [])
            free.append(conn)

    def _attempt(self, rid: int, p: Pending, kind: int, flags: int, env: bytes, bufs: Any,
                 keep: Any) -> None:
        r = p.resend
        was_sent = r is not None and r.sent
        if r is not None:
            r.sent = True  # from here the frame may arrive, even if the connection breaks
        try:
            conn = p.conn = self._connection(p.dst)
            self._send(p.dst, kind, flags, rid, env, bufs, keep, conn)
        except RpcError as exc:  # raised before the frame was queued: it did not go
            if r is not None:
                r.sent = was_sent
            if flags & _wire.FLAG_ONEWAY and p.resend is None:
                p.set_exception(self._lost_error(p.dst, exc))
            else:
                self.send_failed(kind, rid, p.dst, exc)
            return
        if flags & _wire.FLAG_ONEWAY and (p.resend is None
                                          or self.requests.pending.pop(rid, None)):
            p.future.set_result(None)

    def _send(self, dst: WorkerInfo, kind: int, flags: int, rid: int, env: bytes, bufs: Any,
              keep: Any, via: Optional[Connection] = None) -> None:
        """Send one frame to ``dst`` (on ``via``, if given); raise
        :class:`RpcError` when it cannot.

        Every frame of a reply, and of a request not sent privately, leaves through
        here; the fault-injecting agent of the tests (``torchrpc._testing.faulty``)
        overrides it.
        """
        (via or self._connection(dst)).send(kind, flags, rid, env, bufs, keep)

    def send_failed(self, kind: int, rid: int, dst: WorkerInfo, exc: BaseException) -> None:
        """A frame for ``dst`` could not be sent: retry or fail its request, log a reply."""
        if kind in (Kind.RESPONSE, Kind.ERROR):
            log.warning("%s could not reply to %s: %s", self.name, dst.name, exc)
            return
        self._request_lost(rid, dst, exc)

    def _request_lost(self, rid: int, dst: WorkerInfo, exc: BaseException) -> None:
        """Request ``rid`` to ``dst`` may never be answered (its connection failed):
        retry or fail it, unless it is settled already."""
        p = self.requests.pending.pop(rid, None)
        if p is not None:
            self.requests.fail(rid, p, self._lost_error(dst, exc))

    # Resending only what did not arrive. An attempt of a request with the ONCE flag that
    # may have reached the callee (its send returned: the frame was queued, and the
    # connection broke after) is not sent again blindly: the attempt asks the callee first,
    # with one small probe for all such requests to that peer (ids only, see
    # _wire/probe.py), and sends the frame again only for the ids the callee never got.
    # For the others it keeps waiting for the reply, under the same deadline. A probe that
    # cannot be sent, or whose connection breaks before the answer, fails the attempt like
    # a failed send: the next one, after the policy's backoff, probes again. The callee's
    # dedup (Dispatch.first_time) stays the safety net: a frame still in the old
    # connection's buffers may reach it after the probe said it was missing.

    def _probe_later(self, dst: WorkerInfo, rid: int, delay: float) -> None:
        """Let the next attempt of request ``rid`` ask ``dst`` first, in ``delay`` seconds
        (or with the probe already due for ``dst``)."""
        with self._probe_lock:
            due = self._probe_due.get(dst.id)
            if due is not None:
                due.append(rid)
                return
            self._probe_due[dst.id] = [rid]
        self.call_later(delay, self._probe_peer, dst)

    def _probe_peer(self, dst: WorkerInfo) -> None:
        """Ask ``dst`` which of the requests due to be probed it has."""
        with self._probe_lock:
            due = self._probe_due.pop(dst.id, [])
        asking = []
        for rid in due:
            p = self.requests.pending.get(rid)
            r = p.resend if p is not None else None
            if r is None or not r.scheduled:
                continue  # answered, timed out or failed meanwhile
            r.scheduled = False
            r.probing = True
            asking.append(rid)
        for i in range(0, len(asking), _wire.MAX_PROBE_IDS):
            ids = asking[i:i + _wire.MAX_PROBE_IDS]
            with self._probe_lock:  # counted first: the answer may come before send returns
                self._probes += 1
            try:
                self._send(dst, Kind.ONCE_PROBE, _wire.FLAG_ONEWAY, 0, _wire.pack_probe(ids),
                           [], None)
            except RpcError as exc:  # not sent: this attempt failed
                with self._probe_lock:
                    self._probes -= 1
                for rid in ids:
                    self._request_lost(rid, dst, exc)
                continue
            log.info("%s asks %s whether it has %d request(s) before sending them again",
                     self.name, dst.name, len(ids))

    def _on_once_status(self, conn: Connection, envelope: bytes) -> None:
        """The answer to a probe: send again what the callee never got; wait for the rest."""
        missing = []
        for rid, status in _wire.parse_status(envelope):
            p = self.requests.pending.get(rid)
            r = p.resend if p is not None else None
            if r is None or p.dst.id != conn.peer_rank:
                continue  # answered (the kept reply came just before), timed out or failed
            with self._probe_lock:  # one answer acts once
                if not r.probing:
                    continue  # an answer to an earlier attempt's probe
                r.probing = False
                if status == MISSING:
                    self._resends_after_probe += 1
                    missing.append((rid, p))
                    continue
                if not r.known:
                    r.known = True
                    self._resends_avoided += 1
                # Its reply may yet be lost (sent on the broken connection before the
                # callee saw it break): ask again later, while it is still unanswered.
                r.scheduled = True
            self._probe_later(p.dst, rid, _RECHECK)
        for rid, p in missing:
            r = p.resend
            self._attempt(rid, p, r.kind, r.flags, r.env, r.bufs, r.keep)

    def run_here(self, kind: int, what: Any, timeout: float, start: Callable[[], Any],
                 settled: torch.futures.Future) -> RpcFuture:
        """A request of ``kind`` this worker addresses to itself, served without a message
        (an ``rpc.remote()`` to self): ``start()`` runs on the worker pool, and the future
        returned completes when ``settled`` does, or fails with the timeout error at the
        deadline, as a request's would (torch sends such requests to itself)."""
        self._check_running()
        rid = next(self._rid)
        p = Pending(new_future(self._pool), self.worker_info, what, timeout, None)
        self.requests.add(rid, p, time.monotonic() + timeout if timeout > 0 else None)

        def finish(f: torch.futures.Future) -> None:
            q = self.requests.pending.pop(rid, None)
            if q is None:
                return  # timed out or failed already
            try:
                f.wait()
            except BaseException as exc:  # noqa: BLE001 - the work's own error
                q.future.set_exception(exc)
            else:
                q.future.set_result(None)

        torch.futures.Future.add_done_callback(settled, finish)
        self._start_here(kind, rid, start)
        return p.future

    def _start_here(self, kind: int, rid: int, start: Callable[[], Any]) -> None:
        """Start the work of :meth:`run_here`'s request ``rid`` (the fault-injecting agent
        of the tests fails or delays it first, as it does a send)."""
        self._pool.submit(start)

    def call_later(self, delay: float, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the worker pool in ``delay`` seconds; dropped at shutdown."""
        self.scheduler.call_later(delay, fn, *args)

    def _outgoing(self, dst: WorkerInfo, kind: int) -> Tuple[Any, Any, Any]:
        meta: Dict[str, Any] = {}
        states: Dict[str, Any] = {}
        send_hooks = []
        for hook in self._hooks:
            out = hook.outgoing_request(dst, kind)
            if out is not None:
                meta[hook.key], h, states[hook.key] = out
                send_hooks.append(h)
        return (meta or None), combine(send_hooks), (states or None)

    def _lost_error(self, dst: WorkerInfo, exc: BaseException) -> RpcError:
        if isinstance(exc, (ConnectionLostError, NotInitializedError)) and getattr(exc, "worker", None):
            return exc
        if dst.id in self.registry.left:
            return self._left_error(dst)
        return ConnectionLostError(f"RPC to worker {dst.name} (rank {dst.id}) failed: {exc}",
                                   worker=dst.name)

    @staticmethod
    def _left_error(dst: WorkerInfo) -> WorkerLeftError:
        return WorkerLeftError(f"worker {dst.name} (rank {dst.id}) has shut down and left the "
                               f"group", worker=dst.name)

    def _check_running(self) -> None:
        self.check_failure()
        if self._state is not RUNNING:
            raise NotInitializedError(
                f"RPC agent of {self.name!r} is {self._state.value}; call init_rpc() first")

    def _connection(self, dst: WorkerInfo, patient: bool = False) -> Connection:
        conn = self._conns.get(dst.id)
        if conn is not None and not conn.closed:
            if dst.id in self.registry.left:  # it said GOODBYE: nothing sent now is answered
                raise self._left_error(dst)
            return conn
        with self._lock:
            lock = self._connect_locks.setdefault(dst.id, threading.Lock())
        with lock:
            conn = self._conns.get(dst.id)
            if conn is not None and not conn.closed:
                return conn
            if dst.id in self.registry.left:
                raise self._left_error(dst)
            if self._state is not RUNNING and self._state is not STOPPING:
                raise NotInitializedError(f"RPC agent of {self.name!r} is {self._state.value}")
            host, port = self.registry.addresses[dst.id]
            lost = self._lost.get(dst.id)
            timeout = self.default_timeout or 30.0
            hb_timeout = self.liveness.timeout
            if lost is not None and hb_timeout > 0 and not patient:
                timeout = min(timeout, max(hb_timeout, 1.0))  # don't wait long on the dead
            try:
                conn = self._open(dst, host, port, timeout)
            except RpcError as exc:
                raise ConnectionLostError(
                    f"cannot reach worker {dst.name} (rank {dst.id}) at {host}:{port}: {exc}"
                    + (f" (its connection was lost before: {lost})" if lost else ""),
                    worker=dst.name) from exc
            return self._conns.get(dst.id) or conn

    def _open(self, dst: WorkerInfo, host: str, port: int, timeout: float) -> Connection:
        """Connect to ``dst`` within ``timeout``. A peer on this host that runs but did not
        finish the handshake in time (or reset it) is busy, not gone: with dozens of
        workers connecting to each other at once on a few cores, a handshake can take
        longer than the transport waits for one. It is tried again until ``timeout``."""
        deadline = time.monotonic() + timeout
        delay = 0.05
        while True:
            try:
                return self._transport.connect(dst.id, host, port,
                                               max(deadline - time.monotonic(), 0.5),
                                               local=self.registry.same_host(dst.id))
            except RpcError as exc:
                busy = isinstance(exc.__cause__, (TimeoutError, ConnectionResetError,
                                                  BrokenPipeError)) \
                    and self.liveness.runs_here(dst.id)
                if not busy or time.monotonic() + delay >= deadline:
                    raise
                log.info("%s: worker %s is busy (%s); connecting again in %.2g s",
                         self.name, dst.name, exc, delay)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    # -- connections -------------------------------------------------------------------------------

    def _on_connect(self, conn: Connection) -> None:
        if conn.private:
            # Used by one call at a time; registered for liveness (see liveness.py).
            with self._lock:
                self._private_conns.setdefault(conn.peer_rank, []).append(conn)
            return
        with self._lock:
            self._all_conns.setdefault(conn.peer_rank, []).append(conn)
            current = self._conns.get(conn.peer_rank)
            if current is None or current.closed:
                self._conns[conn.peer_rank] = conn
            self._lost.pop(conn.peer_rank, None)
            self.liveness.reconnected(conn.peer_rank)
        if self._state is STOPPING or self._state is STOPPED:
            # Perhaps too late for the GOODBYEs of Shutdown.stop: without its own, a caller
            # on this connection would wait for a reply until its timeout. (Not while
            # starting: a peer that finished rendezvous first may connect before this agent
            # runs.)
            self.shutdown_protocol.goodbye(conn)

    def _on_close(self, conn: Connection, reason: Optional[BaseException]) -> None:
        if conn.private:
            # Its caller learns it from read_frame; the shared connection watches the peer.
            with self._lock:
                for table in (self._private_conns, self._private):
                    try:
                        table.get(conn.peer_rank, []).remove(conn)
                    except ValueError:
                        pass  # never there, or checked out meanwhile
            return
        rank = conn.peer_rank
        with self._lock:
            conns = self._all_conns.get(rank, [])
            if conn in conns:
                conns.remove(conn)
            open_conns = [c for c in conns if not c.closed]
            if self._conns.get(rank) is conn:
                if open_conns:
                    self._conns[rank] = open_conns[0]
                else:
                    del self._conns[rank]
        if self._state is not RUNNING or reason is None:
            return
        w = self.registry.workers.get(rank)
        if rank in self.registry.left:
            # A request sent while the GOODBYE was on its way was on this connection.
            if w is not None:
                self.requests.fail_peer(rank, self._left_error(w))
            return
        name = w.name if w else f"rank{rank}"
        if open_conns:
            # The peer is still reachable, but what went out on this connection may be lost.
            self.requests.fail_matching(lambda p: p.conn is conn, ConnectionLostError(
                f"a connection to worker {name} (rank {rank}) broke with this request on it: "
                f"{reason}", worker=name))
            return
        with self._lock:
            self._lost[rank] = str(reason)
        log.warning("%s lost its connection to worker %s (rank %d): %s", self.name,
                    name, rank, reason)
        self._close_idle_private(rank, reason)
        self.requests.fail_peer(rank, ConnectionLostError(
            f"connection to worker {name} (rank {rank}) was lost: {reason}. The worker may have "
            f"died.", worker=name))
        self.liveness.suspect(rank, reason)

    def _connections_of(self, rank: int) -> List[Connection]:
        """The open connections, shared and private, with worker ``rank``."""
        with self._lock:
            return [c for table in (self._all_conns, self._private_conns)
                    for c in table.get(rank, ()) if not c.closed]

    def _close_idle_private(self, rank: int, reason: BaseException) -> None:
        """Close the idle private connections to ``rank``, lost: nobody reads them, and
        the next call to a restarted worker must not go out on one to its predecessor."""
        with self._lock:
            idle = list(self._private.get(rank, ()))
        for conn in idle:
            conn.close(reason)

    # -- frames ------------------------------------------------------------------------------------

    def mark_ready(self) -> None:
        """Start serving requests (``init_rpc`` calls this once every layer is installed)."""
        self._ready.set()

    # Theory of operation (reading). A connection is read by whichever thread holds its
    # reading role (Connection.read_frames). The transport's own thread reads first; as
    # soon as the pool has an idle thread the role moves into the pool, where a reading
    # thread counts as blocked (it waits for the network, not for work).
    #
    # A pool thread that reads a request runs it at once, itself: no other thread is
    # woken, and on two cores a wake-up and the GIL hand-over that follows cost more
    # than a small request does. While it runs the request, the reading role is *lent*
    # (``_lent``): it goes to another pool thread the moment the request blocks on an
    # RPC (``WorkerPool.blocking`` calls ``_lend_out``), so a nested call, even back to
    # the caller over this very connection, never waits for itself; and the timer hands
    # it on when a request runs for longer than ``INLINE_LIMIT`` without returning
    # (blocked on a lock, sleeping, computing), so one slow request holds the frames
    # behind it up for INLINE_LIMIT plus a tick at most. Only shared connections need
    # that: the caller on a private connection waits for this very reply (its parked
    # requests, if any, are about the same RRef), so the timer wakes every LENT_TICK
    # only while a shared connection's role is lent (or a tick hook has work queued),
    # and every TICK otherwise. On two cores each wake-up of a helper thread takes a
    # CPU, and the GIL, from the request path: in the benchmark's training loop the
    # caller's main thread was preempted 237 times a second before, 82 after. A
    # reader whose role went elsewhere stops reading when its request returns.

    def _on_frame(self, conn: Connection, header: _wire.Header, envelope: bytes,
                  buffers: List[torch.Tensor]) -> Optional[Callable[[], None]]:
        mark_reader_thread()
        if not self._ready.is_set():
            # A peer may finish rendezvous and call us before init_rpc here has returned.
            self._ready.wait(120.0)
        kind = header.kind
        if kind == Kind.RESPONSE or kind == Kind.ERROR:
            self._on_reply(conn, header, envelope, buffers)
            return self._reading_to_pool(conn)
        registry = self.registry
        src = registry.workers.get(conn.peer_rank)
        if src is None and self.elastic:
            registry.refresh()  # a new member may call before we saw it join
            src = registry.workers.get(conn.peer_rank)
        if src is None:
            raise ConnectionLostError(f"frame from unknown rank {conn.peer_rank}")
        if kind == Kind.GOODBYE:
            registry.left.add(src.id)
            self.requests.fail_peer(src.id, self._left_error(src))
            return None
        if kind == Kind.HEARTBEAT:
            self.liveness.beating.add(src.id)
            return self._reading_to_pool(conn)
        if kind == Kind.ONCE_PROBE:
            self.dispatch.answer_probe(conn, src, envelope)
            return self._reading_to_pool(conn)
        if kind == Kind.ONCE_STATUS:
            self._on_once_status(conn, envelope)
            return self._reading_to_pool(conn)
        stats = self._peer_stats.get(src.id) or self._new_stats(src.id)
        stats.calls_in += 1
        stats.bytes_in += len(envelope) + nbytes(buffers) if buffers else len(envelope)
        dispatch = self.dispatch
        handler = dispatch.handlers.get(kind)
        via = conn  # the reply goes back on it: the caller watches that connection for it
        if header.flags & _wire.FLAG_ONCE and not dispatch.first_time(src, header.request_id, via):
            return self._reading_to_pool(conn)
        if current_pool() is self._pool and self._state is RUNNING:
            return self._serve_inline(conn, src, header, envelope, buffers, handler, via)
        # A transport thread. With a pool thread idle, it takes the request and the
        # reading role with it, and serves what comes next as it comes, inline. Otherwise
        # (and until then) this thread reads on and passes each request to the pool,
        # which costs a wake-up per request: where both CPUs are taken by this thread
        # polling and the caller, the woken thread waits for the poll to end.
        if self._state is RUNNING and self._pool.hand_off(
                self._serve_then_read, conn, src, header, envelope, buffers, handler, via):
            return _nothing
        if self._max_queued and self._pool.num_pending >= self._max_queued \
                and not header.oneway and not header.flags & _wire.FLAG_ONCE:
            dispatch.refuse(src, header, via)
            return self._reading_to_pool(conn)
        try:
            self._pool.submit(dispatch.serve, src, header, envelope, buffers, handler, via)
        except RuntimeError:
            pass  # stopping; the caller learns from the GOODBYE or the closed connection
        return self._reading_to_pool(conn)

    def _serve_inline(self, conn: Connection, src: WorkerInfo, header: _wire.Header,
                      envelope: bytes, buffers: List[torch.Tensor], handler: Any,
                      via: Optional[Connection]) -> Optional[Callable[[], None]]:
        """Run a request on the reading thread, lending the reading role meanwhile."""
        # _lent is changed with single dict operations, which the GIL makes atomic.
        self._lent[conn] = time.monotonic()
        scheduler = self.scheduler
        if scheduler.slow and not conn.private:
            scheduler.wake()  # it set slow before it looked at _lent
        _inline.conn = conn
        try:
            self.dispatch.serve(src, header, envelope, buffers, handler, via)
        except Exception as exc:  # noqa: BLE001 - must not reach a reader that lent its role
            Guard(f"serving a {Kind(header.kind).name} from {src.name} on {self.name}",
                  limit=None).failed(exc)
        finally:
            _inline.conn = None
            kept = self._lent.pop(conn, None) is not None
        return None if kept else _nothing  # None: read on; else the role is elsewhere

    def _serve_then_read(self, conn: Connection, src: WorkerInfo, header: _wire.Header,
                         envelope: bytes, buffers: List[torch.Tensor], handler: Any,
                         via: Optional[Connection]) -> None:
        """A pool task: run a request that a transport thread read, then hold the reading
        role of its connection, as if this thread had read the request itself."""
        with self._pool.blocking():
            mark_reader_thread()
            work = self._serve_inline(conn, src, header, envelope, buffers, handler, via)
            if work is None:
                work = conn.read_frames()
        if work is not None:
            work()

    def _lend_out(self, conn: Optional[Connection] = None) -> None:
        """Give a lent reading role to another thread (this one's, without ``conn``)."""
        if conn is None:
            conn = getattr(_inline, "conn", None)
            if conn is None:
                return
            _inline.conn = None
            mark_reader_thread(False)  # this thread reads no more
        if self._lent.pop(conn, None) is None:
            return  # the request returned, or the role went elsewhere already
        try:
            if not self._pool.hand_off(self._keep_reading, conn):
                self._pool.submit(self._keep_reading, conn)
        except RuntimeError:
            pass  # the pool is shut down, and with it the connection

    def _check_lent(self, now: float) -> None:
        """Timer: hand on the reading role of requests that run inline for too long."""
        if not self._lent:
            return
        lent = self._lent
        overdue = [c for c in list(lent) if now - lent.get(c, now) > INLINE_LIMIT]
        for conn in overdue:
            self._lend_out(conn)

    def _reading_to_pool(self, conn: Connection) -> Optional[Callable[[], None]]:
        """On a transport thread: move the reading role into the pool if a thread is idle."""
        if current_pool() is not self._pool and self._pool.hand_off(self._keep_reading, conn):
            return _nothing
        return None

    def _keep_reading(self, conn: Connection) -> None:
        """A pool task: hold the reading role of ``conn`` until it moves on or ends."""
        with self._pool.blocking():
            work = conn.read_frames()
        if work is not None:
            work()

    def _on_reply(self, conn: Connection, header: _wire.Header, envelope: bytes,
                  buffers: List[torch.Tensor]) -> None:
        pending = self.requests.pending
        p = pending.get(header.request_id)
        if p is None:
            return  # expired or failed already
        if p.dst.id != conn.peer_rank:
            # Only the callee answers a call: a reply from anyone else is dropped.
            log.warning("%s dropped a reply from rank %d to request %d, which was "
                        "sent to rank %d", self.name, conn.peer_rank, header.request_id, p.dst.id)
            return
        if pending.pop(header.request_id, None) is not p:
            return  # failed meanwhile
        now = time.monotonic()
        if p.timeout > 0 and now - p.sent > p.timeout:
            # Past its deadline, before the timer got to it (a loaded machine): the
            # deadline holds all the same, as the caller was promised.
            self.requests.time_out(p)
            return
        if p.resend is not None and p.resend.probing:
            with self._probe_lock:  # the reply came before the probe's answer
                if p.resend.probing:
                    p.resend.probing = False
                    if not p.resend.known:
                        self._resends_avoided += 1
        stats = p.stats
        if stats is not None:
            stats.latency(now - p.sent)
            stats.bytes_in += len(envelope) + nbytes(buffers) if buffers else len(envelope)
            if header.kind == Kind.ERROR:
                stats.errors_out += 1
        ctx = MessageContext(self, p.dst, header.kind)
        recv_hook = None
        if p.states is not None:
            recv_hook = lambda meta: self._response_hook(p, meta)  # noqa: E731
        try:
            _, value = _wire.decode(envelope, buffers, ctx, recv_hook)
        except Exception as exc:  # noqa: BLE001 - the caller gets the error
            if stats is not None and header.kind != Kind.ERROR:
                stats.errors_out += 1
            p.future.set_exception(SerializationError(
                f"cannot unpickle the reply of {p.dst.name} to {describe(p.what)}: {exc}"))
            return
        if header.kind == Kind.ERROR:
            p.future.set_exception(rebuild_error(value))
        else:
            p.future.set_result(value)

    def _request_failed(self, dst: WorkerInfo, states: Dict[str, Any]) -> None:
        for hook in self._hooks:
            if hook.key in states:
                try:
                    hook.request_failed(dst, states[hook.key])
                except Exception:  # noqa: BLE001 - the caller's error matters more
                    log.exception("%s: call hook %r failed", self.name, hook.key)

    def _response_hook(self, p: Pending, meta: Any) -> Optional[Callable]:
        hooks = []
        for hook in self._hooks:
            if hook.key in p.states:
                hooks.append(hook.incoming_response(p.dst, p.states[hook.key],
                                                    (meta or {}).get(hook.key)))
        return combine(hooks)

    # -- the timer's duties (scheduler.py) ---------------------------------------------------------

    def _schedule_duties(self) -> None:
        """Register the agent's own tick hooks, before any upper layer's."""
        scheduler = self.scheduler
        scheduler.add_tick_hook(lambda: self.requests.expire_due(scheduler.now, scheduler.failed))
        scheduler.add_tick_hook(lambda: self._check_lent(scheduler.now),
                                pending=self._lends_shared)
        scheduler.add_tick_hook(lambda: self._drain_parked(scheduler.now))
        scheduler.add_tick_hook(self._housekeeping)
        scheduler.add_tick_hook(lambda: self.liveness.check(scheduler.now))

    def _lends_shared(self) -> bool:
        """Whether a shared connection's reading role is lent (the timer then ticks fast,
        to hand it on in time: see "Theory of operation (reading)")."""
        return any(not c.private for c in list(self._lent))

    def _housekeeping(self) -> None:
        """Timer, every TICK: the pool's progress check, the transport's housekeeping."""
        now = self.scheduler.now
        if now >= self._next_tick:
            self._next_tick = now + TICK
            self._pool.check_progress()
            if self._transport is not None:
                self._transport.housekeeping()
                set_spare_cpus(self._spare_cpus())

    # -- shutdown (shutdown.py) --------------------------------------------------------------------

    def shutdown(self, graceful: bool = True, timeout: float = 0,
                 meet: Optional[Callable[[], None]] = None) -> None:
        """Stop the agent; with ``graceful``, first meet every worker (see shutdown.py).
        ``meet`` runs once every worker has reached shutdown; if it raises, the agent
        stops at once and its error is raised as it is."""
        self.shutdown_protocol.shutdown(graceful, timeout, meet)

    def check_peers(self, barrier: Optional[str] = None) -> None:
        """Raise :class:`ShutdownError` naming any worker that is gone.

        A worker is gone when its connection broke without a GOODBYE (seen here, or by
        another worker and told through the store) and connecting to it again fails.
        While waiting at the store barrier ``barrier``, the workers that have not
        arrived are probed as well, and one that stopped without arriving is named.
        """
        self.shutdown_protocol.check_peers(barrier)

    def probe(self, ranks: Iterable[int]) -> None:
        """Connect to each of ``ranks`` not known lost or gone; one that cannot be reached
        is gone (:meth:`check_peers` then names it)."""
        self.shutdown_protocol.probe(ranks)


def debug_info_here() -> Dict[str, Any]:
    """The debug info of the worker this runs on (the target of ``get_debug_info(to)``)."""
    return current_agent().debug_info()


def _as_json(info: Dict[str, Any]) -> str:
    return json.dumps(info, sort_keys=True, default=str)


def _run_all(actions: List[Callable[[], None]], _fut: Any) -> None:
    for action in actions:
        try:
            action()
        except Exception:  # noqa: BLE001 - one must not keep the others from running
            log.exception("an action after a request settled failed")


def _nothing() -> None:
    """The work of a reader that handed its role on and has nothing else to do."""

