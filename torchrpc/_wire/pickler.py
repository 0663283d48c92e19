"""Sending side of tensor-aware pickling: the pickler that reduces tensors to storage slots.

:class:`_Pickler` pickles with protocol 5 and hands every object it meets that needs our
reduction (tensors, parameters, script functions, objects with large buffers) to the
:class:`_Encoder` of the running :func:`~torchrpc._wire.serialize.encode`, which turns storages
into out-of-band buffers and small tensors into inline bytes. See :mod:`.serialize` for the
theory of operation.
"""

from __future__ import annotations

import copyreg
import ctypes
import pickle
from typing import Any, Callable, List, Optional, Tuple

import torch

from ..errors import DeviceMapError
from .rebuild import (_BUILTIN, _BYTES, _DEVICE, _DTYPE_IDS, _EMPTY, _INLINE, _SLOT, _TENSOR,
                      _TORCH_FUNCTION, _TORCH_FUNCTIONS, _contiguous_strides, _load_script_function,
                      _place, _rebuild, _rebuild_parameter, _rebuild_sparse_compressed,
                      _rebuild_sparse_coo, TensorHook, memoryview_of)

_SPAN_SLACK = 2
_SPAN_EXTRA = 64 * 1024
_ALIGN = 16
# A buffer of a non-tensor object this large or larger travels out of band; a smaller one
# stays in the envelope, where pickle puts it.
OUT_OF_BAND_MIN = 256 * 1024
# By default, contiguous tensors travel inside the envelope while the message's inline bytes
# stay within this many: up to here a buffer of its own costs more in bookkeeping than
# copying the bytes a few times, and the envelope stays within the reader's buffer.
INLINE_MAX = 64 * 1024


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


# An encoder's cpu_target and cuda_share before it has asked its context.
_UNREAD = object()
# The key, among an encode's retry ranges (which every pass of it sees), of the CUDA
# tensors it has shared: id(tensor) -> how it is rebuilt.
_SHARED = object()


def device_maps_move_cpu() -> None:
    """Have every later encode ask its context where CPU tensors go (``cpu_target``):
    called once a device map that moves CPU tensors exists in this process."""
    _Encoder.moves_cpu = True


class Placed:
    """A tensor that lands on ``device`` at the receiver of the message that carries it,
    whatever the device maps say: distributed autograd sends a gradient back to the device
    its tensor came from (through the inverse of the map it came by). ``device`` may be
    the error that says why no device fits; encoding the message raises it."""

    __slots__ = ("tensor", "device")

    def __init__(self, tensor: torch.Tensor, device: Any) -> None:
        self.tensor = tensor
        self.device = device

    def __reduce__(self) -> Tuple[Any, ...]:  # outside an RPC message
        if isinstance(self.device, BaseException):
            raise self.device
        return _place, (self.tensor, str(self.device))

    def __repr__(self) -> str:
        return f"Placed({self.tensor!r}, {self.device!r})"


# What the PickleBuffers that mark a _Bytes' place export (pickle never reads their
# content: the data is the view); never resized.
_PLACE = bytearray()


