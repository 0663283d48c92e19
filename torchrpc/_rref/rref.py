"""The RRef class: a reference to a value on an owner, as users hold it.

:class:`RRef` objects are either owner RRefs (the value lives here) or user
RRefs (a reference to a value on another worker). Pickling one is a *fork*: it
is only allowed while an RPC message is being built, because the destination
decides what the fork means (see :mod:`torchrpc._rref.book`); the receiver
rebuilds it with :func:`_rebuild_rref`. The protocol itself runs in the agent's
:class:`~torchrpc._rref.layer.RRefLayer`. User RRefs that are garbage collected
only append their ForkId to a queue of the layer's control part (safe from
``__del__``; see :mod:`torchrpc._rref.control`).
"""

from __future__ import annotations

from typing import Any, Generic, Optional, Tuple, TypeVar

import torch

from .._agent import Agent, Described, MessageContext, Slot, WorkerInfo, fresh_error
from .._agent.current import current_agent, handle as agent_handle
from .._agent.futures import RpcFuture, SyncFuture, new_future, torch_future_of
from .._wire import Kind, PassThrough, register_message_reducer, register_rebuilder
from ..errors import ConnectionLostError, InvalidArgumentError, NotInitializedError, RpcTimeoutError
from .book import GloballyUniqueId, OwnerEntry
from .proxy import (_UNSET, _backward_local, _Proxy, _rref_typeof_on_owner, _timeout,
                    _typeof_on_owner)

_FETCH = int(Kind.RREF_FETCH)  # an int: an enum lookup is slow on the hot path

Layer = Any
"""The :class:`~torchrpc._rref.layer.RRefLayer` an RRef belongs to; named here without
importing layer.py, which imports this module."""

T = TypeVar("T")

RREF_LAYER: "Slot[Layer]" = Slot("rref")
"""Where an agent keeps its RRef layer."""


def _layer_of(agent: Agent) -> Layer:
    layer = agent.extensions.get(RREF_LAYER)
    if layer is None:
        raise RuntimeError("the RRef layer is not installed on this agent")
    return layer


