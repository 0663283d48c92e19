"""RemoteModule: an ``nn.Module`` that lives on another worker. Built on the public API only."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type

import torch
from torch import nn

from ... import rpc

_NOT_SUPPORTED = (
    "register_buffer", "register_parameter", "add_module", "apply", "cuda", "ipu", "xpu", "cpu",
    "type", "float", "double", "half", "bfloat16", "to", "register_backward_hook",
    "register_full_backward_hook", "register_forward_pre_hook", "register_forward_hook",
    "state_dict", "load_state_dict", "parameters", "named_parameters", "buffers", "named_buffers",
    "children", "named_children", "modules", "named_modules", "requires_grad_", "zero_grad",
    "share_memory", "extra_repr",
)


def parse_remote_device(remote_device: str) -> Tuple[str, torch.device]:
    """Split ``"worker1/cpu"`` or ``"worker1"`` into the worker name and the device."""
    if not isinstance(remote_device, str):
        raise ValueError(f"remote_device must be a string like 'worker1/cpu' or 'worker1', "
                         f"got {remote_device!r}")
    parts = remote_device.split("/")
    if len(parts) == 1 and parts[0]:
        return parts[0], torch.device("cpu")
    if len(parts) == 2 and parts[0] and parts[1]:
        try:
            return parts[0], torch.device(parts[1])
        except RuntimeError as exc:
            raise ValueError(f"invalid device {parts[1]!r} in remote_device {remote_device!r}: "
                             f"{exc}") from exc
    raise ValueError(f"invalid remote_device {remote_device!r}: expected "
                     f"'<workername>/<device>' such as 'trainer0/cpu' or 'ps0/cuda:0', "
                     f"or just '<workername>'")


def _create_module(module_cls: Callable[..., nn.Module], args: Sequence[Any],
                   kwargs: Dict[str, Any], device: torch.device) -> rpc.RRef:
    module = module_cls(*args, **kwargs)
    if not isinstance(module, nn.Module):
        raise ValueError(f"module_cls must create an nn.Module, but {module_cls!r} created "
                         f"{type(module).__name__}")
    return rpc.RRef(module.to(device))


def _move(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_move(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _move(v, device) for k, v in value.items()}
    return value


def _forward(module_rref: rpc.RRef, device: torch.device, args: Tuple[Any, ...],
             kwargs: Dict[str, Any]) -> Any:
    module = module_rref.local_value()
    if device.type != "cpu":
        args, kwargs = _move(args, device), _move(kwargs, device)
        return _move(module(*args, **kwargs), torch.device("cpu"))
    return module(*args, **kwargs)


def _param_rrefs(module_rref: rpc.RRef, recurse: bool) -> List[rpc.RRef]:
    return [rpc.RRef(p) for p in module_rref.local_value().parameters(recurse)]


def _train(module_rref: rpc.RRef, mode: bool) -> None:
    module_rref.local_value().train(mode)


class RemoteModule(nn.Module):
    r"""A module created on a remote worker, used here like a local ``nn.Module``.

    ``forward`` runs on the remote worker with :func:`~torchrpc.rpc.rpc_sync`;
    ``forward_async`` returns a future. Gradients flow back through ``forward``
    inside a :func:`torchrpc.autograd.context`, and :meth:`remote_parameters`
    feeds :class:`~torchrpc.optim.DistributedOptimizer`.

    Args:
        remote_device (str): ``"<workername>/<device>"`` such as ``"trainer0/cpu"``,
            or just ``"<workername>"`` (device ``cpu``).
        module_cls (Callable): the class (or factory) of the module to create remotely.
        args (Sequence, optional): positional arguments for ``module_cls``.
        kwargs (Dict, optional): keyword arguments for ``module_cls``.

    Example::
        >>> remote_linear = RemoteModule("worker1/cpu", nn.Linear, args=(20, 30))
        >>> out = remote_linear.forward_async(torch.randn(128, 20)).wait()
    """

    def __init__(self, remote_device: str, module_cls: Type[nn.Module],
                 args: Optional[Sequence[Any]] = None, kwargs: Optional[Dict[str, Any]] = None,
                 _module_interface_cls: Any = None) -> None:
        super().__init__()
        self.on, self.device = parse_remote_device(remote_device)
        self.module_rref = rpc.rpc_sync(self.on, _create_module,
                                        args=(module_cls, tuple(args or ()), dict(kwargs or {}),
                                              self.device))

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """Run the remote module's ``forward`` and return its result."""
        return rpc.rpc_sync(self.on, _forward, args=(self.module_rref, self.device, args, kwargs))

    def forward_async(self, *args: Any, **kwargs: Any) -> torch.futures.Future:
        """Run the remote module's ``forward``; return a future of its result."""
        return rpc.rpc_async(self.on, _forward, args=(self.module_rref, self.device, args, kwargs))

    def remote_parameters(self, recurse: bool = True) -> List[rpc.RRef]:
        """RRefs to the remote module's parameters (for ``DistributedOptimizer``).

        Args:
            recurse (bool): include parameters of submodules (default True).
        """
        return rpc.rpc_sync(self.on, _param_rrefs, args=(self.module_rref, recurse))

    def get_module_rref(self) -> rpc.RRef:
        """An ``RRef[nn.Module]`` to the remote module."""
        return self.module_rref

    def train(self, mode: bool = True) -> "RemoteModule":
        """Set training mode here and on the remote module."""
        rpc.rpc_sync(self.on, _train, args=(self.module_rref, mode))
        self.training = mode
        return self

    def __repr__(self) -> str:
        return f"RemoteModule(on={self.on}, device={self.device})"


def _make_unsupported(name: str) -> Callable[..., Any]:
    def unsupported(self: RemoteModule, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(f"Method ``{name}`` not supported for RemoteModule: the module lives on "
                         f"{self.on}; call it there, e.g. through get_module_rref().rpc_sync()")
    unsupported.__name__ = name
    return unsupported


for _name in _NOT_SUPPORTED:
    setattr(RemoteModule, _name, _make_unsupported(_name))
del _name

# The attributes a RemoteModule pickles with, as torch names them.
_REMOTE_MODULE_PICKLED_ATTRIBUTES = ("on", "device", "is_device_map_set", "is_scriptable",
                                     "generated_methods", "module_rref")
_RemoteModule = RemoteModule
