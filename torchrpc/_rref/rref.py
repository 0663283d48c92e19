"""The RRef class and the layer that runs the RRef protocol on an agent.

:class:`RRef` objects are either owner RRefs (the value lives here) or user
RRefs (a reference to a value on another worker). Pickling one is a *fork*: it
is only allowed while an RPC message is being built, because the destination
decides what the fork means (see :mod:`torchrpc._rref.book`). The
:class:`RRefLayer` registers the protocol's message handlers with the agent and
sends the control messages the book asks for from one sender thread. User RRefs
that are garbage collected only append their ForkId to a queue (safe from
``__del__``); the next REMOTE_CALL or FETCH to the owner carries the deletion, or
the sender sends it at the agent timer's next tick.
"""

from __future__ import annotations

import collections
import functools
import gc
import inspect
import logging
import queue
import threading
import time
import weakref
from typing import Any, Callable, Dict, Generic, List, Optional, Tuple, TypeVar

import torch

from .. import _threads
from .._agent import (Agent, AsyncResult, MessageContext, Parked, WorkerInfo, describe,
                      fresh_error, run_callable)
from .._agent.current import current_agent, handle as agent_handle
from .._agent.futures import RpcFuture, new_future
from .._agent.retry import RetryPolicy
from .._threads import Guard
from .._wire import Kind, PassThrough, current_context
from ..errors import (ConnectionLostError, InvalidArgumentError, NotInitializedError,
                      RpcError, RpcTimeoutError, WrongTypeError)
from .book import GloballyUniqueId, Msg, OwnerEntry, RRefBook

log = logging.getLogger(__name__)
T = TypeVar("T")
# Control messages are idempotent on the receiver (sets and tombstones), so they are
# retried on connection failures, as the protocol prescribes.
_CONTROL_RETRY = RetryPolicy(max_attempts=5, initial_backoff=0.05, max_backoff=1.0)
_UNSET = -1.0


def _layer_of(agent: Agent) -> "RRefLayer":
    layer = agent.extensions.get("rref")
    if layer is None:
        raise RuntimeError("the RRef layer is not installed on this agent")
    return layer


