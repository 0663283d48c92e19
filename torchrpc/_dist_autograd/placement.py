"""Where the gradient of a received tensor goes: back to the device it came from.

A tensor that crossed with a device map landed on the device the map named; its gradient
goes back through the inverse of that map (``devices.back_map``), to the device the
tensor came from on its sender, as torch's ``RecvRpcBackward`` sends it. While the
forward pass receives a leaf that a map moved, or that lies on a CUDA device,
:class:`PlacingRecvRecorder` notes in its context where its gradient goes, by sender and
key; the backward pass sends that gradient *placed* there (:func:`placed`: a
``_wire.Placed``, which lands on that device whatever the maps of the message that
carries it say). A leaf whose device no map reaches gets the error noted instead, raised
when its gradient is sent. Nothing here does I/O or needs a GPU: the wire's rebuild
moves the gradient (``.to(device)``), and the sender's ``parts.materialize`` moves one
that still arrives elsewhere to the device of the tensor it sent.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from .._agent.devices import Map, gradient_device
from .._wire import Placed
from ..errors import DeviceMapError
from .records import DistAutogradContext, MessageKey, RecvRecorder

Routed = Dict[int, List[Tuple[MessageKey, Optional[torch.Tensor]]]]


def gradient_place(back: Optional[Map], device: torch.device) -> Any:
    """Where the gradient of a leaf received on ``device`` goes on its sender, through
    ``back`` (:func:`~torchrpc._agent.devices.gradient_device`): None where it needs no
    placing, or the error to raise when it is sent (not while the forward pass runs)."""
    try:
        return gradient_device(back, device)
    except DeviceMapError as exc:
        return exc


class PlacingRecvRecorder(RecvRecorder):
    """A :class:`~torchrpc._dist_autograd.records.RecvRecorder` that also notes where the
    gradient of each leaf goes (``back``: the map gradients go back through, None where
    no map applies)."""

    __slots__ = ("_back",)

    def __init__(self, ctx: DistAutogradContext, src: int, msg: int,
                 back: Optional[Map]) -> None:
        super().__init__(ctx, src, msg)
        self._back = back

    def __call__(self, leaf: torch.Tensor) -> torch.Tensor:
        index = len(self._leaves)
        out = super().__call__(leaf)
        ctx = self._ctx
        if (self._back is not None or not leaf.is_cpu) and self._src != ctx.rank:
            place = gradient_place(self._back, leaf.device)
            if place is not None:
                ctx._places[(self._src, (self._msg, index))] = place
        return out


def recv_recorder(ctx: DistAutogradContext, src: int, msg: int,
                  back: Optional[Map]) -> RecvRecorder:
    """The receive hook of a message from ``src``: one that notes placements where a
    leaf may need one (a map applies, or CUDA tensors may arrive)."""
    if back is None and not _CUDA:
        return RecvRecorder(ctx, src, msg)
    return PlacingRecvRecorder(ctx, src, msg, back)


def placed(ctx: DistAutogradContext, routed: Routed) -> Routed:
    """The gradients a local pass routed to their senders, each placed where its
    received tensor came from (see the module docs)."""
    places = ctx._places
    if not places:
        return routed
    return {rank: [(key, g if g is None or places.get((rank, key)) is None
                    else Placed(g, places[(rank, key)])) for key, g in items]
            for rank, items in routed.items()}


_CUDA = torch.cuda.is_available()
