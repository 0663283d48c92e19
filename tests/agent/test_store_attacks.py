"""An outsider that reaches a dynamic group's rendezvous store (raw TCPStore writes, or a
process of another uid running torchrpc) can deny, kill or redirect nothing: forged,
replayed, moved, malformed and missing-field records, gaps in the membership log,
squatted claims and error keys are ignored (and logged); the members keep serving and
later joiners get in. Static groups: test_store_attacks_static.py."""

from __future__ import annotations

import datetime
import json
import logging
import os
import tempfile
import threading
import time
from typing import Any, Dict

import pytest
import torch.distributed as dist

import torchrpc.rpc as rpc
from torchrpc._rendezvous import membership
from torchrpc._agent.current import current_agent

from ..support import helpers
from ..support.group import free_port, start_module, wait_for, worker_env
from ..support.nobody import init_rpc_as_nobody, needs_nobody

PORT = free_port()
STOP = tempfile.mkdtemp(prefix="torchrpc-attacks-")


def spawn(name: str, rank: int, **extra: str) -> Any:
    env = worker_env(PORT, 0, {"SCENARIO_NAME": name,
                               "SCENARIO_STOPFILE": os.path.join(STOP, f"stop-{name}"), **extra})
    env.pop("WORLD_SIZE")
    return start_module("tests.support.scenarios", ["elastic_member", str(rank), "0", "0"], env,
                        capture=True)


def outsider() -> Any:
    """The group's store as anyone who reaches its port sees it."""
    return dist.PrefixStore(membership.PREFIX, dist.TCPStore(
        "127.0.0.1", PORT, is_master=False, timeout=datetime.timedelta(seconds=10)))


def joins_and_serves(name: str, rank: int) -> str:
    """A legitimate joiner gets in, every member sees it, it serves and it leaves; its
    output (its log included)."""
    p = spawn(name, rank)
    try:
        wait_for(f"{name} joins", lambda: name in {w.name for w in rpc.get_worker_infos()}
                 or p.poll() is not None, 120)
        assert p.poll() is None, p.communicate()[0]
        assert rpc.rpc_sync(name, helpers.whoami) == name
        assert rpc.rpc_sync(name, helpers.nested_call, args=("w1", 1)) == f"{name}>w1"
        assert rpc.rpc_sync("w1", helpers.nested_call, args=(name, 1)) == f"w1>{name}"
    finally:
        open(os.path.join(STOP, f"stop-{name}"), "w").close()
        out, _ = p.communicate(timeout=120)
    assert p.returncode == 0 and f"OK elastic {name}" in out, out
    wait_for(f"{name} leaves", lambda: name not in {w.name for w in rpc.get_worker_infos()}, 30)
    return out


def still_serving() -> None:
    assert rpc.rpc_sync("w1", helpers.add, args=(20, 22)) == 42
    assert rpc.rpc_sync("w1", helpers.nested_call, args=("w0", 1)) == "w1>w0"
    assert sorted(w.name for w in rpc.rpc_sync("w1", helpers.worker_infos)) == ["w0", "w1"]
    assert current_agent().failure is None


def ignored(caplog, key: str, why: str = "") -> bool:
    return any("ignored the rendezvous store's record" in r.getMessage()
               and f"torchrpc-elastic/{key}'" in r.getMessage() and why in r.getMessage()
               for r in caplog.records)


@pytest.fixture(scope="module", autouse=True)
def group():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(PORT))
    os.environ.pop("WORLD_SIZE", None)
    rpc.init_rpc("w0", rank=0, world_size=None,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(num_worker_threads=4))
    stable = spawn("w1", 1)
    try:
        wait_for("w1 joins", lambda: "w1" in {w.name for w in rpc.get_worker_infos()}, 120)
        yield stable
    finally:
        open(os.path.join(STOP, "stop-w1"), "w").close()
        out, _ = stable.communicate(timeout=120)
        rpc.shutdown()
        assert stable.returncode == 0 and "OK elastic w1" in out, out


@pytest.fixture(autouse=True)
def warnings(caplog):
    caplog.set_level(logging.WARNING, logger="torchrpc")


