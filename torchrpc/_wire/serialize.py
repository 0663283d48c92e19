"""Tensor-aware pickling: tensors travel as out-of-band buffers, never through pickle.

Theory of operation. :func:`encode` pickles an object with protocol 5. Every
strided CPU tensor it meets is reduced to a reference to a *storage slot* plus
its metadata (dtype, shape, stride, offset). A slot stands for the byte range of
one storage that the message needs; it is pickled once and becomes one
out-of-band buffer, so two views of one storage arrive as two views of one
storage. Only the covered range is sent, and a view arrives with its strides,
unless it covers much less than its span (a sparse strided slice of a large
tensor): that one is sent compacted. A small contiguous tensor (at most
:data:`INLINE_MAX` bytes) whose storage no other tensor of the message shares
travels inside the envelope instead, as its bytes: a buffer of its own would cost
more (a length, a receive, a tensor to receive into) than copying a few bytes
twice. :func:`decode` receives the
buffers as uint8 tensors that the transport already filled (``recv_into``, or
mapped from shared memory), and rebuilds each tensor on that memory without a
copy. A tensor's dtype travels as a small fixed id, and every reduction made here
refers to one global, :func:`_rebuild`, with a tag: pickling a global costs an
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
*context* object that pickling code of upper layers (RRefs) can read with
:func:`current_context`.
"""

from __future__ import annotations

import copyreg
import ctypes
import importlib
import io
import pickle
import sys
import threading
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from ..errors import DeviceMapError, MissingDefinitionError, SerializationError

TensorHook = Callable[[torch.Tensor], torch.Tensor]

_local = threading.local()
_SPAN_SLACK = 2
_SPAN_EXTRA = 64 * 1024
_ALIGN = 16
# A buffer of a non-tensor object this large or larger travels out of band; a smaller one
# stays in the envelope, where pickle puts it.
OUT_OF_BAND_MIN = 256 * 1024
# A contiguous tensor of at most this many bytes travels inside the envelope: for small
# tensors, a buffer of its own costs more in bookkeeping than copying the bytes twice.
INLINE_MAX = 512


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

    The encoder pickles it (:meth:`_Encoder.reduce_slot`) by appending a memoryview of
    the range to its ``views``, in the order the pickle refers to its buffers. The
    PickleBuffer handed to pickle wraps a ctypes array, not that memoryview: a
    memoryview that a PickleBuffer exports from must never be left to the cycle
    collector (CPython clears it despite the export, and may then crash), and an
    exception's traceback can put both in a cycle.
    """

    __slots__ = ("tensor", "base", "lo", "hi")

    def __init__(self, tensor: torch.Tensor, base: int, lo: int, hi: int) -> None:
        self.tensor = tensor  # keeps the memory alive until sent
        self.base = base  # address of the storage's first byte
        self.lo = lo
        self.hi = hi


class _Bytes:
    """A large buffer of a non-tensor object, sent out of band.

    ``view`` is the buffer's bytes as a memoryview exported by the object itself (so it
    keeps the object alive until sent). It stands in for the PickleBuffer among the
    object's reduction arguments.
    """

    __slots__ = ("view",)

    def __init__(self, view: memoryview) -> None:
        self.view = view


# What the PickleBuffers that mark a _Bytes' place export (pickle never reads their
# content: the data is the view); never resized.
_PLACE = bytearray()


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


def _rebuild_bytes(buf: Any, readonly: bool) -> memoryview:
    if isinstance(buf, torch.Tensor):
        if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
            raise ValueError(f"malformed out-of-band buffer: {buf.dtype} tensor of shape "
                             f"{tuple(buf.shape)}")
        view = _owning_view(buf)
    else:  # in-band fallback, as in _rebuild_slot
        view = memoryview(bytearray(buf))
    return view.toreadonly() if readonly else view


def _owning_view(t: torch.Tensor) -> memoryview:
    """A writable byte memoryview over a uint8 tensor that keeps the tensor alive."""
    n = t.numel()
    if n == 0:
        return memoryview(bytearray())
    raw = (ctypes.c_ubyte * n).from_address(t.data_ptr())
    raw.owner = t  # the memoryview holds raw, raw holds the tensor
    return memoryview(raw).cast("B")


def _received_with_grad(t: torch.Tensor) -> torch.Tensor:
    """A received tensor that requires grad, after the receive hook saw it, so that
    distributed autograd records it (every rebuilder of a tensor with grad ends here)."""
    t.requires_grad_(True)
    hook = getattr(_local, "recv_hook", None)
    return hook(t) if hook is not None else t


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
    return _received_with_grad(t) if requires_grad else t


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
def _rebuild_inline(data: bytes, dtype: Any, shape: Tuple[int, ...],
                    requires_grad: bool) -> torch.Tensor:
    if type(dtype) is int:
        dtype = _DTYPES[dtype]
    t = torch.frombuffer(bytearray(data), dtype=dtype)  # contiguous strides: see the encoder
    if len(shape) != 1:
        t = t.view(shape)
    elif shape[0] != t.numel():
        raise ValueError(f"malformed inline tensor: {len(data)} bytes for shape {shape}")
    return _received_with_grad(t) if requires_grad else t


def _rebuild_on_device(target: str, fn: Callable[..., torch.Tensor], args: Tuple[Any, ...]
                       ) -> torch.Tensor:
    """A CUDA tensor: its bytes travel as a CPU tensor (``fn(*args)``) and land on
    ``target``, the device its sender's device map names."""
    device = torch.device(target)
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"malformed tensor: target device {target!r} is not a CUDA device")
    t = fn(*args)
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"malformed tensor: {type(t).__name__} sent for device {target}")
    if t.is_leaf:
        with torch.no_grad():
            moved = t.to(device)
        return moved.requires_grad_(t.requires_grad)
    return t.to(device)  # received by a distributed autograd pass: the copy is in its graph


