"""``python -m torchrpc.inspect`` and ``rpc.snapshot`` on a group of 3 processes whose links
run over TLS: the observer speaks TLS with what a worker is given, the workers check its
certificate as they check each other's, and without it the observer says what to give."""

from __future__ import annotations

import json
import os
import threading

import pytest

import torchrpc.rpc as rpc
from torchrpc._agent.observer import Observer, TlsRequiredError
from torchrpc._transport import tls

from ..support import certs
from ..support.group import running_group, start_module, wait_for

pytestmark = certs.needs_openssl

SECRET = "inspect-tls-test-secret-" + "0123456789abcdef" * 2
NAMES = ["worker0", "worker1", "worker2"]

_release = threading.Event()  # in each process: lets hold() return


def hold() -> str:
    _release.wait(120)
    return "held"


def release() -> None:
    _release.set()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return certs.make_pki(tmp_path_factory.mktemp("pki"), ("ca", "rogue_ca"), (
        ("worker", "ca", "IP:127.0.0.1"),
        ("rogue", "rogue_ca", "IP:127.0.0.1"),  # another CA
        ("elsewhere", "ca", "IP:10.9.9.9"),  # the job's CA, another host's address
    ))


@pytest.fixture(scope="module")
def group(pki):
    with running_group(3, threads=4, timeout=60.0,
                       options={"secret": SECRET, **certs.tls_options(pki)}) as g:
        fut = rpc.rpc_async("worker1", hold)  # one call outstanding, for the rows to show
        wait_for("worker1 to serve hold", lambda: any(
            s["function"].endswith("hold")
            for s in rpc.snapshot(workers=["worker1"])["workers"][0]["serving"]), 60)
        yield g
        rpc.rpc_sync("worker1", release)
        assert fut.wait() == "held"


def tls_args(pki, cert: str = "worker", ca: str = "ca") -> list:
    return ["--tls-certfile", pki[cert], "--tls-keyfile", pki[f"{cert}.key"],
            "--tls-cafile", pki[ca]]


def run_cli(group, *args: str):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(group.port),
               TORCHRPC_SECRET=SECRET)
    env.pop("TORCHRPC_SECRET_FILE", None)
    proc = start_module("torchrpc.inspect", list(args), env, capture=True)
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, out


def test_cli_over_tls_shows_every_worker(group, pki):
    code, out = run_cli(group, *tls_args(pki))
    assert code == 0, out
    assert "NO ANSWER" not in out and "cannot reach" not in out, out
    for rank, name in enumerate(NAMES):
        assert f"\n{name} (rank {rank}):" in out, out
    assert f"{__name__}.hold" in out, out  # worker1's served call: its snapshot came
    code, out = run_cli(group, "--json", *tls_args(pki))
    assert code == 0, out
    doc = json.loads(out)
    assert [w["name"] for w in doc["workers"]] == NAMES
    assert all(w["answered"] for w in doc["workers"]), doc


def test_snapshot_in_a_worker_process_uses_its_tls(group):
    # rank 0 runs in this process: its observer takes the worker's own TLS material.
    doc = rpc.snapshot()
    assert [w["name"] for w in doc["workers"]] == NAMES
    assert all(w["answered"] for w in doc["workers"]), doc


def test_observer_without_tls_material_says_what_to_give(group, pki):
    code, out = run_cli(group)
    assert code == 2, out
    assert "run over TLS" in out and "speaks TLS" in out, out
    for flag in ("--tls-certfile", "--tls-keyfile", "--tls-cafile", "--tls-identity"):
        assert flag in out, out
    assert "hold" not in out  # nothing of the workers' state
    with pytest.raises(TlsRequiredError, match="tls_certfile"):
        with Observer(f"tcp://127.0.0.1:{group.port}", SECRET.encode(), 10.0) as observer:
            observer.snapshot()
    # Half of the material is an error of its own.
    code, out = run_cli(group, "--tls-cafile", pki["ca"])
    assert code == 2 and "tls_certfile is required" in out, out


@pytest.mark.parametrize("cert, ca", [("rogue", "ca"), ("elsewhere", "ca"),
                                      ("worker", "rogue_ca")])
def test_workers_check_the_observer_certificate_as_a_peer(group, pki, cert, ca):
    # A certificate of another CA, or of the job's CA naming another host; or the observer
    # not trusting the job's CA: no worker answers, nothing of them shows.
    observer = Observer(f"tcp://127.0.0.1:{group.port}", SECRET.encode(), 5.0,
                        tls_certfile=pki[cert], tls_keyfile=pki[f"{cert}.key"],
                        tls_cafile=pki[ca])
    with observer:
        doc = observer.snapshot(timeout=5.0)
    assert [w["name"] for w in doc["workers"]] == NAMES
    assert not any(w["answered"] for w in doc["workers"]), doc
    assert all("cannot reach it" in w["error"] for w in doc["workers"]), doc
    assert not any(w["serving"] for w in doc["workers"])
    if ca == "rogue_ca":
        assert "certificate verify failed" in doc["workers"][0]["error"], doc


def test_speaks_tls_tells_a_tls_listener_from_a_plain_one(group):
    host, port = "127.0.0.1", group.port  # the rendezvous store: no TLS
    assert not tls.speaks_tls(host, port, 5.0)
    from torchrpc.rpc import api
    whost, wport = api.current_agent().registry.addresses[1]
    assert tls.speaks_tls(whost, wport, 5.0)
