"""The messages of distributed autograd: small frozen dataclasses, validated when built.

They pickle as a call of a module-level builder with plain fields, the credit as two
ints: the default pickling of a dataclass and of a ``Fraction`` (which travels as a
string to parse) costs more, once per message of every backward pass.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Any, Optional, Tuple

import torch

from .records import MessageKey

PassId = Tuple[int, int]
"""``(rank of the root, pass number on the root)``: one call of ``backward``."""


def _check_id(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")


def _check_pass(pass_id: object) -> None:
    if not (isinstance(pass_id, tuple) and len(pass_id) == 2):
        raise TypeError(f"pass_id must be a (rank, number) tuple, got {pass_id!r}")
    for v in pass_id:
        _check_id("pass_id", v)


def _check_credit(credit: object) -> None:
    # On the numerator and denominator: Fraction's own comparisons cost a few us each.
    if type(credit) is not Fraction or not 0 < credit.numerator <= credit.denominator:
        raise ValueError(f"credit must be a Fraction in (0, 1], got {credit!r}")


_ONE = Fraction(1)


def _credit(numerator: int, denominator: int) -> Fraction:
    if type(numerator) is not int or type(denominator) is not int or denominator <= 0:
        raise ValueError(f"malformed credit {numerator!r}/{denominator!r}")
    if numerator == denominator == 1:
        return _ONE  # a pass between two workers: all of it, every time
    return Fraction(numerator, denominator)


def _check_time_left(time_left: object) -> None:
    if time_left is None:
        return
    if type(time_left) is not float or not (math.isfinite(time_left) and time_left >= 0):
        raise ValueError(f"time_left must be None or a float of seconds >= 0, got "
                         f"{time_left!r}")


def _backward_request(context_id: int, pass_id: PassId, numerator: int, denominator: int,
                      grads: Tuple[Tuple[MessageKey, torch.Tensor], ...],
                      time_left: Optional[float]) -> "BackwardRequest":
    return BackwardRequest(context_id, pass_id, _credit(numerator, denominator), grads,
                           time_left)


def _backward_reply(numerator: int, denominator: int,
                    grads: Tuple[Tuple[MessageKey, torch.Tensor], ...]) -> "BackwardReply":
    return BackwardReply(_credit(numerator, denominator), grads)


def _done_report(pass_id: PassId, numerator: int, denominator: int,
                 error: Optional[Any]) -> "DoneReport":
    return DoneReport(pass_id, _credit(numerator, denominator), error)


@dataclasses.dataclass(frozen=True)
class BackwardRequest:
    """``AUTOGRAD_BACKWARD``: gradients for send records of ``context_id`` on the callee.

    The callee runs its part of pass ``pass_id`` from those records and forwards the
    gradients of what it had received, splitting ``credit`` among the requests it
    sends; with nothing to forward, or on an error, it returns ``credit`` to the
    root in a :class:`DoneReport`. ``time_left``: the seconds left until the root's
    deadline when the request was built (None: the pass has no deadline); the callee
    counts its own deadline from when the request arrives.
    """

    context_id: int
    pass_id: PassId
    credit: Fraction
    grads: Tuple[Tuple[MessageKey, torch.Tensor], ...]
    time_left: Optional[float] = None

    def __post_init__(self) -> None:
        _check_id("context_id", self.context_id)
        _check_pass(self.pass_id)
        _check_credit(self.credit)
        _check_time_left(self.time_left)
        if not self.grads:
            raise ValueError("a BackwardRequest must carry at least one gradient")

    def __reduce__(self) -> Tuple[Any, ...]:
        c = self.credit
        return _backward_request, (self.context_id, self.pass_id, c.numerator, c.denominator,
                                   self.grads, self.time_left)


@dataclasses.dataclass(frozen=True)
class BackwardReply:
    """The reply to an ``AUTOGRAD_BACKWARD``: gradients the callee owes the request's
    sender (for the sender's own send records), with ``credit`` for the sender to go on
    with. A callee with nothing for the sender replies None.
    """

    credit: Fraction
    grads: Tuple[Tuple[MessageKey, torch.Tensor], ...]

    def __post_init__(self) -> None:
        _check_credit(self.credit)
        if not self.grads:
            raise ValueError("a BackwardReply must carry at least one gradient")

    def __reduce__(self) -> Tuple[Any, ...]:
        c = self.credit
        return _backward_reply, (c.numerator, c.denominator, self.grads)


@dataclasses.dataclass(frozen=True)
class DoneReport:
    """``AUTOGRAD_DONE`` (one-way, to the root): ``credit`` of pass ``pass_id`` comes back.

    ``error`` is a failure on the reporting worker as a ``RemoteErrorInfo`` (see
    ``_agent.remote_error``), or None. The pass is over when all the credit (1) is back.
    """

    pass_id: PassId
    credit: Fraction
    error: Optional[Any] = None

    def __post_init__(self) -> None:
        _check_pass(self.pass_id)
        # No credit comes back with the error of a worker that lost a part of the pass
        # (the part's credit went down with the lost worker).
        if self.error is None or self.credit != 0:
            _check_credit(self.credit)

    def __reduce__(self) -> Tuple[Any, ...]:
        c = self.credit
        return _done_report, (self.pass_id, c.numerator, c.denominator, self.error)


@dataclasses.dataclass(frozen=True)
class ReleaseRequest:
    """``AUTOGRAD_RELEASE``: drop contexts ``context_ids`` here and where this worker sent
    them."""

    context_ids: Tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.context_ids, tuple) or not self.context_ids:
            raise TypeError(f"context_ids must be a non-empty tuple, got {self.context_ids!r}")
        for context_id in self.context_ids:
            _check_id("context_id", context_id)
