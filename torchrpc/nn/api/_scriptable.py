"""The ``forward`` and ``forward_async`` of a TorchScript-able RemoteModule.

TorchScript compiles a module's methods from their source with their exact types, so a
RemoteModule built with ``_module_interface_cls`` needs methods whose signature is the
interface's ``forward``. :func:`methods_for_interface` writes them, once per interface,
as source in a module of their own. Their bodies pass the arguments, as one tuple, to
functions marked ``@torch.jit.ignore``: TorchScript calls those in Python, where they
make the RPC with torchrpc (TorchScript's own ``rpc_async`` reaches only torch's agent).

The compiled methods reach the RemoteModule's target through one attribute of type
``Future[Any]`` (:data:`TARGET_ATTRIBUTE`): a completed future whose value is any
Python object is the one attribute type that TorchScript keeps with the module and
hands back to Python intact.
"""

import inspect
import itertools
import linecache
import re
import sys
import threading
import types
from typing import Any, Callable, Dict, List, Tuple

import torch

# The attribute of a scriptable RemoteModule that holds its target in a completed future.
TARGET_ATTRIBUTE = "_remote_target"

_SOURCE = '''\
def forward_async(self, {params}) -> _Future[_Result]:
    return _call_async(self.{target}, ({args}))


def forward(self, {params}) -> _Result:
    return _call_sync(self.{target}, ({args}))


@_ignore
def _call_async(target: _Future[_Any], args: _Args) -> _Future[_Result]:
    return _run_async(target, args)


@_ignore
def _call_sync(target: _Future[_Any], args: _Args) -> _Result:
    return _run_sync(target, args)
'''

_lock = threading.Lock()
_cache: Dict[Tuple[type, Callable[..., Any], Callable[..., Any]], Tuple[Any, Any]] = {}
_serial = itertools.count()


def methods_for_interface(interface: type, run_async: Callable[[Any, tuple], Any],
                          run_sync: Callable[[Any, tuple], Any]) -> Tuple[Any, Any]:
    """``(forward_async, forward)`` with the signature of ``interface.forward``.

    Both call, in Python, ``run_async(target, args)`` or ``run_sync(target, args)``
    with the value of the :data:`TARGET_ATTRIBUTE` future and the arguments as a tuple.

    Args:
        interface (type): a class decorated with ``@torch.jit.interface`` that has ``forward``.
        run_async (Callable): returns a ``torch.futures.Future`` of the result.
        run_sync (Callable): returns the result.
    """
    key = (interface, run_async, run_sync)
    with _lock:
        methods = _cache.get(key)
        if methods is None:
            methods = _cache[key] = _generate(interface, run_async, run_sync)
    return methods


def _forward_signature(interface: type) -> inspect.Signature:
    if not getattr(interface, "__torch_script_interface__", False):
        raise TypeError(f"_module_interface_cls must be a class decorated with "
                        f"@torch.jit.interface, got {interface!r}")
    forward = interface.__dict__.get("forward")
    if not inspect.isfunction(forward):
        raise TypeError(f"the TorchScript interface {interface.__qualname__} has no forward method")
    return inspect.signature(forward, eval_str=True)


def _generate(interface: type, run_async: Callable[..., Any],
              run_sync: Callable[..., Any]) -> Tuple[Any, Any]:
    signature = _forward_signature(interface)
    params: List[inspect.Parameter] = list(signature.parameters.values())[1:]  # without self
    namespace: Dict[str, Any] = {
        "_Future": torch.jit.Future, "_Any": Any, "_ignore": torch.jit.ignore,
        "_run_async": run_async, "_run_sync": run_sync,
    }
    texts, types_ = [], []
    for i, p in enumerate(params):
        if p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
            raise TypeError(f"the forward of TorchScript interface {interface.__qualname__} "
                            f"has parameter {p.name!r} of kind {p.kind.description}; "
                            f"a scriptable RemoteModule takes plain parameters only")
        # A parameter without an annotation is a Tensor, as TorchScript reads it.
        annotation = torch.Tensor if p.annotation is p.empty else p.annotation
        namespace[f"_T{i}"] = annotation
        types_.append(annotation)
        text = f"{p.name}: _T{i}"
        if p.default is not p.empty:
            namespace[f"_D{i}"] = p.default
            text += f" = _D{i}"
        texts.append(text)
    namespace["_Result"] = signature.return_annotation
    namespace["_Args"] = Tuple[tuple(types_)] if types_ else Tuple[()]
    args = "".join(f"{p.name}, " for p in params)
    source = _SOURCE.format(params=", ".join(texts), args=args, target=TARGET_ATTRIBUTE)
    module = _new_module(interface, source, namespace)
    return module.forward_async, module.forward


def _new_module(interface: type, source: str, namespace: Dict[str, Any]) -> types.ModuleType:
    """Run ``source`` as a new module that ``inspect`` (and so TorchScript) can read back."""
    safe = re.sub(r"\W", "_", f"{interface.__module__}.{interface.__qualname__}")
    name = f"{__name__}.for_{safe}_{next(_serial)}"
    filename = f"<torchrpc RemoteModule methods for {interface.__module__}." \
               f"{interface.__qualname__} ({name})>"
    # Kept in linecache with no modification time, so checkcache never drops it.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    module = types.ModuleType(name)
    module.__dict__.update(namespace)
    module.__file__ = filename
    sys.modules[name] = module
    exec(compile(source, filename, "exec"), module.__dict__)
    return module
