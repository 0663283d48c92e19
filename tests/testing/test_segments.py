"""``python -m torchrpc._testing.segments``: two real workers, one table of segments."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_segments_cover_a_call_from_the_callers_call_to_its_return() -> None:
    proc = subprocess.run([sys.executable, "-m", "torchrpc._testing.segments", "--call", "add",
                           "--calls", "300"], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    head = re.search(r"add call, torch threads 1: (\d+) of (\d+) calls in the usual order "
                     r"\(of 300\); median total ([\d.]+) us", proc.stdout)
    assert head, proc.stdout
    usual, runs, total = int(head[1]), int(head[2]), float(head[3])
    assert runs == 300 and usual >= 150 and total > 0, proc.stdout
    rows = re.findall(r"^\| (\w+ \S+) \| (\w+ \S+) \| ([\d.]+) \|$", proc.stdout, re.M)
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
