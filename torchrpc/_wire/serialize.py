"""Tensor-aware pickling: tensors travel as out-of-band buffers, never through pickle.

Theory of operation. :func:`encode` pickles an object with protocol 5. Every
strided CPU tensor it meets is reduced to a reference to a *storage slot* plus
its metadata (dtype, shape, stride, offset). A slot stands for the byte range of
one storage that the message needs; it is pickled once and becomes one
out-of-band buffer, so two views of one storage arrive as two views of one
storage. Only the covered range is sent, and a view arrives with its strides,
unless it covers much less than its span (a sparse strided slice of a large
tensor): that one is sent compacted. A small contiguous tensor whose storage no
other tensor of the message shares travels inside the envelope instead, as its bytes,
while the message's inline bytes stay within :data:`INLINE_MAX` (by default): a
buffer of its own would cost more (a length, a receive, a tensor to receive into) than
copying those bytes a few times. :func:`decode` receives the
buffers as uint8 tensors that the transport already filled (``recv_into``, or
mapped from shared memory), and rebuilds each tensor on that memory without a
copy. A tensor's dtype travels as a small fixed id, and every reduction made here
refers to one global, :func:`.rebuild._rebuild`, with a tag: pickling a global costs an
import-system lookup per message, which is most of what a small call spends here.

Other objects' large buffers. Anything else whose reduction hands pickle a
:class:`pickle.PickleBuffer` (numpy arrays, objects written for protocol 5) keeps
its small buffers in the envelope, exactly as pickle would, and sends buffers of
:data:`OUT_OF_BAND_MIN` bytes or more out of band like a tensor's storage: the
encoder reduces such objects itself, replaces each large buffer among the
reduction's arguments by a reference to a received buffer, and the decoder hands
the object a memoryview over that received memory (read-only if the original was),
which is what pickle gives an object whose buffers it loads out of band.

Nothing here does I/O. Callers may pass hooks to see every tensor that requires
grad on the way out and on the way in (distributed autograd uses them), and a
*context* object for the pickling code of upper layers (RRefs). Both are state of the
one encode or decode, never of the thread: the pickler's encoder hands the context to
the reducers of :func:`register_message_reducer`, and the unpickler binds its context
and receive hook to the globals that take them (:func:`register_rebuilder` and the
tensor rebuilders) when it finds them, once per global and message.

The sending side, the pickler and its reductions, lives in :mod:`.pickler`; the receiving
side, the globals an envelope names and the tensors they rebuild, in :mod:`.rebuild`. This
module holds the two entry points and the unpickler.
"""

from __future__ import annotations

import functools
import io
import pickle
import sys
import threading
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from ..errors import MissingDefinitionError, SerializationError
from .pickler import (INLINE_MAX, OUT_OF_BAND_MIN, PassThrough, Placed, TensorHook, _Encoder,
                      _Pickler, register_message_reducer, register_reducer, tensor_bytes)
from .rebuild import HOOKED, memoryview_of, new_buffer

__all__ = ["INLINE_MAX", "OUT_OF_BAND_MIN", "PassThrough", "Placed", "TensorHook", "decode",
           "encode",
           "locate", "memoryview_of", "new_buffer", "register_message_reducer",
           "register_rebuilder", "register_reducer", "tensor_bytes"]

_HOOK, _CONTEXT = 0, 1
# id(global) -> (global, what the unpickler binds to it): the receive hook (keyword
# ``hook``) or the decode's context (keyword ``context``).
_BOUND: dict = {id(fn): (fn, _HOOK) for fn in HOOKED}


def register_rebuilder(fn: Callable[..., Any]) -> None:
    """Make :func:`decode` call global ``fn`` with the keyword ``context``: the context the
    decode was given (plain ``pickle.loads`` calls it without, so its default applies)."""
    _BOUND[id(fn)] = (fn, _CONTEXT)


class _Unpickler(pickle.Unpickler):
    """Finds globals of already imported modules with one getattr, and binds the
    decode's state (``context``, ``recv_hook``; set after construction: a Python
    ``__init__`` would cost a call per message) to the globals that take it.

    The default looks each one up through the import machinery, a cost paid per global
    and message; what it returns is the same object.
    """

    context: Any = None
    recv_hook: Optional[TensorHook] = None

    def find_class(self, module: str, name: str) -> Any:
        mod = sys.modules.get(module)
        if mod is not None and "." not in name:
            try:
                found = getattr(mod, name)
            except AttributeError:
                pass
            else:
                bound = _BOUND.get(id(found))
                if bound is None or (bound[1] == _HOOK and self.recv_hook is None):
                    return found
                return self._bind(bound)
        try:
            found = super().find_class(module, name)
        except (AttributeError, ImportError) as exc:
            raise MissingDefinitionError(
                f"RPC pickler does not serialize function code. Ensure that UDFs are defined "
                f"on both caller and callee modules: {module}.{name} is not defined in this "
                f"process ({exc})") from None
        bound = _BOUND.get(id(found))
        if bound is None or (bound[1] == _HOOK and self.recv_hook is None):
            return found
        return self._bind(bound)

    def _bind(self, bound: Tuple[Callable[..., Any], int]) -> Callable[..., Any]:
        fn, what = bound
        if what == _HOOK:
            return functools.partial(fn, hook=self.recv_hook)
        return functools.partial(fn, context=self.context)


