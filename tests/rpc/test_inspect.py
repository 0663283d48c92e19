"""``python -m torchrpc.inspect`` and ``rpc.snapshot`` on a real group of 3 processes: a
call chain worker0 -> worker1 -> worker2 stuck on an event, the observer's output (text,
JSON, stacks), an observer that is no member, and the ways an observer is refused."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time

import pytest
import torch.distributed as dist

import torchrpc.rpc as rpc
from torchrpc._agent.observer import Observer
from torchrpc._agent.snapshot import OBSERVER_RANK
from torchrpc._transport import handshake
from torchrpc._transport.sockets import recv_exact

from ..support.group import free_port, running_group, start_module, wait_for

SECRET = "inspect-test-secret-" + "0123456789abcdef" * 2
NAMES = ["worker0", "worker1", "worker2"]

_release = threading.Event()  # in each process: lets stuck() and hold() return


def stuck() -> str:
    """Waits (on worker2) until released: the end of the chain."""
    _release.wait(120)
    return "released"


def relay(to: str) -> str:
    """On worker1: the middle of the chain."""
    return rpc.rpc_sync(to, stuck)


def hold() -> str:
    _release.wait(120)
    return "held"


def release() -> None:
    _release.set()


def rearm() -> None:
    _release.clear()


def members() -> list:
    return sorted(w.name for w in rpc.get_worker_infos())


@pytest.fixture(scope="module")
def group():
    watcher = None
    try:
        # running_group shuts down gracefully at its end and checks every worker exits 0:
        # here with an observer attached (the earlier ones have left). The secret is an
        # option: TORCHRPC_SECRET would stay with this process's later groups.
        with running_group(3, threads=4, timeout=60.0, options={"secret": SECRET}) as g:
            yield g
            watcher = inspect_cli(g, "--watch", "0.3", "--timeout", "2")
            wait_for("the watching observer to attach", lambda: observers_of("worker1") >= 1,
                     60)
    finally:
        if watcher is not None:
            watcher.send_signal(signal.SIGINT)
            out, _ = watcher.communicate(timeout=60)
            assert "worker2" in out  # it printed the group while it ran


def observers_of(name: str) -> int:
    doc = rpc.snapshot(workers=[name], timeout=10)
    return doc["workers"][0]["observers"] - 1  # less this one


def cli_env(group, **extra: str) -> dict:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(group.port))
    env["TORCHRPC_SECRET"] = SECRET
    env.pop("TORCHRPC_SECRET_FILE", None)
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def inspect_cli(group, *args: str, **env: str):
    return start_module("torchrpc.inspect", list(args), cli_env(group, **env), capture=True)


def run_cli(group, *args: str, **env: str):
    proc = inspect_cli(group, *args, **env)
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, out


@pytest.fixture(scope="module")
def chain(group):
    """worker0 -> worker1 (relay) -> worker2 (stuck), stuck until the module's tests end."""
    fut = rpc.rpc_async("worker1", relay, ("worker2",))
    wait_for("the chain to reach worker2",
             lambda: any(s["function"].endswith("stuck")
                         for s in rpc.snapshot(workers=["worker2"])["workers"][0]["serving"]),
             60)
    time.sleep(1.0)  # ages of a second or more
    yield fut
    rpc.rpc_sync("worker2", release)
    assert fut.wait() == "released"
    rpc.rpc_sync("worker2", rearm)


def _by_name(doc: dict) -> dict:
    return {w["name"]: w for w in doc["workers"]}


def test_snapshot_names_the_chain_functions_and_ages(chain):
    doc = rpc.snapshot()
    w = _by_name(doc)
    assert set(w) == set(NAMES) and all(x["answered"] for x in w.values())
    (p0,) = [p for p in w["worker0"]["pending"] if p["function"].endswith("relay")]
    assert p0["to"] == "worker1" and p0["kind"] == "call" and p0["age_s"] >= 1.0
    (s1,) = w["worker1"]["serving"]
    assert s1["from"] == "worker0" and s1["function"] == f"{__name__}.relay"
    assert s1["kind"] == "call" and s1["age_s"] >= 1.0 and s1["thread"]
    (p1,) = w["worker1"]["pending"]
    assert p1["to"] == "worker2" and p1["function"] == f"{__name__}.stuck"
    (s2,) = w["worker2"]["serving"]
    assert s2["from"] == "worker1" and s2["function"] == f"{__name__}.stuck"
    assert p1["age_s"] <= s1["age_s"] and s2["age_s"] <= p0["age_s"] + 0.5
    chains = [c for c in doc["chains"] if c["links"][0]["worker"] == "worker0"
              and c["links"][1]["function"].endswith("relay")]
    assert len(chains) == 1, doc["chains"]
    links = chains[0]["links"]
    assert [link["worker"] for link in links] == NAMES
    assert [link.get("state") for link in links[1:]] == ["running", "running"]
    assert not chains[0]["cycle"]
    assert w["worker1"]["state"] == "running" and w["worker1"]["threads"]["total"] >= 1


