"""Values of every kind that pickle round-trips, and a deep comparison of two of them.

The matrix of issue 22, shared by the wire tests (on bytes) and the RPC tests (through
a real echo). The expected result of sending a value is what ``pickle.loads`` of
``pickle.dumps(value, protocol=5)`` gives in one process (:func:`pickled`); where torch's
own pickling is broken (float8 tensors in torch 2.13) it is the value itself.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
import pickle
import warnings
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import torch

from torchrpc._wire import OUT_OF_BAND_MIN

# ----------------------------------------------------------------------------------------
# value types defined here (module level, so both ends can unpickle them)


@dataclasses.dataclass
class Observation:
    obs: Any
    reward: float
    info: Dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Frozen:
    name: str
    value: Any


Step = collections.namedtuple("Step", ["obs", "action", "done"])


class Color(enum.Enum):
    RED = 1
    GREEN = "green"


class Flag(enum.IntFlag):
    A = 1
    B = 2


class CustomError(Exception):
    """An exception whose arguments are not a message."""

    def __init__(self, code: int, payload: Any) -> None:
        super().__init__(code, payload)
        self.code = code
        self.payload = payload


class ZeroCopyBytes(bytearray):
    """pickle's documented protocol-5 example: it hands pickle its own buffer."""

    def __reduce_ex__(self, protocol: int) -> Any:
        if protocol >= 5:
            return type(self)._reconstruct, (pickle.PickleBuffer(self),), None
        return type(self)._reconstruct, (bytearray(self),)

    @classmethod
    def _reconstruct(cls, obj: Any) -> "ZeroCopyBytes":
        with memoryview(obj) as m:
            obj = m.obj
            return obj if type(obj) is cls else cls(obj)


class Blob:
    """An object whose ``__reduce__`` returns a buffer among other arguments."""

    def __init__(self, data: Any, label: str) -> None:
        self.data = data
        self.label = label

    def __reduce__(self) -> Any:
        return Blob._rebuild, (self.label, pickle.PickleBuffer(self.data))

    @staticmethod
    def _rebuild(label: str, data: Any) -> "Blob":
        return Blob(bytes(data), label)

    def __eq__(self, other: object) -> bool:
        return type(other) is Blob and other.label == self.label and \
            bytes(other.data) == bytes(self.data)


class MyTensor(torch.Tensor):
    """A tensor subclass, as users write them."""


# ----------------------------------------------------------------------------------------
# the matrix

NUMPY_DTYPES = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                np.uint32, np.uint64, np.float16, np.float32, np.float64, np.longdouble,
                np.complex64, np.complex128, np.clongdouble]
LARGE = OUT_OF_BAND_MIN  # bytes: the smallest buffer that travels out of band


