"""Distributed pipeline parallelism: a ResNet-style model split over two workers.

Re-creates the "Distributed Pipeline Parallelism Using RPC" tutorial:

* ``master`` (rank 0) drives training; ``worker1`` and ``worker2`` each hold one
  half (shard) of the model, created there with ``rpc.remote``; the master keeps
  only RRefs to them.
* every input batch is cut into micro-batches. For each one the master wraps
  the slice in a local ``RRef``, asks worker1 for the first half with
  ``p1_rref.remote().forward(x_rref)`` (an RRef to a result that stays on
  worker1) and passes that RRef on with ``p2_rref.rpc_async().forward(y_rref)``
  (an RRef shared from one user to another; its owner is worker1). Inside each
  shard ``to_here()`` fetches the input. The master waits for all the
  micro-batches at the end and joins the outputs in input order.
* each shard serialises its own computation with a ``threading.Lock``, since
  concurrent RPCs run on different server threads.
* the backward pass is ``dist_autograd.backward``, the update a
  ``DistributedOptimizer`` over the parameter RRefs of both shards.
* an inference pass shows ``@rpc.functions.async_execution``: worker1 holds an
  RRef to the second shard; its ``infer`` method runs the first half, sends the
  result on to worker2 with ``rpc_async`` and returns that future as its own
  result, so its server thread is free for the next micro-batch at once.
  In evaluation mode the pipelined output must equal an unsplit pass.

It prints the loss of each batch and a throughput table for 1, 2 and 4 splits.

Differences from the tutorial: a small hand-written ResNet (one bottleneck block
per stage, 16 to 256 channels, 10 classes) on 32x32 random images, batch 32, and
2 timed batches per split value, instead of ResNet-50 (torchvision) on 128x128
images, batch 120, 3 batches; no GPUs. The split value here is the number of
micro-batches (the tutorial's ``split_size`` is a micro-batch size). The
``async_execution`` inference pass is an addition. It is not used for training
because in ``torch.distributed.rpc`` (checked with torch 2.13) the reply of an
``async_execution`` function is not recorded by distributed autograd: the
caller gets a tensor without a ``grad_fn`` and no gradient reaches the callee.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import threading
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchrpc.autograd as dist_autograd
import torchrpc.rpc as rpc
from torchrpc.examples import _launch
from torchrpc.examples._launch import say
from torchrpc.optim import DistributedOptimizer

WORKERS = ("master", "worker1", "worker2")
NUM_CLASSES = 10
SPLITS = (1, 2, 4)


# --------------------------------------------------------------------------- model


class Bottleneck(nn.Module):
    """A ResNet bottleneck block: 1x1 reduce, 3x3, 1x1 expand, plus a shortcut."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + self.shortcut(x))


class Shard(nn.Module):
    """Common part of both shards: a lock around the layers and parameter RRefs."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def parameter_rrefs(self) -> list[rpc.RRef]:
        """Every parameter of this shard, wrapped in an RRef owned by this worker."""
        return [rpc.RRef(p) for p in self.parameters()]

    def compute(self, x: torch.Tensor, train: bool = True) -> torch.Tensor:
        """Run the layers on one micro-batch, one micro-batch at a time.

        ``train=False`` runs them in evaluation mode (BatchNorm uses its running
        statistics), so that each sample's output does not depend on the split.
        """
        with self._lock:
            self.layers.train(train)
            return self.layers(x)


class ShardOne(Shard):
    """First half, on worker1: stem, stage 1 and stage 2; holds an RRef to the second half."""

    def __init__(self, next_rref: rpc.RRef) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.next_rref = next_rref
        self.layers = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            Bottleneck(16, 8),              # -> 32 channels
            Bottleneck(32, 16, stride=2),   # -> 64 channels, half size
        )

    def forward(self, x_rref: rpc.RRef) -> torch.Tensor:
        """Training path: fetch the micro-batch from its owner (the master), run this half."""
        return self.compute(x_rref.to_here())

    @rpc.functions.async_execution
    def infer(self, x: torch.Tensor) -> torch.futures.Future:
        """Inference path: run this half, then hand the result straight on to worker2.

        The call to worker2 is asynchronous and its future is returned as this
        call's result, so this server thread is free for the next micro-batch
        while worker2 is still busy with this one.
        """
        with torch.no_grad():
            y = self.compute(x, train=False)
        return self.next_rref.rpc_async().infer(y)


class ShardTwo(Shard):
    """Second half, on worker2: stages 3 and 4, pooling and the classifier."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.layers = nn.Sequential(
            Bottleneck(64, 32, stride=2),   # -> 128 channels
            Bottleneck(128, 64, stride=2),  # -> 256 channels
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(256, NUM_CLASSES),
        )

    def forward(self, y_rref: rpc.RRef) -> torch.Tensor:
        """Training path: fetch worker1's output from worker1, run this half."""
        return self.compute(y_rref.to_here())

    def infer(self, y: torch.Tensor) -> torch.Tensor:
        """Inference path: run this half on a tensor sent by worker1."""
        with torch.no_grad():
            return self.compute(y, train=False)


