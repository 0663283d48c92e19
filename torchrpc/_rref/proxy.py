"""RRef proxies, and the functions an RRef's methods run on its owner.

``rref.rpc_sync()``, ``rref.rpc_async()`` and ``rref.remote()`` return a :class:`_Proxy`, whose
attributes call a method of the value on the owner through :func:`_invoke_method`. That
function, the type query and the backward pass travel by reference in RPC messages, so every
worker finds them under this module's name.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Tuple

import torch

from .._agent import fresh_error
from ..errors import WrongTypeError

# What the functions here take: an RRef (rref.py) and its RRefLayer (layer.py), named
# without importing those modules, which import this one.
_RRef = Any
_Layer = Any

# The default of an RRef method's timeout: the agent's rpc_timeout.
_UNSET = -1.0


def _timeout(layer: _Layer, timeout: float) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, got {timeout!r}")
    if timeout == _UNSET:
        return layer.agent.default_timeout
    if timeout < 0:
        raise ValueError(f"timeout must be >= 0 seconds (0: no timeout), got {timeout}")
    return float(timeout)


def _typeof_on_owner(rref: _RRef) -> torch.futures.Future:
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


def _rref_typeof_on_owner(rref: _RRef) -> torch.futures.Future:
    """Run on the owner for :meth:`RRef._get_type`; replies when the value exists."""
    return _typeof_on_owner(rref)


_rref_typeof_on_owner._wrapped_async_rpc_function = _rref_typeof_on_owner  # type: ignore[attr-defined]


class _Proxy:
    """``rref.rpc_sync()`` and friends: attribute access makes a method call on the owner."""

    __slots__ = ("_rref", "_mode", "_timeout")

    def __init__(self, rref: _RRef, mode: str, timeout: float) -> None:
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


def _invoke_method(rref: _RRef, name: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]
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


def _backward_local(rref: _RRef, ctx_id: int, retain_graph: bool) -> None:
    value = rref.local_value()
    if not isinstance(value, torch.Tensor):
        raise WrongTypeError(f"RRef should contain a tensor for .backward(), but it holds a "
                             f"{type(value).__name__}; call backward() on an RRef of a tensor "
                             f"(for example the loss)")
    if ctx_id == -1:
        value.backward(retain_graph=retain_graph)
        return
    backward = rref._layer.backward
    if backward is None:
        raise RuntimeError("distributed autograd is not available on this worker")
    backward(ctx_id, [value], retain_graph)
