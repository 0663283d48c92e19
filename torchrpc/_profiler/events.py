"""Remote events in torch's legacy profiler (``torch.autograd.profiler_legacy.profile``).

torch's C++ RPC hands the callee's events to the caller's profiler itself; from Python
the only way in is the step where a profile turns its records into
``FunctionEvent``\\ s. So torchrpc wraps two functions of
``torch.autograd.profiler_legacy`` (once, at the first ``init_rpc``), both of which
pass through unchanged when there is nothing to add:

- ``profile._start_trace`` remembers the options of a profile on the thread that
  starts it (torch keeps them in C++ only), so that a profiled RPC asks the callee to
  record the same (input shapes, memory, stacks, FLOPs);
- ``_parse_legacy_records`` gives local events this worker's rank as ``node_id``, as
  torch does once RPC is initialized, and adds, for every RPC whose event is among
  the records, the callee's events as remote ones (``is_remote``, the callee's
  ``node_id``, its durations, shapes and memory), named
  ``<rpc event>#remote_op: <event>``.

A Kineto profile takes no foreign events: the callee's events are replayed as empty
``record_function`` blocks on the thread that waits for the result (see
:func:`torchrpc._profiler._replay`), and each replay is noted in the profiler state. A
third wrapper, of ``torch.autograd.profiler.profile._parse_kineto_results``, gives each
replayed event found in the parsed events the callee's duration, the callee's rank as
``node_id`` and ``is_remote``; it is marked async, so that its stretched time range
does not make the waiting thread's later events its children.

A finished RPC waits in the process's :class:`~.state.ProfilerState` until the parse of the profile that holds
its event takes it. The event is found by its name and start time: the time window in
which the RPC's ``record_function`` was entered, in the records' clock (wall-clock
microseconds).
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch.autograd import DeviceType, profiler_legacy
from torch.autograd import profiler as torch_profiler
from torch.autograd.profiler_util import MEMORY_EVENT_NAME, FunctionEvent, Interval

from .._agent.current import handle as _current
from .state import MAX_COMPLETED, Replay, state

REMOTE_OP = "#remote_op: "
_WINDOW_SLACK_US = 50.0  # clock granularity allowed around an RPC event's start window
_REPLAY_SLACK_NS = 50_000  # clock granularity allowed around a replay's window


class Options(NamedTuple):
    """What a legacy profile records beyond names and times; sent to the callee."""

    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False

    def union(self, other: "Options") -> "Options":
        """Everything either records."""
        return Options(*(a or b for a, b in zip(self, other)))

    def config(self) -> Any:
        """A CPU ``ProfilerConfig`` for these options."""
        return torch._C._profiler.ProfilerConfig(
            torch._C._profiler.ProfilerState.CPU, self.record_shapes, self.profile_memory,
            self.with_stack, self.with_flops, False, torch._C._profiler._ExperimentalConfig())


# One callee event on the wire: times in microseconds from the callee's profile start.
WireEvent = Tuple[int, str, int, int, float, float, Any, Any, Any, int, int, int, bool, int, Any]


def now_us() -> float:
    """Wall-clock microseconds, the clock of the legacy profiler's records."""
    return time.time_ns() / 1000.0


def is_legacy() -> bool:
    """Whether the profiler enabled on this thread is torch's legacy one."""
    return torch._C._autograd._profiler_type() == torch._C._profiler.ActiveProfilerType.LEGACY


def current_options() -> Options:
    """The options of the legacy profile running on this thread (defaults if unknown)."""
    return getattr(state().thread, "options", None) or Options()


def set_options(options: Optional[Options]) -> None:
    """Record (or, with None, forget) the options of this thread's legacy profile."""
    state().thread.options = options


class Call:
    """One profiled RPC on the caller: its event and, once answered, the callee's events."""

    __slots__ = ("name", "node_id", "legacy", "options", "window", "t_end", "span", "events",
                 "done")

    def __init__(self, name: str, node_id: int, legacy: bool, options: Options) -> None:
        self.name = name
        self.node_id = node_id  # the callee's rank
        self.legacy = legacy  # a legacy profile takes the events; kineto gets replays
        self.options = options
        self.window = (0.0, 0.0)  # when the RPC's record_function was entered (wall us)
        self.t_end = 0.0  # when the reply arrived (wall us)
        self.span = 0.0  # how long the callee profiled, microseconds
        self.events: List[WireEvent] = []
        self.done: Optional[torch.futures.Future] = None  # completed once answered or failed

    def receive(self, meta: Any) -> None:
        """The reply (or the failure, with ``meta`` None) is here: keep the callee's events
        for the parse of the caller's profile. Only the first call counts."""
        if self.t_end:
            return
        self.t_end = now_us()
        if isinstance(meta, tuple) and len(meta) == 2:
            self.span, self.events = float(meta[0]), list(meta[1])
        if self.legacy:
            _add_completed(self)
        if self.done is not None and not self.done.done():
            self.done.set_result(None)


