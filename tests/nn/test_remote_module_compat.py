"""RemoteModule behaves as torch.distributed.nn's, over real worker processes: remote
devices, pickling over RPC, init_from_module_rref, errors, and TorchScript."""

import contextlib
import gc
import io
import os
import pickle
import subprocess
import sys
from typing import Tuple

import pytest
import torch
from torch import Tensor, nn

import torchrpc.rpc as rpc
from torchrpc.nn import RemoteModule
from torchrpc.nn.api.remote_module import _REMOTE_MODULE_PICKLED_ATTRIBUTES, _RemoteModule

from ..support import helpers
from ..support.group import ROOT, wait_for


pytestmark = pytest.mark.group(3, threads=4, timeout=30.0)


# -- code the workers run ---------------------------------------------------------------------


class Echo(nn.Module):
    """Returns its arguments reversed; one parameter."""

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((1,), scale))

    def forward(self, tensor: Tensor, number: int, word: str = "default") -> Tuple[str, int, Tensor]:
        return word, number, tensor * self.weight


class NotAModule:
    def __init__(self, *args, **kwargs) -> None:
        pass


@torch.jit.interface
class EchoInterface:
    def forward(self, tensor: Tensor, number: int, word: str = "default") -> Tuple[str, int, Tensor]:
        pass


@torch.jit.interface
class AsyncEchoInterface:
    def forward(self, tensor: Tensor, number: int, word: str = "default") -> Tuple[str, int, Tensor]:
        pass

    def forward_async(self, tensor: Tensor, number: int, word: str = "default"
                      ) -> torch.jit.Future[Tuple[str, int, Tensor]]:
        pass


class CountingRemoteModule(RemoteModule):
    """A subclass: it must arrive as itself."""

    def twice(self, tensor: Tensor) -> Tensor:
        return self.forward(tensor, 0)[2] * 2


def scripted_echo(scale: float = 1.0) -> torch.jit.ScriptModule:
    return torch.jit.script(Echo(scale))


def attributes(remote_module: nn.Module) -> dict:
    return remote_module.__dict__


def forward_there(remote_module: nn.Module, *args) -> tuple:
    return remote_module.forward(*args)


def forward_async_there(remote_module: nn.Module, *args) -> tuple:
    return remote_module.forward_async(*args).wait()


def type_name(value) -> str:
    return type(value).__name__


def training_of(module_rref: rpc.RRef) -> bool:
    return module_rref.local_value().training


def run_script_module(module: torch.jit.ScriptModule, x: Tensor) -> Tensor:
    return module(x)


@torch.jit.script
def run_forward(module: EchoInterface, x: Tensor) -> Tuple[str, int, Tensor]:
    return module.forward(x, 2, "3")


@torch.jit.script
def run_forward_async(module: AsyncEchoInterface, x: Tensor) -> Tuple[str, int, Tensor]:
    return module.forward_async(x, 2, "3").wait()


ARGS = (torch.ones(1), 2, "3")
EXPECTED = ("3", 2, torch.ones(1))


def wait_drained(names=("worker1", "worker2"), timeout: float = 10.0) -> dict:
    """Wait until no worker owns an RRef, for at most ``timeout``; return the last counts
    (the caller asserts on them)."""
    counts: dict = {}

    def drained() -> bool:
        gc.collect()
        counts.update({n: rpc.rpc_sync(n, helpers.rref_counts) for n in names})
        return all(c["num_owner_rrefs"] == 0 for c in counts.values())
    with contextlib.suppress(AssertionError):
        wait_for("no worker owns an RRef", drained, timeout)
    return counts


# -- placement and construction -------------------------------------------------------------


def test_rank_remote_device_means_that_rank():
    rm = RemoteModule("rank:1/cpu", Echo, args=(2.0,))
    assert rm.on == 1 and rm.device == "cpu"
    assert rm.get_module_rref().owner_name() == "worker1"
    assert rm.forward(*ARGS) == ("3", 2, torch.full((1,), 2.0))
    named = RemoteModule("worker2", Echo)
    assert (named.on, named.device) == ("worker2", "cpu")
    assert named.get_module_rref().owner_name() == "worker2"


def test_attributes_are_torchs():
    rm = RemoteModule("worker1/cpu", Echo)
    for name in _REMOTE_MODULE_PICKLED_ATTRIBUTES:
        assert name in rm.__dict__, name
    assert rm.is_device_map_set is False and rm.is_scriptable is False
    assert isinstance(rm.device, str)
    assert [m.__name__ for m in rm.generated_methods] == ["forward_async", "forward"]
    assert isinstance(rm, _RemoteModule)


