"""torchrpc: a distributed RPC framework for PyTorch, compatible with torch.distributed.rpc.

Import mapping::

    torch.distributed.rpc                         -> torchrpc.rpc
    torch.distributed.autograd                    -> torchrpc.autograd
    torch.distributed.optim.DistributedOptimizer  -> torchrpc.optim.DistributedOptimizer
    torch.distributed.nn.RemoteModule             -> torchrpc.nn.RemoteModule
"""

import logging

from . import _platform

_platform.check()  # before any module that needs fcntl or Unix sockets
logging.getLogger("torchrpc").addHandler(logging.NullHandler())

__version__ = "0.1.0"
