"""CUDA tensors and device maps (issue 18), on machines without a GPU.

A CUDA tensor travels as its bytes plus the device it lands on, which the sender's device
map names (a request) or the inverse of the caller's map (a reply); without an entry for
its device, the call fails with torch's error before anything is sent. Here a stand-in
for CUDA tensors (``tests.support.cuda.FakeCuda``, mocked at the serialization layer
only) maps to ``cpu``, a target torch allows too; ``tests/rpc/test_cuda.py`` runs the real
thing where a GPU exists.
"""

from __future__ import annotations

import pytest
import torch

import torchrpc.rpc as rpc
from torchrpc import _wire
from torchrpc._wire import pickler
from torchrpc._agent.current import current_agent
from torchrpc.errors import DeviceMapError

from ..support import cuda as ch
from ..support.group import running_group

TORCH_WORDS = ("TensorPipe RPC backend only supports CPU tensors by default, please move your "
               "tensors to CPU before sending them over RPC, or call `set_device_map` on "
               "`TensorPipeRpcBackendOptions` to explicitly configure device mapping.")


class _To:
    """A message context whose device map sends every CUDA device to ``target``."""

    def __init__(self, target: str) -> None:
        self.target = torch.device(target)

    def target_device(self, device: torch.device) -> torch.device:
        return self.target


def _round_trip(value, context):
    env, bufs, _ = _wire.encode(value, context)
    received = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in bufs]
    return env, _wire.decode(env, received)[1]


@pytest.mark.parametrize("n", [3, 100_000])  # inline and out of band
def test_a_cuda_tensor_travels_as_bytes_and_lands_on_the_mapped_device(n):
    x = ch.fake_cuda(torch.arange(float(n)))
    _, out = _round_trip((x, 7), _To("cpu"))
    assert type(out[0]) is torch.Tensor and out[0].device == torch.device("cpu")
    assert torch.equal(out[0], torch.arange(float(n))) and out[1] == 7


def test_several_cuda_tensors_of_one_message_each_arrive_with_their_own_values():
    # Each travels as a CPU copy made while encoding; a copy freed early could hand its
    # address to the next one, which would then pass for a view of the first.
    xs = [ch.fake_cuda(torch.full((100,), float(i))) for i in range(4)]
    _, out = _round_trip(("worker3", *xs), _To("cpu"))
    assert out[0] == "worker3"
    assert [t.tolist() for t in out[1:]] == [[float(i)] * 100 for i in range(4)]


def test_the_target_device_is_in_the_message_and_needs_the_device_on_arrival():
    env, bufs, _ = _wire.encode(ch.fake_cuda(torch.ones(2)), _To("cuda:1"))
    assert b"cuda:1" in env
    if not torch.cuda.is_available():
        with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
            _wire.decode(env, bufs)


def test_a_leaf_that_requires_grad_arrives_as_a_leaf_that_requires_grad():
    x = ch.fake_cuda(torch.ones(3)).requires_grad_()
    _, out = _round_trip(x, _To("cpu"))
    assert out.is_leaf and out.requires_grad and torch.equal(out.detach(), torch.ones(3))


def test_a_target_that_is_not_a_device_of_ours_is_refused_on_arrival():
    env, bufs, _ = _wire.encode(ch.fake_cuda(torch.ones(2)), _To("cuda:1"))
    hostile = env.replace(b"cuda:1", b"meta:1")
    with pytest.raises(Exception, match="not a CUDA device"):
        _wire.decode(hostile, bufs)


def test_outside_an_rpc_message_a_cuda_tensor_is_encoded_as_its_cpu_copy():
    _, out = _round_trip(ch.fake_cuda(torch.ones(2)), None)
    assert out.device == torch.device("cpu")


def test_a_cpu_tensor_travels_to_the_device_the_map_gives_the_cpu(monkeypatch):
    # As once a map of this process moves CPU tensors (devices.watch).
    monkeypatch.setattr(pickler._Encoder, "moves_cpu", True)

    class ToCuda1(_To):
        def cpu_target(self) -> torch.device:
            return torch.device("cuda:1")

    env, bufs, _ = _wire.encode((torch.ones(2), "x"), ToCuda1("cpu"))
    assert b"cuda:1" in env
    if not torch.cuda.is_available():
        with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
            _wire.decode(env, bufs)
    _, out = _round_trip((torch.ones(2), "x"), _To("cpu"))  # no cpu_target: stays
    assert out[0].device == torch.device("cpu") and out[0].tolist() == [1.0, 1.0]


# -- between workers -----------------------------------------------------------------------

# worker0 maps the CPU to worker1's CPU, which moves nothing (the maps that move tensors
# need a GPU: tests/rpc/test_cuda.py); worker1 has no map at all.
MAPS = {"device_maps": {"worker1": {"cpu": "cpu"}}}


