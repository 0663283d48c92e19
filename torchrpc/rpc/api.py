"""The public RPC calls. Thin: validate arguments, then hand over to the current agent.

``rpc_sync`` is ``rpc_async`` plus ``wait``. The one piece of module state is the
handle of the current agent, set by :func:`init_rpc` and cleared by :func:`shutdown`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .._agent import Agent, RpcFuture, WorkerInfo, debug_info_here
from .._agent import collect, cuda_ipc
from .._agent.current import current_agent, handle as _state
from .. import _dist_autograd, _profiler, _rref
from .._rref import RREF_LAYER, RRef
from .._rendezvous.membership import open_elastic_store
from .._rendezvous.rendezvous import missing_rank_error, open_store, validate_name
from ..errors import RpcError
from . import _gather, backend_registry, constants
from ._calls import (WorkerLike, _invoke, _prepare,  # noqa: F401
                     _thread_local_var, _wait_all)
from ._many import _collective_timeout, _gather_names, rpc_async_many, rpc_sync_many  # noqa: F401
from .backend_registry import BackendType
from .internal import _internal_rpc_pickler
from .options import SECRET_ENV, RpcBackendOptions, read_environment

log = logging.getLogger(__name__)


# Upper layers (RRefs, distributed autograd) install themselves on each new agent.
def _install_public_calls(agent: Agent) -> None:
    agent.extensions[RREF_LAYER].public_rpc_async = rpc_async


_agent_installers: List[Callable[[Agent], None]] = [_rref.install, _dist_autograd.install,
                                                    _profiler.install, _install_public_calls,
                                                    cuda_ipc.install]


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from exc


def init_rpc(name: str, backend: Optional[BackendType] = None, rank: int = -1,
             world_size: Optional[int] = None, rpc_backend_options: Any = None) -> None:
    r"""Initializes RPC primitives such as the local RPC agent and distributed autograd.

    After it returns, the current process is ready to send and receive RPCs.

    Args:
        name (str): a globally unique name of this node (e.g. ``Trainer3``). Only
            letters, digits, ``_``, ``:`` and ``-``; shorter than 128 characters.
        backend (BackendType, optional): the backend (default ``BackendType.TENSORPIPE``).
        rank (int): a globally unique id of this node; ``-1`` reads ``RANK``.
        world_size (int): the number of workers in the group; ``None`` reads ``WORLD_SIZE``,
            and without it the group is dynamic: workers join a running group (rank 0,
            which hosts the store, first) and leave it with :func:`shutdown`.
        rpc_backend_options (RpcBackendOptions, optional): the backend's options; by
            default a 60 s timeout and rendezvous through ``env://`` (``MASTER_ADDR``
            and ``MASTER_PORT``).
    """
    validate_name(name)
    if backend is not None and not isinstance(backend, BackendType):
        raise TypeError(f"Argument backend must be a member of BackendType, got {backend!r}; "
                        f"use for example torchrpc.rpc.BackendType.TENSORPIPE")
    if rpc_backend_options is not None and not isinstance(rpc_backend_options,
                                                          RpcBackendOptions):
        raise TypeError(f"Argument rpc_backend_options must be an instance of "
                        f"RpcBackendOptions, got {type(rpc_backend_options).__name__}")
    if backend is None:
        backend = (BackendType.TENSORPIPE if rpc_backend_options is None
                   else _infer_backend(rpc_backend_options))
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"rank must be an int, got {type(rank).__name__}")
    if rank < 0:
        env_rank = _env_int("RANK")
        if env_rank is None and rank != -1:
            raise ValueError(f"rank must be >= 0, got {rank}")
        rank = env_rank if env_rank is not None else -1
    if world_size is None:
        world_size = _env_int("WORLD_SIZE")
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int)
                                   or world_size < 1):
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    with _state.lock:
        if _state.agent is not None:
            raise RuntimeError(f"RPC is already initialized on this process as "
                               f"{_state.agent.name!r}; call shutdown() first")
        if rpc_backend_options is None:
            rpc_backend_options = backend_registry.construct_rpc_backend_options(backend)
        if rank < 0:
            raise missing_rank_error(rpc_backend_options.init_method)
        rpc_backend_options, plan = _read_environment(rpc_backend_options)
        if world_size is None:  # dynamic membership: workers join and leave a running group
            store = open_elastic_store(rpc_backend_options.init_method, rank, plan)
        else:
            store, rank, world_size = open_store(rpc_backend_options.init_method, rank,
                                                 world_size, plan)
        _init_rpc_backend(backend, store, name, rank, world_size, rpc_backend_options)


def _read_environment(options: RpcBackendOptions) -> Tuple[RpcBackendOptions, Any]:
    """This init_rpc's settings: ``options`` completed from the ``TORCHRPC_*`` variables,
    and its rendezvous plan. ``TORCHRPC_SECRET`` leaves the environment here, once."""
    popped = os.environ.pop(SECRET_ENV, None)
    if popped:
        _state.launcher_secret = popped
    return read_environment(options, os.environ, _state.launcher_secret)


def _infer_backend(options: Any) -> BackendType:
    """The first backend whose default options are of a type ``options`` is an instance of."""
    for candidate in BackendType:
        defaults = backend_registry.construct_rpc_backend_options(candidate)
        if isinstance(options, type(defaults)):
            return candidate
    raise TypeError(f"Could not infer backend for options {options}: pass backend= "
                    f"explicitly, or options of a registered backend "
                    f"({', '.join(BackendType.__members__)})")


def _init_rpc_backend(backend: BackendType, store: Any, name: str, rank: int,
                      world_size: Optional[int], rpc_backend_options: Any) -> None:
    """Start ``backend``'s agent on a rendezvous ``store`` and make it the current agent."""
    validate_name(name)
    with _state.lock:
        if _state.agent is not None:
            raise RuntimeError(f"RPC is already initialized on this process as "
                               f"{_state.agent.name!r}; call shutdown() first")
        rpc_backend_options, _ = _read_environment(rpc_backend_options)
        collect.install()  # torch.futures.wait_all and collect_all read our futures' replies
        agent = backend_registry.init_backend(backend, store, name, rank, world_size,
                                              rpc_backend_options)
        if isinstance(agent, Agent):
            try:
                for installer in _agent_installers:
                    installer(agent)
            except BaseException:
                agent.shutdown(graceful=False)
                raise
        _set_and_start_rpc_agent(agent)


