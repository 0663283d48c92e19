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
from torchrpc.errors import RendezvousError

from ..support.group import free_port, running_group, start_module, wait_for

SECRET = "inspect-test-secret-" + "0123456789abcdef" * 2
NAMES = ["worker0", "worker1", "worker2"]

_release = threading.Event()  # in each process: lets stuck() and hold() return


def stuck() -> str:
    """Waits (on worker2) until released: the end of the chain."""
    _release.wait(600)
    return "released"


def relay(to: str) -> str:
    """On worker1: the middle of the chain (held for the whole module: no timeout)."""
    return rpc.rpc_sync(to, stuck, timeout=0)


def hold() -> str:
    _release.wait(120)
    return "held"


def release() -> None:
    _release.set()


def rearm() -> None:
    _release.clear()


def members() -> list:
    return sorted(w.name for w in rpc.get_worker_infos())


_gate = threading.Event()  # in each process: lets gated_a, gated_b and gated_c return


def gated_a() -> str:
    _gate.wait(120)
    return "a"


def gated_b() -> str:
    _gate.wait(120)
    return "b"


def gated_c() -> str:
    _gate.wait(120)
    return "c"


def relay_a(to: str) -> str:
    return rpc.rpc_sync(to, gated_a)


def relay_b(to: str) -> str:
    return rpc.rpc_sync(to, gated_b)


@rpc.functions.async_execution
def async_relay(to: str):
    """Returns at once; its reply waits for the onward call's."""
    return rpc.rpc_async(to, gated_c)


def open_gate() -> None:
    _gate.set()


def close_gate() -> None:
    _gate.clear()


def serves(worker: str, function: str) -> list:
    """The requests ``worker`` serves now that run this module's ``function``."""
    (w,) = rpc.snapshot(workers=[worker], timeout=10)["workers"]
    return [s for s in w["serving"] if s["function"] == f"{__name__}.{function}"]


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
    fut = rpc.rpc_async("worker1", relay, ("worker2",), timeout=0)
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
    assert "in stuck\n" in labelled[0][1] and "_release.wait(600)" in labelled[0][1]
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


