"""Dynamic membership: workers join a running group and leave it (init_rpc world_size=None).

A member that is SIGKILLed, or stopped until it is declared lost, is removed from the
group by the survivors: a new process joins under its name and rank, and a stopped one
that is continued learns that it was removed and leaves the new one alone.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from typing import Any

import pytest

import torchrpc.rpc as rpc
from torchrpc._agent.current import current_agent
from torchrpc.errors import WorkerLeftError

from ..support import helpers
from ..support.handshake import authenticate
from ..support.group import free_port, start_module, wait_for, worker_env

PORT = free_port()
STOP = tempfile.mkdtemp(prefix="torchrpc-elastic-")


def spawn(name: str, rank: int, stop: str, scenario: str = "elastic_member"
          ) -> Any:
    env = worker_env(PORT, 0, {"SCENARIO_NAME": name, "SCENARIO_STOPFILE": os.path.join(STOP, stop)})
    env.pop("WORLD_SIZE")
    return start_module("tests.support.scenarios", [scenario, str(rank), "0", "0"], env,
                        capture=True)


def names_everywhere(expected, who=("w0", "w1"), timeout=60.0):
    seen: dict = {}

    def converged() -> bool:
        seen["w0"] = sorted(w.name for w in rpc.get_worker_infos())
        for name in who[1:]:
            if name in seen["w0"]:
                seen[name] = sorted(w.name for w in rpc.rpc_sync(name, helpers.worker_infos))
            else:
                seen[name] = "not joined yet"
        return all(v == sorted(expected) for v in seen.values())
    wait_for(f"membership converges to {expected}", converged, timeout, state=lambda: seen)


@pytest.fixture(scope="module", autouse=True)
def group():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(PORT))
    os.environ.pop("WORLD_SIZE", None)
    rpc.init_rpc("w0", rank=0, world_size=None,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(num_worker_threads=4))
    stable = spawn("w1", 1, "stop-w1")
    try:
        yield stable
    finally:
        open(os.path.join(STOP, "stop-w1"), "w").close()
        out, _ = stable.communicate(timeout=120)
        rpc.shutdown()
        assert stable.returncode == 0 and "OK elastic w1" in out, out


def test_grow_to_five_and_shrink_back_to_two(group):
    names_everywhere(["w0", "w1"], timeout=120)
    joiners = [spawn(f"w{r}", r, "stop-joiners") for r in (2, 3, 4)]
    try:
        names_everywhere(["w0", "w1", "w2", "w3", "w4"], timeout=120)
        assert rpc.rpc_sync("w4", helpers.whoami) == "w4"
        assert rpc.rpc_sync("w1", helpers.nested_call, args=("w3", 1)) == "w1>w3"
        open(os.path.join(STOP, "stop-joiners"), "w").close()
        for p in joiners:
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0 and "OK elastic" in out, out
        names_everywhere(["w0", "w1"])
        with pytest.raises(WorkerLeftError, match="left"):
            rpc.rpc_sync("w3", helpers.whoami)
        assert rpc.rpc_sync("w1", helpers.whoami) == "w1"  # the stable member kept working
    finally:
        for p in joiners:
            if p.poll() is None:
                p.kill()


def test_joining_with_a_name_in_use_is_refused(group):
    p = spawn("w1", 7, "never")
    out, _ = p.communicate(timeout=120)
    assert "ERR" in out and "'w1' is already in use" in out, out
    assert rpc.rpc_sync("w1", helpers.whoami) == "w1"
    assert sorted(w.name for w in rpc.get_worker_infos()) == ["w0", "w1"]


HB_TIMEOUT = 5.0  # the default heartbeat_timeout of every member here


def _joined(name: str, rank: int, proc: Any) -> None:
    """``name`` (rank ``rank``) is served by ``proc`` for w0 and w1, and in both tables."""
    names_everywhere(["w0", "w1", name], timeout=120)
    assert rpc.rpc_sync(name, helpers.pid, timeout=30) == proc.pid
    assert rpc.rpc_sync("w1", helpers.nested_call, args=(name, 1), timeout=30) == f"w1>{name}"
    for infos in (rpc.get_worker_infos(), rpc.rpc_sync("w1", helpers.worker_infos)):
        assert [(w.name, w.id) for w in infos if w.name == name] == [(name, rank)]


def _removed(name: str, since: float) -> float:
    """Wait until w0 and w1 no longer list ``name``; seconds since ``since``."""
    names_everywhere(["w0", "w1"], timeout=HB_TIMEOUT + 30)
    took = time.monotonic() - since
    with pytest.raises(WorkerLeftError, match=f"{name} .*was lost and removed from the group"):
        rpc.rpc_sync(name, helpers.whoami)
    return took


def _stop_member(name: str, proc: Any) -> None:
    """Let member ``name`` (``proc``, a rejoin_member worker) leave gracefully; the group is
    w0 and w1 again."""
    open(os.path.join(STOP, f"stop-{name}"), "w").close()
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and f"OK rejoin member {name}" in out, out
    names_everywhere(["w0", "w1"])


def test_a_killed_member_is_removed_and_its_name_and_rank_taken_again(group):
    first = spawn("w5", 5, "stop-w5", "rejoin_member")
    second = None
    try:
        _joined("w5", 5, first)
        first.kill()
        first.wait(30)
        took = _removed("w5", time.monotonic())
        print(f"killed member removed after {took:.2f} s", file=sys.stderr)
        second = spawn("w5", 5, "stop-w5", "rejoin_member")
        _joined("w5", 5, second)
        _stop_member("w5", second)
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()


def test_a_stopped_member_removed_as_lost_finds_out_when_continued(group):
    stale = spawn("w6", 6, "stop-w6", "rejoin_member")
    fresh = None
    try:
        _joined("w6", 6, stale)
        stale_incarnation = int(stale.stdout.readline().split()[1])  # "JOINED <n>"
        stale.send_signal(signal.SIGSTOP)
        took = _removed("w6", time.monotonic())
        print(f"stopped member removed after {took:.2f} s", file=sys.stderr)
        assert took < HB_TIMEOUT + 2.0, took
        fresh = spawn("w6", 6, "stop-w6", "rejoin_member")
        _joined("w6", 6, fresh)
        # A connection of the removed process is refused once it proved it holds the
        # secret: this handshake is the one it would make.
        agent = current_agent()
        with pytest.raises(ConnectionError, match="closed after 0 of 1 bytes"):
            authenticate(*agent._transport.address, agent._transport._secret, 6, 0,
                         incarnation=stale_incarnation,
                         server_incarnation=agent.registry.incarnation)
        stale.send_signal(signal.SIGCONT)  # it comes back believing it is w6
        out, _ = stale.communicate(timeout=60)
        assert "REMOVED" in out and "declared lost by the group and removed" in out, out
        # The group still knows only the new w6, which still works.
        _joined("w6", 6, fresh)
        _stop_member("w6", fresh)
    finally:
        for p in (stale, fresh):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()


def test_a_survivor_that_never_talked_to_a_lost_member_learns_its_removal_from_the_log(group):
    # w1 has no connection to w7, so it cannot see w7 die: only w0 does, and removes it;
    # w1 learns of the removal from the membership log alone.
    first = spawn("w7", 7, "stop-w7", "rejoin_member")
    second = None
    try:
        names_everywhere(["w0", "w1", "w7"], timeout=120)
        assert rpc.rpc_sync("w7", helpers.pid, timeout=30) == first.pid
        assert rpc.rpc_sync("w1", helpers.view_of, args=(7,)) == {
            "connections": 0, "lost_connection": False, "removed": None}
        first.kill()
        first.wait(30)
        _removed("w7", time.monotonic())  # gone from w0's and w1's get_worker_infos()
        view = rpc.rpc_sync("w1", helpers.view_of, args=(7,))
        assert view["connections"] == 0 and not view["lost_connection"], view
        assert view["removed"] and "was lost" in view["removed"], view
        outcome = rpc.rpc_sync("w1", helpers.call_outcome, args=("w7",))
        assert outcome.startswith("WorkerLeftError: worker w7 (rank 7) was lost and removed "
                                  "from the group"), outcome
        # A successor under the same name and rank is a member for w1 too, and answers it.
        second = spawn("w7", 7, "stop-w7", "rejoin_member")
        _joined("w7", 7, second)
        assert rpc.rpc_sync("w1", helpers.call_outcome, args=("w7",)) == "w7"
        _stop_member("w7", second)
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
