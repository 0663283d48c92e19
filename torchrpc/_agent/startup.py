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
from typing import TYPE_CHECKING, Any, Dict, Optional

from .._transport import Transport, handshake
from .._transport.tls import TlsContexts, make_contexts
from ..errors import RendezvousError, RpcError
from . import devices, membership, rendezvous
from .secret import discard_local as discard_local_secret
from .shutdown import RUNNING

if TYPE_CHECKING:
    from .agent import Agent

log = logging.getLogger(__name__)


def start(agent: "Agent", plan: rendezvous.Plan) -> None:
    """Rendezvous with the group under ``plan``, start listening and the agent's threads."""
    store, rank, registry = agent.store, agent.rank, agent.registry
    host = rendezvous.listen_host(agent.options.init_method,
                                  getattr(agent.options, "listen_addr", None))
    if agent.elastic:
        secret = rendezvous.job_secret(store, rank, plan,
                                       keep=membership.outlives_rank0(agent.options.init_method))
        store = agent.store = rendezvous.Records(store, secret, membership.PREFIX)
        registry.log = membership.EventLog(store)
        membership.join(store, agent.name, rank, plan, registry.incarnation, registry.log)
    else:
        secret = rendezvous.job_secret(store, rank, plan, agent.world_size)
        store = agent.store = rendezvous.Records(store, secret, rendezvous.PREFIX)
        rendezvous.claim(store, agent.name, rank, agent.world_size, plan)
    try:
        agent._transport = _transport(agent, secret, host)
    except ValueError as exc:
        _failed(agent, exc)
        raise
    except RpcError as exc:
        raise _failed(agent, exc) from exc
    announced = False
    try:
        # Peers watch this worker for silence only if they know it sends heartbeats.
        facts: Dict[str, Any] = {"heartbeat_interval": agent.liveness.interval,
                                 **devices.facts(registry.device_maps,
                                                 list(getattr(agent.options, "devices", ())))}
        if agent.elastic:
            membership.announce(store, agent.name, rank, agent._transport.address, facts,
                                registry.incarnation)
            announced = True
            registry.log.poll()
            infos = dict(registry.log.current)
        else:
            infos = rendezvous.publish(store, agent.name, rank, agent.world_size,
                                       agent._transport.address, plan, facts)
            discard_local_secret()  # every rank has joined, so has read it
        devices.check(infos, static=not agent.elastic)
    except BaseException:
        agent._transport.close()
        if agent.elastic:
            _undo_join(agent, announced)
        raise
    for r, info in infos.items():
        registry.add(r, info)
    agent.shutdown_protocol.enter(RUNNING)
    agent.scheduler.start(agent._start_thread)
    if agent.elastic:
        registry.follow()
    agent.liveness.start()
    log.info("worker %s (rank %d of %s) listening on %s:%d%s", agent.name, rank,
             agent.world_size, *agent._transport.address,
             " (TLS)" if getattr(agent.options, "tls_certfile", None) else "")


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


def _transport(agent: "Agent", secret: bytes, host: str) -> Transport:
    """The transport of ``agent``, listening on ``host``, its parts as the callbacks."""
    options, registry = agent.options, agent.registry
    return Transport(agent.rank, secret, agent._limits, agent.connections.on_connect,
                     agent.inbound.on_frame, agent.connections.on_close, host,
                     on_fatal=agent.fail, tls_contexts=_tls_contexts(options),
                     features=_features(options),
                     shm_threshold=int(getattr(options, "shm_threshold", 0)),
                     same_host=registry.same_host, same_pids=registry.same_pids,
                     send_timeout=float(getattr(options, "send_timeout", 0.0)),
                     max_outbox=int(getattr(options, "max_outbox_bytes", 0)),
                     max_private=agent.lanes.private.max,
                     local_socket=bool(getattr(options, "enable_uds", False)),
                     incarnation=registry.incarnation,
                     admit=registry.admit if agent.elastic else None,
                     connection_type=agent.connection_type,
                     tensor_mac=bool(getattr(options, "tensor_mac", True)))


def _features(options: Any) -> int:
    return handshake.FEATURE_SHM if getattr(options, "enable_shm", False) else 0


def _tls_contexts(options: Any) -> Optional[TlsContexts]:
    if not getattr(options, "tls_certfile", None):
        return None
    return make_contexts(options.tls_certfile, options.tls_keyfile, options.tls_cafile,
                         options.tls_require_client_cert, getattr(options, "tls_identity", None))
