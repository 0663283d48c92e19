"""An outsider and a static group's rendezvous store: another uid's failed init_rpc and a
forged error fail no rank of a group still forming; the group forms and shuts down while
the store is flooded with junk (a FileStore file that an outsider filled first); a squatted
per-user runtime directory makes rank 0 use a private one; and a deleted key fails the
group with a clear error after the rendezvous timeout, not a hang. Each test forms its own
group: the attacks are on forming."""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import threading
import time
from typing import Any, Dict, List

import pytest
import torch.distributed as dist

import torchrpc.rpc as rpc
from torchrpc._rendezvous import rendezvous, secret
from torchrpc._agent.current import current_agent
from torchrpc.errors import RendezvousError

from ..support import helpers
from ..support.group import free_port, running_group, start_module, worker_env
from ..support.nobody import init_rpc_as_nobody, needs_nobody

NOBODY = 65534

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")


def member(port: int, rank: int, world_size: int, options: Dict[str, Any]) -> Any:
    env = worker_env(port, world_size, {"TORCHRPC_TEST_OPTIONS": json.dumps(options)})
    return start_module("tests.support.worker_main",
                        [f"worker{rank}", str(rank), str(world_size), "2", "30"], env,
                        capture=True)


class RankZero:
    """init_rpc of rank 0 here, on a thread (it returns once the group has formed)."""

    def __init__(self, port: int, world_size: int, **options: Any) -> None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        self.error: List[BaseException] = []
        opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=2, rpc_timeout=30, **options)

        def init() -> None:
            try:
                rpc.init_rpc("worker0", rank=0, world_size=world_size, rpc_backend_options=opts)
            except BaseException as exc:  # noqa: BLE001 - the test reads it
                self.error.append(exc)
        self.thread = threading.Thread(target=init, daemon=True)
        self.thread.start()

    def store(self, port: int) -> Any:
        """The group's store as an outsider sees it (once rank 0 hosts it)."""
        deadline = time.monotonic() + 30
        while True:
            try:
                return dist.PrefixStore(rendezvous.PREFIX, dist.TCPStore(
                    "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10)))
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def join(self, limit: float = 120) -> None:
        self.thread.join(limit)
        assert not self.thread.is_alive(), "rank 0's init_rpc still waits"


def finish(members: List[Any]) -> None:
    assert rpc.rpc_sync("worker1", helpers.add, args=(20, 22)) == 42
    rpc.shutdown()
    for p in members:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out


@needs_nobody
def test_another_users_failed_init_and_a_forged_error_fail_no_rank_of_a_forming_group():
    port = free_port()
    zero = RankZero(port, 2)
    store = zero.store(port)
    store.set("error", "rank 1: cannot read the job secret (forged)")  # the old attack, raw
    out = init_rpc_as_nobody("worker1", 1, 2, port)
    assert "FAILED RendezvousError" in out.stdout and "job secret" in out.stdout, out
    assert zero.thread.is_alive() and not zero.error  # rank 0 still waits for rank 1
    assert not store.check(["rank/1"]) and not store.check(["name/worker1"])
    real = member(port, 1, 2, {})
    zero.join()
    assert not zero.error, zero.error
    finish([real])


def _squat_file_store(path: str) -> None:
    """What an outsider that can write the rendezvous file leaves in it before the job."""
    raw = dist.FileStore(path, -1)
    store = dist.PrefixStore(rendezvous.PREFIX, raw)
    store.set("secret_locator", json.dumps({"host": rendezvous.host_identity(), "dir": "/tmp",
                                            "file": "job-evil"}))
    for r in range(3):
        store.set(f"rank/{r}", f"evil{r}")
        store.set(f"worker/{r}", json.dumps({"name": "evil", "host": "127.0.0.1", "port": 1}))
    store.set("name/worker0", "2")
    store.set("error", "forged")
    store.add("shutdown/1", 2)


def test_a_static_group_forms_and_shuts_down_while_an_outsider_floods_its_store(tmp_path):
    path = str(tmp_path / "store")
    _squat_file_store(path)
    stop = threading.Event()
    counts = {"n": 0}

    def flood() -> None:
        store = dist.PrefixStore(rendezvous.PREFIX, dist.FileStore(path, -1))
        i = 0
        while not stop.is_set():
            i += 1
            store.set(f"junk/{i}", os.urandom(32))
            store.set("error", f"forged {i}")
            for r in range(3):
                store.compare_set(f"shutdown/{1 + i % 3}/{r}", "", "1")  # arrivals, first
                store.compare_set(f"lost/{r}", "", f"forged {i}")
            store.add(f"shutdown/{1 + i % 3}", 1)
            store.add("lost", 1)
            counts["n"] = i
            time.sleep(0.005)
    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    try:
        with running_group(3, threads=2, timeout=30.0,
                           options={"init_method": f"file://{path}"}) as g:
            assert g.port  # formed
            assert rpc.rpc_sync("worker1", helpers.nested_call, args=("worker2", 1)) \
                == "worker1>worker2"
            assert rpc.rpc_sync("worker2", helpers.nested_call, args=("worker0", 1)) \
                == "worker2>worker0"
            assert sorted(current_agent().registry.workers) == [0, 1, 2]
    finally:
        stop.set()
        flooder.join(10)
    assert counts["n"] > 5, counts


@as_root
@pytest.mark.parametrize("squat", ["owned by nobody", "a symlink"])
def test_a_squatted_runtime_directory_makes_rank_0_use_a_private_one(squat, tmp_path,
                                                                      monkeypatch):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)  # like /tmp
    shared = tmp / f"torchrpc-{os.geteuid()}"
    if squat == "owned by nobody":
        shared.mkdir(mode=0o700)
        os.chown(shared, NOBODY, NOBODY)
    else:
        target = tmp / "nobodys"
        target.mkdir(mode=0o777)
        os.chown(target, NOBODY, NOBODY)
        shared.symlink_to(target)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setattr(secret, "_fallback", [])
    with running_group(2, threads=2, timeout=30.0) as g:
        assert rpc.rpc_sync("worker1", helpers.add, args=(1, 2)) == 3
        store = dist.PrefixStore(rendezvous.PREFIX, dist.TCPStore(
            "127.0.0.1", g.port, is_master=False, timeout=datetime.timedelta(seconds=10)))
        where = json.loads(store.get("secret_locator"))
        assert os.path.dirname(where["dir"]) == str(tmp)
        assert os.path.basename(where["dir"]).startswith(f"torchrpc-{os.geteuid()}-")
        st = os.lstat(where["dir"])
        assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o700
    assert os.lstat(shared).st_uid == NOBODY or os.path.islink(shared)  # left as it was
    assert not os.listdir(where["dir"])  # the secret file is gone once rank 0 shut down


def test_a_deleted_key_fails_the_group_after_the_rendezvous_timeout_not_a_hang(tmp_path):
    path = str(tmp_path / "store")
    options = {"rendezvous_timeout": 6, "init_method": f"file://{path}"}
    start = time.monotonic()
    zero = RankZero(free_port(), 2, **options)
    store = dist.PrefixStore(rendezvous.PREFIX, dist.FileStore(path, -1))
    deadline = time.monotonic() + 30
    while not store.check(["secret_locator"]):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    store.delete_key("secret_locator")  # rank 1 cannot find the secret any more
    late = member(0, 1, 2, options)
    zero.join(60)
    assert len(zero.error) == 1 and isinstance(zero.error[0], RendezvousError), zero.error
    assert "timed out waiting for all 2 workers to join: missing ['worker/1']" in str(
        zero.error[0])
    assert time.monotonic() - start < 20
    out, _ = late.communicate(timeout=60)
    assert late.returncode != 0
    assert "timed out waiting for where rank 0 keeps the job secret: missing " \
           "['secret_locator']" in out, out
