"""Serving requests: a request goes to the handler of its kind, and its reply or error
back to the caller; the callee's side of at-most-once.

Theory of operation. The agent reads a request on some thread (the reading thread
itself, or a pool thread it was handed to) and calls :meth:`Dispatch.serve` there. The
request is decoded with the call hooks of the layers above (a layer whose key is in the
request's metadata, or one that asked to see every request: ``serve_all``), which
may open a *scope* around the handler (a distributed autograd context, a profiler
range) and add metadata to the reply; it waits for its *gates* (futures that must
complete before it runs, such as the RRefs it was sent) as a blocked pool thread. Then
the handler of its kind runs: ``CALL``'s runs the user's function (:func:`run_callable`),
the layers above register their own (``Agent.register_handler``). Its result goes back
as a ``RESPONSE`` on the connection the request came on, since the caller watches that
connection for it; an :class:`AsyncResult` (``@async_execution``, a coroutine) replies
when its future completes. Whatever fails, from decoding to encoding the result, goes
back as an ``ERROR`` carrying a ``RemoteErrorInfo`` (remote_error.py), and the callee
logs it, as torch's agent does. A one-way request gets no reply; its failure is logged.

At most once. A request with a retry policy is sent again when its connection fails
before the reply, and it may have arrived all the same: the caller cannot tell. So such
requests of the internal kinds (a backward pass part that must not add its gradients
twice, an autograd report that must not return its credit twice) carry FLAG_ONCE, and
the callee remembers them by (caller, request id) (:meth:`Dispatch.first_time`, once.py): a copy
that arrives while the first runs is dropped (the first one's reply goes to the caller's
current connection), one that arrives later gets the first one's reply again. A caller
that lost the connection may ask which of its requests arrived (a probe,
:meth:`Dispatch.answer_probe`) before it sends any again. Replies are remembered for
``once.KEEP`` seconds, and at most ``once.MAX`` requests at once (once.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from types import CoroutineType
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence

import torch

from .. import _wire
from .._transport import Connection, Releasable, Transport
from .._transport.logbudget import LogBudget
from .._wire import Kind
from ..errors import (OperatorSchemaError, OverloadedError, RpcError, SerializationError,
                      WrongTypeError)
from .coroutines import CoroutineRunner
from .current import current_agent
from .hooks import AsyncResult, CallHook, CallScope, MessageContext, combine, describe
from .once import OnceTable
from .pool import WorkerPool, current_pool
from .remote_error import capture
from .serving import WHAT, Clock, ServingTable, this_thread
from .snapshot import FUNCTION_FIRST
from .stats import PeerStats, nbytes
from .worker import WorkerInfo

log = logging.getLogger(__name__)

_CALL, _RESPONSE = int(Kind.CALL), int(Kind.RESPONSE)  # ints: an enum lookup is slow

# The key, in a request's metadata, of the ids of its caller's earlier at-most-once requests
# whose replies reached the caller: their kept replies can go (OnceTable.acknowledged).
ONCE_ACKS = "_once_acks"


class Send(Protocol):
    """Send one frame to a worker (on ``via``, if given); raise :class:`RpcError` when it
    cannot (:meth:`Connections.send <torchrpc._agent.connections.Connections.send>`, the
    one send function the agent hands its parts)."""

    def __call__(self, dst: WorkerInfo, kind: int, flags: int, rid: int, env: bytes,
                 bufs: Any, keep: Any, via: Optional[Connection] = None) -> None: ...


class Dispatch:
    """One agent's handlers by message kind, the serving of requests and their replies:
    handed what serving uses (see the constructor), and the transport by :meth:`adopt`."""

    def __init__(self, name: str, pool: WorkerPool, coroutines: CoroutineRunner,
                 context: Callable[..., MessageContext], hooks: List[CallHook],
                 serve_all: List[CallHook], stats: Dict[int, PeerStats], send: Send,
                 timeout: Callable[[], float], max_queued: int, clock: Clock) -> None:
        self._name = name  # the worker's
        self._pool = pool  # runs requests; at most max_queued wait for a thread (refuse)
        self._context = context  # (peer, kind, replied=False) -> the message's MessageContext
        # The layers' call hooks, and those that see every request (lists the agent fills).
        self._hooks, self._serve_all = hooks, serve_all
        self._stats = stats  # the traffic counters by rank (stats.Traffic.by_rank), read only
        self._send = send  # the one send function of the agent's parts (Connections.send)
        self._timeout = timeout  # the agent's RPC timeout now: how long gates are waited for
        self._max_queued = max_queued
        self._inline_max: Dict[int, int] = {}  # rank -> most tensor bytes in an envelope
        self.handlers: Dict[int, Callable[[WorkerInfo, Any], Any]] = {
            Kind.CALL: functools.partial(_handle_call, coroutines)}
        self._overloads = LogBudget(what="refused requests")
        self.once = OnceTable()  # the requests that may arrive again (once.py)
        # What this worker serves now, for snapshots (serving.py); entries are stamped
        # with ``clock.now`` (the agent's Scheduler: the time of its round under way).
        self.serving = ServingTable()
        self._clock = clock

    def register_handler(self, kind: int, handler: Callable[[WorkerInfo, Any], Any]) -> None:
        """:meth:`Agent.register_handler`."""
        self.handlers[int(kind)] = handler

    def adopt(self, transport: Transport) -> None:
        """The agent's transport has started: size replies by its ``inline_max``."""
        self._inline_max = transport.inline_max

    # -- serving ---------------------------------------------------------------------------------

    def serve(self, src: WorkerInfo, header: _wire.Header, envelope: bytes,
              buffers: List[torch.Tensor], handler: Optional[Callable],
              via: Optional[Connection] = None) -> None:
        """Run a request and send the reply (on ``via``, the connection it came on)."""
        rid, kind = header.request_id, header.kind
        oneway = header.flags & _wire.FLAG_ONEWAY
        scopes: List[CallScope] = []

        def recv_hook(meta: Any) -> Optional[Callable]:
            if not meta and not self._serve_all:
                return None
            if type(meta) is dict and ONCE_ACKS in meta:
                self.once.acknowledged(src.id, meta[ONCE_ACKS])
            for hook in self._hooks:
                if meta and hook.key in meta:
                    scope = hook.incoming_request(src, kind, meta[hook.key])
                elif hook in self._serve_all:
                    scope = hook.incoming_request(src, kind, None)
                else:
                    continue
                if scope is not None:
                    scope.hook_key = hook.key
                    scopes.append(scope)
            return combine([s.recv_hook for s in scopes])

        what: Any = kind  # the function, once known; only error paths describe it
        # What this thread serves, until the handler returns or, for an AsyncResult, until
        # the reply is sent (serving.py).
        table = self.serving
        stack = this_thread.stack
        if stack is None:
            stack = table.thread_stack()
        entry = [table, src, rid, kind, None, self._clock.now]
        stack.append(entry)
        waits = False  # the handler gave an AsyncResult that is replied to
        try:
            ctx = self._context(src, kind, replied=not oneway)
            _, payload = _wire.decode(envelope, buffers, ctx, recv_hook)
            buffers.clear()  # the tensors in payload hold what they need
            if ctx.gates is not None:
                self._pass_gates(ctx.gates)
            if kind == _CALL:
                what = entry[WHAT] = payload[0]
            elif kind in FUNCTION_FIRST:
                entry[WHAT] = payload[0]
            if handler is None:
                raise RpcError(f"worker {self._name} has no handler for message kind "
                               f"{Kind(kind).name}")
            for s in scopes:
                s.__enter__()
            try:
                result = handler(src, payload)
            finally:
                for s in reversed(scopes):
                    s.__exit__(None, None, None)
            if isinstance(result, AsyncResult) and not oneway:
                waits = True
                table.waiting[id(entry)] = entry  # before this thread lets it go
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
            if not oneway:
                self._reply_error(src, rid, exc, what, via)
            else:
                log.warning("one-way %s from %s failed: %s", Kind(kind).name, src.name, exc)
                if header.flags & _wire.FLAG_ONCE:
                    self.once.ran((src.id, rid))
            return
        finally:
            stack.pop()
        if oneway:
            if header.flags & _wire.FLAG_ONCE:
                self.once.ran((src.id, rid))
            return
        if waits:
            def done(fut: torch.futures.Future) -> None:
                try:
                    value = fut.wait()
                except BaseException as exc:  # noqa: BLE001
                    self._reply_error(src, rid, exc, what, via)
                else:
                    self._reply(src, rid, value, scopes, what, via=via)
                finally:
                    table.waiting.pop(id(entry), None)
            result.future.add_done_callback(done)
            return
        # Hand the result over and let go of the request: once the reply is staged
        # into shared memory, nothing may hold the request's segment any more, so the
        # caller finds it free for its next call.
        owned = [result]
        result = payload = None
        self._reply(src, rid, owned, scopes, what, owned=True, via=via)

    def _pass_gates(self, gates: List[torch.futures.Future]) -> None:
        """Wait (as a blocked pool thread) until every gate of a request has completed."""
        passed = threading.Semaphore(0)
        for gate in gates:
            gate.add_done_callback(lambda _: passed.release())
        pool = current_pool()
        deadline = time.monotonic() + (self._timeout() or 60.0)
        with pool.blocking() if pool is not None else contextlib.nullcontext():
            for _ in gates:
                if not passed.acquire(timeout=max(deadline - time.monotonic(), 0)):
                    break

    def _reply(self, dst: WorkerInfo, rid: int, value: Any, scopes: List[CallScope], what: Any,
               owned: bool = False, via: Optional[Connection] = None) -> None:
        """Send ``value`` back; with ``owned``, ``value`` is a one-item list to take it from."""
        if owned:
            value = value.pop()
        meta = send_hook = None
        if scopes:
            meta = {s.hook_key: s.response_meta() for s in scopes} or None
            send_hook = combine([s.send_hook for s in scopes])
        try:
            env, bufs, keep = _wire.encode(value, self._context(dst, _RESPONSE),
                                           send_hook, meta, "result",
                                           self._inline_max.get(dst.id, _wire.INLINE_MAX))
        except Exception as exc:  # noqa: BLE001 - a result that won't encode: the caller is told
            self._reply_error(dst, rid, exc, what, via)
            return
        if owned:
            value = None
            keep = Releasable(keep)
        self.send_reply(dst, _RESPONSE, rid, env, bufs, keep, via)
        _wire.prepare_encode()  # while the caller reads the reply

    def _reply_error(self, dst: WorkerInfo, rid: int, exc: BaseException, what: Any,
                     via: Optional[Connection] = None) -> None:
        stats = self._stats.get(dst.id)
        if stats is not None:
            stats.errors_in += 1
        # The callee's side of the story, as torch's agent reports it; the caller gets the error.
        _warn_even_unconfigured("%s raised %s: %s in %s called by %s", self._name,
                                type(exc).__name__, exc, describe(what), dst.name)
        self.send_error(dst, rid, exc, via)

    def send_error(self, dst: WorkerInfo, rid: int, exc: BaseException,
                   via: Optional[Connection] = None) -> None:
        """Answer request ``rid`` of ``dst`` with ``exc``."""
        info = capture(exc, self._name)
        try:
            env, bufs, keep = _wire.encode(info, self._context(dst, Kind.ERROR))
        except SerializationError:
            info.exc_type = RpcError
            env, bufs, keep = _wire.encode(info, self._context(dst, Kind.ERROR))
        self.send_reply(dst, Kind.ERROR, rid, env, bufs, keep, via)

    def send_reply(self, dst: WorkerInfo, kind: int, rid: int, env: bytes, bufs: Any, keep: Any,
                   via: Optional[Connection] = None) -> None:
        """Send a reply (``kind`` RESPONSE or ERROR) to request ``rid`` of ``dst``, on
        ``via`` if it can take it, else on the current connection; keep it if the request
        may arrive again."""
        stats = self._stats.get(dst.id)
        if stats is not None:
            stats.bytes_out += len(env) + nbytes(bufs) if bufs else len(env)
        if self.once.entries:  # some request may arrive again: is it this one?
            keep = self.once.remember((dst.id, rid), kind, env, bufs, keep)
        try:
            self._send(dst, kind, 0, rid, env, bufs, keep, via)
        except RpcError as exc:
            if via is not None and (not via.private or (dst.id, rid) in self.once.entries):
                # Broken: answer on the current connection (the caller ignores a reply it
                # no longer waits for; an at-most-once one is resent on another).
                self.send_reply(dst, kind, rid, env, bufs, keep)
                return
            log.warning("%s could not reply to %s: %s", self._name, dst.name, exc)

    def refuse(self, src: WorkerInfo, header: _wire.Header, via: Optional[Connection]) -> None:
        """Fail a request that would wait behind ``max_queued_requests`` others (one-way
        and at-most-once messages of the protocols are never refused: losing them would
        lose state)."""
        name = self._name
        queued = self._pool.num_pending
        self._overloads.warn("%s refused a %s from %s: %d requests wait for its "
                             "%d threads (max_queued_requests)", name,
                             Kind(header.kind).name, src.name, queued, self._pool.num_threads)
        self.send_error(src, header.request_id, OverloadedError(
            f"worker {name} is overloaded: {queued} requests already wait for a thread "
            f"(max_queued_requests is {self._max_queued}); slow down, wait for replies, or "
            f"raise num_worker_threads or max_queued_requests on {name}"), via)

    # -- at most once (see the module docs) --------------------------------------------------------

    def first_time(self, src: WorkerInfo, rid: int, via: Optional[Connection]) -> bool:
        """Whether request ``rid`` of ``src`` arrives for the first time; if not, send its
        reply again if there is one."""
        first, reply = self.once.arrived((src.id, rid))
        if first:
            return True
        log.info("%s got request %d of %s again; it runs once%s", self._name, rid,
                 src.name, " (its reply goes again)" if reply is not None else "")
        if reply is not None:
            kind, env, bufs, keep = reply
            self.send_reply(src, kind, rid, env, bufs, keep, via)
        return False

    def answer_probe(self, conn: Connection, src: WorkerInfo, envelope: bytes) -> None:
        """Callee: tell ``src`` which of the probed requests arrived here; send the kept
        reply again, ahead of the answer, for those answered already."""
        answers, replies = self.once.status(src.id, _wire.parse_probe(envelope))
        # On the probe's connection, the one known to reach the caller now.
        for rid, (kind, env, bufs, keep) in replies:
            self.send_reply(src, kind, rid, env, bufs, keep, conn)
        try:
            self._send(src, Kind.ONCE_STATUS, _wire.FLAG_ONEWAY, 0,
                        _wire.pack_status(answers), [], None, conn)
        except RpcError as exc:  # the caller's next attempt asks again
            log.info("%s could not answer a probe of %s: %s", self._name, src.name, exc)


