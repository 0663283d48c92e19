"""The featureless RPC of :mod:`.floor` whose callers read their ``rpc_async`` replies
themselves, with no reading thread (the ``floor-self`` system of the benchmark)."""

import functools

from . import floor as _floor
from .floor import TensorPipeRpcBackendOptions, rpc_async, rpc_sync, shutdown

init_rpc = functools.partial(_floor.init_rpc, self_read=True)

__all__ = ["TensorPipeRpcBackendOptions", "init_rpc", "rpc_async", "rpc_sync", "shutdown"]
