"""RemoteModule: an ``nn.Module`` that lives on another worker, as ``torch.distributed.nn``'s.

A RemoteModule holds an RRef to a module created on its owner; ``forward`` and
``forward_async`` run the owner's ``module.forward`` over RPC. It pickles (as an RPC
argument or return value only) to exactly the attributes of
:data:`_REMOTE_MODULE_PICKLED_ATTRIBUTES`, so a receiver gets a RemoteModule of the same
remote module. Built with ``_module_interface_cls``, its methods have the interface's
signature and ``torch.jit.script`` compiles it (see :mod:`._scriptable`).
"""

import io
import types
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ... import rpc
from ...errors import NotInitializedError
from . import _scriptable

__all__ = ["RemoteModule"]

# The attributes a RemoteModule is pickled with over RPC, in this order; others stay behind.
_REMOTE_MODULE_PICKLED_ATTRIBUTES = ("on", "device", "is_device_map_set", "is_scriptable",
                                     "generated_methods", "module_rref")

# Attributes that are never pickled and never warned about: nn.Module's own state and the
# installed methods (rebuilt by the receiver).
_NOT_PICKLED = frozenset(vars(nn.Module())) | {"forward_async", "forward",
                                               _scriptable.TARGET_ATTRIBUTE}

# The nn.Module methods a RemoteModule refuses: they would act on the local stand-in.
_NOT_SUPPORTED = (
    "register_buffer", "register_parameter", "add_module", "apply", "cuda", "ipu", "xpu", "cpu",
    "type", "float", "double", "half", "bfloat16", "to", "register_backward_hook",
    "register_forward_pre_hook", "register_forward_hook", "state_dict", "load_state_dict",
    "parameters", "named_parameters", "buffers", "named_buffers", "children", "named_children",
    "modules", "named_modules", "requires_grad_", "zero_grad", "share_memory", "extra_repr",
)

_PARSE_ERROR = ("Could not parse remote_device: {}. The valid format is '<workername>/<device>' "
                "or 'rank:<rank>/<device>' or '<device>'")


class _OutsideRpcError(AssertionError, NotInitializedError):
    """A RemoteModule was made before ``init_rpc`` (torch raises ``AssertionError``)."""


class _InvalidDeviceError(RuntimeError, ValueError):
    """The device of ``remote_device`` is not a device (torch raises ``RuntimeError``)."""


# -- remote_device ----------------------------------------------------------------------------


def _is_device(text: str) -> bool:
    try:
        torch.device(text)
    except (RuntimeError, ValueError):
        return False
    return True


def _parse_remote_device(remote_device: str) -> Tuple[Union[str, int], str]:
    """``(worker, device)`` of ``"<workername>/<device>"``, ``"rank:<rank>/<device>"`` or
    ``"<workername>"``: the worker is a name or a rank, the device defaults to ``cpu``."""
    if not isinstance(remote_device, str):
        raise TypeError(f"Invalid type for remote_device: {type(remote_device)}; expected a "
                        f"str such as 'worker1/cpu' or 'rank:1/cuda:0'")
    parse_error = _PARSE_ERROR.format(remote_device)
    fields = remote_device.split("/")
    if len(fields) == 1 and _is_device(fields[0]):
        raise ValueError(f"{parse_error}; a RemoteModule needs the worker too, "
                         f"e.g. 'worker1/{fields[0]}'")
    if len(fields) > 2 or not fields[0]:
        raise ValueError(parse_error)
    worker, device = fields[0], fields[1] if len(fields) == 2 else "cpu"
    try:
        device = str(torch.device(device))
    except RuntimeError as exc:
        raise _InvalidDeviceError(f"{exc} (in remote_device {remote_device!r}; expected "
                                  f"'<workername>/<device>' such as 'worker1/cuda:0')") from None
    parts = worker.split(":")
    if len(parts) == 1:
        return worker, device
    if len(parts) == 2 and parts[0] == "rank" and parts[1].isdigit():
        return int(parts[1]), device
    raise ValueError(parse_error)


# -- functions run on the owner ---------------------------------------------------------------


def _create_module(module_cls: Callable[..., nn.Module], args: Sequence[Any],
                   kwargs: Dict[str, Any], device: str,
                   module_interface_cls: Any = None) -> nn.Module:
    module = module_cls(*args, **kwargs)
    if not isinstance(module, nn.Module):
        raise ValueError(
            f"Expect `module_cls(*args, **kwargs)` returns an instance of <class nn.Module>, "
            f"but it returns an instance of {type(module)}. module_cls must be an nn.Module "
            f"subclass or a function that returns an nn.Module")
    module.to(device)
    if module_interface_cls is not None:
        # As torch does: a scriptable RemoteModule's remote module is a ScriptModule.
        module = torch.jit.script(module)
    return module


