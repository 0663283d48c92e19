"""Distributed autograd's messages and the root's credit count, with no sockets: a report
of a part lost with a worker carries no credit but its error, crosses the wire, and ends
the pass at the root; malformed credit is refused."""

from __future__ import annotations

from fractions import Fraction

import pytest

from torchrpc._dist_autograd.passes import RootPass
from torchrpc._dist_autograd.messages import DoneReport
from torchrpc._agent.remote_error import capture, rebuild_error
from torchrpc.errors import ConnectionLostError

from .test_wire import round_trip

PASS = (0, 1)


def test_a_report_of_a_lost_part_carries_no_credit_and_ends_the_pass_at_the_root():
    lost = ConnectionLostError("worker worker3 (rank 3) was lost", worker="worker3")
    report = round_trip(DoneReport(PASS, Fraction(0), capture(lost, "worker2")))
    assert report.credit == 0 and report.pass_id == PASS
    error = rebuild_error(report.error)
    assert isinstance(error, ConnectionLostError) and "worker3" in str(error)
    state = RootPass()
    state.add(Fraction(1, 2), None)
    assert not state.done
    state.add(report.credit, error)
    assert state.done and state.error is error


def test_credit_comes_back_in_parts():
    state = RootPass()
    for part in (Fraction(1, 2), Fraction(1, 4), Fraction(1, 4)):
        assert not state.done
        state.add(round_trip(DoneReport(PASS, part)).credit, None)
    assert state.done and state.error is None and state.wait(0)


@pytest.mark.parametrize("credit", [Fraction(0), Fraction(3, 2), Fraction(-1, 2), 0.5, 1])
def test_a_report_without_an_error_needs_credit_in_0_1(credit):
    with pytest.raises(ValueError, match="credit must be a Fraction in"):
        DoneReport(PASS, credit)


def test_a_report_with_an_error_still_refuses_bad_credit():
    info = capture(RuntimeError("boom"), "worker2")
    with pytest.raises(ValueError, match="credit must be a Fraction in"):
        DoneReport(PASS, Fraction(3, 2), info)
