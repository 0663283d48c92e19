"""The bench's two-host mode, ``python -m benchmarks --hosts 2``, run end to end.

It needs root and the ``ip`` tool (it makes two network namespaces joined by a veth pair);
without them these tests skip. Every byte they send goes to the addresses of the
namespaces the bench makes for them. Each test checks that the namespaces are gone when
the bench is: after a clean run, after a worker is killed in the middle of one, and after
the bench itself is interrupted (Ctrl-C) or terminated, in a workload (its parent ignoring
SIGINT or not), while it makes its namespaces, and with a second signal while it removes
them.

The interrupt tests signal at a point they wait for, never at a guess: a caller whose
record says it is in its workload, of more calls than any test waits for, or an ``ip``
(a stand-in that runs the real one) that tells when it got to a step and holds there.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
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

# A workload that outlasts any test: a signal sent once it has begun lands in it.
LONG = ["--latency-calls", "1000000"]
STOP_S = 30.0
"""How long an interrupted bench may take to end (it takes well under a second)."""
EXIT = {signal.SIGINT: -signal.SIGINT, signal.SIGTERM: 128 + signal.SIGTERM}
"""The exit status of a bench ended by each signal: Python dies of an unhandled Ctrl-C;
SIGTERM is ``SystemExit(143)``."""

_NAMES = re.compile(r"namespaces (\S+) \((\S+), (\S+)\) and (\S+) \((\S+), (\S+)\)")


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Bench:
    """``python -m benchmarks ARGS`` in the background, its stderr read as it comes. With
    ``ignore_sigint`` it starts as a background job of a non-interactive shell does, SIGINT
    ignored."""

    def __init__(self, *args: str, ignore_sigint: bool = False,
                 env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks", *args],
                                     cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env,
                                     preexec_fn=_ignore_sigint if ignore_sigint else None)
        self.lines: list[str] = []
        self.stdout = ""
        self._out: list[str] = []
        # One reader per pipe, and no other: stderr's lines are all in ``lines``.
        self._readers = [threading.Thread(target=self._read, args=(pipe, into), daemon=True)
                         for pipe, into in ((self.proc.stdout, self._out),
                                            (self.proc.stderr, self.lines))]
        for reader in self._readers:
            reader.start()
        self._err = self._readers[1]

    @staticmethod
    def _read(pipe: Any, into: list[str]) -> None:
        for line in pipe:
            into.append(line)

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
        self.proc.wait(timeout=timeout)
        for reader in self._readers:
            reader.join(timeout=10)
        self.stdout = "".join(self._out)
        return self.proc.returncode

    def in_workload(self, logs: Path, system: str, timeout: float = 120.0) -> None:
        """Wait until the caller of ``system`` is in its workload: its record (under the
        bench's ``--keep-logs`` folder ``logs``, rewritten whole at each phase) says so."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for path in logs.glob(f"twohost-threads-*/{system}-*/rank0.result.json"):
                with contextlib.suppress(OSError, ValueError):
                    if json.loads(path.read_text(encoding="utf-8"))["phase"] == "workload":
                        return
            assert self.proc.poll() is None, (
                f"the bench ended ({self.proc.returncode}) before {system}'s workload:\n"
                f"{''.join(self.lines)[-4000:]}")
            time.sleep(0.05)
        raise AssertionError(f"{system}'s caller never began its workload")

    def interrupt(self, sig: int) -> int:
        """Send ``sig``; return the exit status, which must come within ``STOP_S``."""
        self.proc.send_signal(sig)
        return self.ends()

    def ends(self) -> int:
        """The exit status of a bench that was told to stop, within ``STOP_S``."""
        try:
            return self.finish(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the bench did not end {STOP_S:g} s after it was told to:"
                                 f"\n{''.join(self.lines)[-4000:]}") from None

    def report(self) -> dict[str, Any]:
        assert self.stdout, f"no report; stderr:\n{''.join(self.lines)[-4000:]}"
        return json.loads(self.stdout)


@pytest.fixture
def sweep():
    """Ends the benches a test registers and removes what they left, whatever the test's
    outcome: a failing test must not leave the next one a machine with stray namespaces."""
    benches: list[Bench] = []
    yield benches.append
    for bench in benches:
        if bench.proc.poll() is None:
            bench.proc.kill()
            bench.proc.wait()
        for name in list_namespaces():
            if name.startswith(f"trpc-{bench.proc.pid}-"):
                for pid in pids_in(name):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                subprocess.run(["ip", "netns", "del", name], check=False)


def ip_stand_in(directory: Path, step: str, hold: bool) -> dict[str, str]:
    """The environment of a bench whose ``ip`` runs the real one, but at ``ip netns
    STEP`` (``add`` or ``del``) it first creates the file ``directory/STEP`` so the test
    knows it got there. With ``hold``, the real ``ip`` runs after the test creates
    ``directory/go``; without, the real one runs first and then the stand-in sleeps, as an
    ``ip`` that is slow to return."""
    real = shutil.which("ip")
    bindir = directory / "bin"
    bindir.mkdir()
    marker, go = directory / step, directory / "go"
    if hold:
        act = (f'touch {marker}\n'
               f'for _ in $(seq 600); do [ -e {go} ] && break; sleep 0.05; done\n'
               f'exec {real} "$@"')
    else:
        act = f'{real} "$@"\ntouch {marker}\nexec sleep 60'
    script = bindir / "ip"
    script.write_text(f'#!/bin/bash\nif [ "$1" = netns ] && [ "$2" = {step} ]; then\n'
                      f'{act}\nfi\nexec {real} "$@"\n', encoding="ascii")
    script.chmod(0o755)
    return {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}


def wait_for_file(path: Path, bench: Bench, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert bench.proc.poll() is None, (
            f"the bench ended ({bench.proc.returncode}) before {path.name}:\n"
            f"{''.join(bench.lines)[-4000:]}")
        assert time.monotonic() < deadline, f"{path.name} never came"
        time.sleep(0.02)


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
def test_an_interrupted_bench_leaves_no_namespace_or_worker(sig: int, tmp_path: Path,
                                                             sweep) -> None:
    bench = Bench(*REDUCED, *LONG, "--systems", "torch", "--keep-logs", str(tmp_path))
    sweep(bench)
    a, b, dev_a, dev_b = bench.namespaces()
    bench.in_workload(tmp_path, "torch")
    workers = wait_for_pids(a) + wait_for_pids(b)
    assert bench.interrupt(sig) == EXIT[sig], "".join(bench.lines)[-4000:]
    assert_gone(a, b, dev_a, dev_b)
    assert_dead(workers)


@needs_netns
@pytest.mark.parametrize("system", ["tcp-raw", "torchrpc-tcp"])
def test_ctrl_c_ends_a_long_workload_even_if_the_parent_ignored_sigint(
        system: str, tmp_path: Path, sweep) -> None:
    # A background job of a non-interactive shell starts with SIGINT ignored, and Python
    # then installs no handler of its own: the bench would run on past a Ctrl-C.
    bench = Bench(*REDUCED, *LONG, "--systems", system, "--keep-logs", str(tmp_path),
                  ignore_sigint=True)
    sweep(bench)
    a, b, dev_a, dev_b = bench.namespaces()
    bench.in_workload(tmp_path, system)
    workers = wait_for_pids(a) + wait_for_pids(b)
    assert bench.interrupt(signal.SIGINT) == EXIT[signal.SIGINT], (
        "".join(bench.lines)[-4000:])
    assert "KeyboardInterrupt" in "".join(bench.lines)
    assert_gone(a, b, dev_a, dev_b)
    assert_dead(workers)


@needs_netns
def test_ctrl_c_while_a_namespace_is_being_made_removes_it(tmp_path: Path, sweep) -> None:
    # The interrupt comes after ``ip netns add`` made the first namespace and before it
    # returned: the bench must remove a namespace it has no answer about.
    env = ip_stand_in(tmp_path, "add", hold=False)
    bench = Bench(*REDUCED, "--systems", "tcp-raw", env=env)
    sweep(bench)
    wait_for_file(tmp_path / "add", bench)
    a, b = (f"trpc-{bench.proc.pid}-0-{side}" for side in "ab")
    assert a in list_namespaces()
    assert bench.interrupt(signal.SIGINT) == EXIT[signal.SIGINT], (
        "".join(bench.lines)[-4000:])
    assert_gone(a, b, f"tv{bench.proc.pid % 10**7}x0a", f"tv{bench.proc.pid % 10**7}x0b")


@needs_netns
def test_a_second_signal_does_not_cut_the_cleanup_short(tmp_path: Path, sweep) -> None:
    # Ctrl-C in the workload, then SIGTERM while the first namespace is being deleted:
    # the bench still deletes both and leaves no worker.
    env = ip_stand_in(tmp_path, "del", hold=True)
    bench = Bench(*REDUCED, *LONG, "--systems", "tcp-raw", "--keep-logs", str(tmp_path),
                  env=env)
    sweep(bench)
    a, b, dev_a, dev_b = bench.namespaces()
    bench.in_workload(tmp_path, "tcp-raw")
    workers = wait_for_pids(a) + wait_for_pids(b)
    bench.proc.send_signal(signal.SIGINT)
    wait_for_file(tmp_path / "del", bench)
    bench.proc.send_signal(signal.SIGTERM)
    (tmp_path / "go").touch()
    assert bench.ends() != 0
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