def _move(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it (through tuples, lists and dicts) on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        moved = (_move(v, device) for v in value)
        return type(value)(*moved) if hasattr(value, "_fields") else type(value)(moved)
    if isinstance(value, list):
        return [_move(v, device) for v in value]
    if isinstance(value, dict):
        return {k: _move(v, device) for k, v in value.items()}
    return value


def _remote_forward(module_rref: rpc.RRef, device: str, is_device_map_set: bool,
                    args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    module = module_rref.local_value()
    where = torch.device(device)
    if where.type != "cuda":
        return module.forward(*args, **kwargs)
    # CPU inputs go to the module's device; without a device map the result comes back on CPU.
    result = module.forward(*_move(args, where), **_move(kwargs, where))
    return result if is_device_map_set else _move(result, torch.device("cpu"))


def _param_rrefs(module_rref: rpc.RRef, recurse: bool) -> List[rpc.RRef]:
    return [rpc.RRef(p) for p in module_rref.local_value().parameters(recurse)]


def _set_training(module_rref: rpc.RRef, mode: bool) -> None:
    module_rref.local_value().train(mode)


# -- the installed methods ----------------------------------------------------------------------


def _call_forward(call: Callable[..., Any], module_rref: rpc.RRef, device: str,
                  is_device_map_set: bool, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """Run the owner's ``module.forward`` with ``call`` (``rpc_sync`` or ``rpc_async``)."""
    return call(module_rref.owner(), _remote_forward,
                args=(module_rref, device, is_device_map_set, args, kwargs))


def _forward_async(self: "_RemoteModule", *args: Any, **kwargs: Any) -> torch.futures.Future:
    return _call_forward(rpc.rpc_async, self.module_rref, self.device, self.is_device_map_set,
                         args, kwargs)


def _forward(self: "_RemoteModule", *args: Any, **kwargs: Any) -> Any:
    return _call_forward(rpc.rpc_sync, self.module_rref, self.device, self.is_device_map_set,
                         args, kwargs)


# Installed under these names, as torch's generated methods are.
_forward_async.__name__, _forward.__name__ = "forward_async", "forward"
_forward_async.__doc__ = "Run the remote module's ``forward``; return a future of its result."
_forward.__doc__ = "Run the remote module's ``forward`` and return its result."


class _Target:
    """What a scriptable RemoteModule's compiled methods need to make the call."""

    __slots__ = ("module_rref", "device", "is_device_map_set")

    def __init__(self, module_rref: rpc.RRef, device: str, is_device_map_set: bool) -> None:
        self.module_rref = module_rref
        self.device = device
        self.is_device_map_set = is_device_map_set


class _TargetFuture(torch.futures.Future):
    """The completed future of a :class:`_Target` that a scriptable RemoteModule holds; in
    an RPC message it travels as its target, and arrives as a new future of it."""


def _target_future(module_rref: rpc.RRef, device: str, is_device_map_set: bool) -> _TargetFuture:
    future = _TargetFuture()
    future.set_result(_Target(module_rref, device, is_device_map_set))
    return future


def _reduce_target_future(future: _TargetFuture) -> Tuple[Any, ...]:
    t: _Target = future.wait()
    return _target_future, (t.module_rref, t.device, t.is_device_map_set)


def _run_async(target: Any, args: Tuple[Any, ...]) -> torch.futures.Future:
    t: _Target = target.wait()
    return _call_forward(rpc.rpc_async, t.module_rref, t.device, t.is_device_map_set, args, {})


def _run_sync(target: Any, args: Tuple[Any, ...]) -> Any:
    t: _Target = target.wait()
    return _call_forward(rpc.rpc_sync, t.module_rref, t.device, t.is_device_map_set, args, {})


class _GeneratedMethods(tuple):
    """The ``(forward_async, forward)`` a RemoteModule installs; pickles as the interface
    they were made for, and the receiver makes (or finds) them again."""

    interface: Any

    def __reduce__(self) -> Tuple[Any, ...]:
        return _generated_methods, (self.interface,)


def _generated_methods(interface: Any = None) -> _GeneratedMethods:
    if interface is None:
        methods = _GeneratedMethods((_forward_async, _forward))
    else:
        methods = _GeneratedMethods(_scriptable.methods_for_interface(interface, _run_async,
                                                                      _run_sync))
    methods.interface = interface
    return methods


# -- the module ---------------------------------------------------------------------------------


class _RemoteModule(nn.Module):
    r"""A module created on a remote worker, used here like a local ``nn.Module``.

    Only ``forward`` and ``forward_async`` run the module, on the remote worker (``forward``
    inside a :func:`torchrpc.autograd.context` records the autograd graph across workers);
    :meth:`remote_parameters` feeds :class:`~torchrpc.optim.DistributedOptimizer`. The other
    ``nn.Module`` methods that would act on parameters, buffers, submodules or hooks raise
    ``ValueError``; call them on the owner through :meth:`get_module_rref`. Passed over RPC,
    it arrives as a RemoteModule of the same remote module.

    If the module is placed on a CUDA device, CPU tensors in the arguments move to that
    device and, unless a device map to the owner is set, the result comes back on CPU.

    Args:
        remote_device (str): the worker and the device on it: ``"<workername>/<device>"``
            (``"trainer0/cpu"``, ``"ps0/cuda:0"``), ``"rank:<rank>/<device>"``
            (``"rank:1/cpu"``), or ``"<workername>"`` for its CPU.
        module_cls (Callable): the ``nn.Module`` class, or a function returning a module,
            to call on the remote worker.
        args (Sequence, optional): positional arguments for ``module_cls``.
        kwargs (Dict, optional): keyword arguments for ``module_cls``.
        _module_interface_cls (type, optional): a ``@torch.jit.interface`` class with the
            module's ``forward``: the remote module is then scripted, and this RemoteModule's
            ``forward`` and ``forward_async`` take the interface's exact signature, so that
            ``torch.jit.script`` compiles it. Experimental, as in torch.

    Example::
        >>> # On worker 0 (worker1 runs init_rpc("worker1", rank=1, world_size=2), shutdown()):
        >>> import torch
        >>> import torchrpc.rpc as rpc
        >>> from torch import nn
        >>> from torchrpc.nn.api.remote_module import RemoteModule
        >>> rpc.init_rpc("worker0", rank=0, world_size=2)
        >>> remote_linear = RemoteModule("worker1/cpu", nn.Linear, args=(20, 30))
        >>> out = remote_linear.forward_async(torch.randn(128, 20)).wait()
        >>> rpc.shutdown()
    """

    _remote_target: torch.jit.Future[Any]  # the type of _scriptable.TARGET_ATTRIBUTE in TorchScript
    # Python-only attributes: torch.jit.script leaves them on the wrapper and does not try
    # (slowly, and in vain) to compile their classes.
    __jit_ignored_attributes__ = ["module_rref", "generated_methods"]

    def __init__(self, remote_device: str, module_cls: Callable[..., nn.Module],
                 args: Optional[Sequence[Any]] = None, kwargs: Optional[Dict[str, Any]] = None,
                 _module_interface_cls: Any = None) -> None:
        super().__init__()
        self._prepare_init(remote_device)
        create_args = (module_cls, tuple(args or ()), dict(kwargs or {}), self.device)
        if _module_interface_cls is not None:
            self.is_scriptable = True
            self.generated_methods = _generated_methods(_module_interface_cls)
            create_args += (_module_interface_cls,)
        else:
            self.is_scriptable = False
            self.generated_methods = _generated_methods()
        self.module_rref = rpc.remote(self.on, _create_module, args=create_args)
        self._install_generated_methods()

    @staticmethod
    def init_from_module_rref(remote_device: str, module_rref: rpc.RRef,
                              _module_interface_cls: Any = None) -> "RemoteModule":
        r"""A :class:`RemoteModule` of the module that ``module_rref`` refers to.

        Several RemoteModules can share one remote module this way, and it is how a
        scriptable RemoteModule reaches another worker: send its ``module_rref`` and call
        this method there.

        Args:
            remote_device (str): the worker and device of the module, in the format of
                the constructor's ``remote_device``.
            module_rref (RRef[nn.Module]): the remote module.
            _module_interface_cls (type, optional): as in the constructor; the module
                must then be a ScriptModule.

        Example::
            >>> remote_module2 = rpc.rpc_sync(
            ...     "worker2", RemoteModule.init_from_module_rref,
            ...     ("worker1/cpu", remote_module.get_module_rref()))
        """
        remote_module = RemoteModule.__new__(RemoteModule)
        nn.Module.__init__(remote_module)
        remote_module._prepare_init(remote_device)
        remote_module.is_scriptable = _module_interface_cls is not None
        remote_module.generated_methods = _generated_methods(_module_interface_cls)
        remote_module.module_rref = module_rref
        remote_module._install_generated_methods()
        return remote_module

    def _prepare_init(self, remote_device: str) -> None:
        """Set ``on``, ``device`` and ``is_device_map_set`` from ``remote_device``."""
        try:
            rpc.get_worker_info()  # raises before init_rpc
        except NotInitializedError:
            raise _OutsideRpcError("RemoteModule only works in RPC. Call torchrpc.rpc.init_rpc() "
                                   "before creating one") from None
        self.on, self.device = _parse_remote_device(remote_device)
        self.is_device_map_set = bool(rpc.api.device_map_to(self.on))

    def _install_generated_methods(self) -> None:
        """Bind ``forward_async`` and ``forward`` to this module (and, for a scriptable
        one, give it the target its compiled methods read)."""
        for method in self.generated_methods:
            # Exported, so that torch.jit.script compiles both methods.
            self.__dict__[method.__name__] = types.MethodType(torch.jit.export(method), self)
        if self.is_scriptable:
            self.__dict__[_scriptable.TARGET_ATTRIBUTE] = _target_future(
                self.module_rref, self.device, self.is_device_map_set)

    def remote_parameters(self, recurse: bool = True) -> List[rpc.RRef]:
        r"""RRefs to the remote module's parameters, e.g. for ``DistributedOptimizer``.

        Args:
            recurse (bool): include the parameters of the remote module's submodules
                (default True); otherwise only its direct parameters.

        Returns:
            A list of :class:`~torchrpc.rpc.RRef` (``List[RRef[nn.Parameter]]``).
        """
        return rpc.rpc_sync(self.module_rref.owner(), _param_rrefs,
                            args=(self.module_rref, recurse))

    def get_module_rref(self) -> rpc.RRef:
        r"""The :class:`~torchrpc.rpc.RRef` (``RRef[nn.Module]``) to the remote module."""
        return self.module_rref

    def train(self, mode: bool = True) -> "_RemoteModule":
        r"""Set the remote module's training mode (``eval()`` is ``train(False)``).

        Args:
            mode (bool): training mode (True) or evaluation mode (False).

        Returns:
            self
        """
        rpc.rpc_sync(self.module_rref.owner(), _set_training, args=(self.module_rref, mode))
        self.training = mode
        return self

    @torch.jit.export
    def __getstate__(self):
        raise RuntimeError("Cannot pickle RemoteModule in python pickler. RemoteModule can only "
                           "be pickled when using RPC")

    @torch.jit.export
    def __setstate__(self, state):
        raise RuntimeError("Cannot unpickle RemoteModule in python pickler. RemoteModule can "
                           "only be unpickled when using RPC")

    def __reduce_ex__(self, protocol: int) -> Tuple[Any, ...]:
        """Pickling outside an RPC message (inside one, :func:`_reduce_remote_module`)."""
        raise RuntimeError(
            "Cannot pickle RemoteModule in python pickler. RemoteModule can only be "
            "pickled when using RPC: pass it as an argument or return value of rpc_sync, "
            "rpc_async or remote; to save the module itself, fetch its state on the owner "
            "through get_module_rref()")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(on={self.on}, device={self.device})"


def _rebuild_remote_module(cls: type, values: Tuple[Any, ...]) -> _RemoteModule:
    """The receiving side of a RemoteModule pickled over RPC: only the pickled attributes."""
    remote_module = cls.__new__(cls)
    remote_module.__dict__.update(zip(_REMOTE_MODULE_PICKLED_ATTRIBUTES, values))
    remote_module._install_generated_methods()
    return remote_module


def _make_unsupported(name: str) -> Callable[..., Any]:
    if name == "parameters":
        message = ("Method ``parameters`` not supported for RemoteModule. Please use "
                   "``remote_parameters`` instead. It returns RRefs to the parameters on "
                   "the owner, as DistributedOptimizer takes them")
    else:
        message = (f"Method ``{name}`` not supported for RemoteModule: the module lives on "
                   f"its owner; call it there, e.g. get_module_rref().rpc_sync().{name}(...)")

    def unsupported(self: _RemoteModule, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(message)
    unsupported.__name__ = unsupported.__qualname__ = name
    unsupported.__doc__ = "Not supported: raises ``ValueError`` (the module is remote)."
    return unsupported


for _name in _NOT_SUPPORTED:
    setattr(_RemoteModule, _name, _make_unsupported(_name))
del _name


class RemoteModule(_RemoteModule):
    r"""A module created on a remote worker, used here like a local ``nn.Module``.

    ``forward`` runs the remote module's ``forward`` on its worker and returns the result;
    ``forward_async`` returns a future of it. Both take the arguments of the remote
    module's ``forward``. Inside a :func:`torchrpc.autograd.context`, gradients flow back
    through ``forward`` to the remote module, and :meth:`remote_parameters` feeds
    :class:`~torchrpc.optim.DistributedOptimizer`. Passed over RPC, it arrives as a
    RemoteModule of the same remote module.

    Args:
        remote_device (str): the worker and the device on it: ``"<workername>/<device>"``
            (``"trainer0/cpu"``, ``"ps0/cuda:0"``), ``"rank:<rank>/<device>"``, or
            ``"<workername>"`` for its CPU.
        module_cls (Callable): the ``nn.Module`` class, or a function returning a module,
            to call on the remote worker.
        args (Sequence, optional): positional arguments for ``module_cls``.
        kwargs (Dict, optional): keyword arguments for ``module_cls``.

    Example::
        >>> # On worker 0 (worker1 runs init_rpc("worker1", rank=1, world_size=2), shutdown()):
        >>> import torch
        >>> import torchrpc.rpc as rpc
        >>> from torch import nn
        >>> from torchrpc.nn import RemoteModule
        >>> rpc.init_rpc("worker0", rank=0, world_size=2)
        >>> remote_linear = RemoteModule("worker1/cpu", nn.Linear, args=(20, 30))
        >>> out = remote_linear.forward_async(torch.randn(128, 20)).wait()
        >>> rpc.shutdown()
    """

    def __init__(self, remote_device: str, module_cls: Callable[..., nn.Module],
                 args: Optional[Sequence[Any]] = None,
                 kwargs: Optional[Dict[str, Any]] = None) -> None:
        super().__init__(remote_device, module_cls, args, kwargs)


# -- script modules over RPC ----------------------------------------------------------------


def _holds_remote_module(module: torch.jit.RecursiveScriptModule) -> bool:
    return any(m._c.hasattr(_scriptable.TARGET_ATTRIBUTE) for m in module.modules())


def _reduce_script_module(module: torch.jit.RecursiveScriptModule) -> Tuple[Any, ...]:
    """Script modules travel as ``torch.jit.save`` bytes; a scripted RemoteModule can't."""
    if _holds_remote_module(module):
        raise rpc.internal._PassThrough(RuntimeError(
            "Passing a script RemoteModule over RPC is not supported. Send its module_rref "
            "instead (get_module_rref() before scripting) and build the RemoteModule on the "
            "receiver with RemoteModule.init_from_module_rref(remote_device, module_rref, "
            "_module_interface_cls)"))
    buffer = io.BytesIO()
    torch.jit.save(module, buffer)
    return _load_script_module, (buffer.getvalue(),)


def _load_script_module(data: bytes) -> torch.jit.ScriptModule:
    return torch.jit.load(io.BytesIO(data))


def _reduce_remote_module(module: _RemoteModule) -> Tuple[Any, ...]:
    """A RemoteModule (or subclass) in an RPC message: its attributes that travel."""
    for name in module.__dict__:
        if name not in _NOT_PICKLED and name not in _REMOTE_MODULE_PICKLED_ATTRIBUTES:
            warnings.warn(f"The new attribute ``{name}`` of RemoteModule is ignored during "
                          f"RPC pickling: only {', '.join(_REMOTE_MODULE_PICKLED_ATTRIBUTES)} "
                          f"are sent", stacklevel=2)
    return _rebuild_remote_module, (type(module), tuple(
        module.__dict__[name] for name in _REMOTE_MODULE_PICKLED_ATTRIBUTES))


rpc.internal._register_rpc_reducer(_RemoteModule, _reduce_remote_module)
rpc.internal._internal_rpc_pickler._register_reducer(torch.jit.RecursiveScriptModule,
                                                     _reduce_script_module)
rpc.internal._internal_rpc_pickler._register_reducer(_TargetFuture, _reduce_target_future)
