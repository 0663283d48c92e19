"""The callee side: profile the handling of a request, for its caller and for server profiles.

A request is profiled when its caller was profiling (the request carries the caller's
:class:`~torchrpc._profiler.events.Options`) or while a server profile
(``rpc._server_process_global_profile``) is entered on this worker. One legacy profile
of the handler's thread covers both: the caller gets the events in the reply's
metadata, and each server profile that was entered when the request arrived gets
copies of its own, moved to that profile's clock (torch's trees link the events they
are given, so two profiles must not share event objects).

The profile starts right before the handler runs and stops when it returns; the
events are parsed when the reply is sent, so that the remote events of RPCs the
handler made and that finished before an ``@async_execution`` result did are part
of them.
"""

from __future__ import annotations

import copy
from typing import Any, List, Optional, Sequence

import torch
from torch.autograd.profiler_util import FunctionEvent, Interval

from .._agent import CallScope
from . import events
from .events import Options
from .state import state


class ServerProfile:
    """The requests a server profile has collected: one list of events per request."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.start_us = events.now_us()
        self.requests: List[List[FunctionEvent]] = []
        self.open = True


def server_profiles() -> List[ServerProfile]:
    """The server profiles entered now (a copy)."""
    st = state()
    with st.lock:
        return list(st.server_profiles)


def start_server_profile(options: Options) -> ServerProfile:
    """Begin collecting every request this process serves."""
    profile = ServerProfile(options)
    st = state()
    with st.lock:
        st.server_profiles.append(profile)
    return profile


def stop_server_profile(profile: ServerProfile) -> List[List[FunctionEvent]]:
    """Stop ``profile``; the events of each request it collected, one list per request."""
    st = state()
    with st.lock:
        profile.open = False
        if profile in st.server_profiles:
            st.server_profiles.remove(profile)
        return list(profile.requests)


class CalleeScope(CallScope):
    """Profiles one request on the callee (see module docs)."""

    def __init__(self, caller: Optional[Options], servers: Sequence[ServerProfile]) -> None:
        self._caller = caller
        self._servers = list(servers)
        self._records: Optional[List[List[Any]]] = None
        self._on = False

    def __enter__(self) -> "CalleeScope":
        if torch.autograd._profiler_enabled():
            return self  # this thread profiles already: its events go there
        options = self._caller or Options()
        for server in self._servers:
            options = options.union(server.options)
        torch._C._autograd._enable_profiler_legacy(options.config())
        events.set_options(options)  # for the RPCs the handler makes
        self._on = True
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._on:
            self._on = False
            events.set_options(None)
            self._records = torch._C._autograd._disable_profiler_legacy()

    def response_meta(self) -> Any:
        """For the caller: (microseconds profiled, events); delivers the server profiles'."""
        records, self._records = self._records, None
        if records is None:
            return None
        functions, base = events.parse(records)
        for server in self._servers:
            shift = base - server.start_us if base is not None else 0.0
            copies = [_moved(e, shift) for e in functions]  # on the server profile's clock
            with state().lock:
                if server.open and copies:
                    server.requests.append(copies)
        if self._caller is None:
            return None
        span = max((e.time_range.end for e in functions), default=0.0)
        return span, events.to_wire(functions)


def _moved(event: FunctionEvent, shift: float) -> FunctionEvent:
    """A copy of an event not yet in a tree, ``shift`` microseconds later."""
    moved = copy.copy(event)
    moved.time_range = Interval(event.time_range.start + shift, event.time_range.end + shift)
    moved.kernels = list(event.kernels)
    moved.cpu_children = []
    moved.cpu_parent = None
    return moved
