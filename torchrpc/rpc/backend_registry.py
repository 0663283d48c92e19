"""Backends: :class:`BackendType` and the registry behind ``register_backend``.

A backend is a pair of handlers: one builds its options object, the other builds a
started agent from a rendezvous store. ``BackendType`` behaves as torch's enum where a
program can tell (members by attribute, by name and by value, iteration in registration
order, ``name``, ``value``, repr, identity equality, pickling), but it is a plain class
that owns its registry: registering a backend adds one member to it, and nothing ever
rebuilds the class or writes the internals of ``enum``.
"""

from __future__ import annotations

import collections
from types import MappingProxyType
from typing import Any, Callable, Dict, Iterator, Mapping, Tuple

from .._agent import Agent
from . import constants
from .options import TensorPipeRpcBackendOptions, agent_settings, rendezvous_plan_of

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
    agent = Agent(store, name, rank, world_size, agent_settings(rpc_backend_options))
    return agent.start(rendezvous_plan_of(rpc_backend_options))


class _Members(type):
    """What torch's enum does at class level, for :class:`BackendType`: members by
    attribute (``BackendType.TENSORPIPE``) and by name (``BackendType["TENSORPIPE"]``),
    by value (``BackendType(value)``), ``len``, ``in`` and iteration in registration
    order, and ``__members__``."""

    _members: Dict[str, "BackendType"]

    def __getattr__(cls, name: str) -> "BackendType":
        # Called only when ordinary lookup fails, so methods and attributes come first.
        try:
            return cls._members[name]
        except KeyError:
            raise AttributeError(f"type object 'BackendType' has no attribute {name!r}; "
                                 f"registered backends: {list(cls._members)}") from None

    def __getitem__(cls, name: str) -> "BackendType":
        return cls._members[name]

    def __call__(cls, value: Any) -> "BackendType":
        for member in cls._members.values():
            if member.value == value:
                return member
        raise ValueError(f"{value!r} is not a valid BackendType")

    def __iter__(cls) -> Iterator["BackendType"]:
        return iter(list(cls._members.values()))

    def __reversed__(cls) -> Iterator["BackendType"]:
        return reversed(list(cls._members.values()))

    def __len__(cls) -> int:
        return len(cls._members)

    def __contains__(cls, member: Any) -> bool:
        return isinstance(member, cls) and cls._members.get(member.name) is member

    def __dir__(cls) -> list:
        return sorted(set(super().__dir__()) | set(cls._members))

    @property
    def __members__(cls) -> Mapping[str, "BackendType"]:
        """The members by name, in registration order (read-only)."""
        return MappingProxyType(dict(cls._members))


class BackendType(metaclass=_Members):
    """An enum class of available backends.

    torchrpc ships ``BackendType.TENSORPIPE`` (named as torch's default, so ported code
    runs unchanged; it is torchrpc's own transport). Others are added with
    :func:`register_backend`.
    """

    __slots__ = ("_name", "_value")
    _members: Dict[str, "BackendType"] = {}  # by name, in registration order

    @classmethod
    def _add(cls, name: str, value: BackendValue) -> "BackendType":
        """Make and register the member ``name`` (one per name, for the process's life)."""
        member = object.__new__(cls)
        object.__setattr__(member, "_name", name)
        object.__setattr__(member, "_value", value)
        cls._members[name] = member
        return member

    @property
    def name(self) -> str:
        """The backend's name, as given to :func:`register_backend`."""
        return self._name

    @property
    def value(self) -> BackendValue:
        """The backend's handlers."""
        return self._value

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"BackendType.{self._name} cannot be changed")

    def __repr__(self) -> str:
        return f"BackendType.{self._name}"

    __str__ = __repr__

    def __reduce__(self) -> Tuple[Any, Tuple[str]]:
        # By name: unpickling gives the member registered under it in this process.
        return _member, (self._name,)


def _member(name: str) -> BackendType:
    """The registered member ``name`` (what a pickled ``BackendType`` loads as)."""
    return BackendType[name]


BackendType._add("TENSORPIPE", BackendValue(_construct_default_options, _init_default_backend))


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
    return BackendType._add(backend_name,
                            BackendValue(construct_rpc_backend_options_handler,
                                         init_backend_handler))


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
