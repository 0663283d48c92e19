"""What an agent tells about itself: its counters, and reports after a timeout.

``debug_info`` gathers the agent's and the transport's counters (``get_debug_info``'s
``agent.*`` keys), the layers' and the traffic by peer. With
``log_debug_info_on_timeout``, :class:`TimeoutReports` logs this worker's debug info when
a call times out, and the callee's once it answers.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch

from .._wire import Kind
from ..errors import ClosedError
from .current import current_agent
from .hooks import describe
from .stats import PeerStats
from .pool import WorkerPool
from .worker import WorkerInfo

Counters = Callable[[], Dict[str, Any]]

log = logging.getLogger(__name__)

_REPORT_TIMEOUT = 5.0  # seconds a callee has to send its debug info after a timeout


def debug_info_here() -> Dict[str, Any]:
    """The debug info of the worker this runs on (the target of ``get_debug_info(to)``)."""
    return current_agent().debug_info()


def debug_info(own: Counters, sources: Dict[str, Counters], peers: Counters,
               layer: Optional[str] = None) -> Dict[str, Any]:
    """The agent's counters (``own()``, the agent's and the transport's), every layer's
    (``sources``: layer name -> its counters) and the traffic by peer (``peers()``); of
    one layer when ``layer`` is given (``"agent"`` for the agent's own)."""
    if layer is not None and layer != "agent":
        source = sources.get(layer)
        return source() if source is not None else {}
    info = own()
    if layer is None:
        for source in sources.values():
            info.update(source())
        info["peers"] = peers()
    elif "agent" in sources:  # counters upper layers keep for the agent
        info.update(sources["agent"]())
    return info


def peer_stats(stats: List[Tuple[int, PeerStats]], names: Dict[int, str]
               ) -> Dict[str, Dict[str, Any]]:
    """Traffic counters by peer name (``stats`` by rank, ``names`` of the ranks): calls,
    bytes and errors both ways, and the p50 and p99 latency of the last calls (see
    :class:`~torchrpc._agent.stats.PeerStats`)."""
    return {names.get(rank, f"rank{rank}"): s.as_dict() for rank, s in sorted(stats)}


def as_json(info: Dict[str, Any]) -> str:
    return json.dumps(info, sort_keys=True, default=str)


class TimeoutReports:
    """log_debug_info_on_timeout: one report per callee at a time, so a burst of
    timeouts logs once."""

    def __init__(self, name: str, pool: WorkerPool, debug_info: Counters,
                 request: Callable[..., torch.futures.Future], enabled: bool) -> None:
        self._name = name
        self._pool = pool
        self._debug_info = debug_info  # this worker's
        self._request = request  # Agent.request
        self.enabled = enabled
        self._running: Set[int] = set()  # ranks whose debug info is being fetched

    def report(self, dst: WorkerInfo, what: Any, timeout: float) -> None:
        """Log this worker's debug info and, when it answers within a few seconds, the
        callee's; on the pool, so the timer never waits for it."""
        if dst.id in self._running:
            return
        self._running.add(dst.id)
        try:
            self._pool.submit(self._log, dst, what, timeout)
        except ClosedError:  # the pool has stopped: so has the agent
            self._running.discard(dst.id)

    def _log(self, dst: WorkerInfo, what: Any, timeout: float) -> None:
        name = self._name
        log.warning("%s: the call to %s of %s timed out after %g s; debug info of %s: %s",
                    name, dst.name, describe(what), timeout, name, as_json(self._debug_info()))

        def answered(fut: torch.futures.Future) -> None:
            self._running.discard(dst.id)
            try:
                info = fut.wait()
            except Exception as exc:  # noqa: BLE001 - best effort: say why there is none
                log.warning("%s: no debug info from %s after its call timed out: %s",
                            name, dst.name, exc)
            else:
                log.warning("%s: debug info of %s, whose call timed out: %s", name,
                            dst.name, as_json(info))

        try:
            fut = self._request(dst, Kind.CALL, (debug_info_here, (), {}), _REPORT_TIMEOUT,
                                what=debug_info_here)
        except Exception as exc:  # noqa: BLE001 - best effort, as above
            self._running.discard(dst.id)
            log.warning("%s: cannot ask %s for its debug info: %s", name, dst.name, exc)
            return
        fut.add_done_callback(answered)