@pytest.fixture(scope="module")
def group():
    with running_group(2, threads=4, timeout=30.0, self_options=MAPS) as g:
        yield g


def _calls_out(name: str) -> int:
    return current_agent().peer_stats().get(name, {}).get("calls_out", 0)


def test_cpu_tensors_mapped_to_the_cpu_stay_on_cpu(group):
    assert rpc.rpc_sync("worker1", ch.where, args=(torch.ones(2),)) == "Tensor on cpu"
    out = rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
    assert out.device == torch.device("cpu") and out.tolist() == [2.0, 2.0]


@pytest.mark.parametrize("how", ["rpc_sync", "rpc_async", "remote"])
def test_an_unmapped_cuda_tensor_fails_with_torchs_error_before_anything_is_sent(group, how):
    before = _calls_out("worker1")
    call = getattr(rpc, how)
    with pytest.raises(RuntimeError) as info:
        call("worker1", ch.where, args=(ch.fake_cuda(torch.ones(2), index=1),))
    assert isinstance(info.value, DeviceMapError)
    text = str(info.value)
    assert text.startswith(TORCH_WORDS)
    assert "Request device mapping is not available for destination worker1" in text
    assert "cuda:1" in text and "set_device_map('worker1'" in text
    assert _calls_out("worker1") == before
    assert rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1)).tolist() == [2.0, 2.0]


def test_a_worker_without_a_map_cannot_send_cuda_tensors(group):
    said = rpc.rpc_sync("worker1", ch.send_fake_cuda, args=("worker0",))
    assert said.startswith("DeviceMapError: " + TORCH_WORDS), said
    assert "Request device mapping is not available for destination worker0" in said


def test_a_reply_on_a_device_outside_the_inverse_map_fails_with_torchs_error(group):
    with pytest.raises(RuntimeError, match="Response device mapping is not available for "
                                           "destination worker0") as info:
        rpc.rpc_sync("worker1", ch.make_fake_cuda, args=(4,))
    assert TORCH_WORDS in str(info.value)
    assert rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1)).tolist() == [2.0, 2.0]


# -- placed tensors and mapped tensors that require grad (distributed autograd) ----------------

class _Hooks:
    """A send hook and a receive hook that count the tensors they see."""

    def __init__(self) -> None:
        self.sent, self.received = [], []

    def send(self, t):
        self.sent.append(t)

    def recv(self, meta):
        def hook(t):
            self.received.append(t)
            return t
        return hook


def test_a_mapped_tensor_that_requires_grad_is_recorded_where_it_lands():
    hooks = _Hooks()
    x = ch.fake_cuda(torch.ones(3)).requires_grad_()
    empty = ch.fake_cuda(torch.ones(0)).requires_grad_()
    env, bufs, _ = _wire.encode((x, empty), _To("cpu"), send_hook=hooks.send)
    received = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in bufs]
    out, out_empty = _wire.decode(env, received, recv_hook=hooks.recv)[1]
    # Recorded on both sides once, the empty one on neither (as for unmapped tensors).
    assert len(hooks.sent) == 1 and hooks.sent[0] is x
    assert len(hooks.received) == 1 and hooks.received[0] is out
    assert out.is_leaf and out.requires_grad and out.device == torch.device("cpu")
    assert out_empty.requires_grad and out_empty.numel() == 0


def test_a_placed_tensor_lands_where_it_was_placed_whatever_the_maps_say(monkeypatch):
    monkeypatch.setattr(pickler._Encoder, "moves_cpu", True)

    class MovesEverything(_To):
        def cpu_target(self) -> torch.device:
            return torch.device("cuda:1")

    context = MovesEverything("cuda:1")
    value = (_wire.Placed(torch.arange(3.0), torch.device("cpu")),
             _wire.Placed(ch.fake_cuda(torch.full((2,), 5.0)), torch.device("cpu")))
    env, out = _round_trip(value, context)
    assert b"cuda:1" not in env
    assert [type(t) for t in out] == [torch.Tensor, torch.Tensor]
    assert out[0].tolist() == [0.0, 1.0, 2.0] and out[1].tolist() == [5.0, 5.0]
    assert out[1].device == torch.device("cpu")


def test_a_placed_tensor_carries_its_target_and_needs_the_device_on_arrival():
    env, bufs, _ = _wire.encode(_wire.Placed(torch.ones(2), torch.device("cuda:1")), None)
    assert b"cuda:1" in env
    if not torch.cuda.is_available():
        with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
            _wire.decode(env, bufs)


def test_a_placed_tensor_outside_an_rpc_message_pickles_as_the_moved_tensor():
    import pickle
    out = pickle.loads(pickle.dumps(_wire.Placed(torch.ones(2), torch.device("cpu"))))
    assert type(out) is torch.Tensor and out.tolist() == [1.0, 1.0]
    with pytest.raises(DeviceMapError):
        pickle.dumps(_wire.Placed(torch.ones(2), DeviceMapError("no device")))
