"""torchrpc over plain TCP with frame MACs off: only to measure what the MACs cost.

Importing this module turns the MACs off for the whole process, so it is meant for a
benchmark worker and nothing else.
"""

from torchrpc._transport import tcp as _tcp_transport

from ._tcp import forward as __getattr__  # noqa: F401 - the rest of torchrpc.rpc
from ._tcp import tcp_options as TensorPipeRpcBackendOptions  # noqa: F401

_tcp_transport._needs_frame_macs = lambda conn: False
