"""init_rpc / shutdown lifecycles in fresh processes: rendezvous kinds, errors, re-init."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from ..support.group import ROOT, free_port, start_module, worker_env

TIMEOUT = int(os.environ.get("TORCHRPC_SCENARIO_TIMEOUT", "90"))


def launch(scenario: str, world: int, extra=None, ranks=None, env_per_rank=None):
    port = free_port()
    procs = []
    for r in (ranks if ranks is not None else range(world)):
        env = worker_env(port, world, extra)
        if env_per_rank:
            env.update(env_per_rank(r))
        procs.append(start_module("tests.support.scenarios",
                                  [scenario, str(r), str(world), str(free_port())],
                                  env, capture=True))
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += "\nTIMEOUT"
        outs.append((p.returncode, out))
    return outs


def assert_ok(outs):
    for code, out in outs:
        assert code == 0 and "OK" in out, out[-3000:]


def test_api_before_init_twice_after_shutdown_and_reinit():
    assert_ok(launch("lifecycle", 1))


def test_env_rendezvous_group_of_three():
    assert_ok(launch("group_call", 3))


def test_tcp_rendezvous():
    port = free_port()
    assert_ok(launch("group_call", 2, {"SCENARIO_INIT_METHOD": f"tcp://127.0.0.1:{port}"}))


def test_file_rendezvous():
    path = os.path.join(tempfile.mkdtemp(prefix="torchrpc-file-"), "store")
    assert_ok(launch("group_call", 2, {"SCENARIO_INIT_METHOD": f"file://{path}"}))


def test_rank_and_world_size_from_environment():
    outs = launch("group_call", 3, {"SCENARIO_FROM_ENV": "1"},
                  env_per_rank=lambda r: {"RANK": str(r)})
    assert_ok(outs)


@pytest.mark.skipif(shutil.which("torchrun") is None and not os.path.exists(
    os.path.join(os.path.dirname(sys.executable), "torchrun")), reason="torchrun not installed")
def test_torchrun_single_node():
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = worker_env(free_port(), 3, {"SCENARIO_FROM_ENV": "1"})
    for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"):
        env.pop(key, None)
    out = subprocess.run(
        [torchrun, "--nproc-per-node=3", f"--master-port={free_port()}", "--master-addr=127.0.0.1",
         "-m", "tests.support.scenarios", "group_call", "0", "3", "0"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.count("OK group") == 3


def test_duplicate_name_fails_clearly_on_the_workers_involved():
    outs = launch("duplicate", 2, {"SCENARIO_NAME": "same"},
                  env_per_rank=lambda r: {"SCENARIO_RANK": str(r)})
    assert all(code == 0 for code, _ in outs), outs
    errors = [out for _, out in outs if "ERR" in out]
    assert errors and all("RPC worker name same is not unique" in e for e in errors), outs


def test_duplicate_rank_fails_clearly_not_hangs():
    ranks = {0: 0, 1: 1, 2: 1}
    outs = launch("duplicate", 3, ranks=[0, 1, 2],
                  env_per_rank=lambda r: {"SCENARIO_RANK": str(ranks[r]), "SCENARIO_NAME": f"n{r}"})
    assert all("TIMEOUT" not in out for _, out in outs), outs
    assert all("ERR" in out and "duplicate rank 1" in out for _, out in outs), outs


def test_invalid_names_are_rejected_before_rendezvous():
    import torchrpc.rpc as rpc
    for bad in ("bad name", "x" * 128, "a/b", "", "é"):
        with pytest.raises(ValueError,
                           match="Worker name must (match|be non-empty|be shorter than 128)") as e:
            rpc.init_rpc(bad, rank=0, world_size=1)
        assert isinstance(e.value, RuntimeError)  # torch's type too
    with pytest.raises(TypeError):
        rpc.init_rpc(5, rank=0, world_size=1)


def test_calls_to_a_worker_that_said_goodbye_fail_at_once(tmp_path):
    # A stopping worker's socket closes a moment after its GOODBYE; a call sent in
    # between would wait for its whole timeout, so it must not be sent.
    stopfile = str(tmp_path / "stop")
    assert_ok(launch("goodbye_window", 2, {"SCENARIO_STOPFILE": stopfile}))
