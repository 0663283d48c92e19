"""The shared ``group`` fixture of tests/conftest.py, run by an inner pytest on modules
written here: a declared group forms before the first test, serves every test of the
module and shuts down gracefully after the last; a module that asks for ``group``
without declaring one fails, saying what to add. And a Ctrl-C reaches the processes the
tests start even where pytest itself was started with SIGINT ignored."""

from __future__ import annotations

import signal

# Imported here, before the inner runs: pytester forgets the modules an inner run imported,
# and torch cannot be imported a second time in one process.
import torchrpc.rpc  # noqa: F401
from torchrpc._agent.current import handle

pytest_plugins = ["pytester"]

CONFTEST = "from tests.conftest import _module_group, group, pytest_configure  # noqa: F401\n"


def test_a_declared_group_serves_every_test_of_the_module_and_shuts_down(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_declared='''
import pytest

import torchrpc.rpc as rpc
from tests.support import helpers

pytestmark = pytest.mark.group(2, threads=2, timeout=30.0)


def test_the_group_formed_before_the_first_test_without_asking():
    assert rpc.get_worker_info().name == "worker0"
    assert rpc.rpc_sync("worker1", helpers.whoami) == "worker1"


def test_a_test_that_asks_gets_the_same_group(group):
    assert group.world_size == 2 and group.procs[1].poll() is None
    assert rpc.rpc_sync("worker1", helpers.add, args=(20, 22)) == 42
''')
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    # running_group asserted at teardown that the worker exited with 0; rpc is down here.
    assert handle.agent is None


def test_asking_for_group_without_declaring_one_fails_naming_the_mark(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_undeclared='''
def test_wants_a_group(group):
    pass
''')
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*test_undeclared.py uses the group fixture without declaring "
                                 "its group (pytestmark = pytest.mark.group(world_size, ...))*"])


def test_a_child_takes_ctrl_c_where_pytest_was_started_with_sigint_ignored(pytester):
    # As a shell without job control starts pytest in the background: SIGINT ignored,
    # and so in every process the tests start, unless the conftest gives them a handler.
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_ctrl_c='''
import signal
import subprocess
import sys

CHILD = "import time; print('ready', flush=True); time.sleep(120)"


def test_a_child_ends_at_sigint():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline() == "ready\\n"
        child.send_signal(signal.SIGINT)
        assert child.wait(timeout=60) == -signal.SIGINT  # KeyboardInterrupt, unhandled
    finally:
        child.kill()
        child.wait()
''')
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        result = pytester.runpytest("-p", "no:cacheprovider")
    finally:
        signal.signal(signal.SIGINT, previous)
    result.assert_outcomes(passed=1)
