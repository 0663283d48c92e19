"""The messages of distributed autograd: small frozen dataclasses, validated when built."""

from __future__ import annotations

import dataclasses
from typing import Tuple

import torch

from .records import MessageKey


def _check_id(context_id: object) -> None:
    if isinstance(context_id, bool) or not isinstance(context_id, int):
        raise TypeError(f"context_id must be an int, got {type(context_id).__name__}")


@dataclasses.dataclass(frozen=True)
class BackwardRequest:
    """``AUTOGRAD_BACKWARD``: gradients for send records of ``context_id`` on the callee.

    The callee runs its part of the backward pass from those records, forwards
    the gradients of what it had received, and replies once everything it started
    has finished.
    """

    context_id: int
    grads: Tuple[Tuple[MessageKey, torch.Tensor], ...]

    def __post_init__(self) -> None:
        _check_id(self.context_id)
        if not self.grads:
            raise ValueError("a BackwardRequest must carry at least one gradient")


@dataclasses.dataclass(frozen=True)
class ReleaseRequest:
    """``AUTOGRAD_RELEASE``: drop context ``context_id`` here and where this worker sent it."""

    context_id: int

    def __post_init__(self) -> None:
        _check_id(self.context_id)
