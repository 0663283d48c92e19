"""Every picklable value crosses the wire intact, on bytes alone (issue 22).

Each value goes ``encode`` -> frame bytes -> the transport's frame reader -> ``decode``
(see ``test_wire.round_trip``) and must come out as ``pickle.loads(pickle.dumps(value))`` gives
it in one process: same type, value, dtype, shape, strides and flags. Large buffers of
non-tensor objects go out of band, small ones in the envelope.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import threading
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from torchrpc import _wire
from torchrpc._wire import rebuild
from torchrpc.errors import SerializationError

from ..support import values
from ..support.group import ROOT
from ..support.frames import FrameDecoder
from .test_wire import receive, round_trip
from ..support.values import LARGE, assert_same, numpy_sample, pickled

MATRIX = values.matrix()


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about sparse and quantized tensors
        yield


@pytest.mark.parametrize("name", list(MATRIX))
def test_matrix_round_trips_as_in_one_pickle(name):
    value = MATRIX[name]()
    assert_same(pickled(value), round_trip(value))


def test_the_whole_matrix_in_one_message():
    batch = {name: make() for name, make in MATRIX.items()}
    # Item by item: torch can't pickle some of the tensors (float8) in one process.
    assert_same({name: pickled(v) for name, v in batch.items()}, round_trip(batch))


def _decode(value: Any):
    env, bufs, keep = _wire.encode(value)
    head = _wire.pack_header(_wire.Kind.CALL, 0, 1, len(env), [len(b) for b in bufs])
    (frame,) = FrameDecoder().feed(head + env + b"".join(bytes(b) for b in bufs))
    received = receive(frame)
    return _wire.decode(env, received)[1], env, bufs, received


def test_large_numpy_buffers_travel_out_of_band_without_copies():
    a = numpy_sample(np.float32, (LARGE // 4,))
    env, bufs, keep = _wire.encode(a)
    assert len(bufs) == 1 and bufs[0].nbytes == LARGE and len(env) < 512
    assert bufs[0].obj is a  # the array's own memory is what gets sent
    got, _, _, received = _decode(a)
    # The array is built on the received buffer itself.
    assert got.__array_interface__["data"][0] == received[0].data_ptr()
    del received
    assert got.tobytes() == a.tobytes()  # the array keeps its memory alive


def test_small_numpy_buffers_stay_in_band():
    small = numpy_sample(np.uint8, (LARGE - 1,))
    env, bufs, _ = _wire.encode(small)
    assert bufs == [] and len(env) > LARGE - 1


@pytest.mark.parametrize("size", [16, LARGE], ids=["small", "large"])
def test_writeable_flags_are_those_of_one_pickle(size):
    writable = numpy_sample(np.uint8, (size,))
    read_only = numpy_sample(np.uint8, (size,))
    read_only.flags.writeable = False
    got_w, got_r = round_trip((writable, read_only))
    assert got_w.flags.writeable and not got_r.flags.writeable
    got_w[0] = 1  # really writable


def test_one_array_twice_arrives_as_one_array():
    a = numpy_sample(np.int16, (LARGE,))
    env, bufs, _ = _wire.encode([a, a])
    assert len(bufs) == 1
    got = round_trip([a, a, a[::2]])
    assert got[0] is got[1]


def test_tensor_buffers_are_unchanged_by_numpy_buffers_beside_them():
    t = torch.arange(float(LARGE // 4))
    a = numpy_sample(np.float64, (LARGE // 16, 2))
    got = round_trip((t[:10], a, t, a.T))
    assert got[0].untyped_storage().data_ptr() == got[2].untyped_storage().data_ptr()
    assert got[1].tobytes() == a.tobytes() and got[3].tobytes() == a.T.tobytes()
    assert got[3].flags.f_contiguous and torch.equal(got[2], t)


def test_objects_that_reduce_to_large_buffers_get_them_without_copies():
    data = values.ZeroCopyBytes(bytes(range(256)) * (LARGE // 256))
    env, bufs, _ = _wire.encode(data)
    assert len(bufs) == 1 and bufs[0].obj is data
    assert round_trip(data) == data
    # A bare PickleBuffer or a bytearray goes in band, as pickle puts it.
    assert _wire.encode(pickle.PickleBuffer(bytearray(LARGE)))[1] == []


def test_hostile_out_of_band_references_are_refused():
    with pytest.raises(ValueError, match="malformed out-of-band buffer"):
        rebuild._rebuild_bytes(torch.zeros(4, dtype=torch.float32), False)
    with pytest.raises(ValueError, match="malformed out-of-band buffer"):
        rebuild._rebuild_bytes(torch.zeros(8, dtype=torch.uint8)[::2], False)
    view = rebuild._rebuild_bytes(torch.zeros(8, dtype=torch.uint8), True)
    assert view.readonly and view.nbytes == 8


# ----------------------------------------------------------------------------------------
# values that cannot be pickled


@pytest.mark.parametrize("payload, path", [
    ((print, (1, {"obs": [0, 1, 2, threading.Lock()]}), {}), r"args\[1\]\['obs'\]\[3\]"),
    ((print, (memoryview(b"x"),), {}), r"args\[0\] \(<memory"),
    ((lambda: 1, (), {}), r"func \(<function"),
    ((print, (), {"k": values.Observation(np.zeros(2), 0.0, {"bad": threading.Lock()})}),
     r"kwargs\['k'\]\.info\['bad'\]"),
    ((print, (values.Step(1, (x for x in ()), False),), {}), r"args\[0\]\.action"),
    ((print, ([{1, 2}, {threading.Lock(): 1}],), {}), r"args\[0\]\[1\]<key <unlocked"),
    ((print, (torch.ones(2), [np.zeros(LARGE), threading.Event()]), {}),
     r"args\[1\]\[1\]\.(_cond|_flag)"),
])
def test_unpicklable_values_name_the_path_to_the_bad_part(payload, path):
    with pytest.raises(SerializationError, match="cannot pickle " + path):
        _wire.encode(payload, names=_wire.PAYLOAD_NAMES[_wire.Kind.CALL])


def test_unpicklable_values_fail_as_in_pickle():
    for bad in (memoryview(b"abc"), threading.Lock(), (x for x in ())):
        with pytest.raises(TypeError):
            pickle.dumps(bad, protocol=5)
        with pytest.raises(SerializationError, match=r"cannot pickle value\[1\]\[0\]"):
            _wire.encode([1, [bad]])


def test_the_library_needs_no_numpy():
    code = ("import sys; sys.modules['numpy'] = None\n"
            "import torch, torchrpc.rpc, torchrpc._wire as w\n"
            "env, bufs, keep = w.encode((torch.arange(4.0), {'b': bytearray(3)}))\n"
            "print(w.decode(env, [torch.frombuffer(bytearray(b), dtype=torch.uint8)"
            " for b in bufs])[1][0].sum().item())\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("6.0")


# ----------------------------------------------------------------------------------------
# property-based: nested values of every kind

_NUMPY_DTYPES = st.sampled_from([np.bool_, np.int8, np.uint16, np.int32, np.int64,
                                 np.float16, np.float32, np.float64, np.complex128])
_TORCH_DTYPES = st.sampled_from([torch.bool, torch.uint8, torch.int16, torch.int64,
                                 torch.float16, torch.bfloat16, torch.float32,
                                 torch.complex64, torch.float8_e4m3fn])


@st.composite
def _numpy_arrays(draw):
    if draw(st.integers(0, 9)) == 0:  # now and then one that goes out of band
        a = numpy_sample(draw(_NUMPY_DTYPES), (LARGE // 8 + draw(st.integers(0, 3)),),
                         seed=draw(st.integers(0, 9)))
    else:
        a = draw(hnp.arrays(draw(_NUMPY_DTYPES), hnp.array_shapes(min_dims=0, max_dims=3,
                                                                  min_side=0, max_side=4)))
    view = draw(st.sampled_from(["as is", "fortran", "transposed", "strided", "read-only"]))
    if view == "fortran":
        a = np.asfortranarray(a)
    elif view == "transposed":
        a = a.T
    elif view == "strided" and a.ndim:
        a = a[::2]
    elif view == "read-only":
        a.flags.writeable = False
    return a


@st.composite
def _tensors(draw):
    dtype = draw(_TORCH_DTYPES)
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    t = values.tensor_sample(dtype, shape, seed=draw(st.integers(0, 99)))
    view = draw(st.sampled_from(["as is", "transposed", "sliced", "grad"]))
    if view == "transposed" and t.dim() >= 2:
        t = t.transpose(0, 1)
    elif view == "sliced" and t.dim() and t.shape[0]:
        t = t[1:]
    elif view == "grad" and dtype in (torch.float32, torch.complex64):
        t = t.requires_grad_()
    return t


_LEAVES = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8),
    st.binary(max_size=16), st.builds(bytearray, st.binary(max_size=8)),
    st.builds(pickle.PickleBuffer, st.binary(max_size=8)),
    _numpy_arrays(), _tensors(),
    st.sampled_from([np.float32(1.5), np.int64(-7), np.bool_(False), torch.Size([2, 3]),
                     torch.float64, torch.device("cpu"), values.Color.GREEN, Ellipsis]),
    st.frozensets(st.integers() | st.text(max_size=4), max_size=3),
)


def _containers(children):
    return st.one_of(
        st.lists(children, max_size=4), st.tuples(children, children),
        st.dictionaries(st.text(max_size=4) | st.integers(), children, max_size=4),
        st.builds(values.Observation, children, st.floats(allow_nan=False),
                  st.dictionaries(st.text(max_size=3), children, max_size=2)),
        st.builds(values.Step, children, children, st.booleans()),
        st.builds(values.CustomError, st.integers(), children),
    )


@settings(max_examples=80, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.recursive(_LEAVES, _containers, max_leaves=12))
def test_nested_values_round_trip(value):
    assert_same(pickled(value), round_trip(value))
