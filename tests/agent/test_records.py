"""Sealed store records on bytes alone (records.py), and the two readers that must go on
past bad ones: the membership log and the shutdown barrier, on a real store."""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time

import pytest
import torch.distributed as dist

from torchrpc._agent import shutdown
from torchrpc._rendezvous import barriers, membership, records
from torchrpc._rendezvous.group_store import Records
from torchrpc.errors import BarrierTimeoutError, RendezvousError

KEY = records.derive_key(b"s" * 64, "torchrpc")


def test_a_sealed_record_opens_only_where_it_was_sealed():
    value = records.seal(KEY, "torchrpc", "worker/1", {"name": "a", "port": 5})
    assert records.open_record(KEY, "torchrpc", "worker/1", value) == {"name": "a", "port": 5}
    assert records.open_record(KEY, "torchrpc", "worker/1", value.decode(),
                               {"name": str, "port": int})["port"] == 5
    cases = {
        "another key (moved)": (KEY, "torchrpc", "worker/2", value),
        "another sequence": (KEY, "torchrpc", "worker/10", value),
        "another job": (KEY, "torchrpc-elastic", "worker/1", value),
        "another secret": (records.derive_key(b"t" * 64, "torchrpc"), "torchrpc", "worker/1",
                           value),
        "altered body": (KEY, "torchrpc", "worker/1", value.replace(b'"a"', b'"b"')),
        "altered mac": (KEY, "torchrpc", "worker/1", value[:5] + bytes([value[5] ^ 1]) + value[6:]),
    }
    for what, (key, job, where, data) in cases.items():
        with pytest.raises(records.BadRecord, match="MAC does not match"):
            records.open_record(key, job, where, data)
            pytest.fail(what)


@pytest.mark.parametrize("value, why", [
    (b"", "not a sealed record"),
    (b"1", "not a sealed record"),
    (b'{"op": "leave", "rank": 1}', "not a sealed record"),
    (b"R1 " + b"0" * 64, "not a sealed record"),
    (b"R1 " + b"0" * 64 + b" {}", "MAC does not match"),
    (b"\xff\xfe" * 100, "not a sealed record"),
    (b"R1 " + b"0" * (2 << 20), "more than a record may have"),
])
def test_junk_is_refused_saying_why(value, why):
    with pytest.raises(records.BadRecord, match=why):
        records.open_record(KEY, "torchrpc", "event/1", value)


def _sealed_body(body: bytes, where: str = "event/1") -> bytes:
    """A record whose MAC is good but whose body a buggy writer got wrong."""
    return records.MAGIC + records._mac(KEY, "torchrpc", where, body) + b" " + body


@pytest.mark.parametrize("body, why", [
    (b"not json", "not JSON"),
    (b"[1, 2]", "a JSON list, not an object"),
    (b'{"op": "leave"}', "lacks the field 'rank'"),
    (b'{"op": "leave", "rank": "1"}', "field 'rank' is a str, not a int"),
    (b'{"op": "leave", "rank": true}', "field 'rank' is a bool"),
])
def test_a_good_mac_over_a_bad_body_is_refused_saying_why(body, why):
    with pytest.raises(records.BadRecord, match=why):
        records.open_record(KEY, "torchrpc", "event/1", _sealed_body(body),
                            {"op": str, "rank": int})


def test_each_bad_record_is_logged_once(caplog):
    caplog.set_level(logging.WARNING, logger="torchrpc")
    bad = records.BadRecords(logging.getLogger("torchrpc.test").warning)
    for _ in range(3):
        bad.report("torchrpc/event/1", b"junk", records.BadRecord("not a sealed record"))
    bad.report("torchrpc/event/2", b"junk", records.BadRecord("not a sealed record"))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "'torchrpc/event/1'" in said[0] and "not a sealed" in said[0]
    for n in range(3 * records.BadRecords.LIMIT):  # a flood: memory stays bounded
        bad.report(f"k/{n}", b"x", records.BadRecord("x"))
    assert len(bad._seen) == records.BadRecords.LIMIT


# -- readers on a real store ---------------------------------------------------------------------


@pytest.fixture
def stores():
    """(raw, sealed): the group's TCPStore as an outsider and as a member see it."""
    host = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10),
                         wait_for_workers=False)
    raw = dist.PrefixStore(membership.PREFIX, host)
    return raw, Records(raw, b"s" * 64, membership.PREFIX)


def _event(rank: int, op: str = "join", incarnation: int = 0) -> dict:
    return {"op": op, "rank": rank, "name": f"w{rank}", "incarnation": incarnation or rank + 100,
            "host": "127.0.0.1", "port": 1000 + rank, "hostid": "h"}