def encode(obj: Any, context: Any = None, send_hook: Optional[TensorHook] = None,
           meta: Any = None, names: Union[str, Sequence[str]] = "value",
           inline_max: int = INLINE_MAX) -> Tuple[bytes, List[memoryview], List[torch.Tensor]]:
    """Pickle ``meta`` then ``obj``; return the envelope, the out-of-band buffers and the
    tensors to keep alive until the buffers are sent.

    ``meta`` is a small plain object (no tensors) that the receiver reads before
    ``obj``, so it can choose how to rebuild ``obj``. ``send_hook`` sees, in pickling
    order, each tensor that requires grad and whose receiver will call its receive hook
    (its return value is ignored). Both are pickled by one pickler, one after the
    other, so the envelope is two pickles sharing one memo. Raises
    :class:`~torchrpc.errors.SerializationError` when something can't be pickled,
    naming the path to the part that can't (see :func:`locate`); ``names`` is how
    that path names ``obj``, or, a sequence, the items of the tuple ``obj``.
    Contiguous tensors travel inside the envelope while their bytes add up to at most
    ``inline_max``; the others, out of band.
    """
    retry: dict = {}
    # This thread's stream and pickler, taken while in use (an encode nested in a
    # reduction makes its own).
    cached = _pickler_of_thread.__dict__.pop("p", None) or _ThreadPickler()
    out = cached.out
    try:
        for passes in range(1, _MAX_PASSES + 1):
            pickler = cached.pickler or cached.new_pickler()
            enc = _Encoder(send_hook, retry, context, inline_max)
            cached.enc = pickler.enc = enc
            if meta is None:
                out.write(_NONE_META)
            else:
                try:
                    pickler.dump(meta)
                except Exception as exc:
                    raise SerializationError(
                        f"cannot pickle message metadata {_describe(meta)}: {exc}") from exc
            try:
                pickler.dump(obj)
            except SerializationError:
                raise
            except PassThrough as wrapper:
                raise wrapper.take() from None
            except Exception as exc:
                # locate() pickles parts again without the context: no RRef forks twice
                raise SerializationError(f"cannot pickle {locate(obj, exc, names)}: "
                                         f"{exc}") from exc
            if not enc.conflict:
                break
            if passes == _MAX_PASSES:
                raise SerializationError(
                    f"cannot pickle {_describe(obj)}: the tensors sharing a storage did not "
                    f"settle on one byte range in {passes} passes; send .clone()s of the "
                    f"views that share it")
            retry = enc.retry_ranges
            cached.reset()
        envelope = out.getvalue()
    finally:
        cached.reset()
    _pickler_of_thread.p = cached
    return envelope, enc.views, enc.keepalive


def prepare_encode() -> None:
    """Make this thread's pickler for its next :func:`encode` now.

    Each message gets a new pickler (see :class:`_ThreadPickler`), which takes a moment
    to make. A thread that has just sent a message and is about to wait
    (for a reply, or for the next frame) calls this, so that the next message does not
    wait for it.
    """
    cached = _pickler_of_thread.__dict__.get("p")
    if cached is not None and cached.pickler is None:
        cached.new_pickler()


class _ThreadPickler:
    """The stream of one thread's encodes, reused between messages (truncating it frees
    its buffer), and the pickler of its next message.

    Each message gets a new pickler. ``clear_memo()`` would release the memo's objects
    while the memo still lists them, and the garbage collector visits that list: if
    releasing one runs Python code (a finalizer) or lets go of the GIL, a collection
    reads freed objects and the process crashes. A pickler being deallocated leaves the
    collector's sight before it releases its memo.
    """

    __slots__ = ("out", "pickler", "enc")

    def __init__(self) -> None:
        self.out = io.BytesIO()
        self.enc: Optional[_Encoder] = None
        self.pickler: Optional[_Pickler] = None

    def new_pickler(self) -> _Pickler:
        pickler = self.pickler = _Pickler(self.out, 5, buffer_callback=self.in_band)
        return pickler

    def in_band(self, buf: pickle.PickleBuffer) -> bool:
        assert self.enc is not None
        return self.enc.in_band(buf)

    def reset(self) -> None:
        self.pickler = self.enc = None  # the memo goes with the pickler
        self.out.seek(0)
        self.out.truncate()


