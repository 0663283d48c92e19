"""Test helpers; the counterpart of torch's ``torch.distributed.rpc._testing``: importing
it registers the fault-injecting ``FAULTY_TENSORPIPE`` backend (see :mod:`.faulty`)."""

from .faulty import FaultyAgent as FaultyTensorPipeAgent
from .faulty import FaultyTensorPipeRpcBackendOptions

__all__ = ["FaultyTensorPipeAgent", "FaultyTensorPipeRpcBackendOptions", "is_available"]


def is_available() -> bool:
    """Whether the faulty backend can be used (always, in torchrpc)."""
    return True
