"""The plug-in API: what upper layers (RRefs, distributed autograd, the profiler) use to
take part in the agent's messages without the agent knowing them.

A layer registers a handler per message kind (``Agent.register_handler``); a handler that
answers later returns an :class:`AsyncResult`. A :class:`CallHook` adds its metadata to
outgoing requests, gets a :class:`CallScope` around each request it serves, and sees
every tensor that crosses both ways. Pickling code of a layer reads the
:class:`MessageContext` of the message it (un)pickles: the peer, the message kind, and
what must happen before the request runs or after it is answered.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Generic, List, Optional, Tuple, TypeVar

import torch

from .._wire import Kind
from . import devices
from .worker import WorkerInfo


T = TypeVar("T")


class Slot(Generic[T]):
    """The key of one upper layer's object in :class:`Extensions`, defined by the layer that
    owns the object: a layer reaches another's object only by importing its slot."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Slot({self.name!r})"


class Extensions:
    """The objects upper layers keep per agent (the RRef layer, the autograd engine, the
    profiling hook...), each under its owner's :class:`Slot`; never keyed by a string."""

    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: Dict[Slot[Any], Any] = {}

    @staticmethod
    def _check(slot: Any) -> None:
        if not isinstance(slot, Slot):
            raise TypeError(f"extensions are keyed by a Slot that their layer defines, got "
                            f"{slot!r}; import the owner's slot instead of naming it")

    def install(self, slot: Slot[T], obj: T) -> T:
        """Keep ``obj`` under ``slot``, replacing what was there; returns ``obj``."""
        self._check(slot)
        self._items[slot] = obj
        return obj

    def get(self, slot: Slot[T]) -> Optional[T]:
        """The object under ``slot``, or None when its layer is not installed."""
        self._check(slot)
        return self._items.get(slot)

    def setdefault(self, slot: Slot[T], make: Callable[[], T]) -> T:
        """The object under ``slot``, made with ``make()`` and kept when there is none."""
        self._check(slot)
        obj = self._items.get(slot)
        if obj is None:
            obj = self._items.setdefault(slot, make())
        return obj

    def __getitem__(self, slot: Slot[T]) -> T:
        obj = self.get(slot)
        if obj is None:
            raise LookupError(f"no {slot.name} layer is installed on this agent")
        return obj


CUDA_IPC: Slot[Any] = Slot("cuda_ipc")
"""The slot of the agent's CUDA IPC part (``cuda_ipc.CudaIpc``), which message contexts
ask how CUDA tensors travel to their peer."""


class MessageContext:
    """What pickling code of upper layers may know about the message being (un)pickled.

    Read-only by convention. Not a frozen dataclass: one is built for every message
    both ways, and a frozen dataclass is slower to build.
    """

    __slots__ = ("agent", "peer", "kind", "replied", "on_settled", "gates", "per_peer")

    def __init__(self, agent: Any, peer: WorkerInfo, kind: int,
                 replied: bool = False) -> None:
        # The Agent (agent.py), for the upper layers' pickling; typed Any so that the
        # agent's parts, which make contexts, need not import agent.py.
        self.agent = agent
        self.peer = peer
        self.kind = kind
        # Set by pickling code whose output depends on the peer (an RRef fork): the
        # message cannot go to other workers as it is (see Agent.request_many).
        self.per_peer = False
        # A request that gets a reply: the reply shows that the callee has unpickled it.
        self.replied = replied
        # While encoding such a request: what to run once it is answered or has failed.
        self.on_settled: Optional[List[Callable[[], None]]] = None
        # While decoding a request: futures that must complete before it runs.
        self.gates: Optional[List[torch.futures.Future]] = None

    def add_gate(self, gate: torch.futures.Future) -> None:
        """Make the request being decoded run only once ``gate`` has completed (or the
        request's handling has waited the agent's RPC timeout for it)."""
        if self.gates is None:
            self.gates = []
        self.gates.append(gate)

    def when_settled(self, action: Callable[[], None]) -> None:
        """Run ``action`` once the request being encoded is answered or has failed
        (only for a request that gets a reply: check :attr:`replied`)."""
        if self.on_settled is None:
            self.on_settled = []
        self.on_settled.append(action)

    def target_device(self, device: torch.device) -> torch.device:
        """The device a CUDA tensor on ``device`` lands on at the peer (see
        :func:`devices.target_device`)."""
        return devices.target_device(self.agent.registry, self.peer, device,
                                     self.kind == Kind.RESPONSE)

    def cpu_target(self) -> Optional[torch.device]:
        """The device a CPU tensor lands on at the peer where a device map moves CPU
        tensors, else None (see :func:`devices.cpu_target`)."""
        return devices.cpu_target(self.agent.registry, self.peer, self.kind == Kind.RESPONSE)

    def cuda_share(self) -> Optional[Callable[..., Any]]:
        """How the message's CUDA tensors are shared with the peer through CUDA IPC (see
        ``cuda_ipc.CudaIpc.sharing``), or None where they travel as bytes."""
        ipc = self.agent.extensions.get(CUDA_IPC)
        return None if ipc is None else ipc.sharing(self.peer)

    def __repr__(self) -> str:
        return f"MessageContext(agent={self.agent.name!r}, peer={self.peer!r}, kind={self.kind})"


