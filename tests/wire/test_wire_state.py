"""An encode's context and a decode's context and receive hook are state of that one
encode or decode: nested and concurrent ones never see each other's, and plain pickle
sees none. What an encode made is released after it, and releasing it crashes nothing."""

from __future__ import annotations

import pickle
import subprocess
import sys
import threading

import torch

from torchrpc import _wire

from ..support.group import ROOT


class _Marked:
    """Pickled by a message reducer: carries the encode's context inside a message."""

    def __reduce__(self):
        return _Marked, ()


def _rebuild_seen(tag, *, context=None):
    return ("seen", tag, context)


def _reduce_marked(obj, context):
    return (_rebuild_seen, (context,)) if context is not None else NotImplemented


_wire.register_message_reducer(_Marked, _reduce_marked)
_wire.register_rebuilder(_rebuild_seen)


class _SubMarked(_Marked):
    pass


def test_a_message_reducer_sees_its_encodes_context_and_plain_pickle_its_own():
    env, bufs, _ = _wire.encode([_Marked(), _SubMarked()], context="ctx-a")
    _, value = _wire.decode(env, bufs, context="ctx-b")
    assert value == [("seen", "ctx-a", "ctx-b")] * 2  # subclasses too
    env, bufs, _ = _wire.encode(_Marked())  # no context: the object's own reduction
    assert type(_wire.decode(env, bufs)[1]) is _Marked
    assert type(pickle.loads(pickle.dumps(_Marked()))) is _Marked
    # A rebuilder unpickled by plain pickle gets no context.
    env, bufs, _ = _wire.encode(_Marked(), context="c")
    assert pickle.loads(env[len(pickle.dumps(None, protocol=5)):]) == ("seen", "c", None)


def test_a_nested_decode_does_not_take_the_outer_ones_hook():
    inner_env, inner_bufs, _ = _wire.encode(torch.ones(2, requires_grad=True))
    seen = []

    def outer_hook(t):
        seen.append("outer")
        # a decode inside the hook (as an RRef confirmation might): its own hook only
        _wire.decode(inner_env, inner_bufs, None, lambda meta: inner_hook)
        return t

    def inner_hook(t):
        seen.append("inner")
        return t

    env, bufs, _ = _wire.encode([torch.ones(3, requires_grad=True),
                                 torch.zeros(3, requires_grad=True)])
    _, value = _wire.decode(env, bufs, None, lambda meta: outer_hook)
    assert seen == ["outer", "inner", "outer", "inner"]
    assert all(t.requires_grad for t in value)
    _, plain = _wire.decode(env, bufs)  # no hook: none applies
    assert all(t.requires_grad for t in plain) and len(seen) == 4


def test_concurrent_decodes_keep_their_own_hooks():
    env, bufs, _ = _wire.encode([torch.ones(4, requires_grad=True)] * 1)
    counts = {"a": 0, "b": 0}
    start = threading.Barrier(2)

    def run(name):
        def hook(t):
            counts[name] += 1
            return t
        start.wait()
        for _ in range(300):
            _wire.decode(env, bufs, None, lambda meta: hook)

    threads = [threading.Thread(target=run, args=(n,)) for n in counts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counts == {"a": 300, "b": 300}


# Objects that a reduction makes and only the pickler's memo holds die after the encode.
# Each object here makes a 1 MiB bytes (freed memory goes back to the system) and one whose
# finalizer runs a full collection while the others are being released. What the imports
# made is frozen out of the collector's sight: each collection then visits only what the
# encodes made, the objects this test is about, instead of all of torch.
_RELEASE_CODE = """
import gc
from torchrpc import _wire
gc.freeze()

class Collects:
    def __del__(self):
        gc.collect()

class Holder:
    def __reduce__(self):
        return Holder, (), (bytes(1 << 20), Collects())

    def __setstate__(self, state):
        pass

for i in range(20):
    _wire.encode([Holder() for _ in range(16)])
    if i % 2:
        _wire.prepare_encode()  # the next encode's pickler, made ahead
print("released")
"""


def test_a_collection_while_an_encodes_objects_are_released_crashes_nothing():
    # Python's pickler releases a cleared memo's objects while the memo still lists them,
    # and the garbage collector visits that list; encode must never let it see one.
    out = subprocess.run([sys.executable, "-c", _RELEASE_CODE], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, f"exit status {out.returncode}: {out.stderr[-2000:]}"
    assert out.stdout.strip() == "released"
