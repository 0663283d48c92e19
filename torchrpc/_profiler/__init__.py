"""Profiler integration: RPCs as profiler events, and the callee's work as remote events.

When a torch profiler is enabled on the caller, every RPC becomes a
``record_function`` event named as torch names it (``torch.distributed.rpc.internal.
_build_rpc_profiling_key``): ``rpc_async#<function>(<caller> -> <callee>)`` (and
``rpc_sync#``, ``rpc_remote#``), where ``<function>`` is ``aten::add`` for a builtin
operator, the qualified name of a TorchScript function and ``__qualname__`` otherwise.
It lasts from the send until the reply, or for ``remote`` until the owner has created
the value. The request then carries the profile's options; the callee profiles the
handler with torch's legacy profiler, recording what the caller records (input shapes,
memory, ...), and returns its events in the reply's metadata. How they reach the
caller's profile depends on the profiler:

- torch's legacy profiler (``torch.autograd.profiler_legacy.profile``, the one torch's
  RPC supports): as torch's own remote events, with ``is_remote``, the callee's rank as
  ``node_id`` and the callee's durations (see :mod:`.events`);
- a Kineto profiler (``torch.profiler.profile``, ``torch.autograd.profiler.profile``),
  only with the backend option ``profile_kineto`` (torch's RPC records nothing under
  Kineto, and ported code may count on it). Kineto takes no foreign events: replayed on the thread that waits for the result, as
  ``record_function`` events of the same names whose ``args`` carry ``node=<callee>``
  and the callee-side CPU time; the profile's parsed events (``events()``,
  ``key_averages()``) then give them the callee's durations, ``is_remote`` and the
  callee's ``node_id`` (see :mod:`.events`), while an exported trace keeps the replays.

Local events of a legacy profile get this worker's rank as ``node_id``, as in torch.
The callee side, including ``rpc._server_process_global_profile``, is in
:mod:`.callee`. With no profiler enabled none of this runs: the RPC calls check
:func:`enabled` once.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Callable, Dict, List, Optional

import torch
from torch.autograd.profiler import record_function
from torch.autograd.profiler_util import FunctionEvent

from .._agent import Agent, CallHook, CallScope, RpcFuture, Slot, WorkerInfo, describe
from .._agent.current import handle
from . import callee, events
from .callee import CalleeScope, ServerProfile
from .events import REMOTE_OP, Call, Options
from .state import state

PROFILING_HOOK: "Slot[ProfilingHook]" = Slot("profiler")
"""Where an agent keeps its profiling hook."""



def enabled() -> bool:
    """Whether RPCs made on this thread are profiled: a legacy profiler is recording on
    it, or a Kineto one and the current agent's ``profile_kineto`` option is on."""
    if not torch.autograd._profiler_enabled():
        return False
    if events.is_legacy():
        return True
    agent = handle.agent
    hook = agent.extensions.get(PROFILING_HOOK) if agent is not None else None
    return hook is not None and hook.kineto


def profiling_key(mode: str, func_name: str, src_name: str, dst_name: str) -> str:
    """The event name of an RPC: ``rpc_<mode>#<func_name>(<src_name> -> <dst_name>)``."""
    return f"rpc_{mode}#{func_name}({src_name} -> {dst_name})"


def function_name(func: Any) -> str:
    """The name torch's RPC profiling gives ``func``: ``aten::add`` for a builtin
    operator, the qualified name of a TorchScript function, ``__qualname__`` otherwise."""
    try:
        builtin = torch.jit._builtins._find_builtin(func)
    except Exception:  # noqa: BLE001 - unhashable callables and the like
        builtin = None
    if builtin:
        return builtin
    if isinstance(func, torch.jit.ScriptFunction):
        return torch._jit_internal._qualified_name(func)
    qualname = getattr(func, "__qualname__", None)
    return qualname if isinstance(qualname, str) else describe(func)


class ProfilingHook(CallHook):
    """Flags the requests of profiled RPCs; profiles requests on the callee (see module docs)."""

    key = "prof"

    def __init__(self, agent: Agent) -> None:
        self._agent = weakref.ref(agent)
        self.kineto = agent.settings.profile_kineto
        self._thread = state().thread  # .pending: the Call being sent on each thread
        self.gil_profiling = False
        self._gil_waits = [0, 0.0]  # samples, total microseconds

    def outgoing_request(self, dst: WorkerInfo, kind: int) -> Any:
        if self.gil_profiling:
            self._sample_gil_wait()
        call = getattr(self._thread, "pending", None)
        if call is None:
            return None
        self._thread.pending = None
        return tuple(call.options), None, call

    def incoming_request(self, src: WorkerInfo, kind: int, meta: Any) -> Optional[CallScope]:
        if self.gil_profiling:
            self._sample_gil_wait()
        servers = callee.server_profiles()
        caller = _options(meta)
        if caller is None and not servers:
            return None
        return CalleeScope(caller, servers)

    def incoming_response(self, src: WorkerInfo, state: Any, meta: Any) -> None:
        if isinstance(state, Call):
            state.receive(meta)
        return None

    def request_failed(self, dst: WorkerInfo, state: Any) -> None:
        if isinstance(state, Call):
            state.receive(None)

    def _sample_gil_wait(self) -> None:
        """Give the GIL up and time how long taking it back takes (torch's GIL wait time)."""
        t0 = time.perf_counter()
        time.sleep(0)
        waits = self._gil_waits
        waits[0] += 1
        waits[1] += (time.perf_counter() - t0) * 1e6

    def debug_info(self) -> Dict[str, Any]:
        """``agent.gil_average_wait_time_us`` once GIL profiling has sampled a wait."""
        samples, total = self._gil_waits
        if not self.gil_profiling or not samples:
            return {}
        return {"agent.gil_average_wait_time_us": total / samples}

    def watch_all(self, on: bool) -> None:
        """Have the agent consult this hook for every request it serves, or stop."""
        agent = self._agent()
        if agent is None:
            return
        on = on or self.gil_profiling
        if on and self not in agent.serve_all:
            agent.serve_all.append(self)
        elif not on and self in agent.serve_all:
            agent.serve_all.remove(self)