def test_forged_leave_and_lost_events_kill_no_member(caplog):
    store = outsider()
    incarnation = current_agent().registry.incarnations[1]
    for forged in ({"op": "leave", "rank": 1, "name": "w1", "incarnation": incarnation,
                    "lost": "forged"},
                   {"op": "leave", "rank": 0, "name": "w0",
                    "incarnation": current_agent().registry.incarnation, "lost": "forged"},
                   {"op": "join", "rank": 1, "name": "w1", "incarnation": 7,
                    "host": "127.0.0.1", "port": 1, "hostid": "evil"}):
        n = store.add("events", 1)
        store.set(f"event/{n}", json.dumps(forged))
    wait_for("the forged events read and ignored", lambda: ignored(caplog, f"event/{n}"), 10)
    time.sleep(0.5)  # w1 follows the log too
    still_serving()
    assert current_agent().registry.incarnations[1] == incarnation


def test_replayed_and_moved_records_are_ignored(caplog):
    store = outsider()
    # w1's own sealed join event and its claims, copied to other slots and keys.
    events = int(store.add("events", 0))
    joins = [n for n in range(1, events + 1) if store.check([f"event/{n}"])
             and b'"name":"w1"' in store.get(f"event/{n}")]
    assert joins
    join, claim, name = store.get(f"event/{joins[0]}"), store.get("rank/1"), store.get("name/w1")
    n = store.add("events", 1)
    store.set(f"event/{n}", join)  # another sequence
    # w1's join again, at its own next slot, pointing at the outsider's address: a new
    # joiner must not dial it.
    redirected = store.add("events", 1)
    store.set(f"event/{redirected}", join.replace(b'"hostid":"', b'"hostid":"evil').replace(
        f'"port":{current_agent().registry.addresses[1][1]}'.encode(), b'"port":1'))
    store.set("rank/5", claim)     # another key: the rank w5 will claim
    store.set("name/w5", name)
    wait_for("the moved and the redirected events ignored", lambda: ignored(
        caplog, f"event/{n}", "MAC") and ignored(caplog, f"event/{redirected}", "MAC"), 10)
    joins_and_serves("w5", 5)  # it took the claims over (test_records.py checks the log)
    still_serving()


def test_malformed_events_and_gaps_block_no_joiner(caplog):
    store = outsider()
    for junk in (b"not json", b'{"op": "join"}', b"\xff\x00\x01", b"R1 " + b"0" * 64 + b" {}"):
        store.set(f"event/{store.add('events', 1)}", junk)
    store.add("events", 5)  # counted slots never written
    joins_and_serves("w2", 2)
    still_serving()


def test_squatted_claims_and_error_keys_deny_no_joiner(caplog):
    store = outsider()
    store.set("rank/3", "w3 666")  # what the old claims looked like
    store.set("name/w3", b"\x00junk")
    store.set("error", "rank 3: cannot read the job secret (forged)")
    joins_and_serves("w3", 3)
    still_serving()


@needs_nobody
def test_another_users_failed_join_denies_no_later_join():
    # Another uid runs torchrpc against the group's store: it cannot read the secret, so
    # its init_rpc fails, alone, and it leaves nothing that blocks rank 4 or its name.
    out = init_rpc_as_nobody("w4", 4, None, PORT)
    assert "FAILED RendezvousError" in out.stdout and "job secret" in out.stdout, out
    store = outsider()
    assert not store.check(["rank/4"]) and not store.check(["name/w4"])
    joins_and_serves("w4", 4)
    still_serving()


def test_a_joiner_gets_in_while_an_outsider_floods_the_store(caplog):
    store = outsider()
    stop = threading.Event()
    written: Dict[str, int] = {"n": 0}

    def flood() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            store.set(f"junk/{i}", os.urandom(64))
            store.set(f"event/{store.add('events', 1)}", os.urandom(32))
            store.set("error", f"forged error {i}")
            for r in (6, 7):
                store.compare_set(f"rank/{r}", "", f"junk {i}")
                store.compare_set(f"name/w{r}", "", f"junk {i}")
            store.add("lost", 1)
            written["n"] = i
            time.sleep(0.002)
    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    try:
        joins_and_serves("w6", 6)
        still_serving()
    finally:
        stop.set()
        flooder.join(10)
    assert written["n"] > 50, written


def test_a_failed_join_releases_its_claims_at_once():
    # Its secret is good, but its listener cannot bind: it fails alone, and its rank and
    # name are free for the next joiner at once (not when its claims expire).
    failed = spawn("w8", 8, TORCHRPC_LISTEN_ADDR="192.0.2.1")  # TEST-NET-1: not this host's
    out, _ = failed.communicate(timeout=120)
    assert "ERR" in out and "w8" in out, out
    store = outsider()
    assert store.get("rank/8").startswith(b"free ") and store.get("name/w8").startswith(b"free ")
    joins_and_serves("w8", 8)
    still_serving()
