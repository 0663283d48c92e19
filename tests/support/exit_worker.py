"""One worker of a group that ends in one of the ways a worker can end, in a fresh
interpreter: ``python -m tests.support.exit_worker MODE RANK WORLD THREADS`` (the group's store
from ``MASTER_ADDR``/``MASTER_PORT``; THREADS ``1`` runs one torch thread, ``default``
torch's default). tests/agent/test_exit.py runs it and checks how each process ended.

Each mode exits with its own code (:data:`CODES`), the code the program chose; the worker
that dies on purpose (``peer_died``, rank 1) with :data:`DIED`. Before it exits, a worker
prints ``EXITING <mode>``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

import torch

import torchrpc.rpc as rpc

CODES = {"graceful": 0, "local": 3, "peer_died": 4, "no_shutdown": 5, "async_exit": 6,
         "sigterm": 7, "stuck": 8}
DIED = 9

_started = threading.Event()  # a coroutine target runs here (async_exit)
_peer_ready = threading.Event()  # the peer's first call returned (it called mark_ready)


def mark_ready() -> None:
    _peer_ready.set()


def compute(x: torch.Tensor) -> torch.Tensor:
    """Work on torch's threads: a product big enough to run in parallel."""
    return (x @ x.t()).relu_().sum(0)


def compute_for(x: torch.Tensor, seconds: float) -> torch.Tensor:
    """:func:`compute` again and again for ``seconds``."""
    end = time.monotonic() + seconds
    y = compute(x)
    while time.monotonic() < end:
        y = compute(x) + y[: x.shape[0]].sum()
    return y


def sleep_for(seconds: float) -> int:
    time.sleep(seconds)
    return 1


async def keep_calling(caller: str, x: torch.Tensor) -> int:
    """A coroutine target that calls its caller back until that fails."""
    try:
        await rpc.rpc_async(caller, mark_called)
    finally:
        _started.set()  # and the caller knows (it may stop before its reply comes back)
    n = 0
    while True:
        try:
            await rpc.rpc_async(caller, compute, args=(x,))
        except Exception:  # noqa: BLE001 - the caller stopped: the exit is under way
            return n
        n += 1


def mark_called() -> None:
    _started.set()


async def shut_down_here() -> bool:
    """A coroutine target that shuts its own worker down, on its event loop's thread."""
    rpc.shutdown(graceful=False)
    return True


def _calls(n: int, to: str, fn, *args) -> list:
    """Up to ``n`` ``rpc_async`` calls of ``fn(*args)`` on ``to``, fewer once the peer is
    gone (it may stop first, in every mode but graceful)."""
    futs = []
    for _ in range(n):
        try:
            futs.append(rpc.rpc_async(to, fn, args=args))
        except Exception:  # noqa: BLE001 - the peer left or died: expected here
            break
    return futs


def _wait_all(futs) -> None:
    for fut in futs:
        try:
            fut.wait()
        except Exception:  # noqa: BLE001 - the peer stopped or died: expected here
            pass


def _exit(mode: str) -> None:
    print(f"EXITING {mode}", flush=True)
    sys.exit(CODES[mode])


def main() -> None:
    mode, rank, world, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if threads == "1":
        torch.set_num_threads(1)
    if mode == "sigterm":
        signal.signal(signal.SIGTERM, lambda signum, frame: _exit(mode))
    me, peer = f"w{rank}", f"w{(rank + 1) % world}"
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=4, rpc_timeout=30)
    rpc.init_rpc(me, rank=rank, world_size=world, rpc_backend_options=opts)
    x = torch.randn(256, 256)
    assert torch.equal(rpc.rpc_sync(peer, compute, args=(x,)), compute(x))
    # Neither worker goes on before both first calls returned: the ways to end that
    # follow may stop a worker at once.
    rpc.rpc_async(peer, mark_ready)
    if not _peer_ready.wait(30):
        raise AssertionError("the peer's first call did not return")

    if mode == "graceful":
        _wait_all(_calls(20, peer, compute, x))
        rpc.shutdown()
        _exit(mode)
    if mode == "local":
        futs = _calls(8, peer, compute_for, x, 0.2)
        rpc.shutdown(graceful=False)
        assert all(f.done() for f in futs)  # failed at once, or done
        _exit(mode)
    if mode == "peer_died":
        if rank == 1:
            time.sleep(0.3)  # while the calls of rank 0 run here
            print("EXITING died", flush=True)
            os._exit(DIED)
        futs = _calls(6, peer, compute_for, x, 2.0)
        _wait_all(futs)
        try:
            rpc.shutdown(timeout=20)
        except RuntimeError as exc:
            assert "w1" in str(exc), exc
        else:
            raise AssertionError("shutdown did not name the dead worker")
        _exit(mode)
    if mode == "no_shutdown":
        futs = _calls(8, peer, compute_for, x, 0.3)
        try:
            ref = rpc.remote(peer, compute, args=(x,))
        except Exception:  # noqa: BLE001 - the peer exited first
            ref = None
        del ref, futs
        _exit(mode)  # calls outstanding, no shutdown
    if mode == "async_exit":
        # Rank 1 runs rank 0's coroutine target, which calls rank 0 back on and on; then
        # rank 1 exits with it running, and rank 0 shuts down from its own loop.
        if rank == 0:
            fut = rpc.rpc_async(peer, keep_calling, args=(me, x))
        if not _started.wait(30):
            raise AssertionError("the coroutine target did not start")
        if rank == 0:
            try:
                rpc.rpc_sync(me, shut_down_here, timeout=20)
            except Exception:  # noqa: BLE001 - the worker stopped before the reply
                pass
            del fut
        _exit(mode)
    if mode == "sigterm":
        print("READY", flush=True)
        end = time.monotonic() + 60
        while time.monotonic() < end:  # until the signal's handler exits
            try:
                rpc.rpc_sync(peer, compute, args=(x,), timeout=5)
            except Exception:  # noqa: BLE001 - the peer got its signal first
                time.sleep(0.01)
        raise AssertionError("no SIGTERM came")
    if mode == "stuck":
        # A request's function that outlasts the exit's wait: named at WARNING.
        from torchrpc import _threads
        _threads.EXIT_WAIT = 1.0
        fut = rpc.rpc_async(peer, sleep_for, args=(60,))
        time.sleep(0.5)
        del fut
        _exit(mode)
    raise AssertionError(f"no mode {mode}")


if __name__ == "__main__":
    main()
