"""Tensor-aware pickling: tensors travel as out-of-band buffers, never through pickle.

Theory of operation. :func:`encode` pickles an object with protocol 5. Every
strided CPU tensor it meets is reduced to a reference to a *storage slot* plus
its metadata (dtype, shape, stride, offset). A slot stands for the byte range of
one storage that the message needs; it is pickled once and becomes one
out-of-band buffer, so two views of one storage arrive as two views of one
storage. Only the covered range is sent; a view that covers much less than its
span (a strided slice) is sent compacted instead. :func:`decode` receives the
buffers as uint8 tensors that the transport already filled (``recv_into``, or
mapped from shared memory), and rebuilds each tensor on that memory without a
copy. A tensor's dtype travels as a small fixed id, and every reduction made here
refers to one global, :func:`_rebuild`, with a tag: pickling a global costs an
import-system lookup per message, which is most of what a small call spends here.

Nothing here does I/O. Callers may pass hooks to see every tensor that requires
grad on the way out and on the way in (distributed autograd uses them), and a
*context* object that pickling code of upper layers (RRefs) can read with
:func:`current_context`.
"""

from __future__ import annotations

import ctypes
import importlib
import io
import pickle
import sys
import threading
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from ..errors import SerializationError

TensorHook = Callable[[torch.Tensor], torch.Tensor]

_local = threading.local()
# A strided view whose span is larger than this many times its own bytes is compacted.
_SPAN_SLACK = 2
_ALIGN = 16