# -- the handler of CALL ---------------------------------------------------------------------------


def _handle_call(coroutines: CoroutineRunner, src: WorkerInfo, payload: Any) -> Any:
    func, args, kwargs = payload
    return run_callable(func, args, kwargs, coroutines)


def run_callable(func: Any, args: Sequence[Any], kwargs: Optional[Dict[str, Any]],
                 coroutines: Optional[CoroutineRunner] = None) -> Any:
    """Run a user function; an ``@async_execution`` one, or one that returns a coroutine
    (an ``async def``), gives an :class:`AsyncResult`. Coroutines run on ``coroutines``
    (default: the current agent's event loop)."""
    if getattr(func, "_wrapped_async_rpc_function", None) is not None:
        fut = func(*args, **(kwargs or {}))
        if isinstance(fut, CoroutineType):
            return AsyncResult(_coroutines_of(coroutines).submit(fut))
        if not isinstance(fut, torch._C.Future):
            raise WrongTypeError(
                f"Functions decorated with @rpc.async_function must return a "
                f"torch.futures.Future object, but got {type(fut).__name__} from "
                f"{describe(func)}; return the future of the work it started")
        return AsyncResult(fut)
    if type(func) is torch.jit.ScriptFunction:
        func = _runnable_script(func)
    try:
        result = func(*args, **(kwargs or {}))
    except TypeError as exc:
        # Raised by the operator itself (no Python frame below this one): its arguments
        # match none of its schemas, which torch reports as a RuntimeError.
        if exc.__traceback__ is not None and exc.__traceback__.tb_next is None \
                and _is_builtin_operator(func):
            raise OperatorSchemaError(
                f"Overloaded torch operator invoked from Python failed to match any schema: "
                f"{exc}; check the arguments given to {describe(func)}") from exc
        raise
    if isinstance(result, CoroutineType):
        return AsyncResult(_coroutines_of(coroutines).submit(result))
    return result