def _timeout(layer: "RRefLayer", timeout: float) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, got {timeout!r}")
    if timeout == _UNSET:
        return layer.agent.default_timeout
    if timeout < 0:
        raise ValueError(f"timeout must be >= 0 seconds (0: no timeout), got {timeout}")
    return float(timeout)


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
                 "_deleted", "_creation", "_parked", "_type_future", "_profiling_future",
                 "__weakref__")

    def __init__(self, value: T, type_hint: Any = None) -> None:
        if agent_handle.agent is None:
            raise NotInitializedError("Current RPC agent is not set! Did you initialize the "
                                      "RPC framework (e.g. by calling `rpc.init_rpc`)?")
        layer = _layer_of(current_agent())
        entry = OwnerEntry(layer.book.new_id())
        entry.set_value(value)
        self._init(layer, entry.rref_id, None, layer.agent.worker_info, entry)

    def _init(self, layer: "RRefLayer", rref_id: GloballyUniqueId,
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
        self._creation: Optional[torch.futures.Future] = None
        self._parked: Optional[Parked] = None  # the creation's reply, unread (see remote)
        self._type_future: Optional[torch.futures.Future] = None  # of the value's type
        self._profiling_future: Optional[torch.futures.Future] = None  # set by a profiled remote

    @classmethod
    def _make(cls, layer: "RRefLayer", rref_id: GloballyUniqueId,
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
        parked, self._parked = self._parked, None
        owner = self._owner.id
        deletes = layer.take_deletes(owner)
        try:
            value = layer.agent.request_sync(self._owner, Kind.RREF_FETCH,
                                             (self._rref_id, deletes), t,
                                             what=f"RRef.to_here() of {self!r}", after=parked)
        except BaseException:  # noqa: BLE001 - a recorded creation failure explains it better
            layer.return_deletes(owner, deletes)
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
            deletes = layer.take_deletes(owner)
            try:
                source = layer.agent.request(self._owner, Kind.RREF_FETCH,
                                             (self._rref_id, deletes), t,
                                             what=f"RRef.to_here_async() of {self!r}")
            except BaseException:
                layer.return_deletes(owner, deletes)
                raise

        def relay(f: torch.futures.Future) -> None:
            # Holds this RRef until the fetch is answered: its owner keeps the value so long.
            try:
                value = f.wait()
            except BaseException as exc:  # noqa: BLE001 - delivered through the future
                if owner is not None:
                    layer.return_deletes(owner, deletes)
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
        if self._creation is not None:
            return self._creation
        self._check_error()
        if self._entry is not None:
            return self._entry.future
        return self._layer.agent.request(self._owner, Kind.RREF_FETCH, (self._rref_id, ()),
                                         self._layer.agent.default_timeout,
                                         what=f"RRef fetch of {self!r}")

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
        self._check_not_deleted("fork an UserRRef")
        ctx = current_context()
        if not isinstance(ctx, MessageContext):
            raise RuntimeError("Can not pickle rref in python pickler, rref can only be "
                               "pickled when using RPC: pass it as an argument or return "
                               "value of rpc_sync, rpc_async or remote")
        if self._error is not None:
            raise PassThrough(fresh_error(self._error))  # a fork raises the creation error itself
        return ctx.agent.extensions["rref"].fork(self, ctx)

    def __del__(self) -> None:
        if getattr(self, "_fork_id", None) is not None and not self._deleted:
            self._deleted = True
            try:
                self._layer.deferred.append(self._fork_id)
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


def _agent_rpc_async(agent: Agent, to: WorkerInfo, func: Any, args: Tuple[Any, ...],
                     timeout: float) -> torch.futures.Future:
    return agent.call(to, func, args, {}, timeout)


def _gid(gid: Optional[GloballyUniqueId]) -> str:
    """An RRef or fork id as torch prints it."""
    if gid is None:
        return "None"
    return f"GloballyUniqueId(created_on={gid[0]}, local_id={gid[1]})"


def _typeof_on_owner(rref: RRef) -> torch.futures.Future:
    """On the owner: a future of the type of the value (once it exists)."""
    assert rref._entry is not None
    out: torch.futures.Future = torch.futures.Future()

    def relay(f: torch.futures.Future) -> None:
        # Not then(): torch turns a callback's error into a plain RuntimeError.
        try:
            out.set_result(type(f.value()))
        except BaseException as exc:  # noqa: BLE001 - the creation error, with its type
            out.set_exception(fresh_error(exc.with_traceback(None)))
    rref._entry.future.add_done_callback(relay)
    return out


def _rref_typeof_on_owner(rref: RRef) -> torch.futures.Future:
    """Run on the owner for :meth:`RRef._get_type`; replies when the value exists."""
    return _typeof_on_owner(rref)


_rref_typeof_on_owner._wrapped_async_rpc_function = _rref_typeof_on_owner  # type: ignore[attr-defined]


def _rebuild_rref(rref_id: GloballyUniqueId, fork_id: GloballyUniqueId, owner: int,
                  by_owner: bool) -> RRef:
    ctx = current_context()
    if not isinstance(ctx, MessageContext):
        raise RuntimeError("an RRef can only be unpickled as part of an RPC message")
    layer = ctx.agent.extensions["rref"]
    rref = layer.adopt_fork(rref_id, fork_id, owner, by_owner, ctx.peer, ctx.replied)
    if not rref.confirmed_by_owner():
        # As in torch, a function given a forked RRef runs once the owner knows of it.
        ctx.add_gate(layer.confirmation(fork_id))
    return rref


class _Proxy:
    """``rref.rpc_sync()`` and friends: attribute access makes a method call on the owner."""

    __slots__ = ("_rref", "_mode", "_timeout")

    def __init__(self, rref: RRef, mode: str, timeout: float) -> None:
        self._rref = rref
        self._mode = mode
        self._timeout = timeout

    def __getattr__(self, name: str) -> Callable[..., Any]:
        rref, mode = self._rref, self._mode
        layer = rref._layer
        timeout = _timeout(layer, self._timeout)

        def method(*args: Any, **kwargs: Any) -> Any:
            payload = (rref, name, args, kwargs)
            if mode == "remote":
                # As in torch, a method the value's type lacks fails here, not at to_here().
                cls = rref._get_type(timeout)
                if not hasattr(cls, name):
                    raise AttributeError(f"{cls.__name__!r} object has no attribute {name!r} "
                                         f"(the value of {rref!r} on {rref._owner.name})")
                return layer.remote(rref._owner, _invoke_method, payload, {}, timeout)
            fut = layer.agent.call(rref._owner, _invoke_method, payload, {}, timeout)
            return fut.wait() if mode == "sync" else fut
        method.__name__ = name
        return method


def _invoke_method(rref: RRef, name: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]
                   ) -> torch.futures.Future:
    """Run on the owner: call a method of the value; async_execution methods stay async,
    and ``async def`` methods run on the owner's event loop."""
    bound = getattr(rref.local_value(), name)
    result = bound(*args, **kwargs)
    if inspect.iscoroutine(result):
        return rref._layer.agent.coroutines.submit(result)
    if getattr(bound, "_wrapped_async_rpc_function", None) is not None:
        return result
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(result)
    return fut


_invoke_method._wrapped_async_rpc_function = _invoke_method  # type: ignore[attr-defined]


def _backward_local(rref: RRef, ctx_id: int, retain_graph: bool) -> None:
    value = rref.local_value()
    if not isinstance(value, torch.Tensor):
        raise WrongTypeError(f"RRef should contain a tensor for .backward(), but it holds a "
                             f"{type(value).__name__}; call backward() on an RRef of a tensor "
                             f"(for example the loss)")
    if ctx_id == -1:
        value.backward(retain_graph=retain_graph)
        return
    engine = rref._layer.agent.extensions.get("autograd")
    if engine is None:
        raise RuntimeError("distributed autograd is not available on this worker")
    engine.backward(ctx_id, [value], retain_graph)


class RRefLayer:
    """Runs the RRef protocol on one agent: handlers, control messages, shutdown settling."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.book = RRefBook(agent.rank)
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._users: "weakref.WeakValueDictionary[GloballyUniqueId, RRef]" = weakref.WeakValueDictionary()
        self._users_lock = threading.Lock()  # adding and snapshotting _users (see _stop)
        self._phase = 0
        # Deletions: user RRefs garbage collected here (ForkIds, appended by __del__) and
        # the USER_DELETE pairs they became, by owner rank, not sent yet. A REMOTE_CALL or
        # FETCH to an owner takes that owner's along; the timer's tick flushes the rest.
        self.deferred: "collections.deque[GloballyUniqueId]" = collections.deque()
        self._ready: Dict[int, List[Tuple[GloballyUniqueId, GloballyUniqueId]]] = {}
        self._del_lock = threading.Lock()
        self.delete_messages = 0  # USER_DELETE messages received (not counting carried ones)
        # Futures of user forks a request waits on until the owner confirms them.
        self._confirmations: Dict[GloballyUniqueId, torch.futures.Future] = {}
        # The public rpc_async, set by the RPC layer, so calls RRefs make themselves (for
        # _get_type) are seen as user calls are (profiling).
        self.public_rpc_async: Callable[..., torch.futures.Future] = functools.partial(
            _agent_rpc_async, agent)
        self._guard = Guard(f"the RRef sender thread of {agent.name}", agent.fail)
        agent.extensions["rref"] = self
        agent.register_handler(Kind.RREF_REMOTE_CALL, self._on_remote_call)
        agent.register_handler(Kind.RREF_FETCH, self._on_fetch)
        agent.register_handler(Kind.RREF_USER_DELETE, self._on_user_delete)
        agent.register_handler(Kind.RREF_FORK_REQUEST, self._on_fork_request)
        agent.register_handler(Kind.RREF_CHILD_ACCEPT, self._on_child_accept)
        agent.add_debug_source("rref", self._counts)
        agent.add_shutdown_hook(self._settle)
        agent.add_stop_hook(self._stop)
        agent.add_loss_hook(self._worker_lost)
        # Deleted RRefs pin their values on the owners until the deletion arrives.
        agent.add_tick_hook(self._tick, pending=lambda: bool(self.deferred or self._ready))
        self._sender = _threads.start(f"torchrpc-rref-{agent.name}", self._guard,
                                      self._send_loop)

    def _counts(self) -> Dict[str, int]:
        counts = self.book.counts()
        counts["num_delete_messages_received"] = self.delete_messages
        return counts

    # -- creating and forking ------------------------------------------------------------------

    def remote(self, dst: WorkerInfo, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any],
               timeout: float) -> RRef:
        """Start ``func`` on ``dst`` and return an RRef to its result at once."""
        agent = self.agent
        rref_id = self.book.new_id()
        if dst.id == agent.rank:
            entry = self.book.owner_entry(rref_id)
            rref = RRef._make(self, rref_id, None, dst, entry)
            fut = agent.run_here(Kind.RREF_REMOTE_CALL, func, timeout,
                                 functools.partial(self._run_into, entry, func, args, kwargs),
                                 entry.future)
            rref._creation = fut
            ref = weakref.ref(rref)
            fut.add_done_callback(lambda f: self._created_here(ref, entry, f))
            return rref
        fork_id = self.book.new_id()
        rref = RRef._make(self, rref_id, fork_id, dst, None, confirmed=False)
        self.book.user_created(rref_id, fork_id, dst.id, confirmed=False, parent=None)
        with self._users_lock:
            self._users[fork_id] = rref
        deletes = self.take_deletes(dst.id)
        try:
            # Parked: the reply is read by this RRef's to_here() if it comes soon.
            fut, rref._parked = agent.request_parked(
                dst, Kind.RREF_REMOTE_CALL, (func, args, kwargs, rref_id, fork_id, deletes),
                timeout, what=func)
        except BaseException:
            self.return_deletes(dst.id, deletes)
            self._users.pop(fork_id, None)
            self.book.user_abandoned(fork_id)
            rref._deleted = True
            raise
        ref = weakref.ref(rref)
        rref._creation = fut
        fut.add_done_callback(lambda f: self._created(ref, fork_id, f, dst.id, deletes))
        return rref

    def _created(self, ref: "weakref.ref[RRef]", fork_id: GloballyUniqueId,
                 fut: torch.futures.Future, owner: int,
                 deletes: Tuple[Tuple[GloballyUniqueId, GloballyUniqueId], ...]) -> None:
        rref = ref()
        try:
            fut.wait()
        except BaseException as exc:  # noqa: BLE001 - recorded on the RRef (best effort)
            if rref is not None:
                rref._record_error(_creation_error(exc))
            self.return_deletes(owner, deletes)  # they may not have arrived
        if rref is not None:
            rref._confirmed = True
        self.post(self.book.user_confirmed(fork_id))

    def _created_here(self, ref: "weakref.ref[RRef]", entry: OwnerEntry,
                      fut: torch.futures.Future) -> None:
        """A remote() to this worker itself completed: as in torch, a creation that timed
        out or never started marks the owner RRef, whose value may still come."""
        try:
            fut.wait()
        except BaseException as exc:  # noqa: BLE001 - recorded on the RRef
            error = _creation_error(exc)
            if isinstance(exc, ConnectionLostError):  # never started: no value will come
                entry.set_error(error)
                self.book.value_settled(entry.rref_id)
            rref = ref()
            if rref is not None:
                rref._record_error(error)

    def fork(self, rref: RRef, ctx: MessageContext) -> Tuple[Any, ...]:
        """Pickle ``rref`` for the message of ``ctx``: register the fork as the protocol
        requires."""
        ctx.per_peer = True  # the fork is this peer's: the message is for it alone
        if rref._entry is not None:  # owner -> anyone: the owner counts the fork itself
            fork_id = self.book.new_id()
            self.book.adopt(rref._entry)
            self.book.add_fork(rref._rref_id, fork_id, ctx.peer.id)
            return _rebuild_rref, (rref._rref_id, fork_id, rref._owner.id, True)
        # G2: keep the parent until the child is accepted
        fork_id = self.book.fork_child(rref, ctx.peer.id, rref._owner.id)
        if ctx.replied and ctx.peer.id == rref._owner.id:
            # To the owner, in a request that gets a reply: the reply (or the request's
            # failure) accepts the child, with no RREF_CHILD_ACCEPT message.
            ctx.when_settled(functools.partial(self.book.child_accepted, fork_id))
        return _rebuild_rref, (rref._rref_id, fork_id, rref._owner.id, False)

    def adopt_fork(self, rref_id: GloballyUniqueId, fork_id: GloballyUniqueId, owner: int,
                   by_owner: bool, sender: WorkerInfo, replied: bool = False) -> RRef:
        """Unpickle a fork that ``sender`` sent here (in a request that gets a reply, if
        ``replied``)."""
        agent = self.agent
        if owner == agent.rank:
            entry = self.book.owner_entry(rref_id)
            if by_owner:
                self.book.remove_fork(rref_id, fork_id)  # our own fork came back to us
            elif not replied:  # otherwise our reply accepts the child (see fork)
                self.post([Msg(sender.id, Kind.RREF_CHILD_ACCEPT, (fork_id,))])
            return RRef._make(self, rref_id, None, agent.worker_info, entry)
        owner_info = agent.resolve(owner)
        rref = RRef._make(self, rref_id, fork_id, owner_info, None, confirmed=by_owner)
        with self._users_lock:
            self._users[fork_id] = rref
        msgs = self.book.user_created(rref_id, fork_id, owner, confirmed=by_owner,
                                      parent=None if by_owner else sender.id)
        self.post(msgs)
        return rref

    def _run_into(self, entry: OwnerEntry, func: Any, args: Tuple[Any, ...],
                  kwargs: Dict[str, Any]) -> Optional[AsyncResult]:
        """Run ``func`` and store its value (or error) in ``entry``."""
        def settle(value: Any = None, error: Optional[BaseException] = None) -> None:
            if error is not None:
                entry.set_error(error)
            else:
                entry.set_value(value)
            self.book.value_settled(entry.rref_id)

        try:
            result = run_callable(func, args, kwargs, self.agent)
        except BaseException as exc:  # noqa: BLE001 - stored on the entry
            settle(error=exc)
            raise
        if not isinstance(result, AsyncResult):
            settle(result)
            return None
        done: torch.futures.Future = torch.futures.Future()

        def finish(f: torch.futures.Future) -> None:
            try:
                value = f.wait()
            except BaseException as exc:  # noqa: BLE001
                settle(error=exc)
                done.set_exception(exc)
            else:
                settle(value)
                done.set_result(None)
        result.future.add_done_callback(finish)
        return AsyncResult(done)

    # -- handlers (owner side unless noted) ----------------------------------------------------

    def _on_remote_call(self, src: WorkerInfo, payload: Tuple[Any, ...]) -> Any:
        func, args, kwargs, rref_id, fork_id, deletes = payload
        self._remove_forks(deletes)
        self.book.add_fork(rref_id, fork_id, src.id)
        entry = self.book.owner_entry(rref_id)
        return self._run_into(entry, func, args, kwargs)

    def _on_fetch(self, src: WorkerInfo, payload: Tuple[Any, ...]) -> AsyncResult:
        rref_id, deletes = payload
        self._remove_forks(deletes)
        return AsyncResult(self.book.owner_entry(rref_id).future)

    def _on_user_delete(self, src: WorkerInfo, payload: Tuple[Any, ...]) -> None:
        self.delete_messages += 1
        self._remove_forks(payload)

    def _remove_forks(self, pairs: Tuple[Tuple[GloballyUniqueId, GloballyUniqueId], ...]) -> None:
        for rref_id, fork_id in pairs:
            self.book.remove_fork(rref_id, fork_id)

    def _on_fork_request(self, src: WorkerInfo, payload: Tuple[Any, ...]) -> None:
        rref_id, fork_id = payload
        self.book.add_fork(rref_id, fork_id, src.id)

    def _on_child_accept(self, src: WorkerInfo, payload: Tuple[Any, ...]) -> None:
        (fork_id,) = payload
        self.book.child_accepted(fork_id)

    # -- control messages ----------------------------------------------------------------------

    def post(self, msgs: List[Msg]) -> None:
        """Send ``msgs`` from the sender thread; deletions wait to travel with others."""
        if not msgs:
            return
        other = [m for m in msgs if m.kind != Kind.RREF_USER_DELETE]
        if len(other) < len(msgs):
            with self._del_lock:
                self._owe([m for m in msgs if m.kind == Kind.RREF_USER_DELETE])
        if other:
            self._queue.put(("msgs", other))

    def _owe(self, deletes: List[Msg]) -> None:
        # Under _del_lock: the USER_DELETE messages become pairs owed to their owners.
        for m in deletes:
            self._ready.setdefault(m.dst, []).extend(m.payload)

    def _collect(self) -> None:
        # Under _del_lock: turn the garbage collected forks into USER_DELETE pairs.
        deferred = self.deferred
        while deferred:
            self._owe(self.book.user_deleted(deferred.popleft()))

    def take_deletes(self, owner: int) -> Tuple[Tuple[GloballyUniqueId, GloballyUniqueId], ...]:
        """The deletions owed to ``owner``, for a request to it to carry."""
        if not self.deferred and not self._ready:
            return ()
        with self._del_lock:
            self._collect()
            return tuple(self._ready.pop(owner, ()))

    def return_deletes(self, owner: int,
                       deletes: Tuple[Tuple[GloballyUniqueId, GloballyUniqueId], ...]) -> None:
        """The request that carried ``deletes`` failed: send them again (removing a fork
        twice is harmless)."""
        if deletes:
            with self._del_lock:
                self._ready.setdefault(owner, []).extend(deletes)

    def _tick(self) -> None:
        # Timer thread: deletions no request took along go out by themselves.
        if self.deferred or self._ready:
            self._queue.put(("deletes", None))

    def _send_deletes(self) -> None:
        with self._del_lock:
            self._collect()
            ready, self._ready = self._ready, {}
        for dst, pairs in ready.items():
            self._send(Msg(dst, Kind.RREF_USER_DELETE, tuple(pairs)))

    def _send_loop(self) -> None:
        q, guard = self._queue, self._guard
        while guard.ok:
            item = q.get()
            if item is None:
                return
            with guard:
                self._handle(*item)

    def _handle(self, what: str, arg: Any) -> None:
        """Sender thread: act on one item of the queue."""
        if what == "deletes":
            self._send_deletes()
        elif what == "flush":
            try:
                self._send_deletes()
            finally:
                arg.set()  # shutdown waits for it, whatever happened
        else:
            for msg in arg:
                try:
                    self._send(msg)
                except Exception as exc:  # noqa: BLE001 - the other messages still go
                    self._guard.failed(exc)

    def _send(self, msg: Msg) -> None:
        agent = self.agent
        try:
            dst = agent.resolve(msg.dst)
            fut = agent.request(dst, msg.kind, msg.payload, agent.default_timeout,
                                what=f"RRef control message {msg.kind.name}",
                                retry=_CONTROL_RETRY)
        except Exception as exc:  # noqa: BLE001 - control messages are best effort past here
            log.debug("%s to rank %d failed: %s", msg.kind.name, msg.dst, exc)
            return
        if msg.kind == Kind.RREF_FORK_REQUEST:
            fork_id = msg.payload[1]
            fut.add_done_callback(lambda f: self._fork_confirmed(fork_id, f))

    def _fork_confirmed(self, fork_id: GloballyUniqueId, fut: torch.futures.Future) -> None:
        try:
            fut.wait()
        except BaseException as exc:  # noqa: BLE001 - the owner is unreachable
            rref = self._users.get(fork_id)
            if rref is not None:
                rref._record_error(exc)
            log.warning("owner did not confirm RRef fork %s: %s", fork_id, exc)
        rref = self._users.get(fork_id)
        if rref is not None:
            rref._confirmed = True
        self.post(self.book.user_confirmed(fork_id))
        gate = self._confirmations.pop(fork_id, None)
        if gate is not None:
            gate.set_result(None)

    def confirmation(self, fork_id: GloballyUniqueId) -> torch.futures.Future:
        """A future that completes when the owner has confirmed the user fork ``fork_id``
        (or could not be reached)."""
        gate = self._confirmations.setdefault(fork_id, torch.futures.Future())
        rref = self._users.get(fork_id)
        if (rref is None or rref._confirmed) and self._confirmations.pop(fork_id, None):
            gate.set_result(None)
        return gate

    def _flush(self, deadline: Optional[float]) -> None:
        done = threading.Event()
        self._queue.put(("flush", done))
        while not done.wait(0.05):
            self._check_deadline(deadline, "RRef control messages to be sent")

    def _check_deadline(self, deadline: Optional[float], what: str) -> None:
        self.agent.check_peers()
        if deadline is not None and time.monotonic() > deadline:
            raise RpcError(f"shutdown timed out waiting for {what}: {self.book.counts()}")

    # -- lost workers --------------------------------------------------------------------------

    def _worker_lost(self, worker: WorkerInfo, error: RpcError) -> None:
        """``worker`` is gone: release the forks it held here, and make the RRefs it owned
        fail at once, naming it."""
        orphans = self.book.worker_lost(worker.id)
        with self._del_lock:
            self._ready.pop(worker.id, None)  # deletions nobody can receive
        failure = ConnectionLostError(
            f"the owner of this RRef, worker {worker.name} (rank {worker.id}), is lost, and "
            f"the value with it: {error}", worker=worker.name)
        for fork_id in orphans:
            rref = self._users.get(fork_id)
            if rref is not None:
                rref._record_error(failure)
                rref._confirmed = True
                rref._deleted = True  # nothing to tell its owner when it is collected
            gate = self._confirmations.pop(fork_id, None)
            if gate is not None:
                gate.set_result(None)
        if orphans:
            log.info("%s dropped %d RRefs owned by lost worker %s", self.agent.name,
                     len(orphans), worker.name)

    # -- shutdown ------------------------------------------------------------------------------

    def _settle(self, deadline: Optional[float]) -> None:
        """Graceful shutdown: phase 1 settles forks in flight; phase 2 (after every worker
        stopped calling) deletes all user RRefs left here."""
        self._phase += 1
        if self._phase == 1:
            gc.collect(0)  # cheap: young garbage RRefs send their deletes now; phase 2 gets the rest
        if self._phase >= 2:
            self._delete_users()
        self._flush(deadline)
        delay = 0.001
        while not self.book.settled():
            self._check_deadline(deadline, "RRef forks to be confirmed")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        self._flush(deadline)

    def _delete_users(self) -> None:
        """Mark every live user RRef here deleted and queue its USER_DELETE."""
        for fork_id in self.book.live_user_forks():
            rref = self._users.get(fork_id)
            if rref is not None:
                rref._deleted = True
            self.deferred.append(fork_id)

    def delete_all_users(self, timeout: float) -> None:
        """Release every user RRef held here and wait until the deletes are sent."""
        self._delete_users()
        self._flush(time.monotonic() + timeout if timeout > 0 else None)

    def _stop(self) -> None:
        self._queue.put(None)
        if self._sender is not threading.current_thread():
            self._sender.join(10)
        with self._users_lock:
            users = list(self._users.values())
        for rref in users:
            rref._deleted = True
        self.book.clear()


def install(agent: Agent) -> None:
    """Put the RRef protocol on ``agent`` (called by ``init_rpc`` for every new agent)."""
    RRefLayer(agent)


def remote(agent: Agent, dst: WorkerInfo, func: Any, args: Tuple[Any, ...],
           kwargs: Dict[str, Any], timeout: float) -> RRef:
    return _layer_of(agent).remote(dst, func, args, kwargs, timeout)


def delete_all_users(agent: Agent, timeout: float) -> None:
    _layer_of(agent).delete_all_users(timeout)


def live_users(agent: Agent) -> List[str]:
    """The user RRefs ``agent`` still holds, each as torch names it in a leak report."""
    return [f"{_gid(state.rref_id)} with fork Id {_gid(fork_id)}"
            for fork_id, state in _layer_of(agent).book.user_states()]


__all__ = ["RRef", "RRefLayer", "delete_all_users", "install", "live_users", "remote",
           "describe"]