@pytest.mark.parametrize("bad, kind, prefix", [
    ("worker1/cuda:0/cuda:1", ValueError,
     "Could not parse remote_device: worker1/cuda:0/cuda:1. The valid format is "
     "'<workername>/<device>'"),
    ("/", ValueError, "Could not parse remote_device: /. The valid format is"),
    ("/cuda:0", ValueError, "Could not parse remote_device: /cuda:0. The valid format is"),
    ("", ValueError, "Could not parse remote_device: . The valid format is"),
    ("host:1/cpu", ValueError, "Could not parse remote_device: host:1/cpu."),
    ("cpu", ValueError, "Could not parse remote_device: cpu."),
    ("worker1/cpu2", RuntimeError, "Invalid device string: 'cpu2'"),
    ("worker1/", RuntimeError, "Device string must not be empty"),
    ("worker1/foo", RuntimeError, "Expected one of "),
])
def test_bad_remote_device_raises_torchs_error(bad, kind, prefix):
    with pytest.raises(kind) as info:
        RemoteModule(bad, Echo)
    assert str(info.value).startswith(prefix), info.value
    # A bad device is also a ValueError, as torchrpc raised before.
    assert isinstance(info.value, ValueError)


def test_bad_module_cls_raises_torchs_error_at_first_use():
    rm = RemoteModule("worker1/cpu", NotAModule, args=(1,))  # created asynchronously
    with pytest.raises(ValueError, match=r"Expect `module_cls\(\*args, \*\*kwargs\)` returns "
                                         r"an instance of <class nn.Module>, but it returns an "
                                         r"instance of <class '.*NotAModule'>"):
        rm.forward(*ARGS)


