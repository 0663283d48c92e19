"""torchrpc.rpc: the RPC API of ``torch.distributed.rpc``, on torchrpc's own agent.

Port by changing the import: ``import torchrpc.rpc as rpc``.
"""

from .._agent import WorkerInfo
from . import backend_registry, constants, functions
from . import api, internal
from .api import (_get_current_rpc_agent, _get_debug_info, _init_rpc_backend,
                  _is_current_rpc_agent_set, _rref_context_get_debug_info)
from .api import (_set_rpc_timeout, enable_gil_profiling, get_debug_info, get_rpc_timeout,
                  get_worker_info, get_worker_infos, init_rpc, is_available, remote, rpc_async,
                  rpc_sync, shutdown)
from .api import all_gather, barrier, rpc_async_many, rpc_sync_many  # beyond torch
from .._agent.observer import snapshot  # beyond torch: see python -m torchrpc.inspect
from .._rref import RRef
from .backend_registry import BackendType, register_backend
from .options import RpcBackendOptions, TensorPipeRpcBackendOptions
from .server_process_global_profiler import _server_process_global_profile
from .._agent import Agent as TensorPipeAgent  # the agent every TENSORPIPE backend runs

__all__ = [
    "BackendType", "RRef", "TensorPipeAgent", "RpcBackendOptions", "TensorPipeRpcBackendOptions", "WorkerInfo",
    "backend_registry", "constants", "enable_gil_profiling", "functions", "get_debug_info",
    "get_rpc_timeout", "get_worker_info", "get_worker_infos", "init_rpc", "is_available",
    "register_backend", "remote", "rpc_async", "rpc_sync", "shutdown",
    # beyond torch.distributed.rpc
    "all_gather", "barrier", "rpc_async_many", "rpc_sync_many", "snapshot",
]