class PipelinedResNet(nn.Module):
    """The master's handle on the two shards; feeds them micro-batches."""

    def __init__(self, splits: int) -> None:
        super().__init__()
        self.splits = splits
        self.p2_rref = rpc.remote(WORKERS[2], ShardTwo)
        self.p1_rref = rpc.remote(WORKERS[1], ShardOne, args=(self.p2_rref,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Pipelined training forward pass, recorded by distributed autograd."""
        futures = []
        for micro in x.chunk(self.splits):
            x_rref = rpc.RRef(micro)
            y_rref = self.p1_rref.remote().forward(x_rref)      # stays on worker1
            futures.append(self.p2_rref.rpc_async().forward(y_rref))
        # Completion order is arbitrary; the outputs are joined in input order.
        return torch.cat([fut.wait() for fut in futures])

    def infer(self, x: torch.Tensor, splits: int | None = None) -> torch.Tensor:
        """Pipelined inference through worker1's ``async_execution`` hand-off."""
        chunks = x.chunk(splits or self.splits)
        futures = [self.p1_rref.rpc_async().infer(micro) for micro in chunks]
        return torch.cat([fut.wait() for fut in futures])

    def parameter_rrefs(self) -> list[rpc.RRef]:
        """Parameter RRefs of both shards, for the DistributedOptimizer."""
        refs = []
        for shard in (self.p1_rref, self.p2_rref):
            refs.extend(shard.remote().parameter_rrefs().to_here())
        return refs


# --------------------------------------------------------------------------- driver


def train_batches(model: PipelinedResNet, opt: DistributedOptimizer,
                  batches: list[tuple[torch.Tensor, torch.Tensor]], label: str) -> float:
    """Train on every batch; return the seconds taken."""
    started = time.perf_counter()
    for i, (inputs, labels) in enumerate(batches, 1):
        one_hot = F.one_hot(labels, NUM_CLASSES).float()
        with dist_autograd.context() as context_id:
            loss = F.mse_loss(model(inputs), one_hot)
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        say(f"  {label} batch {i}: loss {loss.item():.4f}")
    return time.perf_counter() - started


def infer_batches(model: PipelinedResNet, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Run the inference pass on every batch; return the seconds taken.

    Afterwards the first batch is run again as one piece: in evaluation mode the
    pipelined output must match it, which also shows that the micro-batch
    outputs were joined in input order.
    """
    started = time.perf_counter()
    outputs = [model.infer(inputs) for inputs, _ in batches]
    seconds = time.perf_counter() - started
    whole = model.infer(batches[0][0], splits=1)
    if not torch.allclose(outputs[0], whole, atol=1e-5):
        raise RuntimeError(f"{model.splits}-way pipelined inference differs from the unsplit pass")
    return seconds


def run_master(args: argparse.Namespace) -> None:
    """Build the pipeline once per split value, train, and print the throughput table."""
    gen = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=gen),
         torch.randint(0, NUM_CLASSES, (args.batch_size,), generator=gen))
        for _ in range(args.batches)
    ]
    say(f"pipeline over {WORKERS[1]} and {WORKERS[2]}: batch {args.batch_size} of "
        f"3x{args.image_size}x{args.image_size}, {args.batches} timed batch(es) per split")
    rows = []
    for splits in SPLITS:
        model = PipelinedResNet(splits)
        opt = DistributedOptimizer(torch.optim.SGD, model.parameter_rrefs(), lr=0.05)
        train_batches(model, opt, batches[:1], f"splits={splits} warm-up")
        seconds = train_batches(model, opt, batches, f"splits={splits}")
        infer_seconds = infer_batches(model, batches)
        rows.append((splits, -(-args.batch_size // splits), seconds / len(batches),
                     args.batch_size * len(batches) / seconds,
                     args.batch_size * len(batches) / infer_seconds))
    say("\nsplits  micro-batch  train s/batch  train images/s  inference images/s")
    for splits, micro, per_batch, rate, infer_rate in rows:
        say(f"{splits:>6}  {micro:>11}  {per_batch:>13.3f}  {rate:>14.1f}  {infer_rate:>18.1f}")
    say("")


def run_rank(rank: int, world_size: int, args: argparse.Namespace) -> None:
    """Entry point of one rank: the master trains, the two workers only serve."""
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=120)
    rpc.init_rpc(WORKERS[rank], rank=rank, world_size=world_size, rpc_backend_options=options)
    if rank == 0:
        run_master(args)
    rpc.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Parse flags and run the three ranks; return the exit status."""
    parser = _launch.base_parser(__doc__.splitlines()[0], default_timeout=300)
    parser.add_argument("--batch-size", type=int, default=None, help="default 32, or 16 with --smoke")
    parser.add_argument("--image-size", type=int, default=None, help="default 32, or 16 with --smoke")
    parser.add_argument("--batches", type=int, default=None,
                        help="timed batches per split value; default 2, or 1 with --smoke")
    args = parser.parse_args(argv)
    _launch.smoke_defaults(parser, args, batch_size=(16, 32), image_size=(16, 32), batches=(1, 2))
    return _launch.launch(run_rank, len(WORKERS), args)


if __name__ == "__main__":
    # Run through the package module so that RPC peers and spawned ranks see the
    # functions and classes under their importable names, not under __main__.
    sys.exit(importlib.import_module("torchrpc.examples.pipeline").main())
