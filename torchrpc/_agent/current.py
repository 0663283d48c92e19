"""The one piece of process state: the handle of the current agent (and what this
process read once for every agent it starts: the launcher's secret; and what upper
layers keep for the process rather than for one agent, in typed slots)."""

from __future__ import annotations

import threading
from typing import Any, Optional

from ..errors import NotInitializedError
from .hooks import Extensions


class _Handle:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        # What the backend's init handler returned: an Agent (agent.py), or a registered
        # third-party backend's agent, which this module knows nothing of.
        self.agent: Optional[Any] = None
        self.was_shut_down = False
        self.last_debug_info: dict = {}
        # TORCHRPC_SECRET, read by the first init_rpc and removed from the environment (so
        # child processes do not inherit it); every later init_rpc of this process uses it.
        self.launcher_secret: Optional[str] = None
        # What a layer keeps for the process, not for one agent (the profiler's tables:
        # torch's profiles outlive agents), each under its owner's Slot.
        self.process = Extensions()


handle = _Handle()


def current_agent(failed_ok: bool = False) -> Any:
    """The running agent, or a RuntimeError that says RPC is not initialized; unless
    ``failed_ok``, the error of an agent whose background thread could not go on."""
    agent = handle.agent
    if agent is None:
        if handle.was_shut_down:
            raise NotInitializedError("RPC has not been initialized: it was shut down on this worker; call "
                                      "torchrpc.rpc.init_rpc() again to use it")
        raise NotInitializedError("RPC has not been initialized; call "
                                  "torchrpc.rpc.init_rpc() first")
    if not failed_ok and hasattr(agent, "check_failure"):  # not a third-party backend's agent
        agent.check_failure()
    return agent
