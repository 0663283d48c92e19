"""What an agent tells about itself: its counters, and reports after a timeout.

``debug_info`` gathers the agent's and the transport's counters (``get_debug_info``'s
``agent.*`` keys), the layers' and the traffic by peer. With
``log_debug_info_on_timeout``, :class:`TimeoutReports` logs this worker's debug info when
a call times out, and the callee's once it answers.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, Dict, Optional, Set

import torch

from .._wire import Kind
from ..errors import ClosedError
from .current import current_agent
from .hooks import describe
from .worker import WorkerInfo

if TYPE_CHECKING:
    from .agent import Agent

log = logging.getLogger(__name__)

_REPORT_TIMEOUT = 5.0  # seconds a callee has to send its debug info after a timeout


def debug_info_here() -> Dict[str, Any]:
    """The debug info of the worker this runs on (the target of ``get_debug_info(to)``)."""
    return current_agent().debug_info()


def debug_info(agent: "Agent", layer: Optional[str] = None) -> Dict[str, Any]:
    """Counters of ``agent`` and every layer; of one layer when ``layer`` is given
    (``"agent"`` for the agent's and the transport's own)."""
    sources = agent._debug_sources
    if layer is not None and layer != "agent":
        source = sources.get(layer)
        return source() if source is not None else {}
    info = counters(agent)
    if layer is None:
        for source in sources.values():
            info.update(source())
        info["peers"] = peer_stats(agent)
    elif "agent" in sources:  # counters upper layers keep for the agent
        info.update(sources["agent"]())
    return info


def peer_stats(agent: "Agent") -> Dict[str, Dict[str, Any]]:
    """Traffic counters by peer name: calls, bytes and errors both ways, and the p50
    and p99 latency of the last calls (see :class:`~torchrpc._agent.stats.PeerStats`)."""
    with agent._lock:
        stats = list(agent._peer_stats.items())
        names = {rank: w.name for rank, w in agent.registry.workers.items()}
    return {names.get(rank, f"rank{rank}"): s.as_dict() for rank, s in sorted(stats)}


def counters(agent: "Agent") -> Dict[str, Any]:
    """The counters of ``agent`` and of its transport."""
    pool, probes, transport = agent.pool, agent.calls.probes, agent._transport
    info: Dict[str, Any] = {
        "agent.num_pending_requests": len(agent.requests.pending),
        "agent.thread_pool_size": int(agent.options.num_worker_threads),
        "agent.num_threads_started": pool.num_threads,
        "agent.num_idle_threads": pool.num_threads - pool.num_pending,
        "agent.num_queued_tasks": pool.num_pending,
        "agent.num_connections": agent.connections.count(),
        "agent.num_private_connections": agent.lanes.private.num_idle(),
        "agent.num_parked": agent.lanes.num_parked,
        "agent.num_heartbeat_timeouts": agent.liveness.heartbeat_timeouts,
        "agent.num_duplicate_requests": agent.dispatch.duplicates,
        "agent.num_remembered_requests": len(agent.dispatch.once),
        "agent.num_kept_replies": agent.dispatch.kept_replies(),
        "agent.num_once_probes": probes.sent,
        "agent.num_resends_avoided": probes.resends_avoided,
        "agent.num_resends_after_probe": probes.resends_after_probe,
        "agent.max_outbox_bytes_queued": max(
            (c.outbox_bytes for c in transport.connections()), default=0)
        if transport is not None else 0,
        "agent.state": agent._state.value if agent.failure is None else "failed",
    }
    if transport is not None:
        info.update(transport.debug_info())
    return info


def as_json(info: Dict[str, Any]) -> str:
    return json.dumps(info, sort_keys=True, default=str)


class TimeoutReports:
    """log_debug_info_on_timeout: one report per callee at a time, so a burst of
    timeouts logs once."""

    def __init__(self, agent: "Agent", enabled: bool) -> None:
        self._agent = agent
        self.enabled = enabled
        self._running: Set[int] = set()  # ranks whose debug info is being fetched

    def report(self, dst: WorkerInfo, what: Any, timeout: float) -> None:
        """Log this worker's debug info and, when it answers within a few seconds, the
        callee's; on the pool, so the timer never waits for it."""
        if dst.id in self._running:
            return
        self._running.add(dst.id)
        try:
            self._agent.pool.submit(self._log, dst, what, timeout)
        except ClosedError:  # the pool has stopped: so has the agent
            self._running.discard(dst.id)

    def _log(self, dst: WorkerInfo, what: Any, timeout: float) -> None:
        agent = self._agent
        log.warning("%s: the call to %s of %s timed out after %g s; debug info of %s: %s",
                    agent.name, dst.name, describe(what), timeout, agent.name,
                    as_json(agent.debug_info()))

        def answered(fut: torch.futures.Future) -> None:
            self._running.discard(dst.id)
            try:
                info = fut.wait()
            except Exception as exc:  # noqa: BLE001 - best effort: say why there is none
                log.warning("%s: no debug info from %s after its call timed out: %s",
                            agent.name, dst.name, exc)
            else:
                log.warning("%s: debug info of %s, whose call timed out: %s", agent.name,
                            dst.name, as_json(info))

        try:
            fut = agent.request(dst, Kind.CALL, (debug_info_here, (), {}), _REPORT_TIMEOUT,
                                what=debug_info_here)
        except Exception as exc:  # noqa: BLE001 - best effort, as above
            self._running.discard(dst.id)
            log.warning("%s: cannot ask %s for its debug info: %s", agent.name, dst.name, exc)
            return
        fut.add_done_callback(answered)
