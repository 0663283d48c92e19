"""Run torch's RPC test suites against torchrpc and count what passes.

    python -m tests.conformance.run [--sample | --full | --all | --suites A,B] [-k EXPR]
                                    [--target torchrpc|torch] [--report FILE] [--list]
                                    [--shard I/N]

Each test runs as torch runs it: ``MultiProcessTestCase`` spawns a fresh group of
worker processes for it. The last line is ``conformance: P passed, F failed, S skipped
of N``; the exit status is 1 when a test failed. ``--suites`` takes suite names and
the groups of torch's ``rpc_utils``: ``generic``, ``tensorpipe``, ``faulty`` and ``cuda``
(``GENERIC_CUDA_TESTS`` and ``TENSORPIPE_CUDA_TESTS``, reported skipped without a GPU).
``--report`` writes every failure's output (the workers' tracebacks) to a file.
``--shard I/N`` runs every N-th selected test from the I-th on, so that N runners started
side by side share one selection (each test spawns its own group on its own ports).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
import time
import unittest
from typing import Dict, List, Tuple

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SAMPLE_FILE = os.path.join(HERE, "sample.txt")
# A hung worker group is killed after this many seconds (torch's default is 300).
os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "120")


def _load_sample() -> List[str]:
    with open(SAMPLE_FILE) as f:
        return [line.split("#", 1)[0].strip() for line in f
                if line.split("#", 1)[0].strip()]


def _select(suites, args) -> List[Tuple[str, str]]:
    """The (suite, test name) pairs to run, in a stable order."""
    from . import suites as S
    loader = unittest.TestLoader()
    if args.sample:
        wanted = _load_sample()
        pairs = [tuple(w.split(".", 1)) for w in wanted]
        for suite, name in pairs:
            if suite not in S.SUITES:
                raise SystemExit(f"sample.txt names an unknown suite {suite!r}")
    else:
        wanted = (args.suites.split(",") if args.suites else
                  ["generic", "tensorpipe", "faulty", "cuda"] if args.all else ["generic"])
        try:
            names = S.expand([w.strip() for w in wanted if w.strip()])
        except ValueError as exc:
            raise SystemExit(str(exc)) from exc
        pairs = [(suite, test) for suite in names
                 for test in loader.getTestCaseNames(S.test_class(suite))]
    if args.k:
        alternatives = args.k.split(",")
        pairs = [p for p in pairs if any(k in f"{p[0]}.{p[1]}" for k in alternatives)]
    if args.shard:
        index, count = args.shard
        pairs = pairs[index - 1::count]
    return pairs


def _shard(text: str) -> Tuple[int, int]:
    """``I/N`` as a pair, 1 <= I <= N."""
    index, _, count = text.partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        i = n = 0
    if not 1 <= i <= n:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected I/N with 1 <= I <= N, for example 2/4")
    return i, n


class _Result(unittest.TextTestResult):
    def __init__(self, stream, descriptions, verbosity):
        super().__init__(stream, descriptions, verbosity)
        self.outcome = None

    def addSuccess(self, test):
        super().addSuccess(test)
        self.outcome = "pass"

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self.outcome = "fail"

    def addError(self, test, err):
        super().addError(test, err)
        self.outcome = "fail"

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self.outcome = "skip"

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self.outcome = "pass"

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self.outcome = "fail"


@contextlib.contextmanager
def _redirected(log):
    """Point this process's stdout and stderr (and so its children's) at ``log``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--sample", action="store_true", help="the fixed sample of sample.txt")
    mode.add_argument("--full", action="store_true", help="every generic suite (the default)")
    mode.add_argument("--all", action="store_true",
                      help="every group: generic, tensorpipe, faulty and cuda")
    mode.add_argument("--suites", help="comma-separated suite or group names (groups: generic, "
                      "tensorpipe, faulty, cuda; the cuda suites are skipped without a GPU)")
    parser.add_argument("-k", help="run only tests whose Suite.test_name contains this (or one of these, "
                        "comma-separated)")
    parser.add_argument("--target", choices=("torchrpc", "torch"), default="torchrpc",
                        help="run on torchrpc (default) or on torch itself (the mirror)")
    parser.add_argument("--report", help="write the output of failed tests to this file")
    parser.add_argument("--list", action="store_true", help="list the selected tests and exit")
    parser.add_argument("--shard", type=_shard, metavar="I/N",
                        help="run only every N-th selected test, from the I-th on (1-based)")
    args = parser.parse_args(argv)

    os.environ["TORCHRPC_CONFORMANCE_TARGET"] = args.target
    from . import suites as S
    pairs = _select(S.SUITES, args)
    if args.list:
        for suite, test in pairs:
            print(f"{suite}.{test}")
        return 0

    # Progress goes to the terminal; each test's own output (its workers write to the
    # same descriptors) goes to a file that the report keeps for failures.
    console = os.fdopen(os.dup(1), "w", buffering=1)
    if args.report:
        open(args.report, "w").close()
    counts: Dict[str, Dict[str, int]] = {}
    failures: List[Tuple[str, str]] = []
    start = time.monotonic()
    # Without a GPU the CUDA suites are reported skipped at once: each of their tests
    # would spawn its workers only for torch's own GPU check to skip it.
    no_gpu = not torch.cuda.is_available()
    for i, (suite, test) in enumerate(pairs, 1):
        if no_gpu and suite in S.CUDA_SUITES:
            counts.setdefault(suite, {"pass": 0, "fail": 0, "skip": 0})["skip"] += 1
            print(f"[{i}/{len(pairs)}] SKIP {suite}.{test} (no CUDA device)", file=console)
            continue
        case = S.test_class(suite)(test)
        out = io.StringIO()
        result = _Result(out, True, 0)
        t0 = time.monotonic()
        with tempfile.TemporaryFile("w+") as log:
            with _redirected(log):
                case.run(result)
            outcome = result.outcome or "fail"
            if outcome == "fail":
                log.seek(0)
                details = "".join(tb for _, tb in result.errors + result.failures)
                if result.unexpectedSuccesses:
                    details += "unexpected success\n"
                failures.append((f"{suite}.{test}", details + "---- output\n" + log.read()))
                if args.report:  # written as it goes, so a long run can be read meanwhile
                    with open(args.report, "a") as f:
                        f.write(f"==== {failures[-1][0]}\n{failures[-1][1]}\n")
        counts.setdefault(suite, {"pass": 0, "fail": 0, "skip": 0})[outcome] += 1
        print(f"[{i}/{len(pairs)}] {outcome.upper():4} {suite}.{test} "
              f"({time.monotonic() - t0:.1f} s)", file=console)
    total = {k: sum(c[k] for c in counts.values()) for k in ("pass", "fail", "skip")}
    sys.stdout = console
    print(f"\n{'suite':36} {'passed':>7} {'failed':>7} {'skipped':>8} {'of':>5}")
    for suite, c in counts.items():
        print(f"{suite:36} {c['pass']:7} {c['fail']:7} {c['skip']:8} {sum(c.values()):5}")
    print(f"({time.monotonic() - start:.0f} s, target {args.target})")
    print(f"conformance: {total['pass']} passed, {total['fail']} failed, {total['skip']} "
          f"skipped of {len(pairs)}")
    return 1 if total["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
