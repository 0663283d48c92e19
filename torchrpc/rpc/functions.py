"""Decorators that tell the callee how to treat a function. Importable before ``init_rpc``."""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, TypeVar

from .._agent.retry import RetryPolicy

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


def idempotent(fn: Optional[F] = None, *, max_attempts: int = 3, initial_backoff: float = 0.05,
               backoff_multiplier: float = 2.0, max_backoff: float = 2.0) -> Any:
    r"""Mark a function as safe to run more than once, so calls to it are retried.

    ``rpc_sync`` and ``rpc_async`` of a marked function send the call again when the
    connection fails before the reply arrives (the call may or may not have run), up
    to ``max_attempts`` sends in all, waiting ``initial_backoff`` seconds before the
    first resend and ``backoff_multiplier`` times longer before each next one (at most
    ``max_backoff``). All attempts share the call's timeout. A call that raised on the
    callee or timed out is never retried, and neither is one to a worker that left.

    Use it bare or with arguments; it returns the function itself, so the callee and
    pickling see no difference::

        >>> @rpc.functions.idempotent
        >>> def read_param(name): ...
        >>> @rpc.functions.idempotent(max_attempts=5, initial_backoff=0.1)
        >>> def get_shard(i): ...
    """
    policy = RetryPolicy(max_attempts, initial_backoff, backoff_multiplier, max_backoff)

    def mark(f: F) -> F:
        if not callable(f):
            raise TypeError(f"@idempotent marks a function, got {type(f).__name__}")
        try:
            f._torchrpc_retry = policy  # type: ignore[attr-defined]
        except (AttributeError, TypeError) as exc:
            raise TypeError(f"@idempotent cannot mark {f!r} (it takes no attributes); wrap it "
                            f"in a Python function and mark that") from exc
        return f

    return mark if fn is None else mark(fn)


def retry_policy(fn: Any) -> Optional[RetryPolicy]:
    """The retry policy an ``@idempotent`` mark put on ``fn``, or None."""
    policy = getattr(fn, "_torchrpc_retry", None)
    return policy if isinstance(policy, RetryPolicy) else None
