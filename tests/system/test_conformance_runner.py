"""The conformance runner's redirection: torch's test code sees torchrpc, torch's library
code keeps torch. Checked in a fresh interpreter, since the proxies are process-wide."""

import subprocess
import sys
import textwrap

from tests.support.group import ROOT

_PROBE = textwrap.dedent("""
    from tests.conformance import redirect
    redirect.install("{target}")
    import torch.distributed.rpc as proxy

    def caller(module_name, expr):
        code = compile(expr, module_name, "eval")
        return eval(code, {{"__name__": module_name, "torch": __import__("torch"),
                           "proxy": proxy}})

    test_mod = "torch.testing._internal.distributed.rpc.rpc_test"
    jit_mod = "torch.testing._internal.distributed.rpc.jit.rpc_test"
    lib_mod = "torch.nn.parallel.distributed"
    print(caller(test_mod, "proxy.init_rpc.__module__"))
    print(caller(lib_mod, "proxy.init_rpc.__module__"))
    print(caller(jit_mod, "proxy.init_rpc.__module__"))
    print(caller(test_mod, "torch.distributed.autograd.backward.__module__"))
    print(caller(test_mod, "proxy.api._all_gather.__module__"))
    print(caller(lib_mod, "proxy.api._all_gather.__module__"))
""")


def _probe(target):
    out = subprocess.run([sys.executable, "-c", _PROBE.format(target=target)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_test_code_sees_torchrpc_and_library_code_sees_torch():
    test, lib, jit, autograd, gather, lib_gather = _probe("torchrpc")
    assert test.startswith("torchrpc.rpc")
    assert lib.startswith("torch.distributed.rpc")
    assert jit.startswith("torch.distributed.rpc")  # TorchScript suites keep torch's types
    assert autograd.startswith("torchrpc")
    assert gather.startswith("torchrpc.rpc")
    assert lib_gather.startswith("torch.distributed.rpc")


_LIBRARY_PROBE = textwrap.dedent("""
    from tests.conformance import redirect
    redirect.install("torchrpc", code=("fairscale.",))
    import torch.distributed.rpc as proxy

    def caller(module_name):
        code = compile("proxy.init_rpc.__module__", module_name, "eval")
        return eval(code, {"__name__": module_name, "proxy": proxy})

    print(caller("fairscale.experimental.nn.distributed_pipeline.pipeline"))
    print(caller("torch.testing._internal.distributed.rpc.rpc_test"))
    print(caller("torch.nn.parallel.distributed"))
""")


def test_a_library_named_as_the_code_that_sees_torchrpc():
    out = subprocess.run([sys.executable, "-c", _LIBRARY_PROBE], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    library, tests, torch_itself = out.stdout.split()
    assert library.startswith("torchrpc.rpc")
    assert tests.startswith("torch.distributed.rpc")  # only the modules named see torchrpc
    assert torch_itself.startswith("torch.distributed.rpc")


def test_mirror_gives_torch_to_everyone():
    modules = _probe("torch")
    assert len(modules) == 6 and all(m.startswith("torch.") for m in modules), modules


def _list(*argvs):
    """What ``--list`` prints for each argument list, as lists of ``Suite.test`` (the runs
    overlap: each spends seconds importing torch's test modules)."""
    procs = [subprocess.Popen([sys.executable, "-m", "tests.conformance.run", "--list", *argv],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for argv in argvs]
    listed = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        listed.append(out.split())
    return listed


def _listed(*selections):
    """The test classes ``--list --suites S`` selects, for each S."""
    return [{line.split(".", 1)[0] for line in out}
            for out in _list(*(["--suites", suites] for suites in selections))]


def test_suite_groups_expand_to_torchs_lists():
    pipe_and_faulty, cuda, generic = _listed("tensorpipe,faulty", "cuda",
                                             "generic,FaultyAgentRpcTest")
    assert pipe_and_faulty == {
        "TensorPipeAgentRpcTest", "TensorPipeAgentDistAutogradTest", "FaultyAgentRpcTest",
        "FaultyAgentDistAutogradTest"}
    assert cuda == {
        "CudaRpcTest", "CudaDistAutogradTest", "CudaRemoteModuleTest", "CudaDdpComparisonTest",
        "TensorPipeAgentCudaRpcTest", "TensorPipeCudaDistAutogradTest"}
    assert "RpcTest" in generic


def test_shards_split_a_selection_into_disjoint_parts_that_cover_it():
    whole, *shards = _list(["--suites", "cuda"],
                           *(["--suites", "cuda", "--shard", f"{i}/3"] for i in (1, 2, 3)))
    assert len(whole) > 3 and all(shards)
    assert sorted(sum(shards, [])) == sorted(whole)
    assert shards[1] == whole[1::3]


def test_a_shard_outside_one_to_n_is_a_usage_error():
    proc = subprocess.run([sys.executable, "-m", "tests.conformance.run", "--list",
                           "--shard", "4/3"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2
    assert "'4/3': expected I/N with 1 <= I <= N" in proc.stderr
