"""The public surface mirrors torch's, the layers import only downward, options validate."""

from __future__ import annotations

import ast
import copy
import pathlib
import pickle

import pytest
import torch

import torchrpc
import torchrpc.rpc as rpc
from torchrpc._agent import Extensions, Slot
from torchrpc.rpc import backend_registry, constants

PKG = pathlib.Path(torchrpc.__file__).parent

# What each layer may import from torchrpc (besides itself, errors and _threads, which
# sit below every layer).
ALLOWED = {
    "_wire": set(),
    "_transport": {"_wire"},
    "_rendezvous": {"_transport"},
    "_agent": {"_wire", "_transport", "_rendezvous"},
    "_rref": {"_wire", "_agent"},
    "_dist_autograd": {"_wire", "_agent", "_rref"},
    "_profiler": {"_agent"},
    "_testing": {"_wire", "_transport", "_agent", "rpc"},
    "rpc": {"_wire", "_transport", "_rendezvous", "_agent", "_rref", "_dist_autograd",
            "_profiler"},
    "autograd": {"_agent", "_dist_autograd", "rpc"},
    "optim": {"rpc", "autograd"},
    "nn": {"rpc", "autograd"},
    "examples": {"rpc", "autograd", "optim", "nn", "examples"},
    "inspect": {"_agent"},
}
FORBIDDEN = ("torch.distributed.rpc", "torch.distributed.autograd", "torch.distributed.optim",
             "torch.distributed.nn", "torch._C._distributed_rpc", "torch._C._distributed_autograd")


