"""How an exception raised on one worker is raised again on another.

The worker where it was raised captures it (:func:`capture`) as a :class:`RemoteErrorInfo`:
its type, message, traceback as text, the worker's name and, if it pickles, the exception
itself. The receiving worker rebuilds an exception of the same type from that
(:func:`rebuild_error`), with the remote traceback attached. The agent sends one as the
reply to a request that failed; distributed autograd sends one to a backward pass's root
in the report of a part that failed.
"""

from __future__ import annotations

import dataclasses
import traceback
from typing import Any, Optional

import torch

from .. import _wire
from ..errors import RpcError, SerializationError, as_runtime_error


@dataclasses.dataclass
class RemoteErrorInfo:
    """How an exception raised on the callee travels back to the caller."""

    exc_type: Any
    message: str
    remote_traceback: str
    worker: str
    original: Optional[bytes]


def capture(exc: BaseException, worker: str) -> RemoteErrorInfo:
    """``exc``, raised on ``worker``, as it travels: the exception itself is kept only if
    it pickles."""
    # A coroutine target's error carries its traceback as text (see coroutines.py).
    text = getattr(exc, "_torchrpc_traceback", None) or "".join(
        traceback.format_exception(type(exc), exc, exc.__traceback__))
    info = RemoteErrorInfo(type(exc), str(exc), text, worker, None)
    try:
        info.original = _wire.encode(exc)[0]
    except SerializationError:
        pass
    return info


def rebuild_error(info: Any) -> BaseException:
    """The caller-side exception for a :class:`RemoteErrorInfo`: same type, remote traceback."""
    if not isinstance(info, RemoteErrorInfo):
        return RpcError(f"malformed error reply: {info!r}")
    text = f"{info.message}\n\nOn worker {info.worker}, remote traceback:\n{info.remote_traceback}"
    exc_type = info.exc_type if isinstance(info.exc_type, type) and \
        issubclass(info.exc_type, BaseException) else RpcError
    try:
        exc = exc_type(text)
        if str(exc) != text:
            raise TypeError("constructor changed the message")
    except Exception:  # noqa: BLE001 - fall back to the original object
        exc = None
        if info.original is not None:
            try:
                exc = _wire.decode(info.original, [])[1]
            except Exception:  # noqa: BLE001
                exc = None
        if not isinstance(exc, BaseException):
            exc = RpcError(f"Couldn't unpickle the exception {exc_type.__name__} raised on "
                           f"worker {info.worker}. Original exception on remote side was "
                           f"{exc_type.__name__}: {text}")
        elif hasattr(exc, "add_note"):
            exc.add_note(f"On worker {info.worker}, remote traceback:\n{info.remote_traceback}")
    if isinstance(exc, torch.jit.Error):  # torch's RPC reports TorchScript errors as such
        exc = as_runtime_error(exc)
    exc.remote_traceback = info.remote_traceback
    exc.worker = info.worker
    return exc
