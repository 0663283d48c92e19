"""torchrpc.optim: ``torch.distributed.optim.DistributedOptimizer`` on torchrpc.

Port by changing the import: ``from torchrpc.optim import DistributedOptimizer``.
"""

from .optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