def numpy_sample(dtype: Any, shape: Tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random bit patterns of ``dtype`` (NaNs and infinities included), except bools."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape))
    rng = np.random.default_rng(seed)
    if dtype == np.bool_:
        return rng.integers(0, 2, n).astype(np.bool_).reshape(shape)
    raw = rng.integers(0, 256, n * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def _read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _channels_last() -> torch.Tensor:
    return torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)


def _non_leaf() -> torch.Tensor:
    return torch.randn(3, requires_grad=True) * 2


def _sparse_csc() -> torch.Tensor:
    return torch.tensor([[0.0, 1.0], [2.0, 0.0], [0.0, 3.0]]).to_sparse_csc()


def tensor_dtypes() -> List[torch.dtype]:
    """Every dtype torch can make a strided CPU tensor of (float8 types included)."""
    found = []
    for name in sorted(dir(torch)):
        dtype = getattr(torch, name)
        quantized = str(dtype).startswith(("torch.qint", "torch.quint"))
        if isinstance(dtype, torch.dtype) and dtype not in found and not quantized:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # complex32 is "experimental"
                    torch.empty(1, dtype=dtype)
            except (RuntimeError, TypeError):
                continue
            found.append(dtype)
    return found


def tensor_sample(dtype: torch.dtype, shape: Tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` holding random bytes (bool: 0 or 1)."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)


def matrix() -> Dict[str, Callable[[], Any]]:
    """Name -> a function making a fresh value of the matrix."""
    cases: Dict[str, Callable[[], Any]] = {}
    for dtype in NUMPY_DTYPES:
        name = np.dtype(dtype).name
        cases[f"numpy {name}"] = lambda d=dtype: numpy_sample(d, (3, 4))
        cases[f"numpy {name} large"] = lambda d=dtype: numpy_sample(
            d, (LARGE // np.dtype(d).itemsize + 3,))
    cases.update({
        "numpy object array": lambda: np.array([1, "two", None, (3.0,), np.float32(4)],
                                               dtype=object),
        "numpy 0-d": lambda: np.array(2.5),
        "numpy empty": lambda: np.zeros((0, 3), dtype=np.int32),
        "numpy Fortran-ordered": lambda: np.asfortranarray(numpy_sample(np.float64, (5, 7))),
        "numpy Fortran-ordered large": lambda: np.asfortranarray(
            numpy_sample(np.float32, (256, 300))),
        "numpy non-contiguous view": lambda: numpy_sample(np.int64, (6, 8))[::2, 1::3],
        "numpy non-contiguous large": lambda: numpy_sample(np.float64, (512, 256))[:, ::2],
        "numpy transposed large": lambda: numpy_sample(np.float64, (300, 200)).T,
        "numpy read-only": lambda: _read_only(numpy_sample(np.float32, (10,))),
        "numpy read-only large": lambda: _read_only(numpy_sample(np.uint8, (LARGE,))),
        "numpy structured": lambda: np.array([(1, 2.0, b"ab"), (3, 4.5, b"cd")],
                                             dtype=[("a", "<i4"), ("b", "<f8"), ("c", "S2")]),
        "numpy structured large": lambda: np.zeros(LARGE // 12 + 1,
                                                   dtype=[("x", "<i4"), ("y", "<f8")]),
        "numpy big-endian": lambda: numpy_sample(">f8", (5,)),
        "numpy datetime64": lambda: np.array(["2024-01-01", "2025-06-30"], dtype="M8[D]"),
        "numpy unicode": lambda: np.array(["abc", "dé"]),
        "numpy scalars": lambda: [np.float64(1.5), np.int8(-3), np.bool_(True),
                                  np.complex64(1 - 2j), np.float16(0.5), np.uint64(2**63)],
        "numpy same array twice": lambda: [numpy_sample(np.int16, (LARGE,))] * 2,
        "numpy views of one base": lambda: (lambda a: [a[:LARGE // 8], a[LARGE // 8:]])(
            numpy_sample(np.float64, (LARGE // 4,))),
        "bytes": lambda: b"\x00abc" * 100,
        "bytearray": lambda: bytearray(b"xyz" * 10),
        "bytearray large": lambda: bytearray(LARGE + 1),
        "PickleBuffer": lambda: pickle.PickleBuffer(bytearray(b"mutable")),
        "PickleBuffer read-only": lambda: pickle.PickleBuffer(b"immutable"),
        "PickleBuffer large": lambda: pickle.PickleBuffer(bytearray(LARGE)),
        "ZeroCopyBytes": lambda: ZeroCopyBytes(b"small"),
        "ZeroCopyBytes large": lambda: ZeroCopyBytes(bytes(range(256)) * (LARGE // 256)),
        "reduce returns a buffer": lambda: Blob(b"tiny", "small"),
        "reduce returns a large buffer": lambda: Blob(bytearray(LARGE * 2), "large"),
    })
    for dtype in tensor_dtypes():
        cases[f"tensor {dtype}"] = lambda d=dtype: tensor_sample(d, (2, 3))
    cases.update({
        "tensor large": lambda: tensor_sample(torch.float32, (LARGE // 4,)),
        "tensor 0-d": lambda: torch.tensor(3.5),
        "tensor empty": lambda: torch.empty(0, 4),
        "tensor huge rank": lambda: torch.randn((1,) * 30 + (2, 3)),
        "tensor channels-last": _channels_last,
        "tensor transposed": lambda: torch.randn(4, 6).t(),
        "tensor expanded": lambda: torch.randn(3, 1).expand(3, 5),
        "tensor sparse COO": lambda: torch.randn(4, 5).relu().to_sparse(),
        "tensor sparse COO uncoalesced": lambda: torch.sparse_coo_tensor(
            torch.tensor([[0, 0, 1], [1, 1, 2]]), torch.tensor([1.0, 2.0, 3.0]), (2, 3)),
        "tensor sparse CSR": lambda: torch.randn(4, 5).relu().to_sparse_csr(),
        "tensor sparse CSC": _sparse_csc,
        "tensor quantized": lambda: torch.quantize_per_tensor(torch.randn(6), 0.1, 3,
                                                              torch.qint8),
        "tensor quantized per channel": lambda: torch.quantize_per_channel(
            torch.randn(2, 3), torch.tensor([0.1, 0.2]), torch.tensor([0, 1]), 0, torch.quint8),
        "nn.Parameter": lambda: torch.nn.Parameter(torch.randn(2, 2)),
        "nn.Parameter frozen": lambda: torch.nn.Parameter(torch.randn(2), requires_grad=False),
        "tensor subclass": lambda: torch.randn(3).as_subclass(MyTensor),
        "tensor requires grad": lambda: torch.randn(3, requires_grad=True),
        "tensor requires grad non-leaf": _non_leaf,
        "tensor complex conjugate": lambda: torch.randn(3, dtype=torch.complex64).conj(),
        "tensor negative view": lambda: torch._neg_view(torch.randn(2, 3)),
        "torch.Size": lambda: torch.Size([2, 3, 4]),
        "torch.dtype": lambda: [torch.float32, torch.bfloat16, torch.int64],
        "torch.device": lambda: [torch.device("cpu"), torch.device("cuda", 1),
                                 torch.device("meta")],
        "dataclass": lambda: Observation(numpy_sample(np.float32, (4,)), 1.0, {"t": 3}),
        "frozen dataclass": lambda: Frozen("w", torch.ones(2)),
        "namedtuple": lambda: Step(np.zeros(2), 1, False),
        "enums": lambda: [Color.RED, Color.GREEN, Flag.A | Flag.B],
        "sets": lambda: [{1, "a", (2, 3)}, frozenset({b"x", 4.5}), set()],
        "exception with custom arguments": lambda: CustomError(7, {"why": [1, 2]}),
        "exception": lambda: ValueError("bad", 3),
        "plain values": lambda: [None, True, 2**100, -0.0, float("inf"), 1 + 2j, "ü", "",
                                 range(3, 9, 2), slice(1, None), Ellipsis],
        "nested mix": lambda: {
            "obs": [numpy_sample(np.float32, (4, 4)), torch.ones(2), {"deep": (np.int8(1),)}],
            "step": Step(torch.zeros(3), np.arange(LARGE // 8), True),
            7: [Observation(torch.randn(2, requires_grad=True), 0.5), {frozenset({1})}],
            ("k", 1): [bytearray(b"b"), pickle.PickleBuffer(b"pb"), torch.Size([1]),
                       torch.float16, Color.RED, CustomError(1, np.ones(2))],
        },
    })
    return cases


def shared_storage_pair() -> Tuple[torch.Tensor, torch.Tensor]:
    """Two views of one storage, as two arguments."""
    base = torch.arange(20.0)
    return base[2:10], base.view(4, 5)


# ----------------------------------------------------------------------------------------
# expected values and the comparison


def pickled(value: Any) -> Any:
    """What one process gets from pickling ``value`` (the value itself where torch's
    pickling of it is broken)."""
    try:
        return pickle.loads(pickle.dumps(value, protocol=5))
    except Exception:  # noqa: BLE001 - torch 2.13 can't pickle float8 tensors
        # Only the part that fails stands for itself: its neighbours still go through pickle.
        if type(value) in (tuple, list):
            return type(value)(pickled(v) for v in value)
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
            return type(value)(*(pickled(v) for v in value))
        if type(value) is CustomError:
            return CustomError(value.code, pickled(value.payload))
        if type(value) is dict:
            return {k: pickled(v) for k, v in value.items()}
        return value


def assert_same(expected: Any, got: Any, path: str = "value") -> None:
    """Equal value, type, dtype, shape, strides and flags, all the way down."""
    assert type(got) is type(expected), f"{path}: {type(got)} != {type(expected)}"
    if isinstance(expected, np.ndarray):
        assert got.dtype == expected.dtype and got.shape == expected.shape, path
        assert got.strides == expected.strides, f"{path}: {got.strides} != {expected.strides}"
        for flag in ("writeable", "c_contiguous", "f_contiguous"):
            assert getattr(got.flags, flag) == getattr(expected.flags, flag), \
                f"{path}: flag {flag}"
        if expected.dtype.hasobject:
            for i, (a, b) in enumerate(zip(expected.ravel(), got.ravel())):
                assert_same(a, b, f"{path}[{i}]")
        else:
            assert got.tobytes() == expected.tobytes(), f"{path}: values differ"
    elif isinstance(expected, np.generic):
        assert got.dtype == expected.dtype and got.tobytes() == expected.tobytes(), path
    elif isinstance(expected, torch.Tensor):
        _assert_same_tensor(expected, got, path)
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), path
        for i, (a, b) in enumerate(zip(expected, got)):
            assert_same(a, b, f"{path}[{i}]")
    elif isinstance(expected, dict):
        assert list(got) == list(expected), path
        for k in expected:
            assert_same(expected[k], got[k], f"{path}[{k!r}]")
    elif dataclasses.is_dataclass(expected):
        for f in dataclasses.fields(expected):
            assert_same(getattr(expected, f.name), getattr(got, f.name), f"{path}.{f.name}")
    elif isinstance(expected, BaseException):
        assert_same(expected.args, got.args, f"{path}.args")
        assert_same(vars(expected), vars(got), f"{path}.__dict__")
    elif isinstance(expected, pickle.PickleBuffer):
        assert bytes(expected.raw()) == bytes(got.raw()), path
    elif isinstance(expected, float) and math.isnan(expected):
        assert math.isnan(got), path
    else:
        assert got == expected, f"{path}: {got!r} != {expected!r}"
        if isinstance(expected, float):
            assert math.copysign(1, got) == math.copysign(1, expected), path


def _assert_same_tensor(expected: torch.Tensor, got: torch.Tensor, path: str) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape, path
    assert got.layout == expected.layout, path
    assert got.requires_grad == expected.requires_grad, f"{path}: requires_grad"
    assert got.is_leaf == expected.is_leaf, f"{path}: is_leaf"
    if expected.layout == torch.sparse_coo:
        assert got.is_coalesced() == expected.is_coalesced(), path
        _assert_same_tensor(expected._indices(), got._indices(), f"{path}.indices")
        _assert_same_tensor(expected._values().detach(), got._values().detach(),
                            f"{path}.values")
        return
    if expected.layout in (torch.sparse_csr, torch.sparse_csc):
        _assert_same_tensor(expected.to_dense(), got.to_dense(), f"{path}.dense")
        return
    if expected.is_quantized:
        assert got.qscheme() == expected.qscheme(), path
        if expected.qscheme() == torch.per_tensor_affine:
            assert (got.q_scale(), got.q_zero_point()) == \
                (expected.q_scale(), expected.q_zero_point()), path
        else:
            assert torch.equal(got.q_per_channel_scales(), expected.q_per_channel_scales())
            assert torch.equal(got.q_per_channel_zero_points(),
                               expected.q_per_channel_zero_points())
        assert torch.equal(got.int_repr(), expected.int_repr()), path
        return
    if expected.numel() > 1:
        assert got.stride() == expected.stride(), f"{path}: {got.stride()} != " \
                                                  f"{expected.stride()}"
    assert (got.is_conj(), got.is_neg()) == (expected.is_conj(), expected.is_neg()), path
    assert raw_bytes(got) == raw_bytes(expected), f"{path}: values differ"


def raw_bytes(t: torch.Tensor) -> bytes:
    """The bytes of ``t``'s elements in logical order."""
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    return bytes(t.untyped_storage())[t.storage_offset() * t.element_size():][
        :t.numel() * t.element_size()]
