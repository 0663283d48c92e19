"""Profiler integration: RPCs as profiler events, and the callee's operators as remote events.

When torch's profiler (``torch.profiler.profile`` or the legacy
``torch.autograd.profiler.profile``) is enabled on the caller, every RPC becomes a
``record_function`` event named as torch names it,
``rpc_async#<qualified function name>(<caller> -> <callee>)`` (``rpc_sync#``,
``rpc_remote#``), lasting from the send until the reply. The request then carries a
flag; the callee profiles the handler and returns its operator events in the reply's
metadata. They are replayed on the caller's thread when the caller waits for the
result, as events named ``<rpc event>#remote_op: <operator>`` whose ``args`` carry
``node=<callee>`` and the callee-side CPU time (the replayed events' own duration is
not the remote one).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch.autograd import profiler_legacy
from torch.autograd.profiler import record_function

from .._agent import Agent, CallHook, CallScope, RpcFuture, WorkerInfo, describe

_MAX_EVENTS = 256
_local = threading.local()


def enabled() -> bool:
    """Whether a torch profiler is recording on this thread."""
    return torch.autograd._profiler_enabled()


class RemoteEvents:
    """The caller's record of one profiled RPC: its event name and the callee's operators."""

    __slots__ = ("name", "worker", "events", "emitted")

    def __init__(self, name: str, worker: str) -> None:
        self.name = name
        self.worker = worker
        self.events: List[Tuple[str, float]] = []
        self.emitted = False

    def emit(self) -> None:
        """Replay the callee's operators as events on the current thread (once)."""
        if self.emitted or not enabled():
            return
        self.emitted = True
        for op, cpu_us in self.events:
            with record_function(f"{self.name}#remote_op: {op}",
                                 f"node={self.worker} remote_cpu_time_us={cpu_us:.1f}"):
                pass


class _CalleeScope(CallScope):
    """Profiles one request on the callee and returns its operator events."""

    def __init__(self) -> None:
        self._prof: Optional[profiler_legacy.profile] = None
        self._events: List[Tuple[str, float]] = []

    def __enter__(self) -> "_CalleeScope":
        if not enabled():
            # The legacy (non-kineto) profiler: thread-local and safe on pool threads,
            # where starting kineto can abort the process.
            self._prof = profiler_legacy.profile()
            self._prof.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._events = [(e.name, float(e.cpu_time_total))
                            for e in self._prof.function_events][:_MAX_EVENTS]
            self._prof = None

    def response_meta(self) -> Any:
        return self._events


class ProfilingHook(CallHook):
    """Flags requests made while the caller is profiling; collects the callee's events."""

    key = "prof"

    def outgoing_request(self, dst: WorkerInfo, kind: int) -> Any:
        state = getattr(_local, "pending", None)
        if state is None:
            return None
        _local.pending = None
        return True, None, state

    def incoming_request(self, src: WorkerInfo, kind: int, meta: Any) -> Optional[CallScope]:
        return _CalleeScope() if meta else None

    def incoming_response(self, src: WorkerInfo, state: Any, meta: Any) -> None:
        if isinstance(state, RemoteEvents) and isinstance(meta, list):
            state.events = meta
        return None


class _ProfiledFuture(RpcFuture):
    """The future of a profiled RPC: replays remote events in the thread that waits."""

    _remote: Optional[RemoteEvents] = None

    def wait(self) -> Any:
        try:
            return super().wait()
        finally:
            if self._remote is not None:
                self._remote.emit()


def function_name(func: Any) -> str:
    """The name torch's profiler uses for an RPC target: ``aten::add`` for builtin
    operators, the qualified Python name otherwise."""
    try:
        builtin = torch.jit._builtins._find_builtin(func)
    except Exception:  # noqa: BLE001 - unhashable callables and the like
        builtin = None
    return builtin if builtin else describe(func)


def profiled(prefix: str, agent: Agent, dst: WorkerInfo, func: Any,
             send: Callable[[], Any]) -> Any:
    """Run ``send()`` (which makes the RPC) under an RPC profiler event; see module docs.

    Returns what ``send`` returns; a future is wrapped so its wait replays remote events.
    """
    name = f"{prefix}#{function_name(func)}({agent.name} -> {dst.name})"
    remote = RemoteEvents(name, dst.name)
    rf = record_function(name)
    rf.__enter__()
    _local.pending = remote
    try:
        result = send()
    except BaseException:
        rf.__exit__(None, None, None)
        raise
    finally:
        _local.pending = None
    if not isinstance(result, torch.futures.Future):
        rf.__exit__(None, None, None)
        return result
    ended = rf._call_end_callbacks_on_future(result)
    out = _ProfiledFuture()
    out._pool = agent.pool
    out._remote = remote

    def relay(f: Any) -> None:
        try:
            out.set_result(f.value())
        except BaseException as exc:  # noqa: BLE001 - delivered through the future
            out.set_exception(exc.with_traceback(None))
    ended.add_done_callback(relay)
    return out


def install(agent: Agent) -> None:
    """Add the profiling hook to ``agent`` (called by ``init_rpc``)."""
    agent.add_call_hook(ProfilingHook())