class _Encoder:
    """State of one :func:`encode` call, and its ``context`` (see :func:`encode`), which
    the reductions of :func:`register_message_reducer` receive."""

    # Whether a device map of this process may move CPU tensors (see
    # :func:`device_maps_move_cpu`): until one does, CPU tensors skip asking the context.
    moves_cpu = False

    def __init__(self, send_hook: Optional[TensorHook], retry_ranges: dict,
                 context: Any = None, inline_max: int = INLINE_MAX) -> None:
        self.context = context
        self.inline_left = inline_max  # bytes this message may still carry inline
        self.slots: dict = {}
        self.inlined: dict = {}  # storage address -> byte range of the tensor sent inline
        self.views: List[memoryview] = []
        self.keepalive: List[torch.Tensor] = []
        self.send_hook = send_hook
        # Where this message's CPU tensors land (a device map that moves them), None where
        # they stay on the CPU; read from the context at the first CPU tensor.
        self.cpu_target: Any = _UNREAD
        # How this message's CUDA tensors are shared with a peer on this host (the
        # context's ``cuda_share()``), None where they travel as bytes; read at the first.
        self.cuda_share: Any = _UNREAD
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
                return self.reduce_mapped(t, target)
            data = t.detach().cpu()  # no RPC peer (a local tool's encode): to CPU
        elif self.moves_cpu and self.cpu_target is not None:
            target = self.cpu_target
            if target is _UNREAD:
                where = getattr(self.context, "cpu_target", None)
                target = self.cpu_target = None if where is None else where()
            if target is not None:
                return self.reduce_mapped(t, str(target))
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
            if nbytes <= self.inline_left and key not in self.retry_ranges \
                    and data.stride() == _contiguous_strides(tuple(data.shape)):
                # Inline, unless another tensor of the message shares the storage: then
                # encode() runs again and that storage travels as one slot for both.
                seen = self.inlined.get(key)
                if seen is None and key not in self.slots:
                    self.inlined[key] = (lo, lo + nbytes)
                    self.inline_left -= nbytes
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

    def cuda_target(self, t: torch.Tensor) -> Optional[str]:
        """The device CUDA tensor ``t`` lands on at the peer of the message being encoded
        (its context's ``target_device``, which raises where no device map covers it), or
        None outside an RPC message."""
        where = getattr(self.context, "target_device", None)
        if where is None:
            return None
        try:
            return str(where(t.device))
        except DeviceMapError as exc:
            raise PassThrough(exc) from None

    def reduce_mapped(self, t: torch.Tensor, target: str) -> Tuple[Any, ...]:
        """Send ``t`` (a CUDA tensor, or a CPU tensor that a device map moves) to land on
        ``target``. This is the one place that chooses how a CUDA tensor's data travels:
        through CUDA IPC where the context offers it (a peer on this host, see
        ``torchrpc._agent.cuda_ipc``), else as the bytes of its CPU copy."""
        hook = self.send_hook
        requires_grad = t.requires_grad
        if hook is not None and requires_grad and t.numel():
            hook(t)  # recorded as itself; the receiver records the tensor where it lands
        if t.is_cuda and target != "cpu" and t.layout is torch.strided and t.numel():
            share = self.cuda_share
            if share is _UNREAD:
                offer = getattr(self.context, "cuda_share", None)
                share = self.cuda_share = None if offer is None else offer()
            if share is not None:
                # One share per tensor and message, however many passes encode() makes.
                shared = self.retry_ranges.setdefault(_SHARED, {})
                how = shared.get(id(t))
                if how is None:
                    how = shared[id(t)] = share(t, target)
                return _rebuild, (_DEVICE, target, *how, requires_grad)
        data = t.detach().cpu()
        # Storages are known by address until encode() returns: the copy must outlive it,
        # or the next tensor's copy could take its place and pass for a view of it.
        self.keepalive.append(data)
        cpu_target = self.cpu_target
        self.send_hook = self.cpu_target = None
        try:
            fn, args = self.reduce_tensor(data)[:2]
        finally:
            self.send_hook, self.cpu_target = hook, cpu_target
        return _rebuild, (_DEVICE, target, fn, args, requires_grad)

    def reduce_placed(self, p: "Placed") -> Tuple[Any, ...]:
        """A tensor its sender placed: it lands on ``p.device`` whatever the maps say."""
        t, device = p.tensor, p.device
        if isinstance(device, BaseException):
            raise PassThrough(device)
        if device.type == "cpu" and t.is_cpu:
            cpu_target = self.cpu_target
            self.cpu_target = None  # stays on the CPU, whatever a map does with the CPU
            try:
                return self.reduce_tensor(t)
            finally:
                self.cpu_target = cpu_target
        return self.reduce_mapped(t, str(device))

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
        for cls in type(obj).__mro__:
            reduce = _MESSAGE_REDUCERS.get(cls)
            if reduce is not None:
                rv = reduce(obj, self.context)
                if rv is not NotImplemented:
                    return rv
                break
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
    Placed: _Encoder.reduce_placed,
}


_PICKLE_BUFFER = pickle.PickleBuffer
_OBJECT_REDUCE_EX = object.__reduce_ex__
_OBJECT_REDUCE = object.__reduce__


def register_reducer(cls: type, reducer: Callable[[Any], Tuple[Any, ...]]) -> None:
    """Make :func:`encode` pickle exact instances of ``cls`` as ``reducer(obj)`` says."""
    _REDUCERS[cls] = lambda enc, obj: reducer(obj)


# Classes (and their subclasses) with a reduction that depends on the message being
# encoded: class -> reducer(obj, context). Only classes with a reduction of their own
# (a __reduce__ or __reduce_ex__) are looked up here.
_MESSAGE_REDUCERS: dict = {}


def register_message_reducer(cls: type, reducer: Callable[[Any, Any], Any]) -> None:
    """Make :func:`encode` pickle instances of ``cls`` and its subclasses as
    ``reducer(obj, context)`` says, ``context`` being the one :func:`encode` was given
    (None outside a message); ``NotImplemented``: as the object's own ``__reduce_ex__``
    says. ``cls`` must define its own reduction, the one pickling outside ``encode``."""
    if cls.__reduce_ex__ is _OBJECT_REDUCE_EX and cls.__reduce__ is _OBJECT_REDUCE:
        raise TypeError(f"{cls.__name__} has no reduction of its own: define __reduce__ (what "
                        f"pickling it outside an RPC message does) before registering one")
    _MESSAGE_REDUCERS[cls] = reducer


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


def _plain_reduce(t: torch.Tensor) -> Tuple[Any, ...]:
    return t.__reduce_ex__(5)

