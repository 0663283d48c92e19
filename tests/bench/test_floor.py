"""The benchmark's featureless floor RPC carries frames larger than its read buffer.

With ``self_read`` only ``rpc_sync`` carries large frames: a burst of large ``rpc_async``
calls read by the calling thread at every 16th call is not supported (see floor.py).
"""

from __future__ import annotations

import multiprocessing

import torch

from benchmarks.callees import echo
from benchmarks.ports import free_port


def _worker(rank: int, port: int, self_read: bool) -> None:
    from benchmarks.variants import floor

    floor.init_rpc("w", rank=rank, world_size=2, self_read=self_read,
                   rpc_backend_options=floor.TensorPipeRpcBackendOptions(
                       init_method=f"tcp://127.0.0.1:{port}"))
    if rank == 0:
        # 8 MB frames, beyond the 1 MiB buffer, between small ones.
        for numel in (10, 2_000_000, 100):
            x = torch.rand(numel)
            assert torch.equal(floor.rpc_sync("w1", echo, args=(x,)), x)
            if not self_read or numel < 1000:
                futs = [floor.rpc_async("w1", echo, args=(x,)) for _ in range(3)]
                assert all(torch.equal(v, x) for v in torch.futures.wait_all(futs))
    floor.shutdown()


def test_large_frames_cross_both_reply_paths() -> None:
    ctx = multiprocessing.get_context("spawn")
    for self_read in (False, True):
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(r, port, self_read)) for r in (0, 1)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            if p.is_alive():
                p.kill()
        assert [p.exitcode for p in procs] == [0, 0], self_read
