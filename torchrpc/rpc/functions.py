"""Decorators that tell the callee how to treat a function. Importable before ``init_rpc``."""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def async_execution(fn: F) -> F:
    r"""A decorator for a function whose return value is a ``Future`` to reply with.

    The callee runs ``fn``, takes the :class:`torch.futures.Future` it returns and
    sends the RPC response when that future completes, so ``fn`` can return at once
    (for example after chaining ``rpc_async(...).then(...)``) without holding a
    thread. Combined with ``@staticmethod`` or ``@classmethod``, this decorator must
    be the inner one; combined with ``@torch.jit.script``, the outer one.

    Example::
        >>> @rpc.functions.async_execution
        >>> def async_add_chained(to, x, y, z):
        >>>     return rpc.rpc_async(to, torch.add, args=(x, y)).then(
        >>>         lambda fut: fut.wait() + z)
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    wrapper._wrapped_async_rpc_function = fn  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]
