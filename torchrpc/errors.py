"""The exception hierarchy of torchrpc.

Every error torchrpc raises is a :class:`RpcError` (a ``RuntimeError``, as in
``torch.distributed.rpc``). Where torch raises ``RuntimeError`` for a bad argument,
ours is also a ``ValueError`` or ``TypeError`` (:class:`InvalidArgumentError`,
:class:`WrongTypeError`), so both ported code and plain Python code catch it. Where
torch raises ``TypeError``, so does torchrpc. Remote failures keep the callee's name
and its traceback; timeouts name the callee, the function and the limit.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Tuple, Type


class RpcError(RuntimeError):
    """Base class of every runtime error raised by torchrpc."""


class NotInitializedError(RpcError):
    """An API was used before ``init_rpc`` or after ``shutdown``."""


class RendezvousError(RpcError):
    """Workers could not agree on the group: duplicate names or ranks, bad store."""


class BarrierTimeoutError(RendezvousError):
    """Not every worker arrived at the shutdown barrier by its deadline."""


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


class ClosedError(RpcError):
    """Work was handed to a worker pool or a connection after it closed."""


class ConnectionClosedError(ClosedError, ConnectionLostError):
    """A frame was sent on a connection that is closed (by this side, or because it broke)."""


class RpcTimeoutError(RpcError):
    """An RPC ran past its deadline. The message always contains "timed out"."""


class SerializationError(RpcError):
    """An argument or return value could not be pickled or unpickled."""


class MissingDefinitionError(SerializationError, AttributeError):
    """A message names a function or class that this process does not define."""


class OverloadedError(RpcError):
    """The callee refused a request: too many requests already wait for its threads."""


class ShutdownError(RpcError):
    """Graceful shutdown could not complete (for example a worker is missing)."""


class LifecycleError(RpcError):
    """The agent was told to enter a state its lifecycle does not lead to from the one it
    is in (a fault of torchrpc, not of the program; see ``_agent/shutdown.py``)."""


class InvalidArgumentError(RpcError, ValueError):
    """A bad argument value where torch raises ``RuntimeError``."""


class WrongTypeError(RpcError, TypeError):
    """An argument of the wrong type where torch raises ``RuntimeError``."""


class OptionTypeError(TypeError, ValueError):
    """A backend option of the wrong type (torch: ``TypeError``; a ``ValueError`` too, as
    torchrpc raised before)."""


class OperatorSchemaError(RpcError, TypeError):
    """A builtin torch operator run by RPC matched none of its schemas (torch:
    ``RuntimeError``; the ``TypeError`` torch's Python binding raises, too)."""


class DestinationTypeError(RpcError, ValueError, TypeError):
    """``to`` is neither a worker name, a rank nor a WorkerInfo (torch: ``ValueError``)."""


class DeviceMapError(RpcError):
    """A CUDA tensor was to travel to a worker without a device map entry for its device
    (torch: ``RuntimeError``)."""


class GroupCallError(RpcError):
    """Some calls of a group call (``rpc_async_many``) failed.

    ``errors`` maps the name of each failed worker to its error; ``results`` holds
    every call's result in the order of the workers, None where it failed.
    """

    def __init__(self, message: str, results: Optional[List[Any]] = None,
                 errors: Optional[Dict[str, BaseException]] = None) -> None:
        super().__init__(message)
        self.results: List[Any] = list(results or [])
        self.errors: Dict[str, BaseException] = dict(errors or {})

    @property
    def failed_workers(self) -> List[str]:
        """The names of the workers whose call failed."""
        return list(self.errors)

    def __reduce__(self) -> Tuple[Any, ...]:
        return type(self), (str(self), self.results, self.errors)


_runtime_twins: Dict[type, type] = {}
_twins_lock = threading.Lock()


def as_runtime_error(exc: BaseException) -> BaseException:
    """``exc`` as an instance of both its own type and ``RuntimeError``, for errors torch
    reports as ``RuntimeError`` (raised in ``then()`` callbacks, for example); ``exc``
    itself when it already is one or its type cannot be combined."""
    if isinstance(exc, RuntimeError) or not isinstance(exc, Exception):
        return exc
    cls = type(exc)
    with _twins_lock:
        twin = _runtime_twins.get(cls)
        if twin is None:
            try:
                twin = type(cls.__name__, (cls, RuntimeError),
                            {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                             "__reduce__": _reduce_as_original})
            except TypeError:  # layouts that cannot be combined (e.g. OSError)
                twin = cls
            _runtime_twins[cls] = twin
    if twin is cls:
        return exc
    try:
        clone: BaseException = twin.__new__(twin, *exc.args)
        clone.args = exc.args
        clone.__dict__.update(getattr(exc, "__dict__", {}))
    except Exception:  # noqa: BLE001 - a type that can't be rebuilt this way stays as it is
        return exc
    return clone


def _reduce_as_original(self: BaseException):
    """A combined error pickles as its original type, which the receiver can import."""
    original = type(self).__mro__[1]
    return _rebuild_error, (original, self.args, dict(self.__dict__))


def _rebuild_error(cls: Type[BaseException], args: tuple, state: dict) -> BaseException:
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class ThreadFailedError(RpcError):
    """A background thread of torchrpc failed and cannot go on; the agent is unusable."""