def test_cli_text_names_the_chain(group, chain):
    code, out = run_cli(group)
    assert code == 0, out
    line = [ln for ln in out.splitlines() if ln.strip().startswith("worker0 -> worker1")]
    assert line, out
    assert "worker1 (relay, " in line[0] and "-> worker2 (stuck, " in line[0], line[0]
    assert re.search(rf"<- worker0 +{re.escape(__name__)}\.relay +\[call\] +\d", out), out
    assert re.search(rf"-> worker2 +{re.escape(__name__)}\.stuck +\[call\] +\d", out), out
    for name in NAMES:
        assert f"\n{name} (rank {NAMES.index(name)}):" in out


def test_cli_json_and_stacks_show_the_stuck_frame(group, chain):
    code, out = run_cli(group, "--json", "--stacks", "--workers", "worker1,2")
    assert code == 0, out
    doc = json.loads(out)
    w = _by_name(doc)
    assert set(w) == {"worker1", "worker2"}
    (s2,) = w["worker2"]["serving"]
    assert s2["function"] == f"{__name__}.stuck" and s2["age_s"] >= 1.0
    labelled = [(t, text) for t, text in w["worker2"]["stacks"].items()
                if f"serving call {__name__}.stuck from worker1" in t]
    assert len(labelled) == 1, list(w["worker2"]["stacks"])
    assert "in stuck\n" in labelled[0][1] and "_release.wait(120)" in labelled[0][1]
    assert any("in relay\n" in text for text in w["worker1"]["stacks"].values())
    # Partial view: worker0 was not asked, so the chain starts at worker1.
    assert [c["text"] for c in doc["chains"]][0].startswith("worker1 -> worker2 (stuck, ")


def test_observer_is_no_member_and_leaves_no_trace(group, chain):
    with Observer(f"tcp://127.0.0.1:{group.port}", SECRET.encode()) as observer:
        doc = observer.snapshot()
        assert all(w["observers"] >= 1 for w in doc["workers"])
        for name in NAMES:  # no worker lists it, while it is attached
            assert rpc.rpc_sync(name, members) == NAMES
    # An observer killed mid-watch leaves nothing behind either.
    watcher = inspect_cli(group, "--watch", "0.2")
    wait_for("the observer to attach", lambda: observers_of("worker2") >= 1, 60)
    watcher.kill()
    watcher.communicate(timeout=30)
    wait_for("the workers to forget the killed observer",
             lambda: observers_of("worker2") == 0 and observers_of("worker1") == 0, 30)
    assert rpc.rpc_sync("worker2", members) == NAMES


def test_a_worker_whose_pool_threads_are_all_stuck_still_answers(group):
    futs = [rpc.rpc_async("worker1", hold) for _ in range(8)]
    try:
        def held() -> list:
            (w1,) = rpc.snapshot(workers=["worker1"], timeout=10)["workers"]
            return [s for s in w1["serving"] if s["function"] == f"{__name__}.hold"]

        wait_for("worker1's pool to fill", lambda: len(held()) >= 4, 60)
        (w1,) = rpc.snapshot(workers=["worker1"], timeout=10)["workers"]
        # Every pool thread serves (hold, or the chain's relay), each its own request; the
        # answer came all the same.
        threads = w1["threads"]
        assert threads["busy"] == threads["total"] >= 4, w1
        assert len({s["thread"] for s in w1["serving"]}) == len(w1["serving"]) >= 4, w1
    finally:
        rpc.rpc_sync("worker1", release, timeout=30)
        assert [f.wait() for f in futs] == ["held"] * 8
        rpc.rpc_sync("worker1", rearm)


def test_observer_without_secret_is_told_how_to_give_one(group):
    code, out = run_cli(group, TORCHRPC_SECRET=None)
    assert code == 2
    assert "no job secret" in out and "TORCHRPC_SECRET" in out
    assert "TORCHRPC_SECRET_FILE" in out


def test_observer_with_wrong_secret_learns_nothing(group):
    code, out = run_cli(group, "--json", TORCHRPC_SECRET="w" * 40)
    assert code == 2
    assert "fail their check under this secret" in out and "TORCHRPC_SECRET" in out
    assert "worker1" not in out and "{" not in out