def _set_and_start_rpc_agent(agent: Any) -> None:
    """Make ``agent`` this process's current agent and let it serve (the last step of
    ``init_rpc``; a registered third-party backend's agent is started with ``start()``)."""
    _state.agent = agent
    _state.was_shut_down = False
    if isinstance(agent, Agent):
        agent.mark_ready()
    elif callable(getattr(agent, "start", None)):
        agent.start()


def shutdown(graceful: bool = True, timeout: float = constants.DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    r"""Shut down the RPC agent of this worker, then destroy it.

    Args:
        graceful (bool): if True, wait until the pending RRef control messages are
            settled, every worker has reached ``shutdown`` and all outstanding work is
            done; if a worker died, raise an error naming it instead of waiting forever.
            If False, stop locally at once.
        timeout (float): seconds to wait in a graceful shutdown; 0 means no limit.
    """
    with _state.lock:
        agent = current_agent(failed_ok=True)  # a failed agent stops, then raises why
        try:
            if not isinstance(agent, Agent):  # a registered third-party backend's agent
                agent.shutdown()
            elif graceful and agent.failure is None and not agent.elastic:
                _graceful_shutdown(agent, timeout)
            else:
                agent.shutdown(graceful=graceful, timeout=timeout)
        finally:
            _state.agent = None
            _state.was_shut_down = True
            _state.last_debug_info = agent.shutdown_protocol.final_debug_info \
                if isinstance(agent, Agent) else {}


def _graceful_shutdown(agent: Agent, timeout: float) -> None:
    """The agent's graceful stop, with torch's steps run once every worker has arrived, each
    looked up here when it runs (programs replace them): meet every worker, then release
    this worker's RRefs. A failed step stops the agent at once and raises its error."""
    leaks: List[str] = []

    def torch_steps() -> None:
        _wait_all_workers(timeout)
        _delete_all_user_and_unforked_owner_rrefs()
        if not _ignore_rref_leak:
            leaks.extend(_rref.live_users(agent))

    agent.shutdown(graceful=True, timeout=timeout, meet=torch_steps)
    if leaks:
        raise RpcError(
            "Detected RRef Leaks during shutdown. This usually occurs when an application "
            "code still holds references to RRef instances when calling shutdown(): "
            + "; ".join(f"Leaking RRef {leak}" for leak in leaks)
            + ". Delete them (and let the garbage collector run) before shutdown, or set "
            "torchrpc.rpc.api._ignore_rref_leak = True to ignore leaks")


def get_worker_info(worker_name: Optional[str] = None) -> WorkerInfo:
    r"""Get the :class:`WorkerInfo` of ``worker_name``, or of this worker when ``None``."""
    agent = current_agent()
    if worker_name is None:
        return agent.worker_info
    if not isinstance(worker_name, str):
        raise TypeError(f"worker_name must be a str, got {type(worker_name).__name__}")
    return agent.resolve(worker_name)


def get_worker_infos() -> List[WorkerInfo]:
    r"""The :class:`WorkerInfo` of every worker in the group, ordered by id."""
    return current_agent().worker_infos()


def device_map_to(to: WorkerLike) -> Dict[Any, Any]:
    """The device map this worker's options set for its calls to ``to`` (empty when
    none): for layers built on the public API, such as ``RemoteModule``."""
    agent = current_agent()
    return dict(agent.settings.device_maps.get(agent.resolve(to).name) or {})


def get_rpc_timeout() -> float:
    r"""The default timeout of RPCs, in seconds."""
    return current_agent().default_timeout


def _set_rpc_timeout(rpc_timeout: float) -> None:
    """Change the default timeout of RPCs, in seconds (0 means none)."""
    if isinstance(rpc_timeout, bool) or not isinstance(rpc_timeout, (int, float)) or rpc_timeout < 0:
        raise ValueError(f"rpc_timeout must be a number of seconds >= 0, got {rpc_timeout!r}")
    current_agent().default_timeout = float(rpc_timeout)


def get_debug_info(to: Optional[WorkerLike] = None,
                   timeout: float = constants.UNSET_RPC_TIMEOUT) -> Dict[str, Any]:
    r"""Counters of a worker's agent and layers (pending calls, threads, RRefs, ...).

    ``peers`` holds, by peer name, the traffic with each peer: ``calls_out`` and
    ``calls_in`` (requests of every kind), ``bytes_out`` and ``bytes_in``, ``errors_out``
    (calls to it that failed), ``errors_in`` (its requests that raised here),
    ``timeouts``, ``replies``, and ``latency_p50_ms`` / ``latency_p99_ms`` over the
    last 1024 replies.

    Args:
        to (str or WorkerInfo or int, optional): the worker to ask, over RPC; by default
            this worker, without a message.
        timeout (float, optional): seconds to wait for ``to``'s answer; by default the
            agent's ``rpc_timeout``.
    """
    if to is None:
        return current_agent().debug_info()
    return rpc_sync(to, debug_info_here, timeout=timeout)


def enable_gil_profiling(flag: bool) -> None:
    r"""Set whether this worker's agent measures how long its threads wait for the GIL
    (``agent.gil_average_wait_time_us`` in its debug info). This incurs a slight
    overhead cost; disabled by default."""
    _profiler.enable_gil_profiling(current_agent(), flag)


def _get_current_rpc_agent() -> Agent:
    """The agent of this worker (torch's ``RpcAgent`` methods: ``get_worker_info``,
    ``get_worker_infos``, ``get_debug_info``); a RuntimeError before ``init_rpc``."""
    return current_agent()


def _is_current_rpc_agent_set() -> bool:
    """Whether ``init_rpc`` has run and ``shutdown`` has not."""
    return _state.agent is not None


def _rref_context_get_debug_info() -> Dict[str, Any]:
    """Counters of this worker's RRefs: ``num_owner_rrefs``, ``num_forks``,
    ``num_pending_users``, ``num_pending_futures`` and more."""
    return current_agent().debug_info("rref")


def _get_debug_info() -> Dict[str, Any]:
    """The agent's, the RRefs' and distributed autograd's counters in one dict, as torch
    reports them (``get_debug_info()`` has torchrpc's fuller counters)."""
    info: Dict[str, Any] = {}
    info.update(_rref_context_get_debug_info())
    info.update(_get_current_rpc_agent().get_debug_info())
    info.update(_dist_autograd.api._get_debug_info())
    return info


# When False, a graceful shutdown raises if user RRefs outlived the release step.
_ignore_rref_leak = True


def _delete_all_user_and_unforked_owner_rrefs(timeout: float = constants.DEFAULT_SHUTDOWN_TIMEOUT
                                              ) -> None:
    """Release every user RRef this worker holds and drop owner RRefs never shared."""
    _rref.delete_all_users(current_agent(), timeout)


# The pickler torch's API serializes Python calls with; torchrpc's wire format is fixed,
# so swapping it (``_use_rpc_pickler``) is seen only by code that reads this name.
_default_pickler = _internal_rpc_pickler


@contextlib.contextmanager
def _use_rpc_pickler(rpc_pickler: Any):
    """Make ``rpc_pickler`` the value of ``_default_pickler`` inside the ``with`` block."""
    global _default_pickler
    _default_pickler = rpc_pickler
    try:
        yield
    finally:
        _default_pickler = _internal_rpc_pickler


def _broadcast_to_followers(sequence_id: Any, objects_map: Dict[str, Any]) -> None:
    """Runs on a follower of ``_all_gather``: the leader's complete dict. It lives here, as
    in torch, because followers run it by this module's name (tests patch it here)."""
    _gather.finish(sequence_id, objects_map)


def barrier(workers: Optional[List[WorkerLike]] = None,
            timeout: float = constants.UNSET_RPC_TIMEOUT) -> None:
    r"""Return once every worker of ``workers`` (default: the whole group) has called it.

    Every worker of the set calls ``barrier`` with the same set, the same number of
    times. It runs on RPC messages among those workers (no rendezvous store). Not in
    ``torch.distributed.rpc``.

    Args:
        workers (list of str or WorkerInfo or int, optional): the workers that meet;
            this worker must be one of them. ``None``: every worker of the group.
        timeout (float, optional): seconds to wait for the others; 0 means no limit; by
            default the agent's ``rpc_timeout``. Past it, a "timed out" error names the
            workers still missing.
    """
    agent = current_agent()
    _gather.all_gather(None, _gather_names(agent, workers, "barrier"),
                       _collective_timeout(timeout), broadcast=_broadcast_to_followers)


def all_gather(obj: Any, workers: Optional[List[WorkerLike]] = None,
               timeout: float = constants.UNSET_RPC_TIMEOUT) -> Dict[str, Any]:
    r"""Gather ``obj`` from every worker of ``workers`` (default: the whole group).

    Every worker of the set calls it with its own ``obj``; each gets every object. It
    runs on RPC messages among those workers (no rendezvous store). Not in
    ``torch.distributed.rpc``.

    Args:
        obj (object): this worker's contribution; anything an RPC can carry.
        workers (list of str or WorkerInfo or int, optional): the workers that gather;
            this worker must be one of them. ``None``: every worker of the group.
        timeout (float, optional): as for :func:`barrier`.

    Returns:
        A dict from worker name to that worker's ``obj``, in the order of the ranks.
    """
    agent = current_agent()
    gathered = _gather.all_gather(obj, _gather_names(agent, workers, "all_gather"),
                                  _collective_timeout(timeout),
                                  broadcast=_broadcast_to_followers)
    ranks = {name: agent.resolve(name).id for name in gathered}
    return {name: gathered[name] for name in sorted(gathered, key=ranks.__getitem__)}


def _all_gather(obj: Any, worker_names: Optional[List[str]] = None,
                timeout: float = constants.UNSET_RPC_TIMEOUT) -> Dict[str, Any]:
    """Gather ``obj`` from every worker of ``worker_names`` (default: all); a dict by name.

    Every worker of the set calls it; a worker that does not arrive within ``timeout``
    makes it raise a RuntimeError that says "timed out in _all_gather".
    """
    return _gather.all_gather(obj, worker_names, timeout, broadcast=_broadcast_to_followers)


def _barrier(worker_names: List[str]) -> None:
    """Return once every worker of ``worker_names`` has called ``_barrier`` with them."""
    try:
        _gather.all_gather(None, set(worker_names), broadcast=_broadcast_to_followers)
    except RuntimeError as exc:
        raise RpcError(f"Failed to complete barrier, got error {exc}") from exc


def _wait_all_workers(timeout: float = constants.DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    """Block until every worker of the group has called it (the start of a shutdown)."""
    try:
        _all_gather(None, timeout=timeout)
    except RuntimeError as exc:
        log.error("failed to respond to 'Shutdown Proceed' in time, got error %s",
                  exc)
        raise


def rpc_async(to: WorkerLike, func: Callable[..., Any], args: Optional[Tuple[Any, ...]] = None,
              kwargs: Optional[Dict[str, Any]] = None,
              timeout: float = constants.UNSET_RPC_TIMEOUT) -> torch.futures.Future:
    r"""Make a non-blocking RPC call to run ``func`` on worker ``to``. Thread-safe.

    Args:
        to (str or WorkerInfo or int): name/rank/``WorkerInfo`` of the destination worker.
        func (Callable): a callable, such as a Python function, a builtin operator
            (e.g. :meth:`~torch.add`) or a TorchScript function.
        args (tuple): the argument tuple for the ``func`` invocation.
        kwargs (dict): keyword arguments for the ``func`` invocation.
        timeout (float, optional): seconds before the call fails with a "timed out"
            error; 0 means never; by default the agent's ``rpc_timeout``.

    Returns:
        A :class:`torch.futures.Future` of the return value of ``func``.
    """
    return _invoke("async", to, func, args, kwargs, timeout)


def rpc_sync(to: WorkerLike, func: Callable[..., Any], args: Optional[Tuple[Any, ...]] = None,
             kwargs: Optional[Dict[str, Any]] = None,
             timeout: float = constants.UNSET_RPC_TIMEOUT) -> Any:
    r"""Make a blocking RPC call to run ``func`` on worker ``to``. Thread-safe.

    Takes the same arguments as :func:`rpc_async` and returns the result of
    ``func(*args, **kwargs)``, or raises what it raised (same type where it pickles,
    with the remote traceback in the message).
    """
    return _invoke("sync", to, func, args, kwargs, timeout).wait()


def remote(to: WorkerLike, func: Callable[..., Any], args: Optional[Tuple[Any, ...]] = None,
           kwargs: Optional[Dict[str, Any]] = None,
           timeout: float = constants.UNSET_RPC_TIMEOUT) -> RRef:
    r"""Run ``func`` on worker ``to`` and return an :class:`RRef` to its result at once.

    The callee owns the result; this worker holds a user RRef. The owner keeps the
    value alive while any reference to it exists anywhere.

    Args:
        to (str or WorkerInfo or int): name/rank/``WorkerInfo`` of the destination worker.
        func (Callable): a callable (Python function, builtin operator, TorchScript).
        args (tuple): the argument tuple for the ``func`` invocation.
        kwargs (dict): keyword arguments for the ``func`` invocation.
        timeout (float, optional): seconds for the owner to create the value; if it fails
            or times out, the next use of the RRef (``to_here()``, a fork) raises that
            error. 0 means no limit; by default the agent's ``rpc_timeout``.

    Returns:
        A user :class:`RRef` to the result value.
    """
    agent, dst, args, kwargs, timeout = _prepare(to, func, args, kwargs, timeout)
    if _profiler.enabled():
        return _profiler.profiled_remote(agent, dst, func, lambda target: _rref.remote(
            agent, dst, target, args, kwargs, timeout))
    return _rref.remote(agent, dst, func, args, kwargs, timeout)


def is_available() -> bool:
    """torchrpc is always available."""
    return True


__all__ = [
    "RpcFuture", "all_gather", "barrier", "get_debug_info", "get_rpc_timeout",
    "get_worker_info", "get_worker_infos", "init_rpc", "is_available", "remote", "rpc_async",
    "rpc_async_many", "rpc_sync", "rpc_sync_many", "shutdown", "RRef",
]
