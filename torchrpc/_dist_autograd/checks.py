"""The checks of ``backward``'s arguments and the shape of the errors it raises, as
torch's distributed engine words them."""

from __future__ import annotations

from typing import Any, List

import torch

from ..errors import as_runtime_error


def on_node(exc: Exception, rank: int) -> Exception:
    """``exc`` as torch's distributed engine reports it: "Error on Node <rank>: <message>",
    of the same type where the type can be rebuilt from a message."""
    message = f"Error on Node {rank}: {exc}"
    try:
        wrapped = type(exc)(message)
        if str(wrapped) != message:
            raise TypeError("constructor changed the message")
    except Exception:  # noqa: BLE001 - types with other constructors: torch's RuntimeError
        wrapped = RuntimeError(message)
    wrapped.__cause__ = exc.__cause__
    return wrapped.with_traceback(exc.__traceback__)


def runtime_error(exc: BaseException) -> BaseException:
    """``exc`` as a RuntimeError (torch's type for errors of the backward pass), keeping its
    own type where the two combine; a plain RuntimeError with its message otherwise."""
    combined = as_runtime_error(exc)
    if isinstance(combined, RuntimeError) or not isinstance(exc, Exception):
        return combined
    plain = RuntimeError(str(exc))
    plain.__cause__ = exc.__cause__
    return plain.with_traceback(exc.__traceback__)


_SIGNATURE = ("backward(): incompatible function arguments. The following argument types are "
              "supported:\n    1. (context_id: int, roots: list[torch.Tensor], retain_graph: "
              "bool = False) -> None\n\nInvoked with: ")


def check_arguments(context_id: Any, roots: Any, retain_graph: Any) -> None:
    """torch's TypeError (its binding's wording) for arguments of the wrong types."""
    ok = type(context_id) is int and type(retain_graph) is bool and (
        isinstance(roots, torch.Tensor) or (isinstance(roots, (list, tuple)) and all(
            isinstance(r, torch.Tensor) for r in roots)))
    if not ok:
        raise TypeError(f"{_SIGNATURE}{context_id!r}, {roots!r}"
                        + ("" if retain_graph is False else f", {retain_graph!r}"))


def check_roots(roots: Any) -> List[torch.Tensor]:
    """``roots`` as a list of scalar tensors with a gradient function; torch's errors else."""
    if isinstance(roots, torch.Tensor):
        roots = [roots]
    elif not isinstance(roots, (list, tuple)):
        raise TypeError(f"roots must be a list of tensors, got {type(roots).__name__}")
    if not roots:
        raise RuntimeError("No tensors provided for gradient computation.")
    for i, root in enumerate(roots):
        if not isinstance(root, torch.Tensor):
            raise TypeError(f"roots[{i}] must be a Tensor, got {type(root).__name__}")
        if not root.requires_grad:
            raise RuntimeError(f"requires_grad not set on root roots[{i}]: it is not the result "
                               f"of a computation on tensors that require grad")
        if root.numel() != 1:
            raise RuntimeError(f"roots[{i}] of shape {tuple(root.shape)} is not a scalar, all "
                               f"roots need to be scalar; reduce it first (e.g. loss.sum())")
        if root.grad_fn is None:
            raise RuntimeError(f"roots[{i}] does not have a valid gradient function. A leaf "
                               f"tensor cannot be a root; pass the result of a computation")
    return list(roots)
