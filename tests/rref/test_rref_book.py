"""The RRef book on messages alone: what a lost worker takes with it, and a parent
deleted while its child is parked (G2)."""

from __future__ import annotations

import gc

from torchrpc._rref.book import RRefBook
from torchrpc._wire import Kind


def test_a_lost_holder_releases_its_forks_and_they_never_come_back():
    book = RRefBook(rank=0)
    rid = book.new_id()
    entry = book.owner_entry(rid)
    entry.set_value(1)
    book.add_fork(rid, (1, 1), holder=1)
    book.add_fork(rid, (2, 1), holder=2)
    assert book.counts()["num_forks"] == 2
    assert book.worker_lost(1) == ([], [])
    assert entry.forks == {(2, 1)}
    book.add_fork(rid, (1, 1), holder=1)  # a late FORK_REQUEST from the lost worker
    assert entry.forks == {(2, 1)}
    assert book.worker_lost(2) == ([], [])
    assert book.counts()["num_owner_rrefs"] == 0  # unused and settled: dropped


def test_a_lost_owner_takes_its_user_copies_and_parked_children_with_it():
    book = RRefBook(rank=0)
    msgs = book.user_created((1, 5), (3, 9), owner=1, confirmed=False, parent=3)
    assert msgs[0].kind == Kind.RREF_FORK_REQUEST and msgs[0].dst == 1
    book.user_created((2, 5), (2, 6), owner=2, confirmed=True, parent=None)
    book.fork_child(object(), dst=3, owner=1)  # a copy of worker1's RRef sent to worker3
    kept = book.fork_child(object(), dst=4, owner=2)
    assert book.worker_lost(1) == ([(3, 9)], [])
    counts = book.counts()
    assert counts["num_user_rrefs"] == 1 and counts["num_pending_users"] == 0
    assert list(book.pending_children) == [kept]
    assert book.settled() is False  # worker4 has not accepted its child yet
    assert book.worker_lost(4) == ([], [])
    assert book.settled() is True


class _Parent:
    """A user RRef as the book sees it when it is forked: its ForkId."""

    def __init__(self, fork_id):
        self._fork_id = fork_id


def _deletes(msgs):
    return [m.payload for m in msgs if m.kind == Kind.RREF_USER_DELETE]


def test_a_parent_deleted_while_its_child_is_parked_is_deleted_once_the_child_is_accepted():
    # worker0 holds a confirmed copy (0, 1) of worker1's RRef (1, 0) and sends it to
    # worker2; deleting it before worker2's copy is confirmed must not let the owner drop
    # the value, which worker2 is about to fetch.
    book = RRefBook(rank=0)
    book.user_created((1, 0), (0, 1), owner=1, confirmed=True, parent=None)
    child = book.fork_child(_Parent((0, 1)), dst=2, owner=1)
    other = book.fork_child(_Parent((0, 1)), dst=3, owner=1)
    assert book.user_deleted((0, 1)) == []  # held back
    assert book.user_deleted((0, 1)) == []  # asked again (shutdown): still held
    assert book.child_accepted(child) == []  # another child is still parked
    msgs = book.child_accepted(other)
    assert _deletes(msgs) == [(((1, 0), (0, 1)),)] and msgs[0].dst == 1
    assert book.child_accepted(other) == []  # once only
    assert book.settled() is True and book.counts()["num_user_rrefs"] == 0


def test_a_parent_held_for_a_child_on_a_lost_worker_is_deleted_when_that_worker_is_lost():
    book = RRefBook(rank=0)
    book.user_created((1, 0), (0, 1), owner=1, confirmed=True, parent=None)
    book.fork_child(_Parent((0, 1)), dst=2, owner=1)
    assert book.user_deleted((0, 1)) == []
    orphans, msgs = book.worker_lost(2)
    assert orphans == [] and _deletes(msgs) == [(((1, 0), (0, 1)),)]


def test_a_parent_that_parks_no_child_is_deleted_at_once_and_an_unconfirmed_one_on_confirm():
    book = RRefBook(rank=0)
    book.user_created((1, 0), (0, 1), owner=1, confirmed=True, parent=None)
    assert _deletes(book.user_deleted((0, 1))) == [(((1, 0), (0, 1)),)]
    book.user_created((1, 2), (0, 3), owner=1, confirmed=False, parent=2)
    child = book.fork_child(_Parent((0, 3)), dst=4, owner=1)
    assert book.user_deleted((0, 3)) == []  # unconfirmed, and a child parked
    msgs = book.user_confirmed((0, 3))
    assert [m.kind for m in msgs] == [Kind.RREF_CHILD_ACCEPT]  # to its parent; no delete yet
    assert _deletes(book.child_accepted(child)) == [(((1, 2), (0, 3)),)]


def test_deleted_forks_leave_nothing_for_the_cycle_collector_to_visit():
    # The owner remembers up to 100,000 deleted forks. Each is known by a flat tuple of
    # ints, which the collector stops tracking at its first pass; a pair of id pairs
    # stays tracked while an id it holds is (an RRef's id lives long), and every full
    # collection would visit it.
    book = RRefBook(rank=0)
    rid = book.new_id()
    book.owner_entry(rid).set_value(1)
    book.add_fork(rid, (1, -1), holder=1)  # keeps the entry while the others come and go
    for i in range(1000):
        book.add_fork(rid, (1, i), holder=1)
        book.remove_fork(rid, (1, i))
    gc.collect()
    assert len(book._tombstones) == 1000
    assert all(type(part) is int and not gc.is_tracked(key)
               for key in book._tombstones for part in key)
    book.add_fork(rid, (1, 7), holder=1)  # a late FORK_REQUEST: the fork stays deleted
    assert book.owner_entry(rid).forks == {(1, -1)}
