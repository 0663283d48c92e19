"""DistributedDataParallel combined with RPC: a remote embedding table and a replicated dense part.

Re-creates the "Combining Distributed DataParallel with Distributed RPC
Framework" tutorial. Four processes:

* ranks 0 and 1 are ``trainer0`` and ``trainer1``. Besides RPC they form a
  2-member gloo process group (on its own port) for DistributedDataParallel.
* rank 2 is the ``master``. It creates an ``nn.EmbeddingBag`` on the ps as a
  ``RemoteModule`` and starts training on both trainers with ``rpc_async``,
  passing the RemoteModule itself as an argument: it arrives on the trainers as
  a usable module whose owner is the ps.
* rank 3 is the ``ps``; it only serves.

Each trainer's model looks up bags of embeddings on the ps
(``remote_module.forward``) and feeds them to a local ``nn.Linear`` wrapped in
``DistributedDataParallel``. Every step runs in a distributed autograd context;
``dist_autograd.backward`` runs the RPC backward pass, during which DDP's reducer
averages the dense gradients over the gloo group into the context, as in torch;
then a ``DistributedOptimizer`` over the ps's embedding parameters
(``remote_parameters()``) and the local dense parameters (local ``RRef``\\ s)
applies the update. Each trainer prints its loss per epoch; the master checks
that the two DDP replicas ended identical and counts the embedding rows that
training changed on the ps.

Differences from the tutorial: learnable synthetic data instead of pure noise
(each bag mostly holds rows of its target class, row ``i`` belonging to class
``i % 8``), drawn once per trainer and reused every epoch, so that the loss
visibly falls; 20 epochs (5 with ``--smoke``) instead of 100; gloo on CPU and
no accelerator check; SGD lr 0.1 instead of 0.05; the master checks the result.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import torchrpc.autograd as dist_autograd
import torchrpc.rpc as rpc
from torchrpc.examples import _launch
from torchrpc.examples._launch import say
from torchrpc.nn import RemoteModule
from torchrpc.optim import DistributedOptimizer

NUM_EMBEDDINGS = 100
EMBEDDING_DIM = 16
NUM_CLASSES = 8
NUM_TRAINERS = 2
MASTER_RANK, PS_RANK = 2, 3
WORLD_SIZE = 4
Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class HybridModel(nn.Module):
    """Remote embedding table on the ps, dense layer replicated by DDP on each trainer."""

    def __init__(self, remote_emb_module: RemoteModule) -> None:
        super().__init__()
        self.remote_emb_module = remote_emb_module
        self.fc = DDP(nn.Linear(EMBEDDING_DIM, NUM_CLASSES))

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        embedded = self.remote_emb_module.forward(indices, offsets)   # RPC to the ps
        return self.fc(embedded)


def make_batches(seed: int, count: int) -> list[Batch]:
    """``count`` batches of (indices, offsets, targets); each bag mostly holds its class's rows."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        num_indices = int(torch.randint(20, 50, (1,), generator=gen))
        starts = [0]
        while True:
            nxt = starts[-1] + int(torch.randint(1, 10, (1,), generator=gen))
            if nxt >= num_indices:
                break
            starts.append(nxt)
        offsets = torch.tensor(starts, dtype=torch.long)
        targets = torch.randint(0, NUM_CLASSES, (len(starts),), generator=gen)
        lengths = torch.diff(offsets, append=torch.tensor([num_indices]))
        bag_class = targets.repeat_interleave(lengths)
        # Rows of class c are c, c + 8, c + 16, ...; about one index in five is noise.
        rows = bag_class + NUM_CLASSES * torch.randint(0, NUM_EMBEDDINGS // NUM_CLASSES,
                                                       (num_indices,), generator=gen)
        noise = torch.rand(num_indices, generator=gen) < 0.2
        rows[noise] = torch.randint(0, NUM_EMBEDDINGS, (int(noise.sum()),), generator=gen)
        batches.append((rows, offsets, targets))
    return batches


