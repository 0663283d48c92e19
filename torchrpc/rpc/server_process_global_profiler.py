"""``torch.distributed.rpc.server_process_global_profiler``: profile what a worker serves."""

from __future__ import annotations

import itertools
from typing import Any, List

from torch.autograd import profiler_legacy
from torch.autograd.profiler_util import EventList, FunctionEvent

from .. import _profiler
from .._profiler.events import Options

__all__: List[str] = []


class _server_process_global_profile(profiler_legacy.profile):
    r"""The API of ``torch.autograd.profiler_legacy.profile``, profiling the handling of
    every RPC request this process serves, on whichever thread serves it.

    While it is entered, each request that arrives is profiled from the moment its
    handler starts until it returns (for an ``@async_execution`` function, with the
    remote events of RPCs that finished before its future did). Profiles may be
    nested: each one sees the requests that arrived while it was entered. Usually
    made and driven over RPC, as in the example.

    Args:
        enabled (bool, optional): ``False`` makes this context manager a no-op.
            Default: ``True``.
        use_cuda (bool, optional): accepted for compatibility; requests are profiled
            on the CPU.
        record_shapes (bool, optional): record the input shapes of operators.
            Default: ``False``.
        profile_memory (bool, optional): record memory allocated by operators.
            Default: ``False``.

    Attributes (set on exit):
        function_events (torch.autograd.profiler_util.EventList): the events of all
            requests, on one clock (microseconds since ``__enter__``), for ``table()``,
            ``key_averages()`` and the like.
        process_global_function_events (List[List[FunctionEvent]]): the events of each
            request, one list per request, sorted by start time.

    Example::
        >>> # On worker 0:
        >>> x, y = torch.tensor(1), torch.tensor(2)
        >>> outer_profile_rref = rpc.remote(dst_worker_name, rpc._server_process_global_profile)
        >>> outer_profile_rref.rpc_sync().__enter__()
        >>> rpc.rpc_sync(dst_worker_name, torch.add, (x, y))
        >>> inner_profile_rref = rpc.remote(dst_worker_name, rpc._server_process_global_profile)
        >>> inner_profile_rref.rpc_sync().__enter__()
        >>> rpc.rpc_sync(dst_worker_name, torch.sub, (x, y))
        >>> inner_profile_rref.rpc_sync().__exit__(None, None, None)
        >>> outer_profile_rref.rpc_sync().__exit__(None, None, None)
        >>> print(inner_profile_rref.rpc_sync().key_averages())  # aten::sub
        >>> print(outer_profile_rref.rpc_sync().key_averages())  # aten::sub and aten::add
    """

    def __enter__(self) -> "_server_process_global_profile":
        """Start profiling every request this process serves."""
        if not self.enabled:
            return self
        if self.entered:
            raise RuntimeError("autograd profiler traces are not reentrant")
        self.entered = True
        self._collector = _profiler.start_server_profile(Options(
            bool(self.record_shapes), bool(self.profile_memory), bool(self.with_stack),
            bool(self.with_flops)))
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> bool:
        """Stop profiling; set ``function_events`` and ``process_global_function_events``."""
        if not self.enabled:
            return False
        requests = _profiler.stop_server_profile(self._collector)
        for events in requests:
            events.sort(key=_start_then_longest)
        self.process_global_function_events: List[List[FunctionEvent]] = requests
        flat = sorted(itertools.chain.from_iterable(requests), key=_start_then_longest)
        self.function_events = EventList(flat, use_device=None,
                                         profile_memory=self.profile_memory,
                                         with_flops=self.with_flops)
        self.function_events._build_tree()
        return False


def _start_then_longest(event: FunctionEvent) -> List[float]:
    """Sort key: by start time, the enclosing event first (as torch sorts events)."""
    return [event.time_range.start, -event.time_range.end]
