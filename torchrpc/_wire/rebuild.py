"""Receiving side of tensor-aware pickling: the globals an envelope names, and what they rebuild.

Every function here that a reduction in :mod:`.pickler` returns is named by module and name in
the envelopes it makes (``torchrpc._wire.rebuild._rebuild`` and the few others), so moving or
renaming one changes the wire format. They rebuild tensors on the received buffers without a
copy and refuse metadata that reaches outside its buffer. See :mod:`.serialize` for the theory
of operation.
"""

from __future__ import annotations

import ctypes
import importlib
from typing import Any, Callable, Optional, Tuple

import torch

from ..errors import SerializationError

TensorHook = Callable[[torch.Tensor], torch.Tensor]


def memoryview_of(ptr: int, nbytes: int) -> memoryview:
    """A writable byte memoryview over raw memory (caller keeps the owner alive)."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(ptr)).cast("B")


def _rebuild(tag: int, *args: Any, hook: Optional[TensorHook] = None) -> Any:
    """The one global the encoder's reductions refer to.

    Pickling a global costs an import-system lookup per global and message, so the
    slot, tensor and torch-function reductions share this one (memoized within a
    message); the tag says which it is. The tags are part of the wire format.
    ``hook``: the receive hook of the decode (its unpickler binds it), applied to each
    received tensor that requires grad.
    """
    if hook is None:
        return _REBUILDERS[tag](*args)
    t = _REBUILDERS[tag](*args)
    if (tag == _TENSOR or tag == _INLINE) and t.requires_grad:
        return hook(t)
    # A mapped tensor that requires grad is recorded where it landed; an empty one, whose
    # sender did not record it, is not.
    return hook(t) if tag == _DEVICE and t.requires_grad and t.numel() else t


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
    """A received tensor that requires grad (the rebuilder's caller applies the receive
    hook, so that distributed autograd records it)."""
    return t.requires_grad_(True)


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
    # Memory of its own, sized by the bytes that came (a shape cannot claim more), in
    # contiguous strides (see the encoder). A bytearray's storage cannot be resized;
    # torch.empty and a copy would make one that can, at a cost on every small call
    # (docs/porting.md).
    t = torch.frombuffer(bytearray(data), dtype=dtype)
    if len(shape) != 1:
        try:
            t = t.view(shape)
        except RuntimeError:
            raise ValueError(f"malformed inline tensor: {len(data)} bytes for shape "
                             f"{shape}") from None
    elif shape[0] != t.numel():
        raise ValueError(f"malformed inline tensor: {len(data)} bytes for shape {shape}")
    return _received_with_grad(t) if requires_grad else t


def _rebuild_on_device(target: str, fn: Callable[..., torch.Tensor], args: Tuple[Any, ...],
                       requires_grad: bool = False) -> torch.Tensor:
    """A tensor that lands on ``target``, the device its sender's device map names (or
    that its sender placed it on, see :class:`~torchrpc._wire.pickler.Placed`):
    ``fn(*args)`` rebuilds its data (a CPU tensor from its bytes, or a CUDA tensor copied
    from its sender's memory, see ``torchrpc._agent.cuda_ipc``), which moves to ``target``
    unless it is there already. With ``requires_grad`` it arrives as a leaf that
    requires grad, on ``target``, so that a gradient reaching it is on that device."""
    device = torch.device(target)
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"malformed tensor: target device {target!r} is not a CUDA device")
    t = fn(*args)
    if not isinstance(t, torch.Tensor) or t.requires_grad:
        raise ValueError(f"malformed tensor: {type(t).__name__} sent for device {target}")
    if t.device != device:
        t = t.to(device)
    return t.requires_grad_(True) if requires_grad else t


def _place(t: torch.Tensor, device: str) -> torch.Tensor:
    """A :class:`~torchrpc._wire.pickler.Placed` tensor pickled outside an RPC message."""
    return t.to(device)


_SLOT, _TENSOR, _EMPTY, _TORCH_FUNCTION, _BYTES, _INLINE, _DEVICE = 0, 1, 2, 3, 4, 5, 6
_REBUILDERS = (_rebuild_slot, _rebuild_tensor, _rebuild_empty, _torch_function, _rebuild_bytes,
               _rebuild_inline, _rebuild_on_device)


def _rebuild_sparse_coo(indices: torch.Tensor, values: torch.Tensor, size: Tuple[int, ...],
                        coalesced: bool, requires_grad: bool,
                        *, hook: Optional[TensorHook] = None) -> torch.Tensor:
    t = torch.sparse_coo_tensor(indices, values, size, is_coalesced=coalesced,
                                check_invariants=True)
    return _with_hook(t, requires_grad, hook)


def _rebuild_sparse_compressed(layout: torch.layout, a: torch.Tensor, b: torch.Tensor,
                               values: torch.Tensor, size: Tuple[int, ...],
                               requires_grad: bool = False,
                               *, hook: Optional[TensorHook] = None) -> torch.Tensor:
    t = torch.sparse_compressed_tensor(a, b, values, size, layout=layout, check_invariants=True)
    return _with_hook(t, requires_grad, hook)


def _rebuild_parameter(data: torch.Tensor, requires_grad: bool,
                       *, hook: Optional[TensorHook] = None) -> torch.Tensor:
    p = torch.nn.Parameter(data.detach(), requires_grad=requires_grad)
    return hook(p) if hook is not None and requires_grad else p


def _with_hook(t: torch.Tensor, requires_grad: bool, hook: Optional[TensorHook]) -> torch.Tensor:
    if not requires_grad:
        return t
    t.requires_grad_(True)
    return hook(t) if hook is not None else t


# The globals an unpickler binds its receive hook to (keyword ``hook``), when it has one.
HOOKED = (_rebuild, _rebuild_sparse_coo, _rebuild_sparse_compressed, _rebuild_parameter)


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


def new_buffer(nbytes: int) -> Tuple[torch.Tensor, memoryview]:
    """Allocate a receive buffer: a 64-byte aligned uint8 tensor and a writable view of it."""
    t = torch.empty((nbytes,), dtype=torch.uint8)
    return t, memoryview_of(t.data_ptr(), nbytes) if nbytes else memoryview(bytearray())
