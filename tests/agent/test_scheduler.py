"""The agent's timer, one round at a time: no thread, no agent, a pool that records what it
is given."""

from __future__ import annotations

import logging
from typing import Any, List

import pytest

from torchrpc._agent.scheduler import LENT_TICK, TICK, Scheduler
from torchrpc._threads import Guard
from torchrpc.errors import ClosedError


class Pool:
    """Records the callbacks submitted; ``closed``: refuses them, as a shut-down pool does."""

    def __init__(self) -> None:
        self.submitted: List[Any] = []
        self.closed = False

    def submit(self, fn: Any, *args: Any) -> None:
        if self.closed:
            raise ClosedError("the worker pool is shut down")
        self.submitted.append((fn, args))


@pytest.fixture
def scheduler():
    return Scheduler(Pool())


def test_a_quiet_round_sleeps_a_whole_tick(scheduler):
    assert scheduler._round(Guard("test")) == pytest.approx(TICK)
    assert scheduler.slow


def test_hooks_run_in_order_and_see_when_the_round_started(scheduler):
    seen = []
    scheduler.add_tick_hook(lambda: seen.append(("a", scheduler.now)))
    scheduler.add_tick_hook(lambda: seen.append(("b", scheduler.now)))
    scheduler._round(Guard("test"))
    assert [name for name, _ in seen] == ["a", "b"]
    assert seen[0][1] == seen[1][1] == scheduler.now


def test_work_pending_makes_it_tick_fast(scheduler):
    queued = [True]
    scheduler.add_tick_hook(lambda: None, pending=lambda: queued[0])
    assert scheduler._round(Guard("test")) == pytest.approx(LENT_TICK)
    assert not scheduler.slow
    queued[0] = False
    assert scheduler._round(Guard("test")) == pytest.approx(TICK)
    assert scheduler.slow
    scheduler.wake()
    assert not scheduler.slow


def test_a_hook_may_ask_for_the_next_round_sooner(scheduler):
    scheduler.add_tick_hook(lambda: scheduler.now + 0.03)
    scheduler.add_tick_hook(lambda: None)
    assert scheduler._round(Guard("test")) == pytest.approx(0.03)


def test_callbacks_run_on_the_pool_when_due(scheduler):
    scheduler.call_later(0.0, print, "now")
    scheduler.call_later(0.05, print, "later")
    wait = scheduler._round(Guard("test"))
    assert scheduler._pool.submitted == [(print, ("now",))]
    assert 0 < wait <= 0.05


def test_a_hook_that_raises_spares_the_others(scheduler, caplog):
    ran = []

    def bad() -> None:
        raise ValueError("one bad hook")
    scheduler.add_tick_hook(bad)
    scheduler.add_tick_hook(lambda: ran.append(1))
    scheduler._pool.closed = True
    scheduler.call_later(0.0, print)  # refused by the closed pool: dropped quietly
    guard = Guard("the timer thread of test")
    with caplog.at_level(logging.ERROR):
        with guard:
            scheduler._round(guard)
    assert ran == [1]
    assert "the timer thread of test raised" in caplog.text and "one bad hook" in caplog.text


def test_stop_drops_the_callbacks_not_yet_due(scheduler):
    scheduler.call_later(10.0, print)
    scheduler.stop()
    scheduler._round(Guard("test"))
    assert scheduler._pool.submitted == [] and scheduler._later == []