def test_the_event_log_skips_bad_events_and_reads_on(stores, caplog, monkeypatch):
    raw, store = stores
    caplog.set_level(logging.WARNING, logger="torchrpc")
    monkeypatch.setattr(membership, "GAP_WAIT", 0.2)
    membership._append(store, _event(1))
    good = store.get("event/1")

    def junk(value) -> None:
        raw.set(f"event/{raw.add('events', 1)}", value)
    junk(b"not json at all")                                              # 2
    junk(json.dumps({"op": "leave", "rank": 1, "name": "w1", "incarnation": 101}))  # 3: forged
    junk(good)                                                            # 4: a replay, moved
    junk(store.sealed("event/5", {"op": "join", "name": "w9"}))           # 5: no rank
    junk(store.sealed("event/6", {**_event(2), "op": "explode"}))         # 6: unknown op
    raw.add("events", 3)                                  # 7-9: counted, never written
    membership._append(store, _event(3))                                  # 10
    log = membership.EventLog(store)
    start = time.monotonic()
    events = log.poll()
    assert [(e["op"], e["rank"]) for e in events] == [("join", 1), ("join", 3)]
    assert time.monotonic() - start < 2.0  # one wait for the whole gap, not one per slot
    assert set(log.current) == {1, 3}
    said = " | ".join(r.getMessage() for r in caplog.records)
    for n, why in [(2, "not a sealed record"), (3, "not a sealed record"),
                   (4, "MAC does not match"), (5, "lacks the field 'rank'"),
                   (6, "unknown op 'explode'")]:
        assert f"event/{n}'" in said and why in said, (n, said)
    # A slot written late (a slow writer) still counts, but a join of a process that left
    # (read late) does not bring it back.
    store.put("event/8", _event(4))
    membership._append(store, _event(4, "leave"))
    membership._append(store, _event(5, "leave", incarnation=555))
    store.put("event/9", _event(5, incarnation=555))
    events = log.poll()
    assert set(log.current) == {1, 3} and log.gone >= {104, 555}
    assert [(e["op"], e["rank"]) for e in events] == [("leave", 4), ("leave", 5)]
    store.put("event/7", _event(6))  # a slow writer's join
    assert [(e["op"], e["rank"]) for e in log.poll()] == [("join", 6)]
    assert set(log.current) == {1, 3, 6}


def test_the_barrier_counts_sealed_arrivals_not_the_counter(stores):
    raw, store = stores
    raw.add("shutdown/1", 10)  # an outsider's count
    raw.set("shutdown/1/1", "1")  # and a forged arrival of rank 1
    with pytest.raises(BarrierTimeoutError, match="timed out at the shutdown barrier"):
        barriers.barrier(store, "shutdown/1", 2, time.monotonic() + 1.0, rank=0)
    # rank 1 arrives for real: the barrier completes, for both
    done = []
    waiter = threading.Thread(target=lambda: done.append(barriers.barrier(
        store, "shutdown/2", 2, time.monotonic() + 10, rank=0)))
    raw.add("shutdown/2", -5)  # an outsider takes from the counter: the arrivals still count
    waiter.start()
    time.sleep(0.3)
    assert not done
    barriers.barrier(store, "shutdown/2", 2, time.monotonic() + 10, rank=1)
    waiter.join(10)
    assert done == [None]


def test_claims_bind_only_when_sealed_and_live(stores, caplog):
    raw, store = stores
    caplog.set_level(logging.WARNING, logger="torchrpc")
    membership.join(store, "a", 1, 10, incarnation=11)
    membership.announce(store, "a", 1, ("127.0.0.1", 1), incarnation=11)
    # Squatted with junk, or with a's own claims moved to other keys: taken over.
    raw.set("rank/2", "b 666")
    raw.set("name/b", raw.get("name/a"))
    raw.set("rank/3", raw.get("rank/1"))
    membership.join(store, "b", 2, 10, incarnation=22)
    membership.join(store, "c", 3, 10, incarnation=33)
    said = " | ".join(r.getMessage() for r in caplog.records)
    assert "'torchrpc-elastic/rank/2' (a claim): not a sealed record" in said
    assert "'torchrpc-elastic/name/b' (a claim): its MAC does not match" in said
    assert "'torchrpc-elastic/rank/3' (a claim): its MAC does not match" in said
    # A member's claims bind; so do those of a joiner that is not in yet, until they
    # expire (it failed, or died, before it joined and released them).
    with pytest.raises(RendezvousError, match="rank 1 is already used by worker 'a'"):
        membership.join(store, "x", 1, 10, incarnation=44)
    with pytest.raises(RendezvousError, match="'b' is already in use by rank 2"):
        membership.join(store, "b", 4, 10, incarnation=45)
    membership.join(store, "d", 5, 0.5, incarnation=55)  # never announced
    with pytest.raises(RendezvousError, match="rank 5 is already used by worker 'd'"):
        membership.join(store, "e", 5, 10, incarnation=66)
    time.sleep(0.6)
    membership.join(store, "e", 5, 10, incarnation=66)
    membership.join(store, "d", 6, 10, incarnation=67)
    # A failed join releases its claims at once; a replayed claim of a member that left
    # binds nothing.
    membership.release(store, "e", 5, 66)
    membership.join(store, "f", 5, 10, incarnation=77)
    old = raw.get("rank/1")
    membership.leave(store, "a", 1, 11)
    raw.set("rank/1", old)
    membership.join(store, "g", 1, 10, incarnation=88)


def test_a_deleted_arrival_of_a_worker_gone_on_does_not_hold_the_others(stores):
    """An outsider deletes rank 1's arrival at the first barrier after rank 1 went on to
    the second: rank 0 still passes the first, since the second arrival implies it."""
    raw, store = stores
    later = barriers.SHUTDOWN[1:]
    store.put("shutdown/1/1", {"rank": 1})  # rank 1 arrived at the first barrier,
    store.put("shutdown/2/1", {"rank": 1})  # rank 1 went on and waits at the second
    raw.delete_key("shutdown/1/1")
    with pytest.raises(BarrierTimeoutError):  # what the barrier did before it looked on
        barriers.barrier(store, "shutdown/1", 2, time.monotonic() + 0.5, rank=0)
    barriers.barrier(store, "shutdown/1", 2, time.monotonic() + 5, rank=0, later=later)
    assert barriers.arrived(store, "shutdown/1", 1, later)
    assert not barriers.arrived(store, "shutdown/1", 1)
    # a forged arrival at a later barrier counts for nothing
    raw.set("shutdown/3/2", "1")
    assert not barriers.arrived(store, "shutdown/1", 2, later)
