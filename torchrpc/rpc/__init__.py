"""torchrpc.rpc: the RPC API of ``torch.distributed.rpc``, on torchrpc's own agent.

Port by changing the import: ``import torchrpc.rpc as rpc``.
"""

from .._agent import WorkerInfo
from . import backend_registry, constants, functions
from .api import (_set_rpc_timeout, get_debug_info, get_rpc_timeout, get_worker_info,
                  get_worker_infos, init_rpc, is_available, remote, rpc_async, rpc_sync,
                  shutdown)
from .._rref import RRef
from .backend_registry import BackendType, register_backend
from .options import RpcBackendOptions, TensorPipeRpcBackendOptions

__all__ = [
    "BackendType", "RRef", "RpcBackendOptions", "TensorPipeRpcBackendOptions", "WorkerInfo",
    "backend_registry", "constants", "functions", "get_debug_info", "get_rpc_timeout",
    "get_worker_info", "get_worker_infos", "init_rpc", "is_available", "register_backend",
    "remote", "rpc_async", "rpc_sync", "shutdown",
]