def _add_completed(call: Call) -> None:
    st = state()
    with st.lock:
        st.completed.setdefault(call.name, []).append(call)
        st.order.append(call)
        while len(st.order) > MAX_COMPLETED:
            _drop(st.completed, st.order.popleft())


def _drop(completed: Dict[str, List[Call]], call: Call) -> None:
    """Remove ``call`` from ``completed`` (the state's lock is held)."""
    calls = completed.get(call.name)
    if calls is not None and call in calls:
        calls.remove(call)
        if not calls:
            del completed[call.name]


def _take(name: str, start_us: float) -> Optional[Call]:
    """The finished RPC named ``name`` whose event started at ``start_us``, removed."""
    st = state()
    with st.lock:
        best, best_gap = None, None
        for call in st.completed.get(name, ()):
            lo, hi = call.window
            if lo - _WINDOW_SLACK_US <= start_us <= hi + _WINDOW_SLACK_US:
                gap = abs(start_us - (lo + hi) / 2)
                if best_gap is None or gap < best_gap:
                    best, best_gap = call, gap
        if best is not None:
            _drop(st.completed, best)
            try:
                st.order.remove(best)
            except ValueError:
                pass
        return best


def _rank() -> Optional[int]:
    agent = _current.agent
    return agent.rank if agent is not None else None


def to_wire(functions: Sequence[FunctionEvent]) -> List[WireEvent]:
    """The callee's parsed events as plain tuples for the reply."""
    return [(e.id, e.name, e.node_id, e.thread, e.time_range.start, e.time_range.end,
             e.fwd_thread, e.input_shapes, e.stack, e.scope, e.cpu_memory_usage,
             e.device_memory_usage, e.is_async, e.sequence_nr, e.flops) for e in functions]


def _remote_event(prefix: str, ev: WireEvent, offset: float) -> FunctionEvent:
    (eid, name, node_id, thread, start, end, fwd_thread, shapes, stack, scope, cpu_mem,
     dev_mem, is_async, seq, flops) = ev
    if name != MEMORY_EVENT_NAME:  # top-level memory events keep their name, as in torch
        name = prefix + REMOTE_OP + name
        start, end = start + offset, end + offset
    return FunctionEvent(id=eid, name=name, trace_name=name, thread=thread, start_us=start,
                         end_us=end, fwd_thread=fwd_thread, input_shapes=shapes, stack=stack,
                         scope=scope, cpu_memory_usage=cpu_mem, device_memory_usage=dev_mem,
                         is_async=is_async, is_remote=True, sequence_nr=seq, node_id=node_id,
                         device_type=DeviceType.CPU, is_legacy=True, flops=flops)


def _start_record(thread_records: Sequence[Sequence[Any]]) -> Optional[Any]:
    for records in thread_records:
        for record in records:
            if record.name() == "__start_profile" and not record.is_remote():
                return record
    return None


def add_remote_events(functions: List[FunctionEvent],
                      thread_records: Sequence[Sequence[Any]]) -> Optional[float]:
    """Complete torch's parse of ``thread_records`` into ``functions`` (see module docs).

    Returns the wall-clock start of the profile in microseconds (None without one).
    """
    rank = _rank()
    if rank is not None:
        for event in functions:
            if event.node_id == -1:
                event.node_id = rank
    start = _start_record(thread_records)
    completed = state().completed
    if start is None or not completed:
        return start.start_us() if start is not None else None
    base = start.start_us()
    names = set(completed)
    local = {(e.id, e.name): e for e in functions if e.name in names}
    added: List[FunctionEvent] = []
    for records in thread_records:
        for record in records:
            if record.kind() != "push":
                continue
            name = record.name()
            if name not in names:
                continue
            call = _take(name, record.start_us())
            if call is None:
                continue
            event = local.get((record.handle(), name))
            if event is None:
                # Its end was recorded into a profile already finished (an async
                # callee's nested RPC): the reply's arrival stands for it.
                t0 = start.cpu_elapsed_us(record)
                event = FunctionEvent(id=record.handle(), name=name, trace_name=name,
                                      thread=record.thread_id(), start_us=t0,
                                      end_us=max(call.t_end - base, t0), is_async=True,
                                      node_id=rank if rank is not None else -1,
                                      device_type=DeviceType.CPU, is_legacy=True)
                added.append(event)
            t0, t1 = event.time_range.start, event.time_range.end
            # The callee's events sit in the middle of the RPC: the two clocks are not
            # compared, only the callee's own durations are kept.
            offset = t0 + max((t1 - t0 - call.span) / 2, 0.0)
            added.extend(_remote_event(name, ev, offset) for ev in call.events)
    if added:
        functions.extend(added)
        functions.sort(key=lambda e: [e.time_range.start, -e.time_range.end])
    return base