def _warn_even_unconfigured(msg: str, *args: Any) -> None:
    """A warning that reaches the process's stderr even where logging is not configured
    (only the package's NullHandler): torch's agent writes a failed user function's error
    there, and ported programs and tests read it."""
    log.warning(msg, *args)
    logger: Optional[logging.Logger] = log
    while logger is not None:
        if any(not isinstance(h, logging.NullHandler) for h in logger.handlers):
            return  # a configured handler has it
        logger = logger.parent if logger.propagate else None
    if logging.lastResort is not None and log.isEnabledFor(logging.WARNING):
        logging.lastResort.handle(log.makeRecord(log.name, logging.WARNING, __file__, 0,
                                                 msg, args, None))


def _runnable_script(func: Any) -> Any:
    """``func``, a TorchScript function, or its Python original where its signature has
    RRefs: TorchScript's interpreter takes only torch's own RRefs, while the Python
    function does with torchrpc's what the compiled one does with torch's."""
    original = getattr(func, "_torchdynamo_inline", None)
    if original is not None and any("RRef[" in str(arg.type) for arg in func.schema.arguments):
        return original
    return func


def _coroutines_of(coroutines: Optional[CoroutineRunner]) -> CoroutineRunner:
    return coroutines if coroutines is not None else current_agent(failed_ok=True).coroutines


def _is_builtin_operator(func: Any) -> bool:
    """Whether ``func`` is one of torch's builtin operators (``torch.add``, ...)."""
    try:
        return torch.jit._builtins._find_builtin(func) is not None
    except Exception:  # noqa: BLE001 - an unhashable callable is no builtin
        return False