def test_remote_module_before_init_rpc_is_torchs_assertion_error():
    code = ("import torch; from torchrpc.nn import RemoteModule\n"
            "try:\n    RemoteModule('worker1/cpu', torch.nn.ReLU)\n"
            "except AssertionError as exc:\n"
            "    assert isinstance(exc, RuntimeError), type(exc)\n"
            "    assert str(exc).startswith('RemoteModule only works in RPC.'), exc\n"
            "    print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.stdout.strip() == "ok", out.stderr


def test_unsupported_methods_raise_torchs_error():
    rm = RemoteModule("worker1/cpu", Echo)
    with pytest.raises(ValueError, match=r"^Method ``parameters`` not supported for RemoteModule\. "
                                         r"Please use ``remote_parameters`` instead\."):
        rm.parameters()
    for name, args in (("to", ("cpu",)), ("register_buffer", ("b", torch.ones(1))),
                       ("state_dict", ()), ("named_modules", ()), ("extra_repr", ())):
        with pytest.raises(ValueError, match=f"^Method ``{name}`` not supported for RemoteModule"):
            getattr(rm, name)(*args)
    # torch leaves this one to nn.Module.
    rm.register_full_backward_hook(lambda *a: None)
    assert repr(rm) == "RemoteModule(on=worker1, device=cpu)"


def test_train_and_eval_set_the_remote_mode_and_return_self():
    rm = RemoteModule("worker1/cpu", Echo)
    assert rm.eval() is rm and rm.training is False
    assert rpc.rpc_sync("worker1", training_of, args=(rm.get_module_rref(),)) is False
    assert rm.train() is rm and rm.training is True
    assert rpc.rpc_sync("worker1", training_of, args=(rm.get_module_rref(),)) is True


# -- pickling -----------------------------------------------------------------------------------


def test_sent_over_rpc_with_exactly_torchs_attributes():
    rm = RemoteModule("worker1/cpu", Echo, args=(3.0,))
    rm.new_attr = 1
    with pytest.warns(UserWarning, match="``new_attr`` of RemoteModule is ignored"):
        attrs = rpc.rpc_sync("worker2", attributes, args=(rm,))
    assert list(attrs) == list(_REMOTE_MODULE_PICKLED_ATTRIBUTES) + ["forward_async", "forward"]
    assert (attrs["on"], attrs["device"], attrs["is_device_map_set"], attrs["is_scriptable"]) \
        == ("worker1", "cpu", False, False)
    expected = ("3", 2, torch.full((1,), 3.0))
    assert rpc.rpc_sync("worker2", forward_there, args=(rm, *ARGS)) == expected
    assert rpc.rpc_sync("worker2", forward_async_there, args=(rm, *ARGS)) == expected
    # The module that came back is a working RemoteModule too.
    back = attrs["forward"].__self__
    assert back.forward(*ARGS) == expected and back is not rm


def test_a_subclass_arrives_as_itself():
    rm = CountingRemoteModule("worker1/cpu", Echo, args=(2.0,))
    assert rpc.rpc_sync("worker2", type_name, args=(rm,)) == "CountingRemoteModule"
    assert torch.equal(rm.twice(torch.ones(1)), torch.full((1,), 4.0))


def test_python_pickling_is_refused_with_torchs_error():
    rm = RemoteModule("worker1/cpu", Echo)
    message = ("Cannot pickle RemoteModule in python pickler. RemoteModule can only be pickled "
               "when using RPC")
    with pytest.raises(RuntimeError, match=message):
        pickle.dumps(rm)
    with pytest.raises(RuntimeError, match=message):
        torch.save(rm, io.BytesIO())


def test_init_from_module_rref_shares_the_remote_module():
    rm = RemoteModule("worker1/cpu", Echo, args=(5.0,))
    rm2 = rpc.rpc_sync("worker2", RemoteModule.init_from_module_rref,
                       args=("worker2", rm.get_module_rref()))
    assert type(rm2) is RemoteModule and rm2.on == "worker2"
    assert rm2.get_module_rref().owner_name() == "worker1"
    assert rm2.forward(*ARGS) == rm.forward(*ARGS)
    rm2.eval()
    assert rpc.rpc_sync("worker1", training_of, args=(rm.get_module_rref(),)) is False
    local = RemoteModule.init_from_module_rref("worker1/cpu", rm.get_module_rref())
    assert len(local.remote_parameters()) == 1


# -- TorchScript --------------------------------------------------------------------------------


def scriptable(interface=EchoInterface, scale: float = 1.0) -> _RemoteModule:
    return _RemoteModule("worker1/cpu", scripted_echo, (scale,), None,
                         _module_interface_cls=interface)


def test_scripted_remote_module_runs_in_torchscript():
    rm = scriptable(AsyncEchoInterface, 2.0)
    assert rm.is_scriptable
    expected = ("3", 2, torch.full((1,), 2.0))
    assert rm.forward(*ARGS) == expected  # unscripted, the methods are Python
    scripted = torch.jit.script(rm)
    assert scripted.module_rref is rm.module_rref  # left to Python, as torch keeps it
    assert scripted.forward(*ARGS) == expected
    assert scripted.forward_async(*ARGS).wait() == expected
    assert run_forward(scripted, torch.ones(1)) == expected
    assert run_forward_async(scripted, torch.ones(1)) == expected
    # The remote module is a ScriptModule, as in torch.
    assert rpc.rpc_sync("worker1", type_name, args=(rm.get_module_rref().to_here(),)) \
        == "RecursiveScriptModule"


class Outer(nn.Module):
    """A local module around a scriptable RemoteModule."""

    def __init__(self, remote: nn.Module) -> None:
        super().__init__()
        self.remote = remote

    def forward(self, x: Tensor) -> Tensor:
        return self.remote.forward(x, 1, "a")[2] + 1


def test_scripted_remote_module_inside_a_scripted_module():
    outer = torch.jit.script(Outer(scriptable(scale=3.0)))
    assert torch.equal(outer(torch.ones(1)), torch.full((1,), 4.0))
    with pytest.raises(RuntimeError, match="^Passing a script RemoteModule over RPC"):
        rpc.rpc_sync("worker2", type_name, args=(outer,))


def test_scripted_remote_module_cannot_be_pickled():
    scripted = torch.jit.script(scriptable())
    with pytest.raises(torch.jit.Error, match="can only be pickled when using RPC"):
        torch.save(scripted, io.BytesIO())
    with pytest.raises(RuntimeError, match="^Passing a script RemoteModule over RPC is not "
                                           "supported."):
        rpc.rpc_sync("worker2", attributes, args=(scripted,))


def test_other_script_modules_travel_over_rpc():
    module = torch.jit.script(nn.Linear(3, 2))
    x = torch.randn(4, 3)
    torch.testing.assert_close(rpc.rpc_sync("worker1", run_script_module, args=(module, x)),
                               module(x))


def test_unscripted_scriptable_remote_module_travels_and_works_there():
    rm = RemoteModule.init_from_module_rref("worker1/cpu", scriptable().get_module_rref(),
                                            _module_interface_cls=EchoInterface)
    assert rm.is_scriptable
    assert rpc.rpc_sync("worker2", forward_there, args=(rm, *ARGS)) == EXPECTED
    keys = list(rpc.rpc_sync("worker2", attributes, args=(rm,)))
    assert keys[:len(_REMOTE_MODULE_PICKLED_ATTRIBUTES)] == list(_REMOTE_MODULE_PICKLED_ATTRIBUTES)


def test_scripted_remote_module_releases_the_remote_module():
    wait_drained()
    rm = scriptable()
    scripted = torch.jit.script(rm)
    assert scripted.forward(*ARGS) == EXPECTED
    assert rpc.rpc_sync("worker1", helpers.rref_counts)["num_owner_rrefs"] >= 1
    del rm, scripted
    counts = wait_drained()
    assert counts["worker1"]["num_owner_rrefs"] == 0, counts


def test_bad_interface_is_refused():
    with pytest.raises(TypeError, match="@torch.jit.interface"):
        _RemoteModule("worker1/cpu", Echo, _module_interface_cls=Echo)
