"""Where gradients of received tensors go (placement.py), on records and messages alone: a
leaf that a device map moved has its gradient placed on the device it came from, through
the inverse of the map; the rest go as they are. The move itself needs a GPU
(tests/rpc/test_cuda.py); here the devices are torch.device objects and CPU tensors."""

from __future__ import annotations

import torch

from torchrpc import _wire
from torchrpc._dist_autograd import placement
from torchrpc._dist_autograd.records import DistAutogradContext, RecvRecorder, local_pass
from torchrpc.errors import DeviceMapError

D = torch.device


def _received(ctx, recorder, *values):
    """Leaves as the wire hands them to ``recorder``, and what user code gets."""
    outs = []
    for v in values:
        outs.append(recorder(torch.tensor(v).requires_grad_()))
    return outs


def test_without_a_map_or_cuda_the_plain_recorder_notes_nothing():
    ctx = DistAutogradContext(5, rank=0)
    recorder = placement.recv_recorder(ctx, 1, 7, None)
    assert type(recorder) is (RecvRecorder if not torch.cuda.is_available()
                              else placement.PlacingRecvRecorder)
    outs = _received(ctx, recorder, [1.0, 2.0])
    routed = local_pass(ctx, [outs[0].sum()], [torch.tensor(1.0)])
    assert placement.placed(ctx, routed) is routed
    assert ctx._places == {}


def test_a_leaf_a_map_moved_has_its_gradient_placed_where_it_came_from():
    # The sender (rank 1) mapped its cuda:1 to our CPU: back through {cpu: cuda:1}.
    ctx = DistAutogradContext(5, rank=0)
    recorder = placement.recv_recorder(ctx, 1, 7, {D("cpu"): D("cuda:1")})
    a, b = _received(ctx, recorder, [1.0, 2.0], [3.0])
    assert ctx._places == {(1, (7, 0)): D("cuda:1"), (1, (7, 1)): D("cuda:1")}
    routed = placement.placed(ctx, local_pass(ctx, [(a * 2).sum() + b.sum()],
                                              [torch.tensor(1.0)]))
    sent = dict(routed[1])
    assert set(sent) == {(7, 0), (7, 1)}
    for key, expected in (((7, 0), [2.0, 2.0]), ((7, 1), [1.0])):
        g = sent[key]
        assert type(g) is _wire.Placed and g.device == D("cuda:1")
        assert g.tensor.tolist() == expected


def test_a_leaf_from_this_worker_itself_is_never_placed():
    ctx = DistAutogradContext(5, rank=1)
    recorder = placement.recv_recorder(ctx, 1, 7, {D("cpu"): D("cuda:1")})
    _received(ctx, recorder, [1.0])
    assert ctx._places == {}


def test_a_device_no_map_reaches_is_an_error_raised_when_the_gradient_is_sent():
    place = placement.gradient_place(None, D("cuda:2"))
    assert isinstance(place, DeviceMapError)
    assert placement.gradient_place({D("cuda:2"): D("cuda:0")}, D("cuda:2")) == D("cuda:0")
    assert placement.gradient_place(None, D("cpu")) is None
    ctx = DistAutogradContext(5, rank=0)
    ctx._places[(1, (7, 0))] = place
    routed = placement.placed(ctx, {1: [((7, 0), torch.ones(2)), ((7, 1), None)],
                                    2: [((3, 0), torch.ones(1))]})
    g = routed[1][0][1]
    assert type(g) is _wire.Placed and g.device is place
    assert routed[1][1] == ((7, 1), None)  # no gradient: the sender makes zeros
    assert type(routed[2][0][1]) is torch.Tensor
    try:
        _wire.encode(("grads", routed[1]))
    except DeviceMapError as exc:
        assert exc is place
    else:
        raise AssertionError("a gradient with no device to go to was encoded")
