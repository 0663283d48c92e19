"""torch's RPC test suites, bound to a fixture that runs them on torchrpc.

Importing this module installs the redirection (:mod:`tests.conformance.redirect`) and
then imports torch's test classes from the installed wheel. The worker processes torch's
``MultiProcessTestCase`` spawns unpickle the generated classes by this module's name, so
they install the redirection before torch's test modules load there too.

``TORCHRPC_CONFORMANCE_TARGET=torch`` runs the same classes on torch itself (the mirror).
"""

from __future__ import annotations

import os
from typing import Dict, List

from . import redirect

TARGET_ENV = "TORCHRPC_CONFORMANCE_TARGET"
redirect.install(os.environ.get(TARGET_ENV, "torchrpc"))

import torch.distributed.rpc as rpc  # noqa: E402  (the proxy: torchrpc's module here)
from torch.testing._internal.distributed import rpc_utils  # noqa: E402
from torch.testing._internal.distributed.rpc.faulty_rpc_agent_test_fixture import (  # noqa: E402
    FaultyRpcAgentTestFixture,
)
from torch.testing._internal.distributed.rpc.rpc_agent_test_fixture import (  # noqa: E402
    RpcAgentTestFixture,
)


class TorchRpcAgentTestFixture(RpcAgentTestFixture):
    """The role torch's ``TensorPipeRpcAgentTestFixture`` plays for TensorPipe."""

    @property
    def rpc_backend(self):
        return rpc.backend_registry.BackendType["TENSORPIPE"]

    @property
    def rpc_backend_options(self):
        return rpc.backend_registry.construct_rpc_backend_options(
            self.rpc_backend, init_method=self.init_method)

    def get_shutdown_error_regex(self):
        # A call cut off by a peer's shutdown fails with one of these (torch's TensorPipe
        # fixture accepts anything).
        return "|".join(f"({e})" for e in (
            "left without shutting down", "shut down", "connection", "Connection",
            "lost", "RPC has not been initialized", "closed"))

    def get_timeout_error_regex(self):
        return "RPC ran for more than"


def _is_jit(cls: type) -> bool:
    return cls.__name__.startswith("Jit")


# Groups of suites, as torch's rpc_utils lists them (TorchScript suites left out:
# TorchScript is deprecated in torch 2.13 and torchrpc has no TorchScript agent), with the
# fixture each group runs under. The CUDA group needs a GPU (see CUDA_GROUPS).
_GROUP_LISTS = {
    "generic": (rpc_utils.GENERIC_TESTS, TorchRpcAgentTestFixture),
    "tensorpipe": (rpc_utils.TENSORPIPE_TESTS, TorchRpcAgentTestFixture),
    "faulty": (rpc_utils.FAULTY_AGENT_TESTS, FaultyRpcAgentTestFixture),
    "cuda": (rpc_utils.GENERIC_CUDA_TESTS + rpc_utils.TENSORPIPE_CUDA_TESTS,
             TorchRpcAgentTestFixture),
}
CUDA_GROUPS = frozenset(("cuda",))

# Suite name -> (torch's suite, fixture); group name -> its suite names.
SUITES: Dict[str, tuple] = {}
GROUPS: Dict[str, List[str]] = {}
for _group, (_suites, _fixture) in _GROUP_LISTS.items():
    GROUPS[_group] = []
    for _suite in _suites:
        if not _is_jit(_suite):
            SUITES[_suite.__name__] = (_suite, _fixture)
            GROUPS[_group].append(_suite.__name__)

# The suites issue 14 and 15 call the generic ones (rpc_utils.GENERIC_TESTS without JIT).
GENERIC: List[str] = GROUPS["generic"]
CUDA_SUITES = frozenset(n for g in CUDA_GROUPS for n in GROUPS[g])

for _name, (_suite, _fixture) in SUITES.items():
    globals().update(rpc_utils.generate_tests("TorchRpc", _fixture, [_suite], __name__))


def test_class(suite: str) -> type:
    """The runnable class of ``suite`` (a name of :data:`SUITES`)."""
    return globals()[f"TorchRpc{suite}"]


def expand(names: List[str]) -> List[str]:
    """Suite names for a list of suite and group names (``generic``, ``tensorpipe``,
    ``faulty``, ``cuda``), in order, each once; ValueError naming an unknown one."""
    out: List[str] = []
    for name in names:
        for suite in GROUPS.get(name, [name]):
            if suite not in SUITES:
                raise ValueError(f"unknown suite or group {name!r}; groups: "
                                 f"{', '.join(GROUPS)}; suites: {', '.join(SUITES)}")
            if suite not in out:
                out.append(suite)
    return out