class PassThrough(Exception):
    """Raised by pickling code to make :func:`encode` raise ``error`` itself, unwrapped."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error: Optional[BaseException] = error

    def take(self) -> BaseException:
        """The wrapped error, released: raising it must not make a cycle through us."""
        error, self.error = self.error, None
        self.__traceback__ = None  # its frames hold the objects being pickled
        assert error is not None
        return error.with_traceback(None)


def current_context() -> Any:
    """Return the context object of the encode/decode running on this thread, or None."""
    return getattr(_local, "context", None)


def memoryview_of(ptr: int, nbytes: int) -> memoryview:
    """A writable byte memoryview over raw memory (caller keeps the owner alive)."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(ptr)).cast("B")


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable memoryview over the bytes of a contiguous CPU tensor."""
    return memoryview_of(t.data_ptr(), t.numel() * t.element_size())


class _Slot:
    """One storage range that becomes one out-of-band buffer.

    Pickling it appends a memoryview of the range to ``views``, in the order the
    pickle refers to its buffers. The PickleBuffer handed to pickle wraps a ctypes
    array, not that memoryview: a memoryview that a PickleBuffer exports from must
    never be left to the cycle collector (CPython clears it despite the export, and
    may then crash), and an exception's traceback can put both in a cycle.
    """

    __slots__ = ("tensor", "base", "lo", "hi", "views")

    def __init__(self, tensor: torch.Tensor, base: int, lo: int, hi: int,
                 views: List[memoryview]) -> None:
        self.tensor = tensor  # keeps the memory alive until sent
        self.base = base  # address of the storage's first byte
        self.lo = lo
        self.hi = hi
        self.views = views

    def __reduce__(self) -> Tuple[Any, ...]:
        raw = (ctypes.c_ubyte * (self.hi - self.lo)).from_address(self.base + self.lo)
        self.views.append(memoryview(raw).cast("B"))
        return _rebuild, (_SLOT, pickle.PickleBuffer(raw))


def _out_of_band(buf: pickle.PickleBuffer) -> None:
    return None  # falsy: every buffer travels out of band


def _rebuild(tag: int, *args: Any) -> Any:
    """The one global the encoder's reductions refer to.

    Pickling a global costs an import-system lookup per global and message, so the
    slot, tensor and torch-function reductions share this one (memoized within a
    message); the tag says which it is. The tags are part of the wire format.
    """
    return _REBUILDERS[tag](*args)


def _torch_function(name: str) -> Any:
    return getattr(_TORCH_FUNCTIONS, name)


_BUILTIN = type(len)
_TORCH_FUNCTIONS = torch._C._VariableFunctionsClass


def _rebuild_slot(buf: Any) -> torch.Tensor:
    if isinstance(buf, torch.Tensor):
        return buf
    # In-band fallback (plain pickle.loads of an envelope, used by tools and tests).
    return torch.frombuffer(bytearray(buf), dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)


def _rebuild_tensor(slot: torch.Tensor, byte_offset: int, dtype: Any, shape: Tuple[int, ...],
                    stride: Tuple[int, ...], requires_grad: bool) -> torch.Tensor:
    if type(dtype) is int:
        dtype = _DTYPES[dtype]
    itemsize = _ITEMSIZE.get(dtype) or dtype.itemsize
    if byte_offset == 0 and (stride == (1,) if len(shape) == 1 else
                             stride == _contiguous_strides(shape)) \
            and slot.numel() == itemsize * _prod(shape):
        # The common case: a contiguous tensor that fills its buffer. One or two views.
        t = slot.view(dtype)
        if len(shape) != 1:
            t = t.view(shape)
    else:
        _check_extent(slot.numel(), byte_offset, itemsize, shape, stride)
        t = torch.empty((0,), dtype=dtype).set_(slot.untyped_storage(), byte_offset // itemsize,
                                                shape, stride)
    if requires_grad:
        t.requires_grad_(True)
        hook = getattr(_local, "recv_hook", None)
        if hook is not None:
            t = hook(t)
    return t


def _rebuild_empty(dtype: Any, shape: Tuple[int, ...], stride: Tuple[int, ...],
                   requires_grad: bool) -> torch.Tensor:
    if type(dtype) is int:
        dtype = _DTYPES[dtype]
    if _prod(shape) != 0:
        raise ValueError(f"malformed empty tensor: shape {shape} has elements")
    return torch.empty_strided(shape, stride, dtype=dtype, requires_grad=requires_grad)


def _check_extent(nbytes: int, byte_offset: int, itemsize: int, shape: Tuple[int, ...],
                  stride: Tuple[int, ...]) -> None:
    """Refuse tensor metadata that reaches outside its buffer (set_ would grow it)."""
    if len(shape) != len(stride) or min(shape, default=0) < 0 or min(stride, default=0) < 0 \
            or byte_offset < 0 or byte_offset % itemsize:
        raise ValueError(f"malformed tensor metadata: shape {shape}, stride {stride}, "
                         f"offset {byte_offset}")
    if _prod(shape) == 0:
        return
    end = byte_offset + itemsize * (1 + sum((n - 1) * s for n, s in zip(shape, stride)))
    if end > nbytes:
        raise ValueError(f"tensor of shape {shape} and stride {stride} needs {end} bytes, "
                         f"its buffer has {nbytes}")


def _prod(shape: Tuple[int, ...]) -> int:
    if len(shape) == 1:
        return shape[0]
    n = 1
    for d in shape:
        n *= d
    return n


def _contiguous_strides(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    if len(shape) == 1:
        return (1,)
    if len(shape) == 2:  # the common case, without the loop
        return (max(shape[1], 1), 1)
    strides = []
    acc = 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


# dtype ids are part of the wire format (like message kinds): never renumber one. A dtype
# without an id travels as the dtype object itself.
_DTYPES = tuple(getattr(torch, name, None) for name in (
    "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
    "bool", "complex64", "complex128", "complex32", "uint16", "uint32", "uint64"))
_DTYPE_IDS = {d: i for i, d in enumerate(_DTYPES) if d is not None}
_ITEMSIZE = {d: d.itemsize for d in _DTYPE_IDS}


# _rebuild tags: never renumber one.
_SLOT, _TENSOR, _EMPTY, _TORCH_FUNCTION = 0, 1, 2, 3
_REBUILDERS = (_rebuild_slot, _rebuild_tensor, _rebuild_empty, _torch_function)


def _rebuild_sparse_coo(indices: torch.Tensor, values: torch.Tensor, size: Tuple[int, ...],
                        coalesced: bool, requires_grad: bool) -> torch.Tensor:
    t = torch.sparse_coo_tensor(indices, values, size, is_coalesced=coalesced,
                                check_invariants=True)
    return t.requires_grad_(True) if requires_grad else t


def _rebuild_sparse_compressed(layout: torch.layout, a: torch.Tensor, b: torch.Tensor,
                               values: torch.Tensor, size: Tuple[int, ...]) -> torch.Tensor:
    return torch.sparse_compressed_tensor(a, b, values, size, layout=layout, check_invariants=True)


def _rebuild_parameter(data: torch.Tensor, requires_grad: bool) -> torch.nn.Parameter:
    return torch.nn.Parameter(data.detach(), requires_grad=requires_grad)


def _load_script_function(qualified_name: str) -> Any:
    """Find a ``@torch.jit.script`` function by the qualified name TorchScript gave it."""
    path = qualified_name.split(".")
    if path[0] == "__torch__":
        path = path[1:]
    module_name, name = ".".join(path[:-1]) or "__main__", path[-1]
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise SerializationError(
            f"cannot find TorchScript function {qualified_name!r} on this worker: define it "
            f"at module level in {module_name!r} on every worker") from exc


class _Encoder:
    """State of one :func:`encode` call."""

    def __init__(self, send_hook: Optional[TensorHook], retry_ranges: dict) -> None:
        self.slots: dict = {}
        self.views: List[memoryview] = []
        self.keepalive: List[torch.Tensor] = []
        self.send_hook = send_hook
        self.retry_ranges = retry_ranges
        self.conflict = False

    def reduce_tensor(self, t: torch.Tensor) -> Tuple[Any, ...]:
        # The hot path of every message with a tensor: each attribute read below is a
        # call into torch, so read as few as the common case needs.
        layout = t.layout
        if layout is not torch.strided:
            return _reduce_sparse(t, layout)
        dtype = t.dtype
        dtype_ref = _DTYPE_IDS.get(dtype)
        if dtype_ref is None:
            if t.is_quantized:
                return _plain_reduce(t)
            dtype_ref = dtype
        requires_grad = t.requires_grad
        data = t
        if not t.is_cpu:
            if not t.is_cuda:
                return _plain_reduce(t)
            data = t.detach().cpu()
        if (dtype.is_complex and data.is_conj()) or data.is_neg():
            data = data.detach().resolve_conj().resolve_neg()
        numel = data.numel()
        if numel == 0:
            return _rebuild, (_EMPTY, dtype_ref, tuple(data.shape), data.stride(), requires_grad)
        if requires_grad and self.send_hook is not None:
            # Exactly the tensors whose receiver calls its receive hook: those rebuilt by
            # _rebuild_tensor (strided, not quantized, CPU or CUDA, not empty) with grad.
            self.send_hook(t)
        itemsize = dtype.itemsize
        off = data.storage_offset()
        lo = off * itemsize
        if data.is_contiguous():
            hi = lo + numel * itemsize
        else:
            span = 1 + sum((n - 1) * s for n, s in zip(data.shape, data.stride()) if s > 0)
            if span > _SPAN_SLACK * numel:
                data = data.detach().contiguous()
                lo, span = 0, numel
            hi = lo + span * itemsize
        # The storage is known by the address of its first byte: two live storages never
        # share one, and everything encoded stays alive until encode() returns.
        key = data.data_ptr() - lo
        slot = self.slots.get(key)
        if slot is None or not (slot.lo <= lo and hi <= slot.hi):
            if slot is not None:
                # A later view reaches outside the range already pickled: note the union
                # and let encode() run once more with the whole range known up front.
                self.conflict = True
                lo2, hi2 = self.retry_ranges.get(key, (slot.lo, slot.hi))
                self.retry_ranges[key] = (min(lo2, lo), max(hi2, hi))
            lo_a, hi_a = self.retry_ranges.get(key, (lo, hi))
            slot = _Slot(data, key, (min(lo, lo_a) // _ALIGN) * _ALIGN, max(hi, hi_a), self.views)
            self.slots[key] = slot
            self.keepalive.append(data)
        return _rebuild, (_TENSOR, slot, lo - slot.lo, dtype_ref, tuple(data.shape),
                          data.stride(), requires_grad)

    def reduce_parameter(self, p: torch.nn.Parameter) -> Tuple[Any, ...]:
        return _rebuild_parameter, (p.data, p.requires_grad)

    def reduce_script_function(self, fn: Any) -> Tuple[Any, ...]:
        return _load_script_function, (fn.qualified_name,)


def _reduce_sparse(t: torch.Tensor, layout: torch.layout) -> Tuple[Any, ...]:
    if layout is torch.sparse_coo:
        return _rebuild_sparse_coo, (t._indices(), t._values(), tuple(t.shape),
                                     t.is_coalesced(), t.requires_grad)
    if layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
        if layout in (torch.sparse_csr, torch.sparse_bsr):
            a, b = t.crow_indices(), t.col_indices()
        else:
            a, b = t.ccol_indices(), t.row_indices()
        return _rebuild_sparse_compressed, (layout, a, b, t.values(), tuple(t.shape))
    return _plain_reduce(t)


# Exact types pickled by the encoder; everything else goes the usual way (copyreg's
# dispatch table, then __reduce_ex__), so later copyreg registrations are honoured.
_REDUCERS: dict = {
    torch.Tensor: _Encoder.reduce_tensor,
    torch.nn.Parameter: _Encoder.reduce_parameter,
    torch.jit.ScriptFunction: _Encoder.reduce_script_function,
}


def register_reducer(cls: type, reducer: Callable[[Any], Tuple[Any, ...]]) -> None:
    """Make :func:`encode` pickle exact instances of ``cls`` as ``reducer(obj)`` says; an
    error ``reducer`` raises is raised by :func:`encode` as it is."""
    def reduce(enc: _Encoder, obj: Any) -> Tuple[Any, ...]:
        try:
            return reducer(obj)
        except PassThrough:
            raise
        except Exception as exc:
            raise PassThrough(exc) from None
    _REDUCERS[cls] = reduce


class _Pickler(pickle.Pickler):
    """Protocol 5 with out-of-band buffers; tensors reduced by an :class:`_Encoder` (set as
    ``enc`` after construction: a Python ``__init__`` would cost a call per message)."""

    enc: _Encoder

    def reducer_override(self, obj: Any) -> Any:
        cls = type(obj)
        reduce = _REDUCERS.get(cls)
        if reduce is not None:
            return reduce(self.enc, obj)
        if cls is _BUILTIN and obj.__self__ is None \
                and getattr(_TORCH_FUNCTIONS, obj.__name__, None) is obj:
            # torch.add and friends: one global (memoized) instead of two per message.
            return _rebuild, (_TORCH_FUNCTION, obj.__name__)
        return NotImplemented


class _Unpickler(pickle.Unpickler):
    """Finds globals of already imported modules with one getattr.

    The default looks each one up through the import machinery (about 2 us apiece);
    what it returns is the same object.
    """

    def find_class(self, module: str, name: str) -> Any:
        mod = sys.modules.get(module)
        if mod is not None and "." not in name:
            try:
                return getattr(mod, name)
            except AttributeError:
                pass
        return super().find_class(module, name)


def _plain_reduce(t: torch.Tensor) -> Tuple[Any, ...]:
    return t.__reduce_ex__(5)


def encode(obj: Any, context: Any = None, send_hook: Optional[TensorHook] = None,
           meta: Any = None) -> Tuple[bytes, List[memoryview], List[torch.Tensor]]:
    """Pickle ``meta`` then ``obj``; return the envelope, the out-of-band buffers and the
    tensors to keep alive until the buffers are sent.

    ``meta`` is a small plain object (no tensors) that the receiver reads before
    ``obj``, so it can choose how to rebuild ``obj``. ``send_hook`` sees, in pickling
    order, each tensor that requires grad and whose receiver will call its receive hook
    (its return value is ignored). Both are pickled by one pickler, one after the
    other, so the envelope is two pickles sharing one memo. Raises
    :class:`~torchrpc.errors.SerializationError` when something can't be pickled.
    """
    retry: dict = {}
    local = _local
    prev = getattr(local, "context", None)
    local.context = context
    try:
        for _ in range(2):
            enc = _Encoder(send_hook, retry)
            out = io.BytesIO()
            pickler = _Pickler(out, 5, buffer_callback=_out_of_band)
            pickler.enc = enc
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
                raise SerializationError(f"cannot pickle {_describe(obj)}: {exc}") from exc
            if not enc.conflict:
                break
            retry = enc.retry_ranges
    finally:
        local.context = prev
    return out.getvalue(), enc.views, enc.keepalive


_NONE_META = pickle.dumps(None, protocol=5)


def decode(envelope: bytes | bytearray | memoryview, buffers: Sequence[Any], context: Any = None,
           recv_hook: Optional[Callable[[Any], Optional[TensorHook]]] = None) -> Tuple[Any, Any]:
    """Unpickle an envelope whose tensors live in ``buffers`` (uint8 tensors or bytes).

    Returns ``(meta, obj)``. ``recv_hook(meta)``, when given, returns the hook to
    apply to every received tensor that requires grad.
    """
    local = _local
    prev_hook = getattr(local, "recv_hook", None)
    prev_context = getattr(local, "context", None)
    local.context = context
    try:
        stream = io.BytesIO(envelope)
        unpickler = _Unpickler(stream, buffers=buffers)
        if type(envelope) is not memoryview and envelope.startswith(_NONE_META):
            meta = None  # the common case: skip the empty pickle
            stream.seek(len(_NONE_META))
        else:
            meta = unpickler.load()
        local.recv_hook = recv_hook(meta) if recv_hook is not None else None
        return meta, unpickler.load()
    finally:
        local.recv_hook = prev_hook
        local.context = prev_context


def _describe(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 200 else text[:197] + "..."


def new_buffer(nbytes: int) -> Tuple[torch.Tensor, memoryview]:
    """Allocate a receive buffer: a 64-byte aligned uint8 tensor and a writable view of it."""
    t = torch.empty((nbytes,), dtype=torch.uint8)
    return t, memoryview_of(t.data_ptr(), nbytes) if nbytes else memoryview(bytearray())
