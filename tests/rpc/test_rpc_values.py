"""Every picklable value crosses a real RPC intact, both ways (issue 22).

The matrix of ``tests/support/values.py`` is echoed through ``rpc_sync``, ``rpc_async`` and
``remote``/``to_here`` to a worker process and back; each value must come back as one
``pickle.dumps``/``loads`` in one process gives it. Values that cannot be pickled fail
on the caller before anything is sent, naming the path to the bad part.
"""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest
import torch

import torchrpc.rpc as rpc
from torchrpc.errors import SerializationError

from ..support import helpers, values
from ..support.values import LARGE, assert_same, numpy_sample, pickled

MATRIX = values.matrix()


pytestmark = pytest.mark.group(2, threads=4, timeout=60.0)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about sparse and quantized tensors
        yield


def _expected(value):
    return pickled(pickled(value))  # there and back: two pickles


@pytest.mark.parametrize("name", list(MATRIX))
def test_matrix_echoes_through_rpc_sync(name):
    value = MATRIX[name]()
    assert_same(_expected(value), rpc.rpc_sync("worker1", helpers.echo, args=(value,)))


def test_matrix_echoes_through_rpc_async_and_remote():
    batch = {name: make() for name, make in MATRIX.items()}
    expected = {name: _expected(v) for name, v in batch.items()}
    assert_same(expected, rpc.rpc_async("worker1", helpers.echo, args=(batch,)).wait())
    assert_same(expected, rpc.remote("worker1", helpers.echo, kwargs={"x": batch}).to_here())


@pytest.mark.parametrize("size", [64, LARGE], ids=["small", "large"])
def test_the_callee_gets_numpy_arrays_as_one_pickle_gives_them(size):
    for a in (numpy_sample(np.float32, (size // 4,)),
              np.asfortranarray(numpy_sample(np.int16, (size // 64, 32))),
              values._read_only(numpy_sample(np.uint8, (size,)))):
        ref = pickled(a)
        assert rpc.rpc_sync("worker1", helpers.array_layout, args=(a,)) == (
            "ndarray", str(ref.dtype), ref.shape, ref.strides, ref.flags.writeable,
            ref.flags.f_contiguous, ref.tobytes())


def test_shared_storage_stays_shared_on_the_callee():
    a, b = values.shared_storage_pair()
    assert rpc.rpc_sync("worker1", helpers.share_storage, args=(a, b))
    x, y = rpc.rpc_sync("worker1", helpers.echo, args=((a, b),))
    assert x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()


def test_a_large_numpy_array_in_every_direction():
    a = numpy_sample(np.float64, (4 * LARGE // 8,))
    rref = rpc.remote("worker1", helpers.echo, args=(a,))
    assert rref.to_here().tobytes() == a.tobytes()
    got = rpc.rpc_sync("worker1", helpers.add, args=(a, np.ones_like(a)))
    assert got.tobytes() == (a + 1).tobytes()


def _pending() -> tuple:
    info = rpc.get_debug_info()
    # A remote() that fails to pickle leaves no user RRef waiting for its owner either
    # (shutdown would wait for it).
    return info["agent.num_pending_requests"], info["num_pending_users"], info["num_user_rrefs"]


@pytest.mark.parametrize("call", ["rpc_sync", "rpc_async", "remote"])
def test_unpicklable_arguments_fail_before_sending_naming_the_path(call):
    before = _pending()
    obs = [np.zeros(3), 1.0, {"t": 2}, threading.Lock()]
    with pytest.raises(SerializationError, match=r"cannot pickle args\[1\]\['obs'\]\[3\] "
                                                 r"\(<unlocked _thread.lock"):
        getattr(rpc, call)("worker1", helpers.echo, args=(0, {"obs": obs}))
    with pytest.raises(SerializationError, match=r"cannot pickle kwargs\['x'\]\[0\] "
                                                 r"\(<memory at"):
        getattr(rpc, call)("worker1", helpers.echo, kwargs={"x": [memoryview(b"raw")]})
    # Earlier tests' RRefs may be deleted meanwhile, never created.
    assert all(after <= was for after, was in zip(_pending(), before))
    assert rpc.rpc_sync("worker1", helpers.add, args=(1, 2)) == 3


def test_an_unpicklable_return_value_names_its_path():
    with pytest.raises(SerializationError, match=r"cannot pickle result\['bad'\]\[1\]"):
        rpc.rpc_sync("worker1", helpers.return_nested_unpicklable)


def test_tensors_that_require_grad_keep_their_flags():
    leaf = torch.randn(3, requires_grad=True)
    got = rpc.rpc_sync("worker1", helpers.echo, args=([leaf, leaf * 2, leaf.detach()],))
    assert [(t.requires_grad, t.is_leaf) for t in got] == [(True, True), (True, True),
                                                          (False, True)]
    assert torch.equal(got[1].detach(), leaf.detach() * 2)


def _shm_counts() -> tuple:
    """(buffers this worker sent through shared memory, buffers worker1 received so)."""
    there = rpc.rpc_sync("worker1", helpers.debug_info)
    return (rpc.get_debug_info()["transport.shm_buffers_sent"],
            there["transport.shm_buffers_received"])


def test_tensors_past_the_inline_bound_cross_through_shared_memory_by_default():
    # Default options between workers of one host: up to 64 KiB of tensors travel inside
    # the envelope; a larger one goes through a segment (shm_threshold, 64 KiB).
    inline = torch.arange(16 << 10, dtype=torch.float32)  # 64 KiB
    past = torch.arange((16 << 10) + 1, dtype=torch.float32)
    before = _shm_counts()
    assert torch.equal(rpc.rpc_sync("worker1", helpers.echo, args=(inline,)), inline)
    assert _shm_counts() == before
    for i in range(3):
        assert torch.equal(rpc.rpc_sync("worker1", helpers.echo, args=(past + i,)), past + i)
    sent, received = _shm_counts()
    assert (sent - before[0], received - before[1]) == (3, 3)