def _observer_handshake(host: str, port: int, rank: int, secret: bytes) -> bytes:
    """An observer's handshake with the worker at ``host:port``, its PROOF made under
    ``secret`` (the worker's own MAC is not checked); what the worker answers."""
    with socket.create_connection((host, port), timeout=10) as sock:
        hello, nonce = handshake.make_hello(OBSERVER_RANK, handshake.FEATURE_FRAME_MAC)
        sock.sendall(hello)
        challenge = recv_exact(sock, handshake.CHALLENGE.size)
        server_rank, features, server_nonce, _ = handshake.CHALLENGE.unpack(challenge)
        proof = handshake._mac(secret, b"cli", server_nonce, nonce, OBSERVER_RANK, server_rank,
                               handshake.FEATURE_FRAME_MAC, features, b"", 0, 0, (host, port))
        sock.sendall(proof)
        # What comes back, and then the first frame the worker would send anything with.
        sock.sendall(b"\0" * 64)
        got = b""
        try:
            while len(got) < 64:
                more = sock.recv(64)
                if not more:
                    break
                got += more
        except socket.timeout:
            pass
        return got


def test_workers_refuse_a_handshake_under_another_secret(group):
    # Straight to worker1's listener, past the store: a wrong PROOF is dropped unanswered.
    agent = rpc.api._get_current_rpc_agent()
    host, port = agent.registry.addresses[1]
    assert _observer_handshake(host, port, 1, b"w" * 40) == b""
    # The same handshake under the job's secret is accepted (and the junk after it,
    # which fails its frame MAC, closes the connection).
    assert _observer_handshake(host, port, 1, SECRET.encode()) == handshake.ACCEPT


def test_no_rendezvous_names_the_address(group):
    port = free_port()
    code, out = run_cli(group, "--init-method", f"tcp://127.0.0.1:{port}", "--timeout", "2")
    assert code == 2
    assert f"no rendezvous store reachable at 127.0.0.1:{port}" in out


def test_a_group_that_does_not_exist_yet(group, tmp_path):
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)
    try:
        code, out = run_cli(group, "--init-method", f"tcp://127.0.0.1:{port}")
    finally:
        del store
    assert code == 2
    assert f"no torchrpc group at tcp://127.0.0.1:{port}" in out and "start the job" in out
    code, out = run_cli(group, "--init-method", f"file://{tmp_path}/none")
    assert code == 2 and "no rendezvous file" in out


def _worker(rank: int, pending=(), serving=(), answered: bool = True) -> dict:
    return {"name": f"w{rank}", "rank": rank, "answered": answered,
            "pending": [{"id": i, "to": f"w{to}", "to_rank": to, "function": f"m.f{to}",
                         "kind": "call", "age_s": age} for i, to, age in pending],
            "serving": [{"id": i, "from": f"w{frm}", "from_rank": frm, "function": f"m.f{rank}",
                         "kind": "call", "age_s": age, "thread": "t"}
                        for i, frm, age in serving]}


def test_wait_chains_name_a_cycle_and_a_worker_that_did_not_answer():
    from torchrpc._agent.observer import wait_chains
    # w0 -> w1 -> w2 -> w0: w0 called w1 first, then each serves the call of the one before.
    cycle = [_worker(0, pending=[(1, 1, 9.0)], serving=[(3, 2, 7.5)]),
             _worker(1, pending=[(2, 2, 8.0)], serving=[(1, 0, 8.9)]),
             _worker(2, pending=[(3, 0, 7.4)], serving=[(2, 1, 7.95)])]
    chains = wait_chains(cycle)
    assert [c["cycle"] for c in chains] == [True], chains
    assert chains[0]["text"] == "w0 -> w1 (f1, 9.0 s) -> w2 (f2, 8.0 s) -> w0 (f0, 7.4 s)  CYCLE"
    # The same, every call made while serving the one before it (no call starts the chain).
    cycle[0]["pending"][0]["age_s"] = 7.0
    chains = wait_chains(cycle)
    assert [c["cycle"] for c in chains] == [True], chains
    assert chains[0]["links"][-1]["state"] == "cycle"
    # A call to a worker that did not answer, and one it has not begun to serve.
    chains = wait_chains([_worker(0, pending=[(1, 1, 65.0), (2, 2, 3.0)]),
                          _worker(1, answered=False), _worker(2)])
    assert [c["text"] for c in chains] == ["w0 -> w1 (f1, 1.1 min, no answer)",
                                           "w0 -> w2 (f2, 3.0 s, not running)"]
