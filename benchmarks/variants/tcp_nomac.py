"""torchrpc over plain TCP with frame MACs off, for measuring what the MACs cost.

``--define-system
torchrpc-tcp-nomac=benchmarks.variants.tcp_nomac,torchrpc.autograd,torchrpc.optim`` (run
from the repository root) is the bench's ``torchrpc-tcp`` system less the MACs.
Importing this module turns them off for the whole process: it is for a benchmark worker
and nothing else, which is why it lives with the benchmarks and not in the package.
"""

from torchrpc._transport import links as _links
from .tcp import TensorPipeRpcBackendOptions  # noqa: F401
from .tcp import __getattr__  # noqa: F401 - the rest of torchrpc.rpc

_links.needs_frame_macs = lambda conn: False
