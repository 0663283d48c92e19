"""Distributed autograd: contexts, send/recv records and FAST-mode backward over the agent.

See :mod:`torchrpc._dist_autograd.engine` for the theory of operation.
"""

from .api import backward, backward_rref, context, get_gradients, is_available
from .records import DistAutogradContext, RecvRpc
from .engine import ENGINE, DistAutogradEngine, engine_of, install

__all__ = ["DistAutogradContext", "DistAutogradEngine", "ENGINE", "RecvRpc", "backward",
           "backward_rref", "context", "engine_of", "get_gradients", "install", "is_available"]
