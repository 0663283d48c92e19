"""Functions and classes that tests run remotely (importable on every worker)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, List, Sequence, Tuple

import torch

import torchrpc.rpc as rpc
from torchrpc.rpc import RRef


def add(a: Any, b: Any) -> Any:
    return a + b


def echo(x: Any) -> Any:
    return x


def sleep_then(seconds: float, value: Any = None) -> Any:
    time.sleep(seconds)
    return value


def raise_value_error(msg: str) -> None:
    raise ValueError(msg)


class OddError(Exception):
    """An exception whose constructor does not take a single message."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(code, detail)
        self.code = code
        self.detail = detail


def raise_odd(code: int) -> None:
    raise OddError(code, "odd failure")


def call_raise_on(to: str, msg: str) -> None:
    """Make ``to`` raise ``ValueError(msg)`` in a call from this worker."""
    rpc.rpc_sync(to, raise_value_error, args=(msg,))


def return_future() -> torch.futures.Future:
    return torch.futures.Future()


def whoami() -> str:
    return rpc.get_worker_info().name


def pid() -> int:
    return os.getpid()


def served_by_reader() -> bool:
    """Whether this call runs on the thread that read it from its connection (inline)."""
    from torchrpc._agent.futures import on_reader_thread
    return on_reader_thread()


def thread_names() -> list:
    return [t.name for t in threading.enumerate()]


def nested_call(to: str, depth: int) -> str:
    """Call ``to`` synchronously, which calls back, ``depth`` levels deep."""
    me = rpc.get_worker_info().name
    if depth == 0:
        return me
    return me + ">" + rpc.rpc_sync(to, nested_call, args=(me, depth - 1))


def nested_sleep(to: str, seconds: float) -> float:
    """Block a pool thread in an RPC that itself blocks for a while."""
    return rpc.rpc_sync(to, sleep_then, args=(seconds, seconds))


def return_unpicklable() -> Any:
    return threading.Lock()


def debug_info() -> dict:
    return rpc.get_debug_info()


@torch.jit.script
def script_rref_add(ref: RRef[torch.Tensor], t: torch.Tensor) -> torch.Tensor:
    return ref.to_here() + t


@torch.jit.script
def script_raise(message: str) -> torch.Tensor:
    raise ValueError(message)


@torch.jit.script
def script_add(x: torch.Tensor, y: int) -> torch.Tensor:
    return x + y


class Counter:
    """A picklable object whose bound methods are called remotely."""

    def __init__(self, start: int) -> None:
        self.start = start

    def plus(self, n: int) -> int:
        return self.start + n

    @staticmethod
    def static_mul(a: int, b: int) -> int:
        return a * b

    @classmethod
    def cls_name(cls, suffix: str) -> str:
        return cls.__name__ + suffix


@rpc.functions.async_execution
def async_add_chained(to: str, x: torch.Tensor, y: Any, z: Any) -> torch.futures.Future:
    return rpc.rpc_async(to, torch.add, args=(x, y)).then(lambda fut: fut.wait() + z)


@rpc.functions.async_execution
def async_not_a_future() -> int:
    return 3


@rpc.functions.async_execution
def async_fails(to: str) -> torch.futures.Future:
    return rpc.rpc_async(to, raise_value_error, args=("async boom",))


@rpc.functions.async_execution
def async_delayed(value: Any, seconds: float) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()

    def later() -> None:
        time.sleep(seconds)
        fut.set_result(value)
    threading.Thread(target=later, daemon=True).start()
    return fut


class AsyncExecutionClass:
    @staticmethod
    @rpc.functions.async_execution
    def static_async_add(to: str, x: torch.Tensor, y: Any, z: Any) -> torch.futures.Future:
        return rpc.rpc_async(to, torch.add, args=(x, y)).then(lambda fut: fut.wait() + z)

    @classmethod
    @rpc.functions.async_execution
    def class_async_add(cls, to: str, x: torch.Tensor, y: Any, z: Any) -> torch.futures.Future:
        ret_fut: torch.futures.Future = torch.futures.Future()
        rpc.rpc_async(to, torch.add, args=(x, y)).then(lambda fut: ret_fut.set_result(fut.wait() + z))
        return ret_fut

    @rpc.functions.async_execution
    def bound_async_add(self, to: str, x: torch.Tensor, y: Any, z: Any) -> torch.futures.Future:
        return rpc.rpc_async(to, torch.add, args=(x, y)).then(lambda fut: fut.wait() + z)


# -- RRef helpers ---------------------------------------------------------------------------


