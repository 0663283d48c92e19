"""A stand-in for CUDA tensors on machines without a GPU, for the serialization layer only.

:class:`FakeCuda` is a CPU tensor that answers ``is_cuda``, ``is_cpu`` and ``device`` as a
tensor on ``cuda:0`` would; every torch operation on it returns a plain CPU tensor, so
what the encoder sends (the bytes of its ``.cpu()`` copy) is real. Importing this module
routes it to the encoder's tensor reduction, where a real CUDA tensor goes (a tensor
subclass would otherwise be pickled by its own reduction): the one mock, at the
serialization layer.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List

import torch

from torchrpc._wire import pickler


class FakeCuda(torch.Tensor):
    index = 0  # the CUDA device it claims

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    @property
    def is_cpu(self) -> bool:  # type: ignore[override]
        return False

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", type(self).index)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        # Detached, it is still on the device; its .cpu() is a copy in memory that
        # returns to a pool once the copy is gone, as a caching allocator's does.
        if func is torch.Tensor.detach:
            return out.as_subclass(cls)
        return _pooled_copy(out) if func is torch.Tensor.cpu else out


_POOL: Dict[int, List[bytearray]] = {}  # freed copies' memory, by size in bytes


def _pooled_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` in memory that the next copy of its size reuses once
    this one is freed (the address reuse real device-to-host copies show)."""
    nbytes = t.numel() * t.element_size()
    if not nbytes:
        return torch.empty(t.shape, dtype=t.dtype)
    free = _POOL.setdefault(nbytes, [])
    memory = free.pop() if free else bytearray(max(nbytes, 1))
    copy = torch.frombuffer(memory, dtype=t.dtype, count=t.numel()).view(t.shape)
    copy.copy_(t)
    weakref.finalize(copy, free.append, memory)
    return copy


class FakeCuda1(FakeCuda):
    index = 1


pickler._REDUCERS[FakeCuda] = pickler._Encoder.reduce_tensor
pickler._REDUCERS[FakeCuda1] = pickler._Encoder.reduce_tensor


def fake_cuda(t: torch.Tensor, index: int = 0) -> FakeCuda:
    """``t``'s values, as a tensor that says it lives on cuda:``index`` (0 or 1)."""
    return t.as_subclass(FakeCuda1 if index else FakeCuda)


def make_fake_cuda(n: int, index: int = 0) -> FakeCuda:
    """Run by RPC: a reply that holds a (fake) CUDA tensor."""
    return fake_cuda(torch.arange(float(n)), index)


def send_fake_cuda(to: str) -> str:
    """Run by RPC: send a (fake) CUDA tensor on to ``to``; what happened, as text."""
    import torchrpc.rpc as rpc
    try:
        return rpc.rpc_sync(to, where, args=(fake_cuda(torch.ones(2)),))
    except RuntimeError as exc:
        return f"{type(exc).__name__}: {exc}"


def where(t: torch.Tensor) -> str:
    """Run by RPC: the device and type of the tensor that arrived."""
    return f"{type(t).__name__} on {t.device}"


def send_cuda(to: str) -> str:
    """Run by RPC on a GPU machine: send a real CUDA tensor on to ``to``."""
    import torchrpc.rpc as rpc
    try:
        return rpc.rpc_sync(to, where, args=(torch.ones(2, device="cuda:0"),))
    except RuntimeError as exc:
        return f"{type(exc).__name__}: {exc}"


def add_all(label: str, *tensors: torch.Tensor) -> torch.Tensor:
    """Run by RPC: the sum of ``tensors``, which must all be on one device."""
    assert isinstance(label, str)
    return sum(tensors[1:], tensors[0])


def acknowledge(sender: int, share_ids: List[int]) -> int:
    """Run by RPC: tell worker ``sender``, by a real ``CUDA_RELEASE``, that this worker has
    copied its CUDA IPC shares ``share_ids``; how many acknowledgements went out."""
    from torchrpc._agent.current import current_agent
    from torchrpc._agent.hooks import CUDA_IPC
    ipc = current_agent().extensions[CUDA_IPC]
    ipc.acknowledge(sender, list(share_ids))
    return ipc.acks_sent


def cuda_sum_later(x: torch.Tensor, cycles: int) -> float:
    """Run by RPC on a GPU: the sum of ``x`` after the GPU has spun for ``cycles`` on the
    stream this call runs on (so a caller that changed its tensor in the meantime would
    show)."""
    torch.cuda._sleep(cycles)
    return float(x.sum().item())


def written_late(n: int, cycles: int, side_stream: bool) -> torch.Tensor:
    """Run by RPC on a GPU: a tensor of ``n`` threes that the GPU writes only after
    spinning for ``cycles``, returned at once: written on the stream this call runs on,
    or on a side stream that the current one then waits for (as torch's own tests do)."""
    out = torch.empty((n,), device="cuda:0")
    if not side_stream:
        torch.cuda._sleep(cycles)
        return out.fill_(3.0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(cycles)
        out.fill_(3.0)
    torch.cuda.current_stream().wait_stream(side)
    return out


def die(x: torch.Tensor) -> None:
    """Run by RPC: the callee kills itself mid-call, with the caller's tensor received."""
    import os
    os._exit(3)


def cuda_ipc_counts() -> Dict[str, int]:
    """Run by RPC: this worker's CUDA IPC counters (shares held, released, copies pending)."""
    from torchrpc._agent.current import current_agent
    return current_agent().debug_info("cuda_ipc")
