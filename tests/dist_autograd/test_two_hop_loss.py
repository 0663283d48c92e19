"""A worker two hops from the root of a distributed backward pass is lost: worker0 calls
worker1, which calls a third worker in the forward pass; that worker is SIGKILLed or
SIGSTOPped before or during worker0's backward pass, or before it and worker1 has already
declared it lost. The pass fails within heartbeat_timeout + 1 s, with no RPC timeout,
naming the lost worker (which worker0 never talked to), and the contexts are released on
the survivors.

One group of six serves the module: worker0 (the root, here) and worker1 (the relay)
survive; worker2 to worker5 are lost, one per test. The RPC timeout is 0 (none): nothing
but the loss of a worker may end a pass here, so every wait has its own deadline.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from typing import Any, Callable, List, Tuple

import pytest
import torch

import torchrpc.autograd as dist_autograd
import torchrpc.rpc as rpc

from ..support import helpers
from ..support.group import Group, serving_group, wait_for as _wait_for

HB_TIMEOUT = 2.0
# The bound is heartbeat_timeout + 1 s; the shared 2-core machine gets 1 s more.
BOUND = HB_TIMEOUT + 1.0
SLACK = 1.0


@pytest.fixture(scope="module")
def group():
    # The relay serves on when a worker dies (it would leave a graceful shutdown).
    killed = {r: -signal.SIGKILL for r in range(2, 6)}
    with serving_group(6, {1: 0, **killed}, HB_TIMEOUT,
                       before_stop=_kill_all_but_the_relay) as g:
        yield g


def _kill_all_but_the_relay(g: Group) -> None:
    for r, p in g.procs.items():
        if p.poll() is None and r != 1:
            p.kill()


def _contexts(name: str) -> int:
    if name == "worker0":
        return rpc.get_debug_info()["num_autograd_contexts"]
    return rpc.rpc_sync(name, helpers.autograd_contexts, timeout=10)


def _two_hop_backward(far: str, fn: Callable[..., Any], out: List[Tuple]) -> threading.Thread:
    """In a thread: forward worker0 -> worker1 -> ``far`` (``fn`` there), note it, wait for
    the test's go (``out`` gets a third entry), then the backward pass; note how it ends."""
    go = threading.Event()

    def run() -> None:
        try:
            with dist_autograd.context() as ctx:
                x = torch.ones(4, requires_grad=True)
                y = rpc.rpc_sync("worker1", helpers.relay, args=(far, fn, x))
                assert torch.equal(y, torch.full((4,), 2.0)), y
                out.append(("forward done", time.monotonic(), None))
                go.wait(60)
                out.append(("backward", time.monotonic(), None))
                dist_autograd.backward(ctx, [y.sum()])
                out.append(("finished", time.monotonic(), None))
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            out.append(("failed", time.monotonic(), exc))
    t = threading.Thread(target=run)
    t.go = go  # type: ignore[attr-defined]
    t.start()
    return t


def _lose(group: Group, rank: int, how: signal.Signals, when: str, fn: Callable[..., Any]
          ) -> None:
    far = f"worker{rank}"
    # No context is open anywhere (the last test's releases may still be on their way).
    for n in ("worker0", "worker1"):
        _wait_for(f"{n} without autograd contexts", lambda n=n: _contexts(n) == 0, 10)
    out: List[Tuple] = []
    runner = _two_hop_backward(far, fn, out)
    _wait_for("the forward pass", lambda: out, 30)
    assert out[0][0] == "forward done", out
    if when == "after the loss":  # worker1 released its context before the pass reaches it
        group.procs[rank].send_signal(how)
        lost = time.monotonic()
        _wait_for("worker1 released the context", lambda: _contexts("worker1") == 0, BOUND + SLACK)
        runner.go.set()  # type: ignore[attr-defined]
    elif when == "before":
        group.procs[rank].send_signal(how)
        lost = time.monotonic()
        runner.go.set()  # type: ignore[attr-defined]
    else:  # during: the far worker is in its slow part of the backward pass
        starts = rpc.rpc_sync(far, helpers.slow_backward_starts, timeout=10)
        runner.go.set()  # type: ignore[attr-defined]
        _wait_for(f"{far} in its slow part of the backward pass", lambda: rpc.rpc_sync(
            far, helpers.slow_backward_starts, timeout=10) > starts, 30)
        group.procs[rank].send_signal(how)
        lost = time.monotonic()
    runner.join(BOUND + SLACK + 10)
    assert not runner.is_alive(), f"backward still waits on {far} ({how.name} {when})"
    what, when_done, exc = out[-1]
    took = when_done - lost
    print(f"backward with {far} two hops away, {how.name} {when} it: failed after "
          f"{took:.2f} s: {exc}", file=sys.stderr)
    assert what == "failed" and isinstance(exc, RuntimeError), out
    assert far in str(exc), exc
    assert took < BOUND + SLACK, took
    # worker0's context went with its `with` block; worker1's because the far worker is lost.
    assert _contexts("worker0") == 0
    assert rpc.get_debug_info()["num_current_backward_passes"] == 0
    took = _wait_for("worker1's autograd contexts released",
                     lambda: _contexts("worker1") == 0, BOUND + SLACK + 5)
    print(f"  worker1 released its context {took:.2f} s later", file=sys.stderr)
    # The survivors still run distributed backward passes through each other.
    with dist_autograd.context() as ctx:
        x = torch.ones(4, requires_grad=True)
        y = rpc.rpc_sync("worker1", torch.mul, args=(x, 3.0))
        dist_autograd.backward(ctx, [y.sum()])
        assert torch.equal(dist_autograd.get_gradients(ctx)[x], torch.full((4,), 3.0))


def test_killed_two_hops_away_before_the_backward_pass(group):
    _lose(group, 2, signal.SIGKILL, "before", helpers.echo)


def test_stopped_two_hops_away_before_the_backward_pass(group):
    _lose(group, 3, signal.SIGSTOP, "before", helpers.echo)


def test_killed_two_hops_away_during_the_backward_pass(group):
    _lose(group, 4, signal.SIGKILL, "during", helpers.slow_identity)


def test_killed_two_hops_away_and_declared_lost_before_the_backward_pass(group):
    # worker1 has dropped the context when the pass arrives: it still names the lost worker.
    _lose(group, 5, signal.SIGKILL, "after the loss", helpers.echo)
