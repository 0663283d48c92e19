"""Makes torch's RPC test modules see torchrpc under torch's module names.

``import torch`` has already imported ``torch.distributed.rpc`` and ``.autograd``, and
torch's own library code (DDP's reducer, ``torch.jit``, ``torch.distributed.optim``'s
other optimizers) must keep torch's modules. So each redirected module is replaced, in
``sys.modules`` and as its parent's attribute, by a proxy that answers by who asks: code
defined in a test module (see :data:`TEST_MODULE_PREFIXES`) gets torchrpc's module, every
other caller gets torch's. Because the proxy decides at each attribute access, imports
made later inside test functions are redirected too.

With ``target="torch"`` both sides are torch's modules: the "mirror" that checks the
redirection itself changes nothing.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Dict, Optional, Sequence, Tuple

# Modules whose code is test code: it sees torchrpc.
TEST_MODULE_PREFIXES = (
    "torch.testing._internal.distributed.",
    "torch.testing._internal.dist_utils",
    "tests.conformance.",
    "unittest.mock",  # patches that tests apply land on the modules the tests see
)

# torch's module -> torchrpc's module (None: torchrpc has no such module).
MODULE_MAP: Dict[str, Optional[str]] = {
    "torch.distributed.rpc": "torchrpc.rpc",
    "torch.distributed.rpc.api": "torchrpc.rpc.api",
    "torch.distributed.rpc.backend_registry": "torchrpc.rpc.backend_registry",
    "torch.distributed.rpc.constants": "torchrpc.rpc.constants",
    "torch.distributed.rpc.functions": "torchrpc.rpc.functions",
    "torch.distributed.rpc.internal": "torchrpc.rpc.internal",
    "torch.distributed.rpc.options": "torchrpc.rpc.options",
    "torch.distributed.rpc.rref_proxy": "torchrpc.rpc.rref_proxy",
    "torch.distributed.rpc.server_process_global_profiler":
        "torchrpc.rpc.server_process_global_profiler",
    "torch.distributed.rpc._testing": "torchrpc._testing",
    "torch.distributed.rpc._utils": "torchrpc.rpc._utils",
    "torch.distributed.autograd": "torchrpc.autograd",
    "torch.distributed.optim": "torchrpc.optim",
    "torch.distributed.nn": "torchrpc.nn",
    "torch.distributed.nn.api": "torchrpc.nn.api",
    "torch.distributed.nn.api.remote_module": "torchrpc.nn.api.remote_module",
}


# The TorchScript suites, which the runner does not run, keep torch's modules: their
# module-level ``@torch.jit.script`` functions compile only against torch's RPC types, and
# the generic suites import them through rpc_utils.
TORCH_MODULE_PREFIXES = ("torch.testing._internal.distributed.rpc.jit.",)


def _asks_for_ours(code: Tuple[str, ...]) -> bool:
    """Whether the code two frames up (the caller of the proxy's method) is in a module
    named by one of the prefixes ``code`` (test code, or a library under test)."""
    try:
        name = sys._getframe(2).f_globals.get("__name__", "")
    except ValueError:  # called from C++ with no Python caller: torch's own machinery
        return False
    return name.startswith(code) and not name.startswith(TORCH_MODULE_PREFIXES)


class _MissingModule:
    """Stands for a torchrpc module that does not exist: every attribute is an error."""

    def __init__(self, torch_name: str, ours_name: str, error: Exception) -> None:
        self._names = (torch_name, ours_name, error)

    def __getattr__(self, attr: str):
        torch_name, ours_name, error = self._names
        raise AttributeError(f"torchrpc has no {ours_name}.{attr} (the counterpart of "
                             f"{torch_name}.{attr}): {error}")


class _Proxy(types.ModuleType):
    """A module that is torchrpc's to test code and torch's to everyone else."""

    def __init__(self, theirs: types.ModuleType, ours, code: Tuple[str, ...]) -> None:
        super().__init__(theirs.__name__, theirs.__doc__)
        object.__setattr__(self, "_theirs", theirs)
        object.__setattr__(self, "_ours", ours)
        object.__setattr__(self, "_code", code)
        # The import machinery reads these to find and name submodules.
        for attr in ("__path__", "__file__", "__spec__", "__loader__", "__package__"):
            if hasattr(theirs, attr):
                object.__setattr__(self, attr, getattr(theirs, attr))

    def __getattr__(self, attr: str):
        target = self._ours if _asks_for_ours(self._code) else self._theirs
        return getattr(target, attr)

    def __setattr__(self, attr: str, value) -> None:
        setattr(self._ours if _asks_for_ours(self._code) else self._theirs, attr, value)

    def __delattr__(self, attr: str) -> None:
        delattr(self._ours if _asks_for_ours(self._code) else self._theirs, attr)

    def __dir__(self):
        return dir(self._ours if _asks_for_ours(self._code) else self._theirs)


def install(target: str = "torchrpc", code: Sequence[str] = TEST_MODULE_PREFIXES) -> None:
    """Installs the proxies once in this process; ``target`` is ``torchrpc`` or ``torch``.
    ``code``: the prefixes of the modules whose code sees ``target`` (by default torch's
    test suites; a library ported by imports, such as ``fairscale.``, for its tests)."""
    if target not in ("torchrpc", "torch"):
        raise ValueError(f"target must be 'torchrpc' or 'torch', got {target!r}")
    if getattr(sys.modules.get("torch.distributed.rpc"), "_theirs", None) is not None:
        return
    for torch_name, ours_name in MODULE_MAP.items():
        theirs = importlib.import_module(torch_name)
        if target == "torch":
            ours = theirs
        else:
            try:
                ours = importlib.import_module(ours_name)
            except ImportError as exc:
                ours = _MissingModule(torch_name, ours_name, exc)
        proxy = _Proxy(theirs, ours, tuple(code))
        sys.modules[torch_name] = proxy
        parent_name, _, child = torch_name.rpartition(".")
        parent = sys.modules[parent_name]
        object.__setattr__(parent, child, proxy) if isinstance(parent, _Proxy) else \
            setattr(parent, child, proxy)
