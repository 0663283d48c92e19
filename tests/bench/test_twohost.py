"""The bench's two-host mode, ``python -m benchmarks --hosts 2``, run end to end.

It needs root and the ``ip`` tool (it makes two network namespaces joined by a veth pair);
without them these tests skip. Every byte they send goes to the addresses of the
namespaces the bench makes for them. Each test checks that the namespaces are gone when
the bench is: after a clean run, after a worker is killed in the middle of one, and after
the bench itself is interrupted (Ctrl-C) or terminated.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed

from benchmarks import cli, twohost
from benchmarks.netns import HostPair, list_namespaces, unavailable

REPO_ROOT = Path(__file__).resolve().parents[2]

needs_netns = pytest.mark.skipif(unavailable() is not None,
                                 reason=f"two-host mode unavailable: {unavailable()}")
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="this torch build has no torch.distributed.rpc")

# Tiny sizes, one round, few calls: the shape of the report, not the speed.
REDUCED = ["--hosts", "2", "--quick", "--echo-sizes-mb", "0.0625,0.25", "--echo-iters", "1",
           "--echo-warmup", "0", "--latency-calls", "20", "--latency-warmup", "2",
           "--threads", "1", "--rounds", "1", "--min-available-gib", "0", "--json"]

_NAMES = re.compile(r"namespaces (\S+) \((\S+), (\S+)\) and (\S+) \((\S+), (\S+)\)")


class Bench:
    """``python -m benchmarks ARGS`` in the background, its stderr read as it comes."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks", *args],
                                     cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.stdout = ""
        self._err = threading.Thread(target=self._read_err, daemon=True)
        self._err.start()

    def _read_err(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    def namespaces(self, timeout: float = 120.0) -> tuple[str, str, str, str]:
        """The names of the two namespaces and of their veth devices, once the bench has
        made them (skips the test if the bench said it cannot)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if "two-host mode skipped" in line:
                    self.finish()
                    pytest.skip(line.strip())
                match = _NAMES.search(line)
                if match:
                    return match[1], match[4], match[3], match[6]
            if self.proc.poll() is not None and not self._err.is_alive():
                break
            time.sleep(0.05)
        self.proc.kill()
        raise AssertionError(f"the bench never named its namespaces:\n{''.join(self.lines)}")

    def finish(self, timeout: float = 400.0) -> int:
        """Wait for the bench to exit; return its exit status."""
        self.stdout, _ = self.proc.communicate(timeout=timeout)
        self._err.join(timeout=10)
        return self.proc.returncode

    def report(self) -> dict[str, Any]:
        assert self.stdout, f"no report; stderr:\n{''.join(self.lines)[-4000:]}"
        return json.loads(self.stdout)


def pids_in(namespace: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True,
                         text=True, check=False).stdout
    return [int(word) for word in out.split()]


def wait_for_pids(namespace: str, timeout: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = pids_in(namespace)
        if pids:
            return pids
        time.sleep(0.02)
    raise AssertionError(f"no process appeared in {namespace}")


def assert_gone(a: str, b: str, dev_a: str, dev_b: str) -> None:
    left = list_namespaces() & {a, b}
    assert not left, f"namespaces left behind: {left}"
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True,
                           check=True).stdout
    assert dev_a not in links and dev_b not in links, "veth devices left behind"


def assert_dead(pids: list[int]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@needs_netns
def test_reduced_run_reports_all_four_systems_and_cleans_up() -> None:
    bench = Bench(*REDUCED)
    a, b, dev_a, dev_b = bench.namespaces()
    assert a in list_namespaces() and b in list_namespaces()
    assert bench.finish() == 0, "".join(bench.lines)[-4000:]
    assert_gone(a, b, dev_a, dev_b)
    report = bench.report()
    assert list(report["systems"]) == list(twohost.SYSTEMS)
    assert report["baseline"] == "torch" and report["hosts"]["count"] == 2
    expected = {"noop_p50_us", "noop_p99_us", "echo_0.0625MB_GBps", "echo_0.25MB_GBps",
                "echo_cpu_caller_s", "echo_cpu_callee_s", "peak_rss_caller_MB",
                "peak_rss_callee_MB", "rss_growth_caller_MB",
                "rss_growth_callee_MB"}
    assert set(report["metrics"]) == expected
    for name, entry in report["metrics"].items():
        for system in twohost.SYSTEMS:
            value = entry["values"][system]
            assert isinstance(value, float), (
                f"{system} {name}: {value!r} ({entry['errors'].get(system)})")
            assert value > 0 or name.startswith("rss_growth"), f"{system} {name}: {value}"
        assert set(entry["ratios_vs_raw"]) == {"torch", "torchrpc-tcp", "torchrpc-tls"}
        assert entry["ratios_vs_raw"]["torch"] == pytest.approx(
            entry["values"]["torch"] / entry["values"]["tcp-raw"])


@needs_netns
def test_a_worker_killed_mid_run_is_an_error_cell_and_the_namespaces_go() -> None:
    bench = Bench(*REDUCED, "--systems", "torchrpc-tcp")
    a, b, dev_a, dev_b = bench.namespaces()
    callee = wait_for_pids(b)
    for pid in callee:
        os.kill(pid, signal.SIGKILL)
    assert bench.finish() == 0, "".join(bench.lines)[-4000:]
    assert_gone(a, b, dev_a, dev_b)
    assert_dead(callee)
    report = bench.report()
    errors = report["metrics"]["noop_p50_us"]["errors"]
    assert report["metrics"]["noop_p50_us"]["values"]["torchrpc-tcp"] is None
    assert errors["torchrpc-tcp"], errors
    (session,) = report["sessions"]
    assert session["system"] == "torchrpc-tcp" and session["error"]
    assert session["returncodes"][1] == -signal.SIGKILL, session


@needs_netns
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_interrupted_bench_leaves_no_namespace_or_worker(sig: int) -> None:
    bench = Bench(*REDUCED, "--systems", "torch")
    a, b, dev_a, dev_b = bench.namespaces()
    workers = wait_for_pids(a) + wait_for_pids(b)
    bench.proc.send_signal(sig)
    assert bench.finish(timeout=60) != 0
    assert_gone(a, b, dev_a, dev_b)
    assert_dead(workers)


@needs_netns
def test_a_failed_setup_removes_what_it_made() -> None:
    pair = HostPair()
    pair.dev_a = "x" * 20  # longer than an interface name may be: the veth pair fails
    with pytest.raises(RuntimeError, match="could not make two network namespaces"):
        pair.create()
    assert not list_namespaces() & {pair.a, pair.b}
    pair.destroy()  # again: nothing left to do, no error


@pytest.mark.parametrize("strict", [False, True])
def test_without_root_the_mode_skips_with_a_message(monkeypatch, capsys, strict: bool) -> None:
    can_list = unavailable() is None
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    status = cli.main(["--hosts", "2", "--quick"] + (["--strict"] if strict else []))
    assert status == (1 if strict else 0)
    out = capsys.readouterr()
    assert "two-host mode skipped: needs root" in out.err and out.out == ""
    if can_list:  # and it made nothing
        assert not [ns for ns in list_namespaces() if ns.startswith(f"trpc-{os.getpid()}-")]