class Store:
    """A remote object with plain and async methods."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def get(self) -> Any:
        return self.value

    def add(self, n: Any) -> Any:
        self.value = self.value + n
        return self.value

    @rpc.functions.async_execution
    def async_get_plus(self, to: str, n: Any) -> torch.futures.Future:
        return rpc.rpc_async(to, add, args=(self.value, n))


def make_rref(value: Any) -> rpc.RRef:
    """Runs on the owner: returns an owner RRef to the caller (owner -> user)."""
    return rpc.RRef(value)


def rref_to_here(rref: rpc.RRef) -> Any:
    return rref.to_here()


def rref_value_plus(rref: rpc.RRef, n: Any) -> Any:
    """Works on owner and user alike."""
    value = rref.local_value() if rref.is_owner() else rref.to_here()
    return value + n


def rref_info(rref: rpc.RRef) -> tuple:
    return (rref.is_owner(), rref.owner_name(), rref.confirmed_by_owner())


def forward_rref(to: str, rref: rpc.RRef) -> Any:
    """user -> user fork: pass the RRef on to another worker that reads it."""
    return rpc.rpc_sync(to, rref_to_here, args=(rref,))


def rref_in_containers(data: dict) -> Any:
    return sum(r.to_here() for r in data["list"]) + data["map"]["x"].to_here()


def echo_rrefs(data: Any) -> Any:
    return data


def owns_rref(rref_id: Any) -> bool:
    """Whether this worker has an owner entry for ``rref_id`` (its creation arrived)."""
    from torchrpc._agent.current import current_agent
    from torchrpc._rref import RREF_LAYER
    book = current_agent().extensions[RREF_LAYER].book
    with book._lock:
        return tuple(rref_id) in book.owners


def rref_counts() -> dict:
    import gc
    gc.collect()
    info = rpc.get_debug_info()
    return {k: info[k] for k in ("num_owner_rrefs", "num_forks", "num_pending_users",
                                  "num_pending_children", "num_user_rrefs")}


def hold_remote(to: str, value: Any) -> rpc.RRef:
    """Creates an RRef owned by ``to`` and returns it (user -> user return value)."""
    return rpc.remote(to, echo, args=(value,))


def fan_out(to: str, n: int) -> int:
    """Creates n RRefs on ``to`` and drops them."""
    refs = [rpc.remote(to, echo, args=(i,)) for i in range(n)]
    return sum(r.to_here() for r in refs[:3])


def blocking_to_here(rref: rpc.RRef) -> Any:
    return rref.to_here()


def worker_infos() -> list:
    return rpc.get_worker_infos()


def view_of(rank: int) -> dict:
    """What this worker knows of worker ``rank`` by itself: its open connections with it,
    whether it saw one of them break, and why the group removed it (None if it did not)."""
    from torchrpc.rpc import api
    agent = api.current_agent()
    return {"connections": sum(1 for c in agent._transport.connections() if c.peer_rank == rank),
            "lost_connection": rank in agent.connections.lost, "removed": agent.registry.removed.get(rank)}


def call_outcome(to: str) -> str:
    """``rpc_sync(to, whoami)`` from here: the name it returns, or its error's type and text."""
    try:
        return rpc.rpc_sync(to, whoami, timeout=30)
    except Exception as exc:  # noqa: BLE001 - returned to the test
        return f"{type(exc).__name__}: {exc}"


def connection_census() -> dict:
    """This worker's open connections: private ones, shared ones, and how many of the
    agent's registry (heartbeats, liveness) are private (must be none)."""
    from torchrpc.rpc import api
    agent = api.current_agent()
    conns = agent._transport.connections()
    registered = [c for lst in agent.connections.all.values() for c in lst if not c.closed]
    return {"private": sum(c.private for c in conns), "shared": sum(not c.private for c in conns),
            "registered_private": sum(c.private for c in registered)}


def run_in_threads(fn: Callable[..., Any], args: Sequence[Tuple[Any, ...]],
                   timeout: float = 60.0) -> List[BaseException]:
    """Run ``fn(*a)`` for each ``a`` in ``args``, one thread each, all at once; join them
    and return what they raised (empty when every run succeeded)."""
    errors: List[BaseException] = []

    def run(*a: Any) -> None:
        try:
            fn(*a)
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=a) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), f"threads still running after {timeout} s"
    return errors


def return_nested_unpicklable() -> Any:
    return {"ok": [1, 2], "bad": [0, threading.Lock()]}


def share_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two received tensors are views of one storage."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def array_layout(a: Any) -> Tuple[Any, ...]:
    """What a received numpy array looks like here: type, dtype, shape, strides, flags."""
    return (type(a).__name__, str(a.dtype), a.shape, a.strides, a.flags.writeable,
            a.flags.f_contiguous, a.tobytes())


def stop_heartbeats() -> bool:
    """Make this worker silent while it keeps running (its heartbeat thread sends nothing)."""
    from torchrpc._agent.current import current_agent
    current_agent().liveness._beat = lambda *args: None
    return True


