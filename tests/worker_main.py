"""A group member for tests: init_rpc, then serve until the group shuts down."""

import sys

import torch

import torchrpc.rpc as rpc


def main() -> None:
    name, rank, world_size, threads, timeout = sys.argv[1:6]
    torch.set_num_threads(1)
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=int(threads),
                                           rpc_timeout=float(timeout))
    rpc.init_rpc(name, rank=int(rank), world_size=int(world_size), rpc_backend_options=opts)
    rpc.shutdown()


if __name__ == "__main__":
    main()