def run_trainer(remote_emb_module: RemoteModule, rank: int, epochs: int,
                batches_per_epoch: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """RPC target on a trainer: train, print the loss per epoch; return losses and fc weights."""
    name = rpc.get_worker_info().name
    model = HybridModel(remote_emb_module)
    param_rrefs = remote_emb_module.remote_parameters()
    param_rrefs += [rpc.RRef(p) for p in model.fc.parameters()]
    opt = DistributedOptimizer(torch.optim.SGD, param_rrefs, lr=0.1)
    batches = make_batches(seed=rank, count=batches_per_epoch)
    losses = []
    for epoch in range(1, epochs + 1):
        started = time.perf_counter()
        total = 0.0
        for indices, offsets, targets in batches:
            with dist_autograd.context() as context_id:
                loss = F.cross_entropy(model(indices, offsets), targets)
                dist_autograd.backward(context_id, [loss])
                opt.step(context_id)
            total += loss.item()
        losses.append(total / len(batches))
        say(f"{name}: epoch {epoch}/{epochs}  loss {losses[-1]:.4f}  "
            f"({time.perf_counter() - started:.1f} s)")
    weights = {k: v.detach().clone() for k, v in model.fc.module.state_dict().items()}
    return losses, weights


def run_master(args: argparse.Namespace) -> None:
    """Create the remote table, run both trainers, and check what they did."""
    remote_emb_module = RemoteModule("ps", nn.EmbeddingBag, args=(NUM_EMBEDDINGS, EMBEDDING_DIM),
                                     kwargs={"mode": "sum"})
    table_rref = remote_emb_module.remote_parameters()[0]
    before = table_rref.to_here()
    futures = [
        rpc.rpc_async(f"trainer{rank}", run_trainer,
                      args=(remote_emb_module, rank, args.epochs, args.batches))
        for rank in range(NUM_TRAINERS)
    ]
    results = [fut.wait() for fut in futures]
    after = table_rref.to_here()
    (losses0, fc0), (losses1, fc1) = results
    same = all(torch.equal(fc0[k], fc1[k]) for k in fc0)
    changed = int((after != before).any(dim=1).sum())
    say(f"master: DDP replicas identical on both trainers: {same}")
    say(f"master: embedding rows changed on the ps: {changed}/{NUM_EMBEDDINGS}")
    for rank, losses in enumerate((losses0, losses1)):
        say(f"master: trainer{rank} loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    if not same:
        raise RuntimeError("the DDP replicas of the dense layer diverged")
    if changed == 0:
        raise RuntimeError("training did not change the remote embedding table")


def run_rank(rank: int, world_size: int, args: argparse.Namespace) -> None:
    """Entry point of one rank: trainers 0 and 1, master 2, ps 3."""
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{_launch.LOOPBACK}:{args.rpc_port}")
    if rank < NUM_TRAINERS:
        dist.init_process_group("gloo", init_method=f"tcp://{_launch.LOOPBACK}:{args.ddp_port}",
                                rank=rank, world_size=NUM_TRAINERS)
        rpc.init_rpc(f"trainer{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options)
        rpc.shutdown()   # training runs in an RPC the master sends
        dist.destroy_process_group()
    elif rank == MASTER_RANK:
        rpc.init_rpc("master", rank=rank, world_size=world_size, rpc_backend_options=options)
        run_master(args)
        rpc.shutdown()
    else:
        rpc.init_rpc("ps", rank=rank, world_size=world_size, rpc_backend_options=options)
        rpc.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Parse flags and run the four ranks; return the exit status."""
    parser = _launch.base_parser(__doc__.splitlines()[0], default_timeout=300)
    parser.add_argument("--epochs", type=int, default=None, help="default 20, or 5 with --smoke")
    parser.add_argument("--batches", type=int, default=10, help="batches per epoch (default 10)")
    parser.add_argument("--rpc-port", type=int, default=None,
                        help="RPC rendezvous port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--ddp-port", type=int, default=None,
                        help="gloo rendezvous port on 127.0.0.1 (default: a free one)")
    args = parser.parse_args(argv)
    _launch.smoke_defaults(parser, args, epochs=(5, 20))
    if _launch.torchrun_rank() is not None and (args.rpc_port is None or args.ddp_port is None):
        parser.error("under torchrun pass --rpc-port and --ddp-port, so that every rank uses the same")
    spare = _launch.free_ports(2)
    args.rpc_port = args.rpc_port or spare[0]
    args.ddp_port = args.ddp_port or spare[1]
    if args.rpc_port == args.ddp_port:
        parser.error(f"--rpc-port and --ddp-port must differ, both are {args.rpc_port}")
    return _launch.launch(run_rank, WORLD_SIZE, args)


if __name__ == "__main__":
    # Run through the package module so that RPC peers and spawned ranks see the
    # functions and classes under their importable names, not under __main__.
    sys.exit(importlib.import_module("torchrpc.examples.ddp_rpc").main())