@pytest.fixture
def silent_store():
    """A listener that accepts connections and never answers: the store of a job whose
    rank 0 is stopped (its kernel still accepts). Closing it resets what it holds."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    yield listener
    listener.close()


def silent_env() -> dict:
    env = dict(os.environ, TORCHRPC_SECRET=SECRET)
    env.pop("TORCHRPC_SECRET_FILE", None)
    return env


def store_readers() -> list:
    return [t for t in threading.enumerate() if t.name == "torchrpc-observer-store"]


def test_ctrl_c_ends_a_watcher_whose_store_does_not_answer(silent_store):
    port = silent_store.getsockname()[1]
    watcher = start_module("torchrpc.inspect", ["--init-method", f"tcp://127.0.0.1:{port}",
                                                "--watch", "0.3", "--timeout", "60"],
                           silent_env(), capture=True)
    held = []
    try:
        # Its quick look, then torch's store client, which waits for an answer (in C++,
        # past its own timeout, where a signal does not reach it).
        silent_store.settimeout(60)
        held = [silent_store.accept()[0] for _ in range(2)]
        watcher.send_signal(signal.SIGINT)
        out, _ = watcher.communicate(timeout=30)  # well within its own timeout of 60 s
        assert watcher.returncode == 0, out
        assert "Traceback" not in out, out
    finally:
        watcher.kill()
        for conn in held:
            conn.close()


def test_a_store_that_does_not_answer_is_an_error_within_twice_the_timeout(silent_store):
    port = silent_store.getsockname()[1]
    proc = start_module("torchrpc.inspect", ["--init-method", f"tcp://127.0.0.1:{port}",
                                             "--timeout", "1"], silent_env(), capture=True)
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 2, out
    assert (f"the rendezvous store at tcp://127.0.0.1:{port} did not answer within 2 s; "
            f"check that the job runs and is not stopped") in out, out


def test_snapshot_of_a_store_that_does_not_answer_raises_and_its_reader_ends(silent_store):
    port = silent_store.getsockname()[1]
    assert not store_readers()
    # Without its own bound the call would wait as long as the store: end that in time.
    breaker = threading.Timer(60, silent_store.close)
    breaker.start()
    try:
        with pytest.raises(RendezvousError, match=f"the rendezvous store at "
                           f"tcp://127.0.0.1:{port} did not answer within 2 s"):
            rpc.snapshot(init_method=f"tcp://127.0.0.1:{port}", timeout=1,
                         secret=SECRET.encode())
    finally:
        breaker.cancel()
    (reader,) = store_readers()  # still waiting on the store
    silent_store.close()  # the job's rank 0 dies: its connections break
    reader.join(30)
    assert not reader.is_alive()


def _chains_through(doc: dict, function: str) -> list:
    return [c for c in doc["chains"] if len(c["links"]) > 1
            and c["links"][1]["function"] == f"{__name__}.{function}"]


def test_two_requests_served_at_once_each_chain_names_only_its_own_call(group):
    # worker1 serves relay_a, then relay_b while relay_a still runs; each makes one call
    # to worker2. Both calls were made since either request began: only what the thread
    # that made each served then says which request it belongs to.
    a = rpc.rpc_async("worker1", relay_a, ("worker2",))
    try:
        wait_for("relay_a's call to reach worker2", lambda: serves("worker2", "gated_a"), 60)
        b = rpc.rpc_async("worker1", relay_b, ("worker2",))
        wait_for("relay_b's call to reach worker2", lambda: serves("worker2", "gated_b"), 60)
        doc = rpc.snapshot()
        w1 = _by_name(doc)["worker1"]
        served = {s["function"].rsplit(".", 1)[1]: s for s in w1["serving"]}
        # On two threads, or on one: a thread that waits for relay_a's reply may read
        # relay_b and serve it inline, before relay_a returns.
        assert served["relay_a"]["thread"] and served["relay_b"]["thread"], w1["serving"]
        made_for = {p["function"].rsplit(".", 1)[1]: p["for"] for p in w1["pending"]}
        for relay, gated in (("relay_a", "gated_a"), ("relay_b", "gated_b")):
            assert made_for[gated] == {"from_rank": 0, "id": served[relay]["id"]}, w1
            (c,) = _chains_through(doc, relay)
            assert [(link["worker"], link.get("function", "").rsplit(".", 1)[-1],
                     link.get("state")) for link in c["links"]] == [
                ("worker0", "", None), ("worker1", relay, "running"),
                ("worker2", gated, "running")], c
            assert c["text"].startswith(f"worker0 -> worker1 ({relay}, "), c["text"]
            assert f"-> worker2 ({gated}, " in c["text"], c["text"]
        # The call worker0 itself makes (made for no request) is none of them.
        assert all(p["for"] is None for p in _by_name(doc)["worker0"]["pending"])
    finally:
        rpc.rpc_sync("worker2", open_gate)
        assert a.wait() == "a"
        assert b.wait() == "b"
        rpc.rpc_sync("worker2", close_gate)


def test_an_async_execution_request_stays_listed_until_its_reply_is_sent(group):
    fut = rpc.rpc_async("worker1", async_relay, ("worker2",))
    try:
        wait_for("async_relay's call to reach worker2", lambda: serves("worker2", "gated_c"),
                 60)
        time.sleep(0.3)  # async_relay returned long ago: it waits for its future
        doc = rpc.snapshot()
        w1 = _by_name(doc)["worker1"]
        (s,) = [s for s in w1["serving"] if s["function"] == f"{__name__}.async_relay"]
        assert s["async"] is True and s["thread"] is None and s["age_s"] >= 0.3, s
        (p,) = [p for p in w1["pending"] if p["function"] == f"{__name__}.gated_c"]
        assert p["for"] == {"from_rank": 0, "id": s["id"]}, p
        (c,) = _chains_through(doc, "async_relay")
        assert [link.get("state") for link in c["links"][1:]] == ["running", "running"], c
        assert c["links"][1]["async"] is True and c["links"][2]["worker"] == "worker2"
        assert ", async) -> worker2 (gated_c, " in c["text"], c["text"]
        code, out = run_cli(group, "--workers", "worker1")
        assert code == 0, out
        assert re.search(rf"<- worker0 +{re.escape(__name__)}\.async_relay +\[call\] +\S+ s"
                         r" +waiting for its future", out), out
    finally:
        rpc.rpc_sync("worker2", open_gate)
        assert fut.wait() == "c"
        rpc.rpc_sync("worker2", close_gate)
    # The reply was sent: the entry has gone (it leaves right after sending it).
    wait_for("async_relay to leave worker1's table", lambda: not serves("worker1", "async_relay"),
             10)


def test_the_serving_table_lists_what_each_thread_serves_and_what_waits():
    from torchrpc._agent.serving import ServingTable, this_thread
    from torchrpc._agent.worker import WorkerInfo

    caller = WorkerInfo("w0", 0)
    table, other = ServingTable(), ServingTable()
    outer, inner = [table, caller, 1, 0, None, 1.0], [table, caller, 2, 0, None, 2.0]
    stack = table.thread_stack()
    assert this_thread.stack is stack and table.thread_stack() is stack
    base = len(stack)
    stack.extend([outer, inner, [other, caller, 3, 0, None, 3.0]])
    try:
        got = [(e[2], ident) for e, ident in table.entries()]
        me = threading.get_ident()
        assert got == [(1, me), (2, me)]  # innermost last; another agent's is not listed
        assert table.key_of(inner) == (0, 2) and other.key_of(inner) is None
        # One moving to ``waiting`` (still on its thread's stack) is listed once.
        table.waiting[id(inner)] = inner
        assert [(e[2], ident) for e, ident in table.entries()] == [(1, me), (2, me)]
        del stack[base + 1:]
        assert [(e[2], ident) for e, ident in table.entries()] == [(1, me), (2, None)]
        # Another thread gets a stack of its own.
        seen = []
        t = threading.Thread(target=lambda: seen.append(table.thread_stack() is not stack))
        t.start()
        t.join()
        assert seen == [True]
    finally:
        del stack[base:]
        table.waiting.clear()
    assert table.entries() == []


def _worker(rank: int, pending=(), serving=(), answered: bool = True) -> dict:
    """A worker of a snapshot document: ``pending`` as (id, to, age[, (caller, id) of the
    request served that the call was made for]), ``serving`` as (id, caller, age)."""
    return {"name": f"w{rank}", "rank": rank, "answered": answered,
            "pending": [{"id": p[0], "to": f"w{p[1]}", "to_rank": p[1], "function": f"m.f{p[1]}",
                         "kind": "call", "age_s": p[2],
                         "for": {"from_rank": p[3][0], "id": p[3][1]} if len(p) > 3 else None}
                        for p in pending],
            "serving": [{"id": i, "from": f"w{frm}", "from_rank": frm, "function": f"m.f{rank}",
                         "kind": "call", "age_s": age, "thread": "t"}
                        for i, frm, age in serving]}


def test_wait_chains_name_a_cycle_and_a_worker_that_did_not_answer():
    from torchrpc._agent.chains import wait_chains
    # w0 -> w1 -> w2 -> w0: w0 called w1 first, then each serves the call of the one before.
    cycle = [_worker(0, pending=[(1, 1, 9.0)], serving=[(3, 2, 7.5)]),
             _worker(1, pending=[(2, 2, 8.0, (0, 1))], serving=[(1, 0, 8.9)]),
             _worker(2, pending=[(3, 0, 7.4, (1, 2))], serving=[(2, 1, 7.95)])]
    chains = wait_chains(cycle)
    assert [c["cycle"] for c in chains] == [True], chains
    assert chains[0]["text"] == "w0 -> w1 (f1, 9.0 s) -> w2 (f2, 8.0 s) -> w0 (f0, 7.4 s)  CYCLE"
    # The same, every call made for the request served before it (no call starts the chain).
    cycle[0]["pending"][0]["for"] = {"from_rank": 2, "id": 3}
    chains = wait_chains(cycle)
    assert [c["cycle"] for c in chains] == [True], chains
    assert chains[0]["links"][-1]["state"] == "cycle"
    # A call to a worker that did not answer, and one it has not begun to serve.
    chains = wait_chains([_worker(0, pending=[(1, 1, 65.0), (2, 2, 3.0)]),
                          _worker(1, answered=False), _worker(2)])
    assert [c["text"] for c in chains] == ["w0 -> w1 (f1, 1.1 min, no answer)",
                                           "w0 -> w2 (f2, 3.0 s, not running)"]


def test_wait_chains_follow_the_request_each_call_was_made_for():
    from torchrpc._agent.chains import wait_chains
    # w1 serves two calls of w0 at once; each made one onward call, to w2 and w3. By age
    # alone both onward calls were made since either request began; by ``for`` each
    # chain names only its own.
    ws = [_worker(0, pending=[(1, 1, 5.0), (2, 1, 4.0)]),
          _worker(1, pending=[(7, 2, 3.0, (0, 2)), (8, 3, 2.0, (0, 1))],
                  serving=[(1, 0, 5.0), (2, 0, 4.0)]),
          _worker(2, serving=[(7, 1, 3.0)]), _worker(3, serving=[(8, 1, 2.0)])]
    assert sorted(c["text"] for c in wait_chains(ws)) == [
        "w0 -> w1 (f1, 4.0 s) -> w2 (f2, 3.0 s)", "w0 -> w1 (f1, 5.0 s) -> w3 (f3, 2.0 s)"]
    # A call made for no request (or for one that ended) starts a chain of its own.
    ws[1]["pending"][1]["for"] = {"from_rank": 0, "id": 99}
    assert sorted(c["text"] for c in wait_chains(ws)) == [
        "w0 -> w1 (f1, 4.0 s) -> w2 (f2, 3.0 s)", "w0 -> w1 (f1, 5.0 s)",
        "w1 -> w3 (f3, 2.0 s)"]
