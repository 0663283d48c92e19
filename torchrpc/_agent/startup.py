"""Starting an agent: rendezvous with the group, the transport, the timer.

``start`` claims this worker's rank (or joins a dynamic group), opens the transport with
the agent's parts as its callbacks, publishes the address and learns everyone else's,
then starts the agent's threads. Once the job secret is known, the agent's store is a
:class:`rendezvous.Records`: what the group acts on is sealed. A static group's worker
that fails before the group has met (holding the secret) aborts the group with a sealed
record, so every other worker's rendezvous fails with it instead of waiting; a failure to
get the secret, and any failure of a joiner of a dynamic group, stays its own (the
joiner releases its claims).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Dict, Optional

from .. import _wire
from .._threads import StartThread
from .._transport import Connection, Transport, handshake
from .._transport.tls import TlsContexts, make_contexts
from ..errors import RendezvousError, RpcError, ThreadFailedError
from . import devices
from .._rendezvous import membership, rendezvous
from .connections import Connections
from .inbound import Inbound
from .lifecycle import RUNNING, State
from .liveness import Liveness
from .registry import Registry
from .scheduler import Scheduler
from .settings import Settings
from .snapshot import Observers

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Parts:
    """What starting uses: this worker's place in the group and settings, the parts that
    become the transport's callbacks and start threads, and where the results go."""

    name: str
    rank: int
    world_size: Optional[int]
    elastic: bool
    settings: Settings
    store: Any  # the store given to init_rpc, not sealed yet
    registry: Registry
    connections: Connections
    inbound: Inbound
    liveness: Liveness
    scheduler: Scheduler
    max_private: int  # private connections per peer (the lanes' limit)
    connection_type: Callable[..., Connection]
    start_thread: StartThread
    fail: Callable[[ThreadFailedError], None]  # the agent's: a background thread failed
    enter: Callable[[State], None]  # the lifecycle transition (Shutdown.enter)
    seal: Callable[[Any], None]  # hands the agent its sealed store
    adopt: Callable[[Transport], None]  # hands the agent (and its parts) the transport
    observe: Callable[[bytes], Observers]  # the observers' gate, made with the job secret


def start(parts: Parts, plan: rendezvous.Plan, limits: _wire.Limits) -> None:
    """Rendezvous with the group under ``plan``, start listening (on a transport whose
    frames ``limits`` bound) and the agent's threads."""
    store, rank, registry = parts.store, parts.rank, parts.registry
    settings = parts.settings
    host = rendezvous.listen_host(settings.init_method, settings.listen_addr)
    if parts.elastic:
        secret = rendezvous.job_secret(store, rank, plan,
                                       keep=membership.outlives_rank0(settings.init_method))
        store = rendezvous.Records(store, secret, membership.PREFIX)
        parts.seal(store)
        registry.log = membership.EventLog(store)
        membership.join(store, parts.name, rank, plan, registry.incarnation, registry.log)
    else:
        secret = rendezvous.job_secret(store, rank, plan, parts.world_size)
        store = rendezvous.Records(store, secret, rendezvous.PREFIX)
        parts.seal(store)
        rendezvous.claim(store, parts.name, rank, parts.world_size, plan)
    try:
        transport = _transport(parts, secret, host, limits)
    except ValueError as exc:
        _failed(parts, store, exc)
        raise
    except RpcError as exc:
        raise _failed(parts, store, exc) from exc
    parts.adopt(transport)
    announced = False
    try:
        # Peers watch this worker for silence only if they know it sends heartbeats.
        facts: Dict[str, Any] = {"heartbeat_interval": parts.liveness.interval,
                                 **devices.facts(registry.device_maps,
                                                 list(settings.devices))}
        if parts.elastic:
            membership.announce(store, parts.name, rank, transport.address, facts,
                                registry.incarnation)
            announced = True
            registry.log.poll()
            infos = dict(registry.log.current)
        else:
            infos = rendezvous.publish(store, parts.name, rank, parts.world_size,
                                       transport.address, plan, facts)
        devices.check(infos, static=not parts.elastic)
    except BaseException:
        transport.close()
        if parts.elastic:
            _undo_join(parts, store, announced)
        raise
    for r, info in infos.items():
        registry.add(r, info)
    parts.enter(RUNNING)
    parts.scheduler.start(parts.start_thread)
    if parts.elastic:
        registry.follow()
    parts.liveness.start()
    log.info("worker %s (rank %d of %s) listening on %s:%d%s", parts.name, rank,
             parts.world_size, *transport.address,
             " (TLS)" if settings.tls_certfile else "")


def _failed(parts: Parts, store: Any, error: Exception) -> RendezvousError:
    """The transport could not start: a static group's worker aborts the
    group still forming (a sealed record); a dynamic group's joiner fails alone, and
    releases its claims. The error to raise."""
    message = f"worker {parts.name!r} (rank {parts.rank}): {error}"
    if parts.elastic:
        _undo_join(parts, store, False)
        return RendezvousError(message)
    return rendezvous.abort(store, message, parts.rank, parts.world_size)


def _undo_join(parts: Parts, store: Any, announced: bool) -> None:
    """A dynamic group's joiner failed: free its claims (and announce its departure, if
    it announced its arrival), so that the rank and the name are not held by it."""
    try:
        if announced:
            membership.leave(store, parts.name, parts.rank, parts.registry.incarnation)
        else:
            membership.release(store, parts.name, parts.rank, parts.registry.incarnation)
    except Exception as exc:  # noqa: BLE001 - the store host may be gone: its claims with it
        log.warning("%s could not release its claims after a failed join: %s", parts.name, exc)


def _transport(parts: Parts, secret: bytes, host: str, limits: _wire.Limits) -> Transport:
    """The agent's transport, listening on ``host``, its parts as the callbacks (observers'
    connections kept out of the agent's tables: snapshot.py)."""
    settings, registry = parts.settings, parts.registry
    observers = parts.observe(secret)
    return Transport(parts.rank, secret, limits, observers.on_connect,
                     parts.inbound.on_frame, observers.on_close, host,
                     on_fatal=parts.fail, tls_contexts=_tls_contexts(settings),
                     features=handshake.FEATURE_SHM if settings.enable_shm else 0,
                     shm_threshold=settings.shm_threshold,
                     same_host=registry.same_host, same_pids=registry.same_pids,
                     send_timeout=settings.send_timeout,
                     max_outbox=settings.max_outbox_bytes,
                     max_private=parts.max_private,
                     local_socket=settings.enable_uds,
                     incarnation=registry.incarnation,
                     admit=registry.admit if parts.elastic else None,
                     connection_type=parts.connection_type,
                     tensor_mac=settings.tensor_mac,
                     stripe_threshold=settings.stripe_threshold)


def _tls_contexts(settings: Settings) -> Optional[TlsContexts]:
    if not settings.tls_certfile:
        return None
    return make_contexts(settings.tls_certfile, settings.tls_keyfile, settings.tls_cafile,
                         settings.tls_require_client_cert, settings.tls_identity)
