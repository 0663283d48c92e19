"""A fault-injecting backend for tests, registered as ``BackendType.FAULTY_TENSORPIPE``.

Like torch's faulty agent, it fails or delays the sends of chosen message kinds:
``messages_to_fail`` names kinds whose first ``num_fail_sends`` sends (each kind
counted apart) fail as if the connection had broken, before any byte leaves (where the
other end could learn of it no other way, the connection then breaks indeed: a private
one, which carries one call, and any one a reply fails on);
``messages_to_delay`` maps kinds to seconds by which every send of that kind is
held back (without blocking the sender) and then delivered, even if its connection
closed meanwhile, as bytes sent before a TCP close are. Kinds are named as in
:class:`torchrpc._wire.Kind` (``CALL``, ``RESPONSE``, ``RREF_USER_DELETE``, ...) or
by torch's message type names (``PYTHON_CALL``, ``SCRIPT_REMOTE_CALL``,
``CLEANUP_AUTOGRAD_CONTEXT_REQ``, ...). Every request and reply goes through the
fault plan at the connection it leaves on (private connections of blocking calls
included), and a request to the worker itself meets it before it starts; heartbeats
and GOODBYE meet it only when a plan names them. It talks to normal workers, so one
faulty worker in a group is enough.

Import this module on every process that uses the backend::

    import torchrpc._testing.faulty as faulty
    rpc.init_rpc("w0", backend=rpc.BackendType.FAULTY_TENSORPIPE, rank=0, world_size=2,
                 rpc_backend_options=faulty.FaultyTensorPipeRpcBackendOptions(
                     messages_to_fail=["CALL"], num_fail_sends=2))

Tests may change the plan of a running agent with :meth:`FaultyAgent.inject`, which
can also drop sends: the first ``num_drop_sends`` sends of each kind in ``drop`` are
discarded while the sender believes them sent, as frames lost with a connection that
breaks later (the test breaks it).
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Dict, Iterable, Optional, Sequence

from .._agent import Agent, WorkerInfo
from .._agent.settings import Settings
from .._transport import Connection
from .._wire import Kind
from ..errors import ConnectionLostError, RpcError
from ..rpc import backend_registry, constants
from ..rpc.options import TensorPipeRpcBackendOptions, agent_settings, rendezvous_plan_of

BACKEND_NAME = "FAULTY_TENSORPIPE"

# torch's message type names -> torchrpc's kinds, so ported tests keep their plans.
TORCH_NAMES = {
    "PYTHON_CALL": Kind.CALL, "SCRIPT_CALL": Kind.CALL,
    "PYTHON_RET": Kind.RESPONSE, "SCRIPT_RET": Kind.RESPONSE, "EXCEPTION": Kind.ERROR,
    "PYTHON_REMOTE_CALL": Kind.RREF_REMOTE_CALL, "SCRIPT_REMOTE_CALL": Kind.RREF_REMOTE_CALL,
    "PYTHON_RREF_FETCH_CALL": Kind.RREF_FETCH, "SCRIPT_RREF_FETCH_CALL": Kind.RREF_FETCH,
    "CLEANUP_AUTOGRAD_CONTEXT_REQ": Kind.AUTOGRAD_RELEASE,
    "BACKWARD_AUTOGRAD_REQ": Kind.AUTOGRAD_BACKWARD,
}


def kind_of(name: Any) -> Kind:
    """The kind a message name stands for; ValueError listing the valid names."""
    if isinstance(name, Kind):
        return name
    if isinstance(name, str):
        if name in Kind.__members__:
            return Kind[name]
        if name in TORCH_NAMES:
            return TORCH_NAMES[name]
    raise ValueError(f"unknown message kind {name!r}; use one of {sorted(Kind.__members__)} "
                     f"or torch's names {sorted(TORCH_NAMES)}")


class FaultPlan:
    """Which sends fail and which are delayed; counts what it did. Thread-safe."""

    def __init__(self, fail: Iterable[Any] = (), num_fail_sends: int = 0,
                 delay: Optional[Dict[Any, float]] = None, drop: Iterable[Any] = (),
                 num_drop_sends: int = 0) -> None:
        for name, n in (("num_fail_sends", num_fail_sends), ("num_drop_sends", num_drop_sends)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"{name} must be an int >= 0, got {n!r}")
        self._lock = threading.Lock()
        self._to_fail = {int(kind_of(k)): num_fail_sends for k in fail}
        self._to_drop = {int(kind_of(k)): num_drop_sends for k in drop}
        self._delay: Dict[int, float] = {}
        for k, seconds in (delay or {}).items():
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
                raise ValueError(f"delay of {k!r} must be seconds >= 0, got {seconds!r}")
            self._delay[int(kind_of(k))] = float(seconds)
        self.failed: Dict[str, int] = {}
        self.delayed: Dict[str, int] = {}
        self.dropped: Dict[str, int] = {}

    def should_fail(self, kind: int) -> bool:
        return self._take(self._to_fail, self.failed, kind)

    def should_drop(self, kind: int) -> bool:
        return self._take(self._to_drop, self.dropped, kind)

    def _take(self, budget: Dict[int, int], done: Dict[str, int], kind: int) -> bool:
        """Whether this send of ``kind`` is one of the faults left in ``budget``."""
        with self._lock:
            left = budget.get(kind, 0)
            if left <= 0:
                return False
            budget[kind] = left - 1
            name = Kind(kind).name
            done[name] = done.get(name, 0) + 1
            return True

    def delay_for(self, kind: int) -> float:
        seconds = self._delay.get(kind, 0.0)
        if seconds > 0:
            with self._lock:
                name = Kind(kind).name
                self.delayed[name] = self.delayed.get(name, 0) + 1
        return seconds


class FaultyTensorPipeRpcBackendOptions(TensorPipeRpcBackendOptions):
    """Options of the faulty backend: those of the default backend, plus the fault plan.

    Args:
        messages_to_fail (List[str]): kinds whose first ``num_fail_sends`` sends fail.
        messages_to_delay (Dict[str, float]): kinds to delay, with the delay in seconds.
        num_fail_sends (int): how many sends of each kind in ``messages_to_fail`` fail.
        **kwargs: as for :class:`~torchrpc.rpc.TensorPipeRpcBackendOptions`.
    """

    def __init__(self, *, messages_to_fail: Iterable[str] = (),
                 messages_to_delay: Optional[Dict[str, float]] = None,
                 num_fail_sends: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        FaultPlan(messages_to_fail, num_fail_sends, messages_to_delay)  # validate now
        self.messages_to_fail = list(messages_to_fail)
        self.messages_to_delay = dict(messages_to_delay or {})
        self.num_fail_sends = num_fail_sends


def injected_failure(kind: int, worker: str, what: str = "") -> ConnectionLostError:
    """The error of a send of ``kind`` to ``worker`` that the fault plan fails."""
    return ConnectionLostError(f"injected fault: a send of {Kind(kind).name} to worker "
                               f"{worker}{what} failed ({BACKEND_NAME} messages_to_fail)",
                               worker=worker)


class FaultyConnection(Connection):
    """A connection whose frames meet its agent's :class:`FaultPlan` before they leave.

    Every frame goes through :meth:`send`, on the shared connection and on the private
    ones of blocking calls alike, so the faulty backend runs the production fast paths.
    """

    def __init__(self, agent: "FaultyAgent", *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._agent = agent

    def send(self, kind: int, flags: int, request_id: int, envelope: bytes,
             buffers: Sequence[memoryview], keepalive: Any = None) -> None:
        plan = self._agent.faults
        if plan.should_fail(kind):
            error = injected_failure(kind, self._agent.peer(self.peer_rank).name)
            # The other end learns of a failed send only as of a real one, by the break:
            # a private connection's one call, and the caller of a reply, which has no
            # other way to know that the reply will not come.
            if self.private or kind == Kind.RESPONSE or kind == Kind.ERROR:
                self.close(error)
            raise error
        if plan.should_drop(kind):
            return  # lost on the way, as if in the buffers of a connection that breaks
        seconds = plan.delay_for(kind)
        if seconds > 0:  # held back without blocking the sender
            self._agent.call_later(seconds, self._send_late, kind, flags, request_id,
                                   envelope, buffers, keepalive)
            return
        super().send(kind, flags, request_id, envelope, buffers, keepalive)

    def _send_late(self, kind: int, flags: int, request_id: int, envelope: bytes,
                   buffers: Sequence[memoryview], keepalive: Any) -> None:
        # A held-back frame is on the wire already: as TCP delivers what was sent before
        # a close, one whose connection closed meanwhile goes on the shared connection.
        agent = self._agent
        peer = agent.peer(self.peer_rank)
        try:
            conn = agent.connections.to(peer) if self.closed else self
            Connection.send(conn, kind, flags, request_id, envelope, buffers, keepalive)
        except RpcError as exc:
            agent.calls.send_failed(kind, request_id, peer, exc)


class FaultyAgent(Agent):
    """An agent whose connections are :class:`FaultyConnection` objects; a request to itself
    meets the same plan."""

    def __init__(self, store: Any, name: str, rank: int, world_size: Optional[int],
                 settings: Settings, faults: FaultPlan) -> None:
        super().__init__(store, name, rank, world_size, settings,
                         connection_type=functools.partial(FaultyConnection, self))
        self.faults = faults

    def inject(self, fail: Iterable[Any] = (), num_fail_sends: int = 0,
               delay: Optional[Dict[Any, float]] = None, drop: Iterable[Any] = (),
               num_drop_sends: int = 0) -> FaultPlan:
        """Replace the fault plan (counters restart); return the new plan."""
        self.faults = FaultPlan(fail, num_fail_sends, delay, drop, num_drop_sends)
        return self.faults

    def peer(self, rank: int) -> WorkerInfo:
        """The worker of ``rank``; one named by its rank if it is not a member (any more)."""
        return self.registry.workers.get(rank) or WorkerInfo(str(rank), rank)



def _construct_options(rpc_timeout: float = constants.DEFAULT_RPC_TIMEOUT_SEC,
                       init_method: str = constants.DEFAULT_INIT_METHOD,
                       **kwargs: Any) -> FaultyTensorPipeRpcBackendOptions:
    return FaultyTensorPipeRpcBackendOptions(rpc_timeout=rpc_timeout, init_method=init_method,
                                             **kwargs)


def _init_backend(store: Any, name: str, rank: int, world_size: int, options: Any) -> Agent:
    if not isinstance(options, FaultyTensorPipeRpcBackendOptions):
        raise TypeError(f"`rpc_backend_options` must be a `FaultyTensorPipeRpcBackendOptions`. "
                        f"{options!r} is a {type(options).__name__}; build the options of "
                        f"BackendType.{BACKEND_NAME} with "
                        f"torchrpc._testing.FaultyTensorPipeRpcBackendOptions(...)")
    faults = FaultPlan(options.messages_to_fail, options.num_fail_sends,
                       options.messages_to_delay)
    agent = FaultyAgent(store, name, rank, world_size, agent_settings(options), faults)
    return agent.start(rendezvous_plan_of(options))


if not backend_registry.backend_registered(BACKEND_NAME):
    backend_registry.register_backend(BACKEND_NAME, _construct_options, _init_backend)