def parse(thread_records: Sequence[Sequence[Any]]) -> Tuple[List[FunctionEvent], Optional[float]]:
    """torch's parse of legacy records plus :func:`add_remote_events`; the events and the
    profile's wall-clock start in microseconds."""
    functions = _torch_parse(thread_records)
    return functions, add_remote_events(functions, thread_records)


_torch_parse = profiler_legacy._parse_legacy_records
_torch_start_trace = profiler_legacy.profile._start_trace
_torch_parse_kineto = torch_profiler.profile._parse_kineto_results


def note_replay(name: str, t0_ns: int, t1_ns: int, duration_us: float, node_id: int) -> None:
    """A callee event was replayed into a Kineto profile between ``t0_ns`` and ``t1_ns``."""
    st = state()
    with st.lock:
        st.replayed.append((name, t0_ns, t1_ns, duration_us, node_id))


def give_durations(functions: List[FunctionEvent], trace_start_ns: int) -> None:
    """Give the replayed remote events among ``functions`` (times in microseconds from
    ``trace_start_ns``) the durations they had on the callee."""
    st = state()
    with st.lock:
        pending = list(st.replayed)
    if not pending:
        return
    by_name: Dict[str, List[Replay]] = {}
    for replay in pending:
        by_name.setdefault(replay[0], []).append(replay)
    used = set()
    for fe in functions:
        candidates = by_name.get(fe.name) if REMOTE_OP in fe.name else None
        if not candidates:
            continue
        start_ns = trace_start_ns + fe.time_range.start * 1000.0
        for i, replay in enumerate(candidates):
            if replay[1] - _REPLAY_SLACK_NS <= start_ns <= replay[2] + _REPLAY_SLACK_NS:
                del candidates[i]
                used.add(id(replay))
                fe.time_range = Interval(fe.time_range.start, fe.time_range.start + replay[3])
                fe.is_async = True
                fe.is_remote = True
                fe.node_id = replay[4]
                break
    if used:
        with st.lock:
            kept = [r for r in st.replayed if id(r) not in used]
            st.replayed.clear()
            st.replayed.extend(kept)


def _parse_kineto_results(self: Any, result: Any, *args: Any, **kwargs: Any) -> List[FunctionEvent]:
    """torch's ``profile._parse_kineto_results``, with the callee's durations given to the
    replayed remote events."""
    functions = _torch_parse_kineto(self, result, *args, **kwargs)
    if state().replayed:
        give_durations(functions, result.trace_start_ns())
    return functions


def _parse_legacy_records(thread_records: Sequence[Sequence[Any]]) -> List[FunctionEvent]:
    """torch's ``_parse_legacy_records``, with the remote events of RPCs added."""
    set_options(None)  # the profile of this thread is over
    return parse(thread_records)[0]


def _start_trace(self: Any) -> None:
    """torch's ``profile._start_trace``, remembering the profile's options first."""
    set_options(Options(bool(self.record_shapes), bool(self.profile_memory),
                        bool(self.with_stack), bool(self.with_flops)))
    _torch_start_trace(self)


def install() -> None:
    """Wrap torch's three functions (see module docs); idempotent."""
    if profiler_legacy._parse_legacy_records is _parse_legacy_records:
        return
    _parse_legacy_records.__wrapped__ = _torch_parse  # type: ignore[attr-defined]
    _start_trace.__wrapped__ = _torch_start_trace  # type: ignore[attr-defined]
    _parse_kineto_results.__wrapped__ = _torch_parse_kineto  # type: ignore[attr-defined]
    profiler_legacy._parse_legacy_records = _parse_legacy_records
    profiler_legacy.profile._start_trace = _start_trace
    torch_profiler.profile._parse_kineto_results = _parse_kineto_results
