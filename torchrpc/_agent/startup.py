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

import logging
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional

from .. import _wire
from .._transport import Transport, handshake
from .._transport.tls import TlsContexts, make_contexts
from ..errors import RendezvousError, RpcError
from . import devices
from .._rendezvous import membership, rendezvous
from .._rendezvous.secret import discard_local as discard_local_secret
from .lifecycle import RUNNING
from .settings import Settings
from .snapshot import OBSERVERS, Observers

if TYPE_CHECKING:
    from .agent import Agent

log = logging.getLogger(__name__)


def start(agent: "Agent", plan: rendezvous.Plan, limits: _wire.Limits,
          adopt: Callable[[Transport], None]) -> None:
    """Rendezvous with the group under ``plan``, start listening (``adopt`` hands the
    agent its transport, whose frames ``limits`` bound) and the agent's threads."""
    store, rank, registry = agent.store, agent.rank, agent.registry
    settings = agent.settings
    host = rendezvous.listen_host(settings.init_method, settings.listen_addr)
    if agent.elastic:
        secret = rendezvous.job_secret(store, rank, plan,
                                       keep=membership.outlives_rank0(settings.init_method))
        store = agent.store = rendezvous.Records(store, secret, membership.PREFIX)
        registry.log = membership.EventLog(store)
        membership.join(store, agent.name, rank, plan, registry.incarnation, registry.log)
    else:
        secret = rendezvous.job_secret(store, rank, plan, agent.world_size)
        store = agent.store = rendezvous.Records(store, secret, rendezvous.PREFIX)
        rendezvous.claim(store, agent.name, rank, agent.world_size, plan)
    try:
        transport = _transport(agent, secret, host, limits)
    except ValueError as exc:
        _failed(agent, exc)
        raise
    except RpcError as exc:
        raise _failed(agent, exc) from exc
    adopt(transport)
    announced = False
    try:
        # Peers watch this worker for silence only if they know it sends heartbeats.
        facts: Dict[str, Any] = {"heartbeat_interval": agent.liveness.interval,
                                 **devices.facts(registry.device_maps,
                                                 list(settings.devices))}
        if agent.elastic:
            membership.announce(store, agent.name, rank, transport.address, facts,
                                registry.incarnation)
            announced = True
            registry.log.poll()
            infos = dict(registry.log.current)
        else:
            infos = rendezvous.publish(store, agent.name, rank, agent.world_size,
                                       transport.address, plan, facts)
            discard_local_secret()  # every rank has joined, so has read it
        devices.check(infos, static=not agent.elastic)
    except BaseException:
        transport.close()
        if agent.elastic:
            _undo_join(agent, announced)
        raise
    for r, info in infos.items():
        registry.add(r, info)
    agent.shutdown_protocol.enter(RUNNING)
    agent.scheduler.start(agent.start_thread)
    if agent.elastic:
        registry.follow()
    agent.liveness.start()
    log.info("worker %s (rank %d of %s) listening on %s:%d%s", agent.name, rank,
             agent.world_size, *transport.address,
             " (TLS)" if settings.tls_certfile else "")


def _failed(agent: "Agent", error: Exception) -> RendezvousError:
    """The transport of ``agent`` could not start: a static group's worker aborts the
    group still forming (a sealed record); a dynamic group's joiner fails alone, and
    releases its claims. The error to raise."""
    message = f"worker {agent.name!r} (rank {agent.rank}): {error}"
    if agent.elastic:
        _undo_join(agent, False)
        return RendezvousError(message)
    return rendezvous.abort(agent.store, message, agent.rank, agent.world_size)


def _undo_join(agent: "Agent", announced: bool) -> None:
    """A dynamic group's joiner failed: free its claims (and announce its departure, if
    it announced its arrival), so that the rank and the name are not held by it."""
    try:
        if announced:
            membership.leave(agent.store, agent.name, agent.rank, agent.registry.incarnation)
        else:
            membership.release(agent.store, agent.name, agent.rank, agent.registry.incarnation)
    except Exception as exc:  # noqa: BLE001 - the store host may be gone: its claims with it
        log.warning("%s could not release its claims after a failed join: %s", agent.name, exc)


def _transport(agent: "Agent", secret: bytes, host: str, limits: _wire.Limits) -> Transport:
    """The transport of ``agent``, listening on ``host``, its parts as the callbacks."""
    settings, registry = agent.settings, agent.registry
    # Observers' connections stay out of the agent's tables (snapshot.py).
    observers = agent.extensions.install(OBSERVERS, Observers(
        agent, agent.connections.on_connect, agent.connections.on_close, secret))
    return Transport(agent.rank, secret, limits, observers.on_connect,
                     agent.inbound.on_frame, observers.on_close, host,
                     on_fatal=agent.fail, tls_contexts=_tls_contexts(settings),
                     features=handshake.FEATURE_SHM if settings.enable_shm else 0,
                     shm_threshold=settings.shm_threshold,
                     same_host=registry.same_host, same_pids=registry.same_pids,
                     send_timeout=settings.send_timeout,
                     max_outbox=settings.max_outbox_bytes,
                     max_private=agent.lanes.private.max,
                     local_socket=settings.enable_uds,
                     incarnation=registry.incarnation,
                     admit=registry.admit if agent.elastic else None,
                     connection_type=agent.connection_type,
                     tensor_mac=settings.tensor_mac)


def _tls_contexts(settings: Settings) -> Optional[TlsContexts]:
    if not settings.tls_certfile:
        return None
    return make_contexts(settings.tls_certfile, settings.tls_keyfile, settings.tls_cafile,
                         settings.tls_require_client_cert, settings.tls_identity)