class RRef(Generic[T]):
    r"""A reference to a value of type ``T`` that lives on a (possibly remote) owner.

    ``RRef(value)`` makes an owner RRef here; :func:`~torchrpc.rpc.remote` returns a
    user RRef owned by the callee. RRefs can be passed as arguments and return values
    of any RPC; the owner keeps the value alive while any reference exists anywhere.

    Args:
        value (object): the value to wrap.
        type_hint (Type, optional): accepted for compatibility; not needed.
    """

    __slots__ = ("_layer", "_rref_id", "_fork_id", "_owner", "_entry", "_error", "_confirmed",
                 "_deleted", "_creation", "_type_future", "_profiling_future",
                 "__weakref__")

    def __init__(self, value: T, type_hint: Any = None) -> None:
        if agent_handle.agent is None:
            raise NotInitializedError("Current RPC agent is not set! Did you initialize the "
                                      "RPC framework (e.g. by calling `rpc.init_rpc`)?")
        layer = _layer_of(current_agent())
        entry = OwnerEntry(layer.book.new_id())
        entry.set_value(value)
        self._init(layer, entry.rref_id, None, layer.agent.worker_info, entry)

    def _init(self, layer: Layer, rref_id: GloballyUniqueId,
              fork_id: Optional[GloballyUniqueId], owner: WorkerInfo,
              entry: Optional[OwnerEntry], confirmed: bool = True) -> None:
        self._layer = layer
        self._rref_id = rref_id
        self._fork_id = fork_id
        self._owner = owner
        self._entry = entry
        self._error: Optional[BaseException] = None
        self._confirmed = confirmed
        self._deleted = False
        # The future of remote()'s creation request: a torch future, or a SyncFuture
        # while the reply is parked (_get_future makes a torch future of it)
        self._creation: Any = None
        self._type_future: Optional[torch.futures.Future] = None  # of the value's type
        self._profiling_future: Optional[torch.futures.Future] = None  # set by a profiled remote

    @classmethod
    def _make(cls, layer: Layer, rref_id: GloballyUniqueId,
              fork_id: Optional[GloballyUniqueId], owner: WorkerInfo,
              entry: Optional[OwnerEntry], confirmed: bool = True) -> "RRef":
        self = cls.__new__(cls)
        self._init(layer, rref_id, fork_id, owner, entry, confirmed)
        return self

    # -- queries ---------------------------------------------------------------------------------

    def is_owner(self) -> bool:
        r"""Whether the current node is the owner of this ``RRef``."""
        return self._entry is not None

    def owner(self) -> WorkerInfo:
        r"""The :class:`WorkerInfo` of the owner of this ``RRef``."""
        return self._owner

    def owner_name(self) -> str:
        r"""The worker name of the owner of this ``RRef``."""
        return self._owner.name

    def confirmed_by_owner(self) -> bool:
        r"""Whether the owner has confirmed this ``RRef`` (always True on the owner)."""
        return self._entry is not None or self._confirmed

    def _check_error(self) -> None:
        if self._error is not None:
            raise fresh_error(self._error)

    def _record_error(self, exc: BaseException) -> None:
        # A copy without a traceback: the original's frames hold this RRef, and a cycle
        # through them outlives gc when a C++ future is part of it (the RRef would leak).
        self._error = fresh_error(exc)

    def local_value(self) -> T:
        r"""The local value, if this is an owner ``RRef``; raises on a user ``RRef``."""
        if self._entry is None:
            raise RuntimeError(
                f"For UserRRef(rref_id={_gid(self._rref_id)}, fork_id={_gid(self._fork_id)}), "
                f"can't call localValue() on user {self._layer.agent.worker_info!r}. Call it "
                f"on owner {self._owner!r}, or use to_here() to copy the value here")
        self._raise_creation_error()  # a remote() to self that timed out, as in torch
        return self._entry.future.wait()

    def _get_type(self, timeout: float = _UNSET, blocking: bool = True) -> Any:
        r"""The type of the value; with ``blocking=False``, a future of it.

        A user RRef asks the owner once and remembers the answer.

        Args:
            timeout (float, optional): seconds to wait for the owner's answer.
            blocking (bool, optional): wait for the type (default) or return a future.
        """
        fut = self._type_future
        if fut is None:
            if self._entry is not None:
                fut = _typeof_on_owner(self)
            else:
                layer = self._layer
                fut = layer.public_rpc_async(self._owner, _rref_typeof_on_owner, args=(self,),
                                             timeout=_timeout(layer, timeout))
            self._type_future = fut
        return fut.wait() if blocking else fut

    def to_here(self, timeout: float = _UNSET) -> T:
        r"""Blocking call that copies the value of the RRef from the owner to here.

        Args:
            timeout (float, optional): seconds to wait; 0 means no limit; by default
                the agent's ``rpc_timeout``.
        """
        self._check_not_deleted("to_here() on it")
        self._check_error()
        if self._entry is not None:
            self._raise_creation_error()
            return self._entry.future.wait()
        layer = self._layer
        t = _timeout(layer, timeout)
        owner = self._owner.id
        deletes = layer.control.take_deletes(owner)
        try:
            value = layer.agent.request_sync(self._owner, _FETCH,
                                             (self._rref_id, deletes), t,
                                             what=Described("RRef.to_here() of {!r}", self),
                                             after=self._creation)
        except BaseException:  # noqa: BLE001 - a recorded creation failure explains it better
            layer.control.return_deletes(owner, deletes)
            self._raise_creation_error()
            raise
        self._raise_creation_error()
        return value

    def to_here_async(self, timeout: float = _UNSET) -> RpcFuture:
        r"""Non-blocking :meth:`to_here`: a future of the value, copied from the owner.

        The future is a :class:`torch.futures.Future`; ``await`` works on it in a
        running event loop. It fails with what :meth:`to_here` would raise.

        Args:
            timeout (float, optional): seconds to wait; 0 means no limit; by default
                the agent's ``rpc_timeout``.
        """
        layer = self._layer
        out = new_future(layer.agent.pool)
        if self._error is not None:
            out.set_exception(fresh_error(self._error))
            return out
        owner: Optional[int] = None
        deletes: Tuple[Tuple[GloballyUniqueId, GloballyUniqueId], ...] = ()
        if self._entry is not None:
            source: torch.futures.Future = self._entry.future
        else:
            t = _timeout(layer, timeout)
            owner = self._owner.id
            deletes = layer.control.take_deletes(owner)
            try:
                source = layer.agent.request(self._owner, _FETCH,
                                             (self._rref_id, deletes), t,
                                             what=Described("RRef.to_here_async() of {!r}", self))
            except BaseException:
                layer.control.return_deletes(owner, deletes)
                raise

        def relay(f: torch.futures.Future) -> None:
            # Holds this RRef until the fetch is answered: its owner keeps the value so long.
            try:
                value = f.wait()
            except BaseException as exc:  # noqa: BLE001 - delivered through the future
                if owner is not None:
                    layer.control.return_deletes(owner, deletes)
                error: BaseException = fresh_error(exc)
            else:
                error = None
            try:
                self._raise_creation_error()  # a recorded creation failure explains it better
            except BaseException as creation:  # noqa: BLE001
                error = creation.with_traceback(None)
            if error is not None:
                out.set_exception(error)
            else:
                out.set_result(value)

        torch.futures.Future.add_done_callback(source, relay)
        return out

    def _raise_creation_error(self) -> None:
        self._check_error()
        creation = self._creation
        if creation is not None and creation.done():
            try:
                creation.wait()
            except BaseException as exc:  # noqa: BLE001
                self._record_error(_creation_error(exc))
                self._check_error()

    def _get_future(self) -> torch.futures.Future:
        """The future of this RRef's creation by ``rpc.remote()`` on the owner, as torch's
        (it fails with the creation's timeout or error); for an RRef that was not made by
        a ``remote()`` here, a future of the value, fetched from the owner."""
        creation = self._creation
        if creation is not None:
            if type(creation) is SyncFuture:  # a parked creation's (see RRefLayer.remote)
                creation = self._creation = torch_future_of(creation, self._layer.agent.pool)
            return creation
        self._check_error()
        if self._entry is not None:
            return self._entry.future
        return self._layer.agent.request(self._owner, _FETCH, (self._rref_id, ()),
                                         self._layer.agent.default_timeout,
                                         what=Described("RRef fetch of {!r}", self))

    def _get_profiling_future(self) -> torch.futures.Future:
        r"""A future that completes once the profiler event of the ``rpc.remote`` that made
        this RRef has been recorded (its owner created the value); only for an RRef made
        while a profiler was enabled."""
        if self._profiling_future is None:
            raise RuntimeError("Profiling future has not been set: this RRef was not made by "
                               "rpc.remote() under an enabled profiler")
        return self._profiling_future

    # -- proxies ---------------------------------------------------------------------------------

    def rpc_sync(self, timeout: float = _UNSET) -> Any:
        r"""A proxy: ``rref.rpc_sync().f(*args)`` runs ``rref.local_value().f(*args)`` on the
        owner with :func:`~torchrpc.rpc.rpc_sync` and returns the result."""
        return _Proxy(self, "sync", timeout)

    def rpc_async(self, timeout: float = _UNSET) -> Any:
        r"""A proxy: ``rref.rpc_async().f(*args)`` returns a future of the owner's result."""
        return _Proxy(self, "async", timeout)

    def remote(self, timeout: float = _UNSET) -> Any:
        r"""A proxy: ``rref.remote().f(*args)`` returns an RRef to the owner's result."""
        return _Proxy(self, "remote", timeout)

    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        r"""Runs the backward pass using the RRef as the root of the backward pass.

        If ``dist_autograd_ctx_id`` is given, a distributed backward pass runs in that
        context from the owner; otherwise a local autograd backward runs on the owner.
        The value must be a scalar tensor.

        Args:
            dist_autograd_ctx_id (int, optional): the distributed autograd context id.
            retain_graph (bool, optional): keep the graph for another backward.
        """
        self._check_error()
        if self._entry is not None:
            _backward_local(self, dist_autograd_ctx_id, retain_graph)
        elif dist_autograd_ctx_id == -1:
            raise InvalidArgumentError(
                "User RRefs require 'dist_autograd_ctx_id' to be specified: a user RRef's "
                "backward pass runs from its owner in a distributed autograd context; pass "
                "the id of the context the value was computed in")
        else:
            self._layer.agent.call(self._owner, _backward_local, (self, dist_autograd_ctx_id,
                                                                  retain_graph), {},
                                   self._layer.agent.default_timeout).wait()

    def _serialize(self) -> Tuple[Any, ...]:
        r"""Fork this RRef for the RPC message being pickled (torch's internal pickling
        entry point); raises the creation error of an RRef whose ``rpc.remote()`` failed."""
        self._check_error()
        return self.__reduce__()

    # -- lifetime --------------------------------------------------------------------------------

    def _check_not_deleted(self, what: str) -> None:
        """torch's error for a user RRef used after shutdown deleted it (a recorded error,
        such as its owner's loss, explains better and is raised instead where it is used)."""
        if self._entry is None and self._deleted and self._error is None:
            raise RuntimeError(f"User RRef with RRefId={self._rref_id} and ForkId="
                               f"{self._fork_id} has been deleted. Cannot call {what} after "
                               f"deletion: rpc.shutdown() deletes every user RRef; use "
                               f"RRefs only while RPC runs")

    def __reduce__(self) -> Tuple[Any, ...]:
        """Pickling outside an RPC message (inside one, :func:`_reduce_rref` forks it)."""
        return _reduce_rref(self, None)

    def __del__(self) -> None:
        if getattr(self, "_fork_id", None) is not None and not self._deleted:
            self._deleted = True
            try:
                self._layer.control.deferred.append(self._fork_id)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass

    def __repr__(self) -> str:
        if self._entry is not None:
            return f"OwnerRRef({_gid(self._rref_id)})"
        return f"UserRRef(RRefId = {_gid(self._rref_id)}, ForkId = {_gid(self._fork_id)})"


