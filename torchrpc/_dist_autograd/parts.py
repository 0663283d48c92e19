"""What a part of a backward pass runs with: its siblings (see docs/design.md, "A function
runs once a pass"), and zeros for gradients that are None.

torch's engine runs each node of a worker's graph once a pass, when all of its gradients
are in. torchrpc runs one engine call per part (the gradients one message brings), so the
send records whose graphs share a node wait for each other (:func:`siblings`, with
``PassBook.gather``). Nothing here does I/O.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch.autograd.graph import GradientEdge

from .records import _ACCUMULATE_GRAD, DistAutogradContext, MessageKey


def siblings(ctx: DistAutogradContext, keys: Sequence[MessageKey]
             ) -> Optional[Set[MessageKey]]:
    """The send records whose gradients must be here with those of ``keys`` before
    torch's engine runs from them: those whose graphs share a node with theirs (torch's
    engine runs a node once, when all of its gradients are in; a checkpointed
    partition whose outputs went to two workers recomputes once). None when ``keys``
    have no such siblings. Accumulators of leaves and the receiving ends of messages
    are left out: they only add or pass gradients on. So is a record sent before one
    of the tensors behind ``keys`` was received: its gradient may need theirs (a call
    back to the caller in between), where torch's engine runs the shared node once
    both are in and waiting for it here would wait forever."""
    sends = ctx._sends
    if len(sends) < 2:
        return None
    count, graphs = ctx._by_node
    if count != len(sends):
        graphs = _graphs(ctx, sends)
        ctx._by_node = (len(sends), graphs)
    if not graphs[0]:
        return None
    groups, last_recv = graphs
    after = max((last_recv.get(key, -1) for key in keys), default=-1)
    order = ctx._send_order
    needed: Optional[Set[MessageKey]] = None
    for key in keys:
        for group in groups.get(key, ()):
            for sibling in group:
                if order.get(sibling[0], 0) > after:
                    if needed is None:
                        needed = set(keys)
                    needed.add(sibling)
    return needed


def _graphs(ctx: DistAutogradContext, sends: Dict[MessageKey, GradientEdge]
            ) -> Tuple[Dict[MessageKey, List[List[MessageKey]]], Dict[MessageKey, int]]:
    """Send record -> the groups of send records it shares a node with (see siblings),
    and send record -> the order of the last received message behind it."""
    stops = set(ctx._recv_fns.values())
    recvs = ctx._recvs
    keys_of_node: Dict[Any, List[MessageKey]] = {}
    last_recv: Dict[MessageKey, int] = {}
    for key, edge in list(sends.items()):
        stack, seen = [edge.node], set()
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if type(node) is _ACCUMULATE_GRAD:
                rec = recvs.get(id(node.variable))  # type: ignore[attr-defined]
                if rec is not None:
                    last_recv[key] = max(last_recv.get(key, -1), rec[3])
                continue
            if node not in stops:
                keys_of_node.setdefault(node, []).append(key)
            stack.extend(nxt for nxt, _ in node.next_functions)
    by_key: Dict[MessageKey, List[List[MessageKey]]] = {}
    for group in keys_of_node.values():
        if len(group) > 1:
            for key in group:
                by_key.setdefault(key, []).append(group)
    return by_key, last_recv


def materialize(edge: GradientEdge, g: Optional[torch.Tensor]) -> torch.Tensor:
    """``g``, or zeros shaped as the tensor sent on ``edge`` when ``g`` is None. A CUDA
    gradient that arrived on another device than the tensor sent on ``edge`` moves there
    (the receiver placed it through the inverse of the device map, which cannot tell a
    CPU tensor a map moved from one no map moved)."""
    if g is not None:
        if g.is_cpu:
            return g
        device = edge.node._input_metadata[edge.output_nr].device  # type: ignore[attr-defined]
        return g if g.device == device else g.to(device)
    meta = edge.node._input_metadata[edge.output_nr]  # type: ignore[attr-defined]
    return torch.zeros(meta.shape, dtype=meta.dtype, device=meta.device)