class AsyncResult:
    """A handler's way to say: reply when this future completes."""

    __slots__ = ("future",)

    def __init__(self, future: torch.futures.Future) -> None:
        self.future = future


class CallScope:
    """What a call hook does around one incoming request (all parts optional)."""

    recv_hook: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    send_hook: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    hook_key = ""  # set by the agent: the key of the hook that made this scope

    def __enter__(self) -> "CallScope":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def response_meta(self) -> Any:
        return None


class CallHook:
    """Base class of the hooks upper layers register with :meth:`Agent.add_call_hook`.

    ``key`` names the hook's entry in a message's metadata.
    """

    key = "hook"

    def outgoing_request(self, dst: WorkerInfo, kind: int
                         ) -> Optional[Tuple[Any, Optional[Callable], Any]]:
        """Caller side: return (meta value, tensor send hook, state) or None to stay out."""
        return None

    def incoming_request(self, src: WorkerInfo, kind: int, meta: Any) -> Optional[CallScope]:
        """Callee side, with this hook's meta value: return a scope or None."""
        return None

    def incoming_response(self, src: WorkerInfo, state: Any, meta: Any
                          ) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
        """Caller side, for the reply: return a tensor receive hook or None."""
        return None

    def request_failed(self, dst: WorkerInfo, state: Any) -> None:
        """Caller side: the request failed here, with no reply (it could not be encoded or
        sent, timed out, or its connection or the agent went down); it may or may not
        have reached ``dst``."""


class Described:
    """The name of a request's operation, made only if something asks for it (an error
    or a log names it): ``template.format(subject)``. Formatting it for every request
    would cost more than a small call's bookkeeping does."""

    __slots__ = ("template", "subject")

    def __init__(self, template: str, subject: Any) -> None:
        self.template = template
        self.subject = subject

    def __str__(self) -> str:
        return self.template.format(self.subject)


def describe(what: Any) -> str:
    """A readable name for the function or operation of a request."""
    if what is None:
        return "?"
    if isinstance(what, str):
        return what
    if type(what) is Described:
        return str(what)
    qual = getattr(what, "__qualname__", None) or getattr(what, "qualified_name", None) \
        or getattr(what, "__name__", None)
    if qual is None:
        return type(what).__name__
    module = getattr(what, "__module__", None)
    return f"{module}.{qual}" if module and module != "builtins" else str(qual)


def combine(hooks: List[Optional[Callable]]) -> Optional[Callable]:
    """One tensor hook that runs ``hooks`` in order (those not None); None if there are none."""
    hooks = [h for h in hooks if h is not None]
    if not hooks:
        return None
    if len(hooks) == 1:
        return hooks[0]

    def chained(t: torch.Tensor) -> torch.Tensor:
        for h in hooks:
            t = h(t)
        return t
    return chained
