"""Backends: the :class:`BackendType` enum and the registry behind ``register_backend``.

A backend is a pair of handlers: one builds its options object, the other builds a
started agent from a rendezvous store. ``BackendType`` is a real ``enum.Enum``;
registering a backend adds one member to it (it is never rebuilt).
"""

from __future__ import annotations

import collections
import enum
from typing import Any, Callable

from .._agent import Agent
from .._agent.rendezvous import rendezvous_timeout
from . import constants
from .options import TensorPipeRpcBackendOptions

BackendValue = collections.namedtuple(
    "BackendValue", ["construct_rpc_backend_options_handler", "init_backend_handler"])


def _construct_default_options(rpc_timeout: float = constants.DEFAULT_RPC_TIMEOUT_SEC,
                               init_method: str = constants.DEFAULT_INIT_METHOD,
                               num_worker_threads: int = constants.DEFAULT_NUM_WORKER_THREADS,
                               **kwargs: Any) -> TensorPipeRpcBackendOptions:
    return TensorPipeRpcBackendOptions(rpc_timeout=rpc_timeout, init_method=init_method,
                                       num_worker_threads=num_worker_threads, **kwargs)


def _init_default_backend(store: Any, name: str, rank: int, world_size: int,
                          rpc_backend_options: Any) -> Agent:
    if not isinstance(rpc_backend_options, TensorPipeRpcBackendOptions):
        raise TypeError(
            f"`rpc_backend_options` must be a `TensorPipeRpcBackendOptions`. "
            f"{rpc_backend_options!r} is a {type(rpc_backend_options).__name__}; build the "
            f"options of BackendType.TENSORPIPE with torchrpc.rpc.TensorPipeRpcBackendOptions(...)")
    agent = Agent(store, name, rank, world_size, rpc_backend_options)
    plan = rpc_backend_options.rendezvous_plan  # set when init_rpc read the options
    if plan is None:
        timeout = (rpc_backend_options.rpc_timeout
                   or constants.DEFAULT_RENDEZVOUS_TIMEOUT.total_seconds())
        return agent.start(rendezvous_timeout(timeout, rpc_backend_options.rendezvous_timeout))
    return agent.start(plan)


class BackendType(enum.Enum):
    """An enum class of available backends.

    torchrpc ships ``BackendType.TENSORPIPE`` (named as torch's default, so ported code
    runs unchanged; it is torchrpc's own transport). Others are added with
    :func:`register_backend`.
    """

    TENSORPIPE = BackendValue(_construct_default_options, _init_default_backend)

    def __repr__(self) -> str:
        return f"BackendType.{self.name}"


def backend_registered(backend_name: str) -> bool:
    """Whether a backend of that name is registered."""
    return backend_name in BackendType.__members__


def register_backend(backend_name: str,
                     construct_rpc_backend_options_handler: Callable[..., Any],
                     init_backend_handler: Callable[..., Any]) -> BackendType:
    """Register a new RPC backend and return its new ``BackendType`` member.

    Args:
        backend_name (str): backend string to identify the handler.
        construct_rpc_backend_options_handler (callable): called as
            ``handler(rpc_timeout, init_method, **kwargs)``; returns the options object.
        init_backend_handler (callable): called as
            ``handler(store, name, rank, world_size, rpc_backend_options)``; returns the
            started agent.
    """
    if not isinstance(backend_name, str) or not backend_name.isidentifier():
        raise ValueError(f"backend name must be an identifier string, got {backend_name!r}")
    if backend_registered(backend_name):
        raise RuntimeError(f"RPC backend {backend_name}: already registered")
    value = BackendValue(construct_rpc_backend_options_handler, init_backend_handler)
    member = object.__new__(BackendType)
    member._name_ = backend_name
    member._value_ = value
    BackendType._member_map_[backend_name] = member
    BackendType._value2member_map_[value] = member
    BackendType._member_names_.append(backend_name)
    type.__setattr__(BackendType, backend_name, member)
    return member


def construct_rpc_backend_options(backend: BackendType,
                                  rpc_timeout: float = constants.DEFAULT_RPC_TIMEOUT_SEC,
                                  init_method: str = constants.DEFAULT_INIT_METHOD,
                                  **kwargs: Any) -> Any:
    """Build the default options object of ``backend``."""
    _check_backend(backend)
    return backend.value.construct_rpc_backend_options_handler(rpc_timeout, init_method, **kwargs)


def init_backend(backend: BackendType, *args: Any, **kwargs: Any) -> Any:
    """Build and start ``backend``'s agent."""
    _check_backend(backend)
    return backend.value.init_backend_handler(*args, **kwargs)


def _check_backend(backend: Any) -> None:
    if not isinstance(backend, BackendType):
        raise TypeError(f"backend must be a torchrpc.rpc.BackendType member, got {backend!r}; "
                        f"registered: {list(BackendType.__members__)}")
