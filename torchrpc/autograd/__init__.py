"""torchrpc.autograd: the API of ``torch.distributed.autograd``, on torchrpc's agent.

Port by changing the import: ``import torchrpc.autograd as dist_autograd``.
"""

from .._dist_autograd.api import (_current_context, _get_debug_info, _get_max_id, _init,
                                  _is_valid_context, _new_context, _release_context,
                                  _retrieve_context, backward, context, get_gradients,
                                  is_available)
from .._dist_autograd.records import DistAutogradContext
# Held while torchrpc lends a context's gradients to parameters' ``.grad``.
from .._dist_autograd.records import _GRAD_SLOTS as _grad_lock

__all__ = ["backward", "context", "get_gradients", "is_available"]