def _options(meta: Any) -> Optional[Options]:
    """The caller's options a request carries, or None when it carries none."""
    if isinstance(meta, (tuple, list)) and len(meta) == len(Options._fields):
        return Options(*(bool(v) for v in meta))
    return Options() if meta else None


def _watch_all_requests() -> None:
    """Route every served request to the hooks while a server profile is entered."""
    agent = handle.agent
    hook = agent.extensions.get(PROFILING_HOOK) if agent is not None else None
    if hook is not None:  # an agent installed later watches from its start (install)
        hook.watch_all(bool(callee.server_profiles()))


def enable_gil_profiling(agent: Agent, flag: bool) -> None:
    """Sample, or stop sampling, how long ``agent``'s threads wait for the GIL when they
    send or serve a request (``agent.gil_average_wait_time_us`` in its debug info)."""
    hook = agent.extensions.get(PROFILING_HOOK)
    if hook is None:
        raise RuntimeError(f"worker {agent.name} has no profiling hook")
    hook.gil_profiling = bool(flag)
    hook.watch_all(bool(callee.server_profiles()))


def start_server_profile(options: Options) -> ServerProfile:
    """Profile every request this process serves from now on, on any thread."""
    profile = callee.start_server_profile(options)
    _watch_all_requests()
    return profile


def stop_server_profile(profile: ServerProfile) -> List[List[FunctionEvent]]:
    """Stop ``profile``; the events of each request it collected, one list per request."""
    requests = callee.stop_server_profile(profile)
    _watch_all_requests()
    return requests


class _ProfiledFuture(RpcFuture):
    """The future of a profiled RPC: under Kineto, replays the remote events in the thread
    that waits."""

    _call: Optional[Call] = None

    def wait(self) -> Any:
        try:
            return super().wait()
        finally:
            call, self._call = self._call, None
            if call is not None:
                _replay(call)


def _replay(call: Call) -> None:
    """Record the callee's events of ``call`` as events of this thread (Kineto profiles)."""
    if not enabled():
        return
    for ev in call.events:
        name, start, end = f"{call.name}{REMOTE_OP}{ev[1]}", ev[4], ev[5]
        t0 = time.time_ns()
        with record_function(name, f"node={call.node_id} remote_cpu_time_us={end - start:.1f}"):
            pass
        events.note_replay(name, t0, time.time_ns(), end - start, call.node_id)


def _begin(mode: str, agent: Agent, dst: WorkerInfo, func: Any) -> "tuple[Call, Any]":
    """The profiled RPC's record and its entered ``record_function``."""
    name = profiling_key(mode, function_name(func), agent.name, dst.name)
    legacy = events.is_legacy()
    call = Call(name, dst.id, legacy, events.current_options() if legacy else Options())
    t0 = events.now_us()
    rf = record_function(name)
    rf.__enter__()
    call.window = (t0, events.now_us())
    return call, rf


def profiled(mode: str, agent: Agent, dst: WorkerInfo, func: Any,
             send: Callable[[], torch.futures.Future]) -> torch.futures.Future:
    """Make an RPC with ``send()`` under its profiler event (see module docs).

    ``mode`` is ``"sync"`` or ``"async"``; returns a future of the result that completes
    once the event has ended.
    """
    call, rf = _begin(mode, agent, dst, func)
    state().thread.pending = call
    try:
        fut = send()
    except BaseException:
        rf.__exit__(None, None, None)
        raise
    finally:
        state().thread.pending = None
    ended = rf._call_end_callbacks_on_future(fut)
    rf.__exit__(None, None, None)
    out = _ProfiledFuture()
    out._pool = agent.pool
    if not call.legacy:
        out._call = call

    def relay(f: Any) -> None:
        try:
            out.set_result(f.value())
        except BaseException as exc:  # noqa: BLE001 - delivered through the future
            out.set_exception(exc.with_traceback(None))
    ended.add_done_callback(relay)
    return out


def profiled_remote(agent: Agent, dst: WorkerInfo, func: Any,
                    send: Callable[[Any], Any]) -> Any:
    """Make an ``rpc.remote`` of ``func`` with ``send(func)`` under its profiler event.

    Returns the RRef ``send`` returns, whose ``_get_profiling_future()`` completes once
    the owner has created the value and its events are in.
    """
    call, rf = _begin("remote", agent, dst, func)
    call.done = torch.futures.Future()
    state().thread.pending = call
    try:
        rref = send(func)
    except BaseException:
        rf.__exit__(None, None, None)
        raise
    finally:
        state().thread.pending = None
    ended = rf._call_end_callbacks_on_future(call.done)
    rf.__exit__(None, None, None)
    rref._profiling_future = ended
    return rref


def install(agent: Agent) -> None:
    """Add the profiling hook to ``agent`` (called by ``init_rpc``)."""
    events.install()
    hook = ProfilingHook(agent)
    agent.extensions.install(PROFILING_HOOK, hook)
    agent.add_call_hook(hook)
    agent.add_debug_source("agent", hook.debug_info)
    hook.watch_all(bool(callee.server_profiles()))


__all__ = ["ProfilingHook", "enable_gil_profiling", "enabled", "function_name", "install",
           "profiled", "profiled_remote", "profiling_key", "start_server_profile",
           "stop_server_profile"]
