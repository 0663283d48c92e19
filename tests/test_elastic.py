"""Dynamic membership: workers join a running group and leave it (init_rpc world_size=None)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import pytest

import torchrpc.rpc as rpc
from torchrpc.errors import WorkerLeftError

from . import helpers
from .group import ROOT, free_port, worker_env

PORT = free_port()
STOP = tempfile.mkdtemp(prefix="torchrpc-elastic-")


def spawn(name: str, rank: int, stop: str) -> subprocess.Popen:
    env = worker_env(PORT, 0, {"SCENARIO_NAME": name, "SCENARIO_STOPFILE": os.path.join(STOP, stop)})
    env.pop("WORLD_SIZE")
    return subprocess.Popen([sys.executable, "-m", "tests.scenarios", "elastic_member", str(rank),
                             "0", "0"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def names_everywhere(expected, who=("w0", "w1"), timeout=60.0):
    deadline = time.monotonic() + timeout
    while True:
        seen = {"w0": sorted(w.name for w in rpc.get_worker_infos())}
        for name in who[1:]:
            if name in seen["w0"]:
                seen[name] = sorted(w.name for w in rpc.rpc_sync(name, helpers.worker_infos))
            else:
                seen[name] = "not joined yet"
        if all(v == sorted(expected) for v in seen.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"membership did not converge to {expected}: {seen}")
        time.sleep(0.05)


@pytest.fixture(scope="module", autouse=True)
def group():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(PORT))
    os.environ.pop("WORLD_SIZE", None)
    rpc.init_rpc("w0", rank=0, world_size=None,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(num_worker_threads=4))
    stable = spawn("w1", 1, "stop-w1")
    try:
        yield stable
    finally:
        open(os.path.join(STOP, "stop-w1"), "w").close()
        out, _ = stable.communicate(timeout=120)
        rpc.shutdown()
        assert stable.returncode == 0 and "OK elastic w1" in out, out


def test_grow_to_five_and_shrink_back_to_two(group):
    names_everywhere(["w0", "w1"], timeout=120)
    joiners = [spawn(f"w{r}", r, "stop-joiners") for r in (2, 3, 4)]
    try:
        names_everywhere(["w0", "w1", "w2", "w3", "w4"], timeout=120)
        assert rpc.rpc_sync("w4", helpers.whoami) == "w4"
        assert rpc.rpc_sync("w1", helpers.nested_call, args=("w3", 1)) == "w1>w3"
        open(os.path.join(STOP, "stop-joiners"), "w").close()
        for p in joiners:
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0 and "OK elastic" in out, out
        names_everywhere(["w0", "w1"])
        with pytest.raises(WorkerLeftError, match="left"):
            rpc.rpc_sync("w3", helpers.whoami)
        assert rpc.rpc_sync("w1", helpers.whoami) == "w1"  # the stable member kept working
    finally:
        for p in joiners:
            if p.poll() is None:
                p.kill()


def test_joining_with_a_name_in_use_is_refused(group):
    p = spawn("w1", 7, "never")
    out, _ = p.communicate(timeout=120)
    assert "ERR" in out and "'w1' is already in use" in out, out
    assert rpc.rpc_sync("w1", helpers.whoami) == "w1"
    assert sorted(w.name for w in rpc.get_worker_infos()) == ["w0", "w1"]