def _imports(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    rel = path.relative_to(PKG).parts
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(rel[:-node.level]) if node.level <= len(rel) - 1 else []
                mod = ".".join(["torchrpc", *base] + ([node.module] if node.module else []))
                yield mod
                if not node.module:
                    for alias in node.names:
                        yield f"{mod}.{alias.name}"
            else:
                yield node.module


def test_layers_import_only_downward():
    problems = []
    for path in PKG.rglob("*.py"):
        layer = path.relative_to(PKG).parts[0]
        for mod in _imports(path):
            if mod.startswith(FORBIDDEN):
                problems.append(f"{path}: imports {mod}")
            if not mod.startswith("torchrpc."):
                continue
            target = mod.split(".")[1]
            if target in ("errors", "_threads", layer) or target.endswith(".py"):
                continue
            if layer in ALLOWED and target not in ALLOWED[layer]:
                problems.append(f"{path}: layer {layer} imports {mod}")
    assert not problems, "\n".join(problems)


UPPER = ("optim", "nn", "autograd", "examples", "_testing")
"""Layers built on the RPC API as a user's code is: the public names only."""


def _private_api_uses(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith(("rpc.api", "rpc")):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    yield f"imports {alias.name} from {node.module}"
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name in ("api", "rpc"):
                yield f"uses {name}.{node.attr}"


def test_upper_layers_use_only_the_public_rpc_api():
    problems = [f"{path}: {use}" for layer in UPPER for path in (PKG / layer).rglob("*.py")
                for use in _private_api_uses(path)]
    assert not problems, "\n".join(problems)


def _string_keyed_extensions(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Subscript):
            target, key = node.value, node.slice
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            target, key = node.func.value, node.args[0]
        else:
            continue
        if isinstance(target, ast.Attribute) and target.attr == "extensions" \
                and isinstance(key, ast.Constant) and isinstance(key.value, str):
            yield f"line {node.lineno}: extensions keyed by {key.value!r}"


def test_layers_reach_each_other_by_typed_slots_not_strings():
    problems = [f"{path}: {use}" for path in PKG.rglob("*.py")
                for use in _string_keyed_extensions(path)]
    assert not problems, "\n".join(problems)
    ext = Extensions()
    slot: Slot[list] = Slot("things")
    assert ext.get(slot) is None and ext.setdefault(slot, list) == [] and ext[slot] == []
    with pytest.raises(TypeError, match="Slot"):
        ext.get("things")
    with pytest.raises(LookupError, match="no other layer"):
        ext[Slot("other")]


def test_public_names_match_torch():
    import torch.distributed.rpc as trpc
    for name in ("init_rpc", "rpc_sync", "rpc_async", "remote", "shutdown", "get_worker_info",
                 "WorkerInfo", "RRef", "BackendType", "RpcBackendOptions",
                 "TensorPipeRpcBackendOptions", "functions", "backend_registry", "constants",
                 "get_rpc_timeout"):
        assert hasattr(trpc, name) and hasattr(rpc, name), name
    import torchrpc.autograd as dist_autograd
    for name in ("context", "backward", "get_gradients"):
        assert hasattr(dist_autograd, name), name
    from torchrpc.nn import RemoteModule  # noqa: F401
    from torchrpc.optim import DistributedOptimizer  # noqa: F401
    assert hasattr(rpc.functions, "async_execution")


def test_constants_and_backend_enum():
    assert constants.DEFAULT_RPC_TIMEOUT_SEC == 60.0
    assert constants.UNSET_RPC_TIMEOUT == -1.0
    assert constants.DEFAULT_INIT_METHOD == "env://"
    assert rpc.BackendType.TENSORPIPE is backend_registry.BackendType.TENSORPIPE
    assert isinstance(rpc.BackendType.TENSORPIPE, rpc.BackendType)
    opts = backend_registry.construct_rpc_backend_options(
        rpc.BackendType.TENSORPIPE, init_method="tcp://127.0.0.1:1234", rpc_timeout=5)
    assert isinstance(opts, rpc.TensorPipeRpcBackendOptions)
    assert opts.rpc_timeout == 5 and opts.init_method == "tcp://127.0.0.1:1234"


def test_register_backend():
    def construct(rpc_timeout, init_method, **kwargs):
        return rpc.TensorPipeRpcBackendOptions(rpc_timeout=rpc_timeout, init_method=init_method)

    def init(store, name, rank, world_size, options):
        raise AssertionError("not started in this test")

    member = rpc.register_backend("SURFACE_TEST_BACKEND", construct, init)
    assert rpc.BackendType.SURFACE_TEST_BACKEND is member
    assert rpc.BackendType["SURFACE_TEST_BACKEND"] is member
    assert member in list(rpc.BackendType)
    assert backend_registry.backend_registered("SURFACE_TEST_BACKEND")
    assert backend_registry.construct_rpc_backend_options(member, rpc_timeout=3).rpc_timeout == 3
    with pytest.raises(RuntimeError, match="already registered"):
        rpc.register_backend("SURFACE_TEST_BACKEND", construct, init)
    with pytest.raises(TypeError, match="BackendType"):
        backend_registry.construct_rpc_backend_options("TENSORPIPE")


def test_backend_type_behaves_as_torchs_enum():
    B = rpc.BackendType
    member = B.TENSORPIPE
    assert isinstance(member, B) and member.name == "TENSORPIPE"
    assert member.value.init_backend_handler is not None
    assert repr(member) == str(member) == "BackendType.TENSORPIPE"
    assert B["TENSORPIPE"] is member and B(member.value) is member
    assert list(B)[0] is member and len(B) == len(list(B)) and member in B
    assert list(B.__members__) == [m.name for m in B]
    with pytest.raises(TypeError):
        B.__members__["X"] = member  # read-only, as an enum's
    with pytest.raises(KeyError):
        B["NO_SUCH_BACKEND"]
    with pytest.raises(AttributeError, match="NO_SUCH_BACKEND"):
        B.NO_SUCH_BACKEND
    with pytest.raises(ValueError, match="not a valid BackendType"):
        B("nothing")
    with pytest.raises(AttributeError):
        member.name = "OTHER"
    assert member == B.TENSORPIPE and member != "TENSORPIPE"
    assert {member: 1}[B["TENSORPIPE"]] == 1
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        assert pickle.loads(pickle.dumps(member, protocol)) is member
    assert copy.copy(member) is member and copy.deepcopy(member) is member


def test_options_defaults_and_assignment():
    opts = rpc.TensorPipeRpcBackendOptions()
    assert opts.num_worker_threads == 16 and opts.rpc_timeout == 60.0
    assert opts.init_method == "env://" and opts.device_maps == {} and opts.devices == []
    opts.rpc_timeout = 5
    opts.init_method = "file:///tmp/x"
    opts.num_worker_threads = 2
    assert (opts.rpc_timeout, opts.init_method, opts.num_worker_threads) == (5.0, "file:///tmp/x", 2)
    base = rpc.RpcBackendOptions()
    assert base.rpc_timeout == 60.0 and base.init_method == "env://"
    for bad in (dict(num_worker_threads=0), dict(rpc_timeout=-1), dict(init_method="nowhere"),
                dict(num_worker_threads="4")):
        with pytest.raises(ValueError):
            rpc.TensorPipeRpcBackendOptions(**bad)


def test_device_maps_checked_as_torch_checks_them():
    opts = rpc.TensorPipeRpcBackendOptions(device_maps={"worker1": {0: 1}})
    opts.set_device_map("worker1", {1: 2})
    assert opts.device_maps == {"worker1": {torch.device("cuda:0"): torch.device("cuda:1"),
                                            torch.device("cuda:1"): torch.device("cuda:2")}}
    with pytest.raises(ValueError, match=r"^`set_device_map` only supports 1-to-1 mapping, "
                                         r"trying to map cuda:0 to cuda:3 and cuda:1"):
        opts.set_device_map("worker1", {0: 3})
    with pytest.raises(ValueError, match=r"^`device_map` only supports 1-to-1 mapping, "
                                         r"trying to map cuda:1 and cuda:0 to cuda:0"):
        rpc.TensorPipeRpcBackendOptions(device_maps={"w": {0: 0, 1: 0}})
    # Two calls may map two sources to one target: init_rpc refuses it, as torch's does.
    opts.set_device_map("worker1", {3: 1})
    assert opts.device_maps["worker1"][torch.device("cuda:3")] == torch.device("cuda:1")
    for bad in ({-1: 0}, {0: -1}):
        with pytest.raises(RuntimeError, match="^Device index must not be negative"):
            opts.set_device_map("worker1", bad)
    with pytest.raises(RuntimeError, match="^Expected one of cpu, cuda"):
        opts.set_device_map("worker1", {"nonsense": 0})
    with pytest.raises(TypeError):
        opts.set_device_map(3, {0: 0})
    opts.set_devices([0, "cuda:1", torch.device("cuda", 2)])
    assert opts.devices == [torch.device("cuda", i) for i in range(3)]
    with pytest.raises(ValueError, match=r"^`set_devices` expect a list of CUDA devices, "
                                         r"but got device type cpu\."):
        opts.set_devices(["cpu"])


def test_functions_import_without_agent_and_rref_generic():
    @rpc.functions.async_execution
    def f(x):
        return x
    assert f._wrapped_async_rpc_function is not None and f.__name__ == "f"
    assert rpc.RRef[torch.Tensor] is not None


def test_every_module_and_class_stays_small():
    problems = []
    for path in PKG.rglob("*.py"):
        text = path.read_text()
        if text.count("\n") > 500:
            problems.append(f"{path}: {text.count(chr(10))} lines (at most 500)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 300:
                problems.append(f"{path}: class {node.name} has "
                                f"{node.end_lineno - node.lineno + 1} lines (at most 300)")
    assert not problems, "\n".join(problems)


def test_followers_run_the_broadcast_of_rpc_api_by_name():
    # torch's tests patch rpc.api._broadcast_to_followers on the followers; the leader's
    # call must name that function, so it is defined in rpc.api itself.
    assert rpc.api._broadcast_to_followers.__module__ == "torchrpc.rpc.api"
    for name in ("_all_gather", "_barrier", "_wait_all_workers",
                 "_delete_all_user_and_unforked_owner_rrefs"):
        assert getattr(rpc.api, name).__module__ == "torchrpc.rpc.api", name


# The only module-level mutable state in torchrpc, and why it is process state rather than
# an agent's (docs/design.md, "Process state"). Everything else an agent or a layer keeps
# is its own, or lives on the current-agent handle (_agent/current.py).
PROCESS_STATE = {
    # Which pool, reading role or private read the running thread is in: state of threads.
    "_agent/futures.py:_reader": "per-thread context",
    "_agent/pool.py:_current": "per-thread context",
    "_agent/role.py:_inline": "per-thread context",
    "_transport/reader.py:_reading": "per-thread context",
    # The stacks of the requests each thread serves (serving.py's per-thread this_thread),
    # registered weakly for snapshots, and the lock of that registry.
    "_agent/serving.py:_stacks": "per-thread context",
    "_agent/serving.py:_stacks_lock": "per-thread context",
    # Secret files this process wrote, removed at its exit at the latest.
    "_rendezvous/secret.py:_lock": "process resources",
    "_rendezvous/secret.py:_files": "process resources",
    "_rendezvous/secret.py:_fallback": "process resources",
    # Each thread's reusable pickler, holding nothing between messages.
    "_wire/serialize.py:_pickler_of_thread": "per-thread cache",
    # The threads torchrpc started and the agents that run, which the interpreter's exit
    # stops and joins (held weakly: an ended thread, a collected agent drops out).
    "_threads.py:_ours": "process resources",
    "_threads.py:_lock": "process resources",
    "_threads.py:global _exiting": "process resources",
    "_threads.py:_stoppers": "process resources",
    "_agent/process_exit.py:_agents": "weak registry",
    # Caches of pure functions, and the types they made.
    "_rendezvous/names.py:_checked": "cache",
    "errors.py:_runtime_twins": "cache",
    "errors.py:_twins_lock": "cache",
    "nn/api/_scriptable.py:_lock": "cache",
    "nn/api/_scriptable.py:_cache": "cache",
    # Tensors' .grad is process state: one lock for accumulating into it.
    "_dist_autograd/records.py:_GRAD_SLOTS": "lock over process-wide tensors",
    # Reducers by type, registered at import, as copyreg's.
    "_wire/pickler.py:_MESSAGE_REDUCERS": "type registry",
    # The local optimizers of this process, held weakly (their RRefs keep them).
    "optim/optimizer.py:_by_number": "weak registry",
    # torch's private API, which ported tests use: rpc.api._default_pickler is swapped by
    # _use_rpc_pickler, and rpc.api._thread_local_var is torch's.
    "rpc/_calls.py:_thread_local_var": "torch's private API",
    "rpc/api.py:global _default_pickler": "torch's private API",
}
_MUTABLE_CALLS = {"local", "Lock", "RLock", "Condition", "Event", "WeakSet",
                  "WeakValueDictionary", "WeakKeyDictionary", "deque", "OrderedDict",
                  "defaultdict", "set", "dict", "list"}


def _module_state(tree: ast.Module):
    """Module-level names bound to an empty container, a lock or a thread-local, and the
    names functions rebind with ``global``."""
    for node in tree.body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        value = node.value
        empty = isinstance(value, (ast.List, ast.Set, ast.Dict)) and not (
            value.keys if isinstance(value, ast.Dict) else value.elts)
        call = isinstance(value, ast.Call) and (
            getattr(value.func, "attr", None) or getattr(value.func, "id", None)) in _MUTABLE_CALLS
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if empty or call:
            yield from (t.id for t in targets if isinstance(t, ast.Name) and t.id != "__all__")
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            yield from (f"global {name}" for name in node.names)


def test_no_module_state_beyond_the_handle_and_the_listed():
    found = {f"{path.relative_to(PKG).as_posix()}:{name}"
             for path in PKG.rglob("*.py") for name in _module_state(ast.parse(path.read_text()))}
    new = sorted(found - set(PROCESS_STATE))
    assert not new, (f"module-level mutable state {new}: keep it on the agent (a Slot in "
                     f"agent.extensions), or on the current-agent handle (handle.process)")
    assert not set(PROCESS_STATE) - found, "PROCESS_STATE lists state that is gone"
    # The scan finds what it must: a thread-local, a global rebinding, an empty table.
    tree = ast.parse("import threading\n_a = threading.local()\n_b: dict = {}\n"
                     "def f():\n    global _c\n")
    assert list(_module_state(tree)) == ["_a", "_b", "global _c"]
