"""Internals of ``torch.distributed.rpc.internal`` that user and test code reach for.

The execution modes, the profiling key format, the pickled form of a Python call and
the RPC pickler, all on torchrpc's own wire format.
"""

from __future__ import annotations

import collections
import enum
from typing import Any, Callable, List, Tuple

import torch

from .. import _profiler
from .._agent import MessageContext
from .._wire import PassThrough
from .._wire import serialize as _wire


class RPCExecMode(enum.Enum):
    """How a call was made; its value names the call in profiling keys."""

    SYNC = "sync"
    ASYNC = "async"
    ASYNC_JIT = "async_jit"
    REMOTE = "remote"


# A Python call as it is pickled: the function and its arguments.
PythonUDF = collections.namedtuple("PythonUDF", ["func", "args", "kwargs"])
# A remote exception that could not be rebuilt on the caller: its message and type.
RemoteException = collections.namedtuple("RemoteException", ["msg", "exception_type"])


def _build_rpc_profiling_key(exec_type: RPCExecMode, func_name: str, current_worker_name: str,
                             dst_worker_name: str) -> str:
    """The profiler event name of an RPC: ``rpc_<mode>#<func>(<caller> -> <callee>)``."""
    return _profiler.profiling_key(exec_type.value, func_name, current_worker_name,
                                   dst_worker_name)


class _InternalRPCPickler:
    """Pickles Python objects for RPC: tensors travel beside the pickle, not inside it."""

    def serialize(self, obj: Any) -> Tuple[bytes, List[torch.Tensor]]:
        """Return the pickled ``obj`` and the tensors that carry its buffers."""
        envelope, views, _ = _wire.encode(obj)
        return envelope, [torch.frombuffer(bytearray(v), dtype=torch.uint8) if len(v)
                          else torch.empty(0, dtype=torch.uint8) for v in views]

    def deserialize(self, binary_data: bytes, tensor_table: List[torch.Tensor]) -> Any:
        """Rebuild the object :meth:`serialize` returned ``binary_data`` and ``tensor_table`` for."""
        return _wire.decode(binary_data, list(tensor_table))[1]

    def _register_reducer(self, obj_class: type, reducer: Callable[[Any], Tuple[Any, ...]]) -> None:
        """Pickle exact instances of ``obj_class`` in RPC messages as ``reducer(obj)`` says."""
        _wire.register_reducer(obj_class, reducer)


_internal_rpc_pickler = _InternalRPCPickler()


def _register_rpc_reducer(cls: type, reducer: Callable[[Any], Tuple[Any, ...]]) -> None:
    """Pickle instances of ``cls`` and its subclasses in RPC messages as ``reducer(obj)``
    says; anywhere else (plain pickle, a tool's encode), as their own reduction says."""
    def reduce(obj: Any, context: Any) -> Any:
        return reducer(obj) if isinstance(context, MessageContext) else NotImplemented

    _wire.register_message_reducer(cls, reduce)


# Raised by pickling code to make the RPC's encoding raise the wrapped error itself.
_PassThrough = PassThrough


def serialize(obj: Any) -> Tuple[bytes, List[torch.Tensor]]:
    """``obj`` pickled by the RPC pickler: the bytes and the tensor table."""
    return _internal_rpc_pickler.serialize(obj)


def deserialize(binary_data: bytes, tensor_table: List[torch.Tensor]) -> Any:
    """The inverse of :func:`serialize`."""
    return _internal_rpc_pickler.deserialize(binary_data, tensor_table)


__all__ = ["PythonUDF", "RPCExecMode", "RemoteException", "deserialize", "serialize"]
