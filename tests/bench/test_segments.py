"""``python -m benchmarks.segments``: two real workers, one table of segments."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

REPO_ROOT = Path(__file__).resolve().parents[2]


def _report(call: str) -> Tuple[str, int, float]:
    """The report of 300 ``call`` calls; how many came in the usual order, their total."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.segments", "--call", call,
                           "--calls", "300"], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    head = re.search(rf"{call} call, torch threads 1: (\d+) of (\d+) calls in the usual order "
                     r"\(of 300\); median total ([\d.]+) us", proc.stdout)
    assert head, proc.stdout
    assert int(head[2]) == 300 and float(head[3]) > 0, proc.stdout
    return proc.stdout, int(head[1]), float(head[3])


def _timeline(report: str) -> List[Tuple[str, float]]:
    return [(p, float(t)) for p, t in
            re.findall(r"^\| (\w+ \S+) \| ([\d.]+) \|$", report, re.M)]


def test_segments_cover_a_call_from_the_callers_call_to_its_return() -> None:
    report, usual, total = _report("add")
    assert usual >= 150, report
    rows = re.findall(r"^\| (\w+ \S+) \| (\w+ \S+) \| ([\d.]+) \|$", report, re.M)
    # Consecutive points: the first starts at the call, the last ends at its return, and
    # each segment starts where the one before ended.
    assert rows[0][0] == "caller CALL" and rows[-1][1] == "caller DONE", rows
    assert all(a[1] == b[0] for a, b in zip(rows, rows[1:])), rows
    points = {p for row in rows for p in row[:2]}
    for point in ("caller encode>", "caller send<", "callee frame", "callee run>",
                  "callee run<", "callee send<", "caller decode<"):
        assert point in points, (point, rows)
    # The segments add up to the total of the same calls, within the medians' slack.
    assert 0.5 * total <= sum(float(r[2]) for r in rows) <= 2 * total, (total, rows)
    # The timeline: the same points in the same order, from 0 at the call on.
    timeline = _timeline(report)
    assert [p for p, _ in timeline] == [rows[0][0]] + [r[1] for r in rows], timeline
    assert timeline[0][1] == 0 and timeline[-1][1] > 0, timeline


def test_the_timeline_of_remote_and_to_here_shows_both_requests() -> None:
    report, usual, _ = _report("remote")
    assert usual >= 10, report  # the two requests overlap in more than one order
    points = [p for p, _ in _timeline(report)]
    assert points[0] == "caller CALL" and points[-1] == "caller DONE", points
    # remote() and to_here() each send a request, and the callee serves and answers both.
    for point in ("caller send<", "callee serve>", "callee send<", "caller reply<"):
        assert points.count(point) == 2, (point, points)