_SLOT, _TENSOR, _EMPTY, _TORCH_FUNCTION, _BYTES, _INLINE, _DEVICE = 0, 1, 2, 3, 4, 5, 6
_REBUILDERS = (_rebuild_slot, _rebuild_tensor, _rebuild_empty, _torch_function, _rebuild_bytes,
               _rebuild_inline, _rebuild_on_device)


def _rebuild_sparse_coo(indices: torch.Tensor, values: torch.Tensor, size: Tuple[int, ...],
                        coalesced: bool, requires_grad: bool) -> torch.Tensor:
    t = torch.sparse_coo_tensor(indices, values, size, is_coalesced=coalesced,
                                check_invariants=True)
    return _received_with_grad(t) if requires_grad else t


def _rebuild_sparse_compressed(layout: torch.layout, a: torch.Tensor, b: torch.Tensor,
                               values: torch.Tensor, size: Tuple[int, ...],
                               requires_grad: bool = False) -> torch.Tensor:
    t = torch.sparse_compressed_tensor(a, b, values, size, layout=layout, check_invariants=True)
    return _received_with_grad(t) if requires_grad else t


def _rebuild_parameter(data: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    p = torch.nn.Parameter(data.detach(), requires_grad=requires_grad)
    hook = getattr(_local, "recv_hook", None) if requires_grad else None
    return hook(p) if hook is not None else p


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
        self.inlined: dict = {}  # storage address -> byte range of the tensor sent inline
        self.views: List[memoryview] = []
        self.keepalive: List[torch.Tensor] = []
        self.send_hook = send_hook
        self.retry_ranges = retry_ranges
        self.conflict = False
        # The PickleBuffer that the next buffer_callback must send out of band.
        self.marked: Optional[pickle.PickleBuffer] = None

    def in_band(self, buf: pickle.PickleBuffer) -> bool:
        """pickle's buffer_callback: out of band only the buffers queued in ``views``."""
        if buf is self.marked:
            self.marked = None
            return False
        return True

    def reduce_tensor(self, t: torch.Tensor) -> Tuple[Any, ...]:
        # The hot path of every message with a tensor: each attribute read below is a
        # call into torch, so read as few as the common case needs.
        layout = t.layout
        if layout is not torch.strided:
            if self.send_hook is not None and t.requires_grad and layout in _SPARSE_LAYOUTS:
                # The receiver rebuilds it with its receive hook (see _received_with_grad);
                # its indices and values never require grad, so the two sides count alike.
                self.send_hook(t)
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
            target = self.cuda_target(t)
            if target is not None:
                return self.reduce_cuda(t, target)
            data = t.detach().cpu()  # no RPC peer (a local tool's encode): to CPU
        if (dtype.is_complex and data.is_conj()) or data.is_neg():
            if not requires_grad:
                # Keep the lazy bit, as pickle does: send the memory as it lies, and set
                # the bit again on arrival.
                if data.is_conj():
                    return torch.conj, (data.conj(),)
                return torch._neg_view, (torch._neg_view(data),)
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
            nbytes = numel * itemsize
            key = data.data_ptr() - lo
            if nbytes <= INLINE_MAX and key not in self.retry_ranges \
                    and data.stride() == _contiguous_strides(tuple(data.shape)):
                # Inline, unless another tensor of the message shares the storage: then
                # encode() runs again and that storage travels as one slot for both.
                seen = self.inlined.get(key)
                if seen is None and key not in self.slots:
                    self.inlined[key] = (lo, lo + nbytes)
                    return _rebuild, (_INLINE, ctypes.string_at(key + lo, nbytes), dtype_ref,
                                      tuple(data.shape), requires_grad)
                if seen is not None:
                    self.widen(key, seen, lo, lo + nbytes)
            hi = lo + nbytes
        else:
            # A view keeps its strides: the span of storage it covers travels. Only a view
            # whose span would add more than _SPAN_EXTRA bytes beyond twice its elements'
            # (a sparse strided slice of a big tensor) is sent compacted, and arrives
            # contiguous.
            span = 1 + sum((n - 1) * s for n, s in zip(data.shape, data.stride()) if s > 0)
            if span > _SPAN_SLACK * numel and (span - numel) * itemsize > _SPAN_EXTRA:
                data = data.detach().contiguous()
                lo, span = 0, numel
            hi = lo + span * itemsize
        # The storage is known by the address of its first byte: two live storages never
        # share one, and everything encoded stays alive until encode() returns.
        key = data.data_ptr() - lo
        seen = self.inlined.get(key)
        if seen is not None:  # an earlier tensor of the message, inlined, shares the storage
            self.widen(key, seen, lo, hi)
        slot = self.slots.get(key)
        if slot is None or not (slot.lo <= lo and hi <= slot.hi):
            if slot is not None:
                # A later view reaches outside the range already pickled: note the union
                # and let encode() run once more with the whole range known up front.
                self.widen(key, (slot.lo, slot.hi), lo, hi)
            lo_a, hi_a = self.retry_ranges.get(key, (lo, hi))
            slot = _Slot(data, key, (min(lo, lo_a) // _ALIGN) * _ALIGN, max(hi, hi_a))
            self.slots[key] = slot
            self.keepalive.append(data)
        return _rebuild, (_TENSOR, slot, lo - slot.lo, dtype_ref, tuple(data.shape),
                          data.stride(), requires_grad)

    @staticmethod
    def cuda_target(t: torch.Tensor) -> Optional[str]:
        """The device CUDA tensor ``t`` lands on at the peer of the message being encoded
        (its context's ``target_device``, which raises where no device map covers it), or
        None outside an RPC message."""
        where = getattr(current_context(), "target_device", None)
        if where is None:
            return None
        try:
            return str(where(t.device))
        except DeviceMapError as exc:
            raise PassThrough(exc) from None

    def reduce_cuda(self, t: torch.Tensor, target: str) -> Tuple[Any, ...]:
        """Send CUDA tensor ``t`` as its CPU copy, to be moved to ``target`` on arrival."""
        hook = self.send_hook
        if hook is not None and t.requires_grad and t.numel():
            hook(t)  # recorded as itself; the copy below only carries the bytes
        data = t.detach().cpu()
        if t.requires_grad:
            data.requires_grad_(True)
        self.send_hook = None
        try:
            fn, args = self.reduce_tensor(data)[:2]
        finally:
            self.send_hook = hook
        return _rebuild, (_DEVICE, target, fn, args)

    def widen(self, key: int, sent: Tuple[int, int], lo: int, hi: int) -> None:
        """Storage ``key``, of which bytes ``sent`` are already pickled, is needed over
        [lo, hi) too: note the union, and have encode() run again with it known."""
        self.conflict = True
        lo2, hi2 = self.retry_ranges.get(key, sent)
        self.retry_ranges[key] = (min(lo2, sent[0], lo), max(hi2, sent[1], hi))

    def reduce_slot(self, slot: _Slot) -> Tuple[Any, ...]:
        raw = (ctypes.c_ubyte * (slot.hi - slot.lo)).from_address(slot.base + slot.lo)
        self.views.append(memoryview(raw).cast("B"))
        buf = self.marked = pickle.PickleBuffer(raw)
        return _rebuild, (_SLOT, buf)

    def reduce_bytes(self, data: _Bytes) -> Tuple[Any, ...]:
        self.views.append(data.view)
        buf = self.marked = pickle.PickleBuffer(_PLACE)
        return _rebuild, (_BYTES, buf, data.view.readonly)

    def reduce_parameter(self, p: torch.nn.Parameter) -> Tuple[Any, ...]:
        if p.requires_grad and self.send_hook is not None:
            # Recorded like any tensor that requires grad (its .data does not), so a
            # parameter passed to a callee gets its gradient back.
            self.send_hook(p)
        return _rebuild_parameter, (p.data, p.requires_grad)

    def reduce_script_function(self, fn: Any) -> Tuple[Any, ...]:
        return _load_script_function, (fn.qualified_name,)

    def reduce_custom(self, obj: Any) -> Any:
        """Reduce an object of a class with its own reduction as pickle would, with its
        large buffers taken out of band (pickle saves a PickleBuffer before asking us).

        Where pickle would not call the object's ``__reduce_ex__`` (a class, a type in
        copyreg's dispatch table), leave it to pickle.
        """
        if isinstance(obj, type) or type(obj) in copyreg.dispatch_table:
            return NotImplemented
        rv = obj.__reduce_ex__(5)
        if type(rv) is not tuple or len(rv) < 2 or type(rv[1]) is not tuple:
            return rv
        for arg in rv[1]:
            if type(arg) is _PICKLE_BUFFER:
                break
        else:
            return rv
        args = tuple(self.reduce_buffer(a) if type(a) is _PICKLE_BUFFER else a for a in rv[1])
        return (rv[0], args) + rv[2:]

    def reduce_buffer(self, buf: pickle.PickleBuffer) -> Any:
        """What to pickle in place of ``buf``: itself (in band) or a :class:`_Bytes`."""
        try:
            view = buf.raw()
        except BufferError:
            return buf  # not contiguous: pickle raises its own error
        # A view exported by a memoryview is left in band: a memoryview something exports
        # from must never be left to the cycle collector (see _Slot).
        if view.nbytes < OUT_OF_BAND_MIN or type(view.obj) is memoryview:
            return buf
        return _Bytes(view)


_SPARSE_LAYOUTS = frozenset((torch.sparse_coo, torch.sparse_csr, torch.sparse_csc,
                             torch.sparse_bsr, torch.sparse_bsc))


def _reduce_sparse(t: torch.Tensor, layout: torch.layout) -> Tuple[Any, ...]:
    # The parts travel detached: the tensor's own requires_grad says what the receiver
    # rebuilds, and no part may call the send hook.
    if layout is torch.sparse_coo:
        return _rebuild_sparse_coo, (t._indices().detach(), t._values().detach(),
                                     tuple(t.shape), t.is_coalesced(), t.requires_grad)
    if layout in _SPARSE_LAYOUTS:
        if layout in (torch.sparse_csr, torch.sparse_bsr):
            a, b = t.crow_indices(), t.col_indices()
        else:
            a, b = t.ccol_indices(), t.row_indices()
        return _rebuild_sparse_compressed, (layout, a.detach(), b.detach(),
                                            t.values().detach(), tuple(t.shape),
                                            t.requires_grad)
    return _plain_reduce(t)


# Exact types pickled by the encoder; everything else goes the usual way (copyreg's
# dispatch table, then __reduce_ex__), so later copyreg registrations are honoured.
_REDUCERS: dict = {
    torch.Tensor: _Encoder.reduce_tensor,
    torch.nn.Parameter: _Encoder.reduce_parameter,
    torch.jit.ScriptFunction: _Encoder.reduce_script_function,
    _Slot: _Encoder.reduce_slot,
    _Bytes: _Encoder.reduce_bytes,
}


_PICKLE_BUFFER = pickle.PickleBuffer
_OBJECT_REDUCE_EX = object.__reduce_ex__
_OBJECT_REDUCE = object.__reduce__


def register_reducer(cls: type, reducer: Callable[[Any], Tuple[Any, ...]]) -> None:
    """Make :func:`encode` pickle exact instances of ``cls`` as ``reducer(obj)`` says."""
    _REDUCERS[cls] = lambda enc, obj: reducer(obj)


class _Pickler(pickle.Pickler):
    """Protocol 5 with out-of-band buffers; tensors, and objects with their own reduction,
    reduced by an :class:`_Encoder` (set as ``enc`` after construction: a Python
    ``__init__`` would cost a call per message)."""

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
        if isinstance(obj, torch._C.Future):
            raise PassThrough(RuntimeError(
                "Can not pickle torch.futures.Future: a future is local to its process; "
                "wait for it and send its value instead"))
        if cls.__reduce_ex__ is _OBJECT_REDUCE_EX and cls.__reduce__ is _OBJECT_REDUCE:
            return NotImplemented  # pickle's default reduction hands it no buffers
        return self.enc.reduce_custom(obj)


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
        try:
            return super().find_class(module, name)
        except (AttributeError, ImportError) as exc:
            raise MissingDefinitionError(
                f"RPC pickler does not serialize function code. Ensure that UDFs are defined "
                f"on both caller and callee modules: {module}.{name} is not defined in this "
                f"process ({exc})") from None


def _plain_reduce(t: torch.Tensor) -> Tuple[Any, ...]:
    return t.__reduce_ex__(5)


def encode(obj: Any, context: Any = None, send_hook: Optional[TensorHook] = None,
           meta: Any = None, names: Union[str, Sequence[str]] = "value"
           ) -> Tuple[bytes, List[memoryview], List[torch.Tensor]]:
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
    """
    retry: dict = {}
    local = _local
    prev = getattr(local, "context", None)
    local.context = context
    try:
        for _ in range(2):
            enc = _Encoder(send_hook, retry)
            out = io.BytesIO()
            pickler = _Pickler(out, 5, buffer_callback=enc.in_band)
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
                local.context = None  # the search must not fork RRefs again
                raise SerializationError(f"cannot pickle {locate(obj, exc, names)}: "
                                         f"{exc}") from exc
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


def new_buffer(nbytes: int) -> Tuple[torch.Tensor, memoryview]:
    """Allocate a receive buffer: a 64-byte aligned uint8 tensor and a writable view of it."""
    t = torch.empty((nbytes,), dtype=torch.uint8)
    return t, memoryview_of(t.data_ptr(), nbytes) if nbytes else memoryview(bytearray())