def _creation_error(exc: BaseException) -> BaseException:
    """What using an RRef whose ``rpc.remote()`` never reached its owner raises: torch's
    words for a creation that timed out or whose message was lost, then the cause. Errors
    the owner reported (the function raised) stay as they are."""
    if isinstance(exc, RpcTimeoutError):
        return RpcTimeoutError(f"RRef creation via rpc.remote() timed out, and it is possible "
                               f"that the RRef on the owner node does not exist: {exc}")
    if isinstance(exc, ConnectionLostError):
        return type(exc)(f"RRef creation via rpc.remote() failed, and it is possible that the "
                         f"RRef on the owner node does not exist: {exc}",
                         worker=getattr(exc, "worker", None))
    return exc


def _gid(gid: Optional[GloballyUniqueId]) -> str:
    """An RRef or fork id as torch prints it."""
    if gid is None:
        return "None"
    return f"GloballyUniqueId(created_on={gid[0]}, local_id={gid[1]})"


def _reduce_rref(rref: RRef, ctx: Any) -> Tuple[Any, ...]:
    """An RRef pickled in the message of context ``ctx`` (None: outside a message)."""
    rref._check_not_deleted("fork an UserRRef")
    if not isinstance(ctx, MessageContext):
        raise RuntimeError("Can not pickle rref in python pickler, rref can only be "
                           "pickled when using RPC: pass it as an argument or return "
                           "value of rpc_sync, rpc_async or remote")
    if rref._error is not None:
        raise PassThrough(fresh_error(rref._error))  # a fork raises the creation error itself
    return ctx.agent.extensions[RREF_LAYER].fork(rref, ctx)


def _rebuild_rref(rref_id: GloballyUniqueId, fork_id: GloballyUniqueId, owner: int,
                  by_owner: bool, *, context: Any = None) -> RRef:
    """An RRef unpickled from the message of ``context`` (the decode binds it)."""
    ctx = context
    if not isinstance(ctx, MessageContext):
        raise RuntimeError("an RRef can only be unpickled as part of an RPC message")
    layer = ctx.agent.extensions[RREF_LAYER]
    rref = layer.adopt_fork(rref_id, fork_id, owner, by_owner, ctx.peer, ctx.replied)
    if not rref.confirmed_by_owner():
        # As in torch, a function given a forked RRef runs once the owner knows of it.
        ctx.add_gate(layer.confirmation(fork_id))
    return rref


register_message_reducer(RRef, _reduce_rref)
register_rebuilder(_rebuild_rref)

__all__ = ["RRef"]
