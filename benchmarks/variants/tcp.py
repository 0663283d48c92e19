"""torchrpc over plain TCP, frame MACs on (the path between hosts)."""

from ._tcp import forward as __getattr__  # noqa: F401 - the rest of torchrpc.rpc
from ._tcp import tcp_options as TensorPipeRpcBackendOptions  # noqa: F401
