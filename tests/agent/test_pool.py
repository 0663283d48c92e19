"""The worker pool on its own, with no agent and no sockets."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from torchrpc._agent import pool as pool_module
from torchrpc._agent.pool import WorkerPool, current_pool
from torchrpc.errors import ClosedError

from ..support.group import wait_for


@pytest.fixture()
def pool():
    p = WorkerPool(2, "unit")
    yield p
    assert p.close(5.0) == []


def test_tasks_run_on_pool_threads_that_know_their_pool(pool):
    seen = []
    done = threading.Event()

    def task(i):
        seen.append((i, current_pool() is pool, threading.current_thread().name))
        if len(seen) == 5:
            done.set()

    for i in range(5):
        pool.submit(task, i)
    assert done.wait(5)
    assert sorted(i for i, _, _ in seen) == list(range(5))
    assert all(mine and name.startswith("unit-") for _, mine, name in seen)
    assert current_pool() is None  # this thread is no pool's
    assert pool.num_threads <= 2


def test_a_thread_that_blocks_does_not_count_so_queued_work_still_runs(pool):
    # Both threads block on work that only a third task can release: the pool grows.
    release = threading.Event()
    blocked = []

    def wait_inside():
        with current_pool().blocking():
            blocked.append(1)
            assert release.wait(5)

    pool.submit(wait_inside)
    pool.submit(wait_inside)
    wait_for("both threads to block", lambda: len(blocked) == 2, 5)
    pool.submit(release.set)
    assert release.wait(5)
    assert pool.num_threads == 3


def test_blocking_the_pool_cannot_see_is_found_by_check_progress(pool):
    release = threading.Event()
    started = []

    def stuck():
        started.append(1)
        release.wait(5)

    pool.submit(stuck)
    pool.submit(stuck)
    wait_for("both threads to be stuck", lambda: len(started) == 2, 5)
    pool.submit(release.set)
    pool.check_progress()  # the first check only notes where the pool is
    assert not release.is_set()
    pool.check_progress()  # nothing started since: a thread is added
    assert release.wait(5) and pool.num_threads == 3


def test_hand_off_takes_only_an_idle_thread(pool):
    pool.submit(lambda: None)  # starts a thread, which then idles
    wait_for("a thread to idle", lambda: pool._idle == 1 and pool.num_pending == 0, 5)
    handed = threading.Event()
    assert pool.hand_off(handed.set) is True and handed.wait(5)
    release = threading.Event()
    for _ in range(2):
        pool.submit(release.wait, 5)
    wait_for("every thread to be busy", lambda: pool._idle == 0, 5)
    assert pool.hand_off(lambda: None) is False  # it would wait behind the others
    release.set()


def test_a_failing_task_is_logged_and_the_thread_goes_on(pool, caplog):
    done = threading.Event()

    def boom():
        raise ValueError("on purpose")

    with caplog.at_level(logging.ERROR, logger="torchrpc._agent.pool"):
        pool.submit(boom)
        wait_for("the failure to be logged", lambda: "on purpose" in caplog.text, 5)
        for _ in range(4):  # both threads still take work
            pool.submit(done.set)
        assert done.wait(5)
    assert "task" in caplog.text and "failed in the worker pool" in caplog.text


def test_close_runs_the_queued_work_joins_and_then_refuses():
    p = WorkerPool(1, "closing")
    ran = []
    for i in range(3):
        p.submit(ran.append, i)
    assert p.close(5.0) == []
    assert ran == [0, 1, 2] and p.num_threads == 0
    with pytest.raises(ClosedError, match="shut down"):
        p.submit(ran.append, 9)
    assert p.hand_off(ran.append, 9) is False


def test_close_reports_a_thread_that_does_not_stop_in_time():
    p = WorkerPool(1, "stuck")
    release = threading.Event()
    p.submit(release.wait, 10)
    wait_for("the task to start", lambda: p._idle == 0 and p.num_pending == 0, 5)
    start = time.monotonic()
    assert p.close(0.3) == ["stuck-0"]
    assert time.monotonic() - start < 2
    release.set()


def test_a_size_below_one_is_refused():
    with pytest.raises(ValueError, match="num_worker_threads must be at least 1, got 0"):
        WorkerPool(0, "none")


def test_extra_threads_leave_when_idle(monkeypatch):
    monkeypatch.setattr(pool_module, "IDLE_EXIT", 0.2)
    p = WorkerPool(1, "shrinking")
    release = threading.Event()

    def block():
        with current_pool().blocking():
            release.wait(5)

    p.submit(block)
    wait_for("the thread to block", lambda: p._blocked == 1, 5)
    p.submit(release.set)
    assert release.wait(5)
    assert p.num_threads == 2
    wait_for("the extra thread to leave", lambda: p.num_threads == 1, 5)
    assert p.close(5.0) == []
