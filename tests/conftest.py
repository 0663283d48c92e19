"""Fixtures shared by the test modules (the helpers they use are in ``tests/support/``).

``group``: the module's group of worker processes, started once for the module. A module
declares it with a module-level mark whose arguments are those of
:func:`tests.support.group.running_group`::

    pytestmark = pytest.mark.group(3, threads=4, timeout=30.0)

The group forms (this process is rank 0, named ``worker0``) before the module's first
test and shuts down gracefully after its last, where every worker must exit with 0. A
test that needs the :class:`~tests.support.group.Group` (its processes, to stop or kill
one) takes ``group`` as an argument. A module whose group needs more (work before the
first test, checks after shutdown) defines its own ``group`` fixture instead.
"""

from __future__ import annotations

import signal
from typing import Iterator

import pytest

from tests.support.group import Group, running_group


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "group(world_size, **kwargs): the module's worker group, started once "
                   "for the module (tests/conftest.py)")
    # Tests send SIGINT to the processes they start, as a user's Ctrl-C. A shell without
    # job control starts a command in the background with SIGINT ignored, which every
    # process it starts inherits (Python then installs no handler, and a Ctrl-C does
    # nothing): give this process, and so its children, what a command in the foreground
    # has.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="module")
def group(request: pytest.FixtureRequest) -> Iterator[Group]:
    mark = request.node.get_closest_marker("group")
    if mark is None:
        pytest.fail(f"{request.node.name} uses the group fixture without declaring its group "
                    f"(pytestmark = pytest.mark.group(world_size, ...))", pytrace=False)
    with running_group(*mark.args, **mark.kwargs) as g:
        yield g


@pytest.fixture(scope="module", autouse=True)
def _module_group(request: pytest.FixtureRequest) -> None:
    """Start the declared group before the module's first test, whether or not it asks."""
    if request.node.get_closest_marker("group") is not None:
        request.getfixturevalue("group")
