"""Shared part of the TCP variants: torchrpc.rpc, with options that turn off the same-host
transports."""

from __future__ import annotations

from typing import Any

from torchrpc import rpc as _rpc


def tcp_options(**kwargs: Any) -> Any:
    """``TensorPipeRpcBackendOptions`` without the Unix socket and shared memory."""
    kwargs.setdefault("enable_uds", False)
    kwargs.setdefault("enable_shm", False)
    return _rpc.TensorPipeRpcBackendOptions(**kwargs)


def forward(name: str) -> Any:
    """Every other name is torchrpc.rpc's."""
    return getattr(_rpc, name)
