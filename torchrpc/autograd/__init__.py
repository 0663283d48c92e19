"""torchrpc.autograd: the API of ``torch.distributed.autograd``, on torchrpc's agent.

Port by changing the import: ``import torchrpc.autograd as dist_autograd``.
"""

from .._dist_autograd.api import backward, context, get_gradients, is_available

__all__ = ["backward", "context", "get_gradients", "is_available"]
