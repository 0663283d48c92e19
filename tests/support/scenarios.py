"""Whole-process scenarios for lifecycle tests: ``python -m tests.support.scenarios NAME RANK``.

Each prints ``OK <detail>`` on success; any exception fails the process.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

import torchrpc.rpc as rpc
from torchrpc.errors import NotInitializedError

from . import helpers


def _torchrpc_threads() -> list:
    return [t.name for t in threading.enumerate() if t.name.startswith("torchrpc")]


def lifecycle(rank: int) -> None:
    calls = [
        lambda: rpc.rpc_sync("w", helpers.add, args=(1, 2)),
        lambda: rpc.rpc_async("w", helpers.add, args=(1, 2)),
        lambda: rpc.remote("w", helpers.add, args=(1, 2)),
        lambda: rpc.get_worker_info(),
        lambda: rpc.get_worker_infos(),
        lambda: rpc.get_rpc_timeout(),
        lambda: rpc.shutdown(),
        lambda: rpc.RRef(1),
    ]
    for call in calls:
        try:
            call()
        except NotInitializedError as exc:
            assert isinstance(exc, RuntimeError) and "init_rpc" in str(exc), exc
        else:
            raise AssertionError("API call before init_rpc did not raise")
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=2)
    rpc.init_rpc("solo", rank=0, world_size=1, rpc_backend_options=opts)
    try:
        rpc.init_rpc("solo", rank=0, world_size=1, rpc_backend_options=opts)
    except RuntimeError as exc:
        assert "already initialized" in str(exc), exc
    else:
        raise AssertionError("init_rpc twice did not raise")
    assert rpc.rpc_sync("solo", helpers.add, args=(1, 2)) == 3
    assert rpc.remote("solo", helpers.add, args=(2, 2)).to_here() == 4
    rpc.shutdown()
    assert not _torchrpc_threads(), _torchrpc_threads()
    for call in calls[:6]:
        try:
            call()
        except NotInitializedError as exc:
            assert "shut down" in str(exc), exc
        else:
            raise AssertionError("API call after shutdown did not raise")
    # init again in the same process works, and a non-graceful shutdown stops at once
    os.environ["MASTER_PORT"] = sys.argv[4]
    rpc.init_rpc("again", rank=0, world_size=1, rpc_backend_options=opts)
    assert rpc.rpc_sync(0, helpers.whoami) == "again"
    rpc.shutdown(graceful=False)
    assert not _torchrpc_threads(), _torchrpc_threads()
    print("OK lifecycle", flush=True)


def group_call(rank: int) -> None:
    """init_rpc from the environment / init_method given, call the next worker, shut down."""
    world = int(os.environ.get("WORLD_SIZE", "0")) or int(sys.argv[3])
    init_method = os.environ.get("SCENARIO_INIT_METHOD")
    kwargs = {}
    if init_method:
        kwargs["rpc_backend_options"] = rpc.TensorPipeRpcBackendOptions(
            init_method=init_method, num_worker_threads=2)
    if os.environ.get("SCENARIO_FROM_ENV"):
        rpc.init_rpc(f"w{os.environ['RANK']}", **kwargs)  # rank and world size from torchrun
    else:
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=world, **kwargs)
    me = rpc.get_worker_info()
    peer = (me.id + 1) % world
    assert rpc.rpc_sync(peer, helpers.whoami) == f"w{peer}"
    assert len(rpc.get_worker_infos()) == world
    rpc.shutdown()
    assert not _torchrpc_threads(), _torchrpc_threads()
    print(f"OK group {me.name}", flush=True)


def all_to_all(rank: int) -> None:
    """init_rpc, call every other worker once, graceful shutdown; print the timings."""
    import time
    world = int(sys.argv[3])
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=2, rpc_timeout=120)
    t0 = time.monotonic()
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    t1 = time.monotonic()
    futs = [rpc.rpc_async(f"w{r}", helpers.add, args=(rank, r)) for r in range(world) if r != rank]
    assert torch.futures.wait_all(futs) == [rank + r for r in range(world) if r != rank]
    t2 = time.monotonic()
    rpc.shutdown()
    t3 = time.monotonic()
    assert not _torchrpc_threads(), _torchrpc_threads()
    print(f"OK all_to_all init={t1 - t0:.2f} calls={t2 - t1:.2f} shutdown={t3 - t2:.2f}", flush=True)


def elastic_member(rank: int) -> None:
    """Join a running dynamic group, keep calling rank 0 until told to leave, then leave."""
    import time
    name, stopfile = os.environ["SCENARIO_NAME"], os.environ["SCENARIO_STOPFILE"]
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=2, rpc_timeout=30)
    try:
        rpc.init_rpc(name, rank=rank, world_size=None, rpc_backend_options=opts)
    except RuntimeError as exc:
        print(f"ERR {exc}", flush=True)
        return
    print("JOINED", flush=True)
    calls = 0
    while not os.path.exists(stopfile):
        assert rpc.rpc_sync(0, helpers.add, args=(calls, 1)) == calls + 1
        calls += 1
        time.sleep(0.02)
    rpc.shutdown()
    assert not _torchrpc_threads(), _torchrpc_threads()
    print(f"OK elastic {name} calls={calls}", flush=True)


def multihost(rank: int) -> None:
    """One worker per network namespace: call the other with a large tensor over TCP."""
    from torchrpc._agent.current import current_agent
    rpc.init_rpc(f"h{rank}", rank=rank, world_size=2,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(num_worker_threads=2))
    agent = current_agent()
    host = agent.registry.addresses[rank][0]
    assert not host.startswith("127."), f"advertised a loopback address {host}"
    hostids = agent.registry.hostids
    assert hostids[0] != hostids[1], "namespaces must look like different hosts"
    x = torch.arange(1 << 20, dtype=torch.float32)  # 4 MB: above the shared-memory threshold
    assert torch.equal(rpc.rpc_sync(1 - rank, helpers.echo, args=(x,)), x)
    info = rpc.get_debug_info()
    shm = {k: v for k, v in info.items() if "shm" in k}
    assert not any(v for k, v in shm.items() if isinstance(v, (int, float)) and "enabled" not in k
                   ), f"shared memory used across hosts: {shm}"
    rpc.shutdown()
    print(f"OK multihost {host}", flush=True)


def bad_listen(rank: int) -> None:
    """A listen address that is not on this machine fails, naming the address."""
    try:
        rpc.init_rpc("solo", rank=0, world_size=1,
                     rpc_backend_options=rpc.TensorPipeRpcBackendOptions(num_worker_threads=2))
    except (RuntimeError, ValueError) as exc:
        print(f"ERR {exc}", flush=True)
        return
    rpc.shutdown()
    print("OK unexpectedly started", flush=True)


def unreachable(rank: int) -> None:
    """Rank 1 with no rank 0 anywhere: rendezvous fails within the timeout, naming the address."""
    import time
    start = time.monotonic()
    try:
        rpc.init_rpc("lonely", rank=1, world_size=2,
                     rpc_backend_options=rpc.TensorPipeRpcBackendOptions(num_worker_threads=2))
    except RuntimeError as exc:
        print(f"ERR after {time.monotonic() - start:.1f}s: {exc}", flush=True)
        return
    print("OK unexpectedly joined", flush=True)


def late_then_missing(rank: int) -> None:
    """Rank 0 of two, with a 4 s rendezvous: the other reaches the store after 2.5 s and
    never joins. init_rpc fails at the one deadline (4 s), not 4 s after the store opened."""
    def reach_the_store_late() -> None:
        time.sleep(2.5)
        held.append(dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), 2, False,
                                  datetime.timedelta(seconds=30)))

    held: list = []
    threading.Thread(target=reach_the_store_late, daemon=True).start()
    start = time.monotonic()
    try:
        rpc.init_rpc("alone", rank=0, world_size=2,
                     rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                         num_worker_threads=2, rendezvous_timeout=4.0))
    except RuntimeError as exc:
        print(f"ERR after {time.monotonic() - start:.1f}s store reached {bool(held)}: {exc}",
              flush=True)
        return
    print("OK unexpectedly joined", flush=True)


def duplicate(rank: int) -> None:
    """Started with a clashing name or rank: init_rpc must fail with a clear error."""
    name = os.environ["SCENARIO_NAME"]
    real_rank = int(os.environ["SCENARIO_RANK"])
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=2, rpc_timeout=20)
    try:
        rpc.init_rpc(name, rank=real_rank, world_size=int(sys.argv[3]), rpc_backend_options=opts)
    except RuntimeError as exc:
        print(f"ERR {exc}", flush=True)
        return
    rpc.shutdown(graceful=False)
    print("OK joined", flush=True)


def soak_member(rank: int) -> None:
    """Join a running dynamic group and serve until the stop file exists (or a SIGKILL)."""
    import time
    name, stopfile = os.environ["SCENARIO_NAME"], os.environ["SCENARIO_STOPFILE"]
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=8, rpc_timeout=60)
    rpc.init_rpc(name, rank=rank, world_size=None, rpc_backend_options=opts)
    print("JOINED", flush=True)
    while not os.path.exists(stopfile):
        time.sleep(0.05)
    rpc.shutdown(graceful=False)
    print(f"OK soak member {name}", flush=True)


def rejoin_member(rank: int) -> None:
    """Join a running dynamic group and serve until the stop file exists; a member that
    the group removed (stopped, declared lost, continued) finds out and stops."""
    import time
    name, stopfile = os.environ["SCENARIO_NAME"], os.environ["SCENARIO_STOPFILE"]
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=2, rpc_timeout=30)
    rpc.init_rpc(name, rank=rank, world_size=None, rpc_backend_options=opts)
    from torchrpc._agent.current import current_agent
    print(f"JOINED {current_agent().registry.incarnation}", flush=True)
    while not os.path.exists(stopfile):
        try:
            rpc.get_worker_infos()
        except RuntimeError as exc:
            print(f"REMOVED {exc}", flush=True)
            try:
                rpc.shutdown(graceful=False)
            except RuntimeError:
                pass  # it raises the failure again, once stopped
            return
        time.sleep(0.05)
    rpc.shutdown()
    print(f"OK rejoin member {name}", flush=True)


def goodbye_window(rank: int) -> None:
    """Rank 1 says GOODBYE to rank 0 and serves on: rank 0's calls to it fail at once as
    having left (they would never be answered by a worker that really stops)."""
    import time
    from torchrpc.errors import WorkerLeftError
    stopfile = os.environ["SCENARIO_STOPFILE"]
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=2, rpc_timeout=30)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 1:
        while not os.path.exists(stopfile):
            time.sleep(0.05)
        rpc.shutdown(graceful=False)
        print("OK served", flush=True)
        return
    try:
        rpc.rpc_sync("w1", helpers.goodbye_to, args=(0,))
    except WorkerLeftError:
        pass  # the GOODBYE may come before the reply
    # The reply may also come first (on a connection of its own): calls made once the
    # GOODBYE is in are the ones that must fail, whichever connection they would take.
    from torchrpc._agent.current import current_agent
    deadline = time.monotonic() + 10.0
    while not current_agent().has_left(1) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert current_agent().has_left(1), "rank 1's GOODBYE never arrived"
    outcomes = []
    for _ in range(3):
        start = time.monotonic()
        try:
            rpc.rpc_sync("w1", helpers.sleep_then, args=(1.0, "answered"))
            outcomes.append("answered")
        except WorkerLeftError as exc:
            assert "has shut down" in str(exc), exc
            outcomes.append(time.monotonic() - start)
    open(stopfile, "w").close()
    rpc.shutdown(graceful=False)
    assert all(isinstance(o, float) and o < 0.5 for o in outcomes), outcomes
    print(f"OK calls failed within {max(outcomes):.3f} s", flush=True)


def forked(scenario: str, world: int, outdir: str) -> None:
    """Run ``scenario`` in ``world`` processes forked from this one, which has imported
    torch and torchrpc once for all of them (32 interpreters importing torch at once take
    most of a 2-core machine's minute); rank r's output goes to ``outdir/r``, and its exit
    status becomes the first line of ``outdir/r.status``."""
    children = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            fd = os.open(os.path.join(outdir, str(rank)), os.O_WRONLY | os.O_CREAT, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            code = 0
            try:
                sys.argv[2:4] = [str(rank), str(world)]
                globals()[scenario](rank)
            except BaseException:  # noqa: BLE001 - reported through the status file
                import traceback
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        children[pid] = rank
    while children:
        pid, status = os.wait()
        rank = children.pop(pid)
        with open(os.path.join(outdir, f"{rank}.status"), "w") as f:
            f.write(f"{os.waitstatus_to_exitcode(status)}\n")


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "forked":
        forked(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        globals()[sys.argv[1]](int(sys.argv[2]))