def goodbye_to(rank: int) -> bool:
    """Send GOODBYE to ``rank`` on every connection to it, as a stopping worker does, but
    keep running and serving: the window between a peer's GOODBYE and its closed socket."""
    import time
    from torchrpc._agent.connections import goodbye
    from torchrpc._agent.current import current_agent
    agent = current_agent()
    # The caller's shared connection here may still be registering (its handshake ends
    # on the caller's side first); a GOODBYE needs it.
    deadline = time.monotonic() + 10.0
    while not agent.connections.all.get(rank) and time.monotonic() < deadline:
        time.sleep(0.01)
    conns = list(agent.connections.all.get(rank, []))
    assert conns, f"no shared connection to rank {rank} to say GOODBYE on"
    for conn in conns:
        goodbye(conn)
    return True


def flood(to: str, n: int, seconds: float) -> Tuple[int, List[str]]:
    """Start ``n`` calls of ``sleep_then(seconds)`` on ``to`` at once; return how many
    succeeded and the errors of the others as ``"Type: message"``."""
    futs = [rpc.rpc_async(to, sleep_then, args=(seconds, i)) for i in range(n)]
    ok, errors = 0, []
    for fut in futs:
        try:
            fut.wait()
            ok += 1
        except Exception as exc:  # noqa: BLE001 - reported to the test
            errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
    return ok, errors


def open_private_connections(to: str, n: int) -> int:
    """Make ``n`` blocking calls to ``to`` at once, so that ``n`` private connections are
    opened; return how many this worker holds to ``to`` afterwards (idle, in its free list)."""
    from torchrpc._agent.current import current_agent
    barrier = threading.Barrier(n)

    def call() -> None:
        barrier.wait(10)
        assert rpc.rpc_sync(to, sleep_then, args=(0.5, 1)) == 1
    threads = [threading.Thread(target=call) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    agent = current_agent()
    return len(agent.lanes.private.idle_to(agent.resolve(to).id))


_kept: List[Any] = []


def keep(x: Any) -> int:
    """Hold ``x`` (an RRef, say) in this worker until it dies; how many are held."""
    _kept.append(x)
    return len(_kept)


def keep_remote(to: str, value: Any) -> Any:
    """Make an RRef owned by ``to`` and hold it here; its value."""
    rref = rpc.remote(to, echo, args=(value,))
    keep(rref)
    return rref.to_here()


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps ``seconds`` (a slow part of a backward pass); it counts
    its starts (see :func:`slow_backward_starts`) and, with ``counted``, its runs
    (``bump("backward")``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float, counted: bool) -> torch.Tensor:
        ctx.seconds, ctx.counted = seconds, counted
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        from tests.support.robust import bump
        if ctx.counted:
            bump("backward")
        bump("slow backward")
        time.sleep(ctx.seconds)
        return grad, None, None


def slow_backward_starts() -> int:
    """How many times a backward pass entered the slow part of ``_SlowBackward`` here."""
    from tests.support.robust import count
    return count("slow backward")


def slow_identity(x: torch.Tensor) -> torch.Tensor:
    return _SlowBackward.apply(x, 3.0, False)


def fan_through(x: torch.Tensor, slow: str, fast: str) -> torch.Tensor:
    """Run on an intermediate worker: send ``x`` on to two workers, one slow in backward."""
    a = rpc.rpc_sync(slow, slow_identity, args=(x,))
    b = rpc.rpc_sync(fast, torch.mul, args=(x, 2))
    return a + b


def autograd_contexts() -> int:
    return rpc.get_debug_info()["num_autograd_contexts"]


stopped_serving = threading.Event()  # see tests.support.worker_main's TORCHRPC_TEST_SERVE


def stop_serving() -> bool:
    stopped_serving.set()
    return True


_weight = torch.full((4,), 3.0, requires_grad=True)


def scale_slowly(x: torch.Tensor) -> torch.Tensor:
    """``x`` times a weight that lives here; the backward pass through it is slow."""
    return _SlowBackward.apply(x * _weight, 2.0, True)


def times_weight(x: torch.Tensor) -> torch.Tensor:
    """``x`` times a weight that lives here."""
    return x * _weight


def weight_gradient(context_id: int) -> torch.Tensor:
    import torchrpc.autograd as dist_autograd
    return dist_autograd.get_gradients(context_id)[_weight]


def stream_to(to: str, nbytes: int, seconds: float) -> bool:
    """Start echoing ``nbytes`` tensors off ``to`` in a thread for ``seconds``; return at once."""
    def run() -> None:
        stop = time.monotonic() + seconds
        x = torch.ones(nbytes, dtype=torch.uint8)
        while time.monotonic() < stop:
            try:
                rpc.rpc_sync(to, echo, args=(x,), timeout=10)
            except Exception:  # noqa: BLE001 - the test kills the peer on purpose
                return
    threading.Thread(target=run, daemon=True).start()
    return True


def relay(to: str, fn: Callable[..., Any], x: torch.Tensor) -> torch.Tensor:
    """Run on an intermediate worker: ``fn(x)`` on ``to``, plus one (a nested call whose
    result takes part in the caller's graph)."""
    return rpc.rpc_sync(to, fn, args=(x,)) + 1
