"""torch's ``torch.distributed.rpc._testing``: importing it registers the fault-injecting
``FAULTY_TENSORPIPE`` backend (see :mod:`torchrpc._testing.faulty`)."""

from ..._testing.faulty import FaultyAgent as FaultyTensorPipeAgent
from ..._testing.faulty import FaultyTensorPipeRpcBackendOptions

__all__ = ["FaultyTensorPipeAgent", "FaultyTensorPipeRpcBackendOptions", "is_available"]


def is_available() -> bool:
    """Whether the faulty backend can be used (always, in torchrpc)."""
    return True