_pickler_of_thread = threading.local()
# Passes of one encode at most: each pass after the first knows the byte range of every
# storage that an earlier one saw shared, so the second settles in practice.
_MAX_PASSES = 4


_NONE_META = pickle.dumps(None, protocol=5)


def decode(envelope: bytes | bytearray | memoryview, buffers: Sequence[Any], context: Any = None,
           recv_hook: Optional[Callable[[Any], Optional[TensorHook]]] = None) -> Tuple[Any, Any]:
    """Unpickle an envelope whose tensors live in ``buffers`` (uint8 tensors or bytes).

    Returns ``(meta, obj)``. ``recv_hook(meta)``, when given, returns the hook to
    apply to every received tensor that requires grad.
    """
    stream = io.BytesIO(envelope)
    unpickler = _Unpickler(stream, buffers=buffers)
    if context is not None:
        unpickler.context = context
    if type(envelope) is not memoryview and envelope.startswith(_NONE_META):
        meta = None  # the common case: skip the empty pickle
        stream.seek(len(_NONE_META))
    else:
        meta = unpickler.load()
    if recv_hook is not None:
        unpickler.recv_hook = recv_hook(meta)
    return meta, unpickler.load()


def locate(obj: Any, error: BaseException, names: Union[str, Sequence[str]] = "value") -> str:
    """The path to the innermost part of ``obj`` whose pickling fails with ``error``,
    e.g. ``args[1]['obs'][3] (<unlocked _thread.lock object ...>)``.

    Only for error messages: it pickles parts of ``obj`` again, one at a time, and
    follows the part that fails with the same error (so a part failing only because it
    is pickled alone, an RRef outside a message, is not taken for the culprit). The
    caller runs it with no context, so nothing with side effects is pickled twice.
    """
    if isinstance(names, str):
        path, part = names, obj
    else:
        path, part = "payload", obj
        if type(obj) is tuple:
            for i, item in enumerate(obj):
                if _fails_like(item, error):
                    path, part = (names[i] if i < len(names) else f"payload[{i}]"), item
                    break
    seen = {id(obj)}
    for _ in range(_LOCATE_DEPTH):
        for step, child in _parts(part):
            if id(child) not in seen and _fails_like(child, error):
                seen.add(id(child))
                path, part = path + step, child
                break
        else:
            break
    return f"{path} ({_describe(part)})"


_LOCATE_DEPTH = 100


def _fails_like(obj: Any, error: BaseException) -> bool:
    """Whether pickling ``obj`` alone raises an error of the type and text of ``error``."""
    enc = _Encoder(None, {})
    pickler = _Pickler(_Discard(), 5, buffer_callback=_never_in_band)
    pickler.enc = enc
    try:
        pickler.dump(obj)
    except Exception as exc:  # noqa: BLE001 - compared, not handled
        return type(exc) is type(error) and str(exc) == str(error)
    return False


class _Discard:
    """A file that forgets what is written to it."""

    def write(self, data: Any) -> int:
        return len(data)


def _never_in_band(buf: pickle.PickleBuffer) -> bool:
    return False


def _parts(obj: Any) -> Iterator[Tuple[str, Any]]:
    """The parts pickle would pickle for ``obj``, each with the step that names it."""
    if isinstance(obj, tuple) and hasattr(type(obj), "_fields"):
        for name, item in zip(obj._fields, obj):
            yield f".{name}", item
        return
    if isinstance(obj, (tuple, list, set, frozenset)):
        step = "[{}]" if isinstance(obj, (tuple, list)) else "<item {}>"
        for i, item in enumerate(obj):
            yield step.format(i), item
        return
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield f"<key {_describe(key, 40)}>", key
            yield f"[{_describe(key, 40)}]", value
        return
    if isinstance(obj, type):
        return
    try:
        rv = obj.__reduce_ex__(5)
    except Exception:  # noqa: BLE001 - the object itself is what fails
        return
    if type(rv) is not tuple:
        return
    for i, arg in enumerate(rv[1] if len(rv) > 1 and type(rv[1]) is tuple else ()):
        yield f"<argument {i}>", arg
    state = rv[2] if len(rv) > 2 else None
    slots = None
    if type(state) is tuple and len(state) == 2 and isinstance(state[1], dict):
        state, slots = state
    for attrs in (state, slots):
        if isinstance(attrs, dict):
            for name, value in attrs.items():
                yield f".{name}", value
    if state is not None and not isinstance(state, dict):
        yield "<state>", state


def _describe(obj: Any, limit: int = 200) -> str:
    try:
        text = repr(obj)
    except Exception:  # noqa: BLE001 - an error message must not fail
        text = f"<{type(obj).__qualname__} object>"
    return text if len(text) <= limit else text[:limit - 3] + "..."
