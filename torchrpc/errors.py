"""The exception hierarchy of torchrpc.

Every error torchrpc raises is a :class:`RpcError` (a ``RuntimeError``, as in
``torch.distributed.rpc``), except argument errors, which are ``ValueError`` or
``TypeError`` as Python code expects. Remote failures keep the callee's name and
its traceback; timeouts name the callee, the function and the limit.
"""

from __future__ import annotations


class RpcError(RuntimeError):
    """Base class of every runtime error raised by torchrpc."""


class NotInitializedError(RpcError):
    """An API was used before ``init_rpc`` or after ``shutdown``."""


class RendezvousError(RpcError):
    """Workers could not agree on the group: duplicate names or ranks, bad store."""


class ProtocolError(RpcError):
    """A peer broke the wire protocol: bad magic, version, kind or lengths."""


class AuthenticationError(ProtocolError):
    """A peer failed the HMAC handshake; nothing it sent was unpickled."""


class ConnectionLostError(RpcError):
    """The connection to a worker broke (the worker died or the network failed)."""

    def __init__(self, message: str, worker: str | None = None) -> None:
        super().__init__(message)
        self.worker = worker


class WorkerLeftError(ConnectionLostError):
    """The worker shut down and left the group."""


class RpcTimeoutError(RpcError):
    """An RPC ran past its deadline. The message always contains "timed out"."""


class SerializationError(RpcError):
    """An argument or return value could not be pickled or unpickled."""


class ShutdownError(RpcError):
    """Graceful shutdown could not complete (for example a worker is missing)."""


class ThreadFailedError(RpcError):
    """A background thread of torchrpc failed and cannot go on; the agent is unusable."""
