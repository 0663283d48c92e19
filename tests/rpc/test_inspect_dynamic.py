"""``python -m torchrpc.inspect`` on a dynamic group (world_size=None) of this process and a
member that joined it: the observer reads the members from the membership log, with the
job secret from TORCHRPC_SECRET_FILE, and names a stuck call."""

from __future__ import annotations

import json
import os
import tempfile

import pytest

import torchrpc.rpc as rpc

from ..support.group import free_port, start_module, wait_for, worker_env
from . import test_inspect as ti

PORT = free_port()
STOP = tempfile.mkdtemp(prefix="torchrpc-inspect-")


@pytest.fixture(scope="module")
def group():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(PORT))
    os.environ.pop("WORLD_SIZE", None)
    # The secret of every member; an option here (TORCHRPC_SECRET would stay with this
    # process's later groups).
    rpc.init_rpc("w0", rank=0, world_size=None,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(num_worker_threads=4,
                                                                     secret=ti.SECRET))
    env = worker_env(PORT, 0, {"TORCHRPC_SECRET": ti.SECRET, "SCENARIO_NAME": "w1",
                               "SCENARIO_STOPFILE": os.path.join(STOP, "stop")})
    env.pop("WORLD_SIZE")
    member = start_module("tests.support.scenarios", ["elastic_member", "1", "0", "0"], env,
                          capture=True)
    try:
        wait_for("w1 to join", lambda: len(rpc.get_worker_infos()) == 2, 120)
        yield member
    finally:
        open(os.path.join(STOP, "stop"), "w").close()
        out, _ = member.communicate(timeout=120)
        rpc.shutdown()
        assert member.returncode == 0 and "OK elastic w1" in out, out


def test_cli_on_a_dynamic_group_names_the_members_and_the_stuck_call(group, tmp_path):
    fut = rpc.rpc_async("w1", ti.hold)
    try:
        wait_for("w1 to serve hold", lambda: any(
            s["function"] == f"{ti.__name__}.hold"
            for s in rpc.snapshot(workers=["w1"])["workers"][0]["serving"]), 60)
        secret_file = tmp_path / "secret"
        secret_file.write_text(ti.SECRET)
        secret_file.chmod(0o600)
        env = dict(os.environ, TORCHRPC_SECRET_FILE=str(secret_file))
        env.pop("TORCHRPC_SECRET", None)
        proc = start_module("torchrpc.inspect", ["--json"], env, capture=True)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        doc = json.loads(out)
        w = {x["name"]: x for x in doc["workers"]}
        assert set(w) == {"w0", "w1"} and all(x["answered"] for x in w.values())
        (p,) = [p for p in w["w0"]["pending"] if p["function"] == f"{ti.__name__}.hold"]
        assert p["to"] == "w1" and p["kind"] == "call"
        assert any(c["text"].startswith("w0 -> w1 (hold, ") for c in doc["chains"]), doc["chains"]
        assert sorted(w["w1"]["members"]) == ["w0", "w1"]
    finally:
        rpc.rpc_sync("w1", ti.release)
        assert fut.wait() == "held"
    assert sorted(x.name for x in rpc.get_worker_infos()) == ["w0", "w1"]
