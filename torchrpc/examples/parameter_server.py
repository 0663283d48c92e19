"""A parameter server trained by several trainers with distributed autograd.

Re-creates the "Implementing a Parameter Server using Distributed RPC Framework"
tutorial on scikit-learn's bundled 8x8 handwritten digits (no download):

* rank 0 is ``parameter_server``. It only calls ``init_rpc`` and ``shutdown``;
  the model it holds is created lazily by the first trainer that asks for it,
  and every later trainer gets the same object (a lock guards the creation).
* ranks 1..N are ``trainer1``..``trainerN``. Each holds an RRef to that one
  server object, runs forward passes on it over RPC, runs the backward pass
  with ``dist_autograd.backward`` and updates the shared model with a
  ``DistributedOptimizer`` over parameter RRefs that the server handed out. On
  every step it also fetches the server's gradients for its autograd context
  (a dict keyed by tensors, returned over RPC) and checks that it is complete.
* after every trainer has shut down, the server evaluates the trained model on
  the held-out test set and prints ``test accuracy: 0.xx``.

Run it::

    python -m torchrpc.examples.parameter_server              # 2 trainers, 10 epochs
    python -m torchrpc.examples.parameter_server --trainers 3 --epochs 3
    torchrun --nproc-per-node 3 -m torchrpc.examples.parameter_server

Differences from the tutorial: digits (1,797 8x8 images) instead of MNIST, so
the CNN's first linear layer takes 256 features instead of 9,216; 2 trainers
instead of 3; several epochs with SGD momentum 0.9 (the tutorial runs one MNIST
epoch of 1,875 steps with plain SGD; digits has only ~45 steps per epoch); the
server's forward pass runs on clones of the parameters, so that concurrent
optimizer steps cannot invalidate tensors another trainer's backward pass
saved (see ``ParameterServer.forward``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits

import torchrpc.autograd as dist_autograd
import torchrpc.rpc as rpc
from torchrpc.examples import _launch
from torchrpc.examples._launch import say
from torchrpc.optim import DistributedOptimizer

PS_NAME = "parameter_server"
TEST_SIZE = 360
DATA_SEED = 0
MODEL_SEED = 0


# --------------------------------------------------------------------------- data


def load_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(x_train, y_train, x_test, y_test)``: a fixed split, normalised by train stats."""
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1)  # N x 1 x 8 x 8
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(DATA_SEED))
    test, train = order[:TEST_SIZE], order[TEST_SIZE:]
    mean, std = images[train].mean(), images[train].std()
    images = (images - mean) / std
    return images[train], labels[train], images[test], labels[test]


# --------------------------------------------------------------------------- model


class Net(nn.Module):
    """The tutorial's MNIST CNN, with the first linear layer sized for 8x8 input."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3)     # 8x8 -> 6x6
        self.conv2 = nn.Conv2d(32, 64, 3)    # 6x6 -> 4x4, max-pool -> 2x2
        self.fc1 = nn.Linear(64 * 2 * 2, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor, dropout: bool = True,
                params: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Return log-probabilities; ``dropout=False`` is evaluation mode.

        ``params`` replaces the module's own parameters (same names) for this
        call only, without touching the module, so threads may pass different ones.
        """
        p = dict(self.named_parameters()) if params is None else params
        x = F.relu(F.conv2d(x, p["conv1.weight"], p["conv1.bias"]))
        x = F.max_pool2d(F.relu(F.conv2d(x, p["conv2.weight"], p["conv2.bias"])), 2)
        x = F.dropout(x, 0.25, training=dropout)
        x = F.relu(F.linear(torch.flatten(x, 1), p["fc1.weight"], p["fc1.bias"]))
        x = F.dropout(x, 0.5, training=dropout)
        return F.log_softmax(F.linear(x, p["fc2.weight"], p["fc2.bias"]), dim=1)


class ParameterServer:
    """Owns the shared model on rank 0; trainers reach it through an RRef."""

    def __init__(self) -> None:
        torch.manual_seed(MODEL_SEED)
        self.model = Net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Training-mode forward pass, recorded by distributed autograd.

        Trainers run concurrently, so one trainer's optimizer step can update the
        weights in place while another trainer's backward pass still needs the
        values its forward pass saved. The forward therefore runs on clones of
        the parameters: the clones are what autograd saves, and the gradient
        still flows through each clone to the real parameter.
        """
        snapshot = {name: p.clone() for name, p in self.model.named_parameters()}
        return self.model(x, params=snapshot)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Evaluation-mode class predictions (no dropout, no autograd)."""
        with torch.no_grad():
            return self.model(x, dropout=False).argmax(dim=1)

    def parameter_rrefs(self) -> list[rpc.RRef]:
        """Wrap every model parameter in an RRef owned by this worker."""
        return [rpc.RRef(p) for p in self.model.parameters()]

    def num_parameters(self) -> int:
        """Number of parameter tensors in the model."""
        return len(list(self.model.parameters()))

    def dist_gradients(self, context_id: int) -> dict[torch.Tensor, torch.Tensor]:
        """Gradients held on this worker by the given autograd context, keyed by parameter."""
        return dict(dist_autograd.get_gradients(context_id))


class _LazyServer:
    """Creates the one ParameterServer of this process on first use, under a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._server: ParameterServer | None = None

    def get(self) -> ParameterServer:
        with self._lock:
            if self._server is None:
                self._server = ParameterServer()
            return self._server

    def created(self) -> bool:
        with self._lock:
            return self._server is not None


_SERVER = _LazyServer()


def get_or_create_ps() -> ParameterServer:
    """RPC target: return this process's parameter server, creating it the first time."""
    return _SERVER.get()


def _call_method(method: Callable[..., Any], rref: rpc.RRef, *args: Any) -> Any:
    """Runs on the RRef's owner: call ``method`` on the object the RRef points to."""
    return method(rref.local_value(), *args)


def remote_method(method: Callable[..., Any], rref: rpc.RRef, *args: Any) -> Any:
    """Call ``method`` on the object behind ``rref``, on its owner, and wait for the result."""
    return rpc.rpc_sync(rref.owner(), _call_method, args=(method, rref, *args))


class TrainerNet(nn.Module):
    """The trainer's view of the model: every forward pass runs on the parameter server."""

    def __init__(self) -> None:
        super().__init__()
        self.ps_rref = rpc.remote(PS_NAME, get_or_create_ps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return remote_method(ParameterServer.forward, self.ps_rref, x)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return remote_method(ParameterServer.predict, self.ps_rref, x)

    def parameter_rrefs(self) -> list[rpc.RRef]:
        return remote_method(ParameterServer.parameter_rrefs, self.ps_rref)


# --------------------------------------------------------------------------- ranks


def accuracy(predictions: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of correct predictions."""
    return float((predictions == labels).float().mean())


def run_trainer(rank: int, num_trainers: int, args: argparse.Namespace) -> None:
    """Train on this trainer's shard of the training set, then evaluate over RPC."""
    name = rpc.get_worker_info().name
    x_train, y_train, x_test, y_test = load_split()
    shard = torch.arange(rank - 1, len(y_train), num_trainers)
    net = TrainerNet()
    n_params = remote_method(ParameterServer.num_parameters, net.ps_rref)
    opt = DistributedOptimizer(torch.optim.SGD, net.parameter_rrefs(),
                               lr=args.lr, momentum=args.momentum)
    shuffle = torch.Generator().manual_seed(rank)
    for epoch in range(1, args.epochs + 1):
        started = time.perf_counter()
        order = shard[torch.randperm(len(shard), generator=shuffle)]
        losses = []
        for batch in order.split(args.batch_size):
            with dist_autograd.context() as context_id:
                loss = F.nll_loss(net(x_train[batch]), y_train[batch])
                dist_autograd.backward(context_id, [loss])
                grads = remote_method(ParameterServer.dist_gradients, net.ps_rref, context_id)
                if len(grads) != n_params:
                    raise RuntimeError(f"{name}: server holds {len(grads)} gradients "
                                       f"for context {context_id}, expected {n_params}")
                opt.step(context_id)
            losses.append(loss.item())
        say(f"{name}: epoch {epoch}/{args.epochs}  loss {sum(losses) / len(losses):.4f}  "
            f"({len(losses)} steps, {time.perf_counter() - started:.1f} s)")
    own = accuracy(net.predict(x_test), y_test)
    say(f"{name}: training complete; accuracy seen over RPC after its last step {own:.2f}")


def run_rank(rank: int, world_size: int, args: argparse.Namespace) -> None:
    """Entry point of one rank: 0 is the parameter server, the others are trainers."""
    if rank == 0:
        started = time.perf_counter()
        rpc.init_rpc(PS_NAME, rank=rank, world_size=world_size)
        say(f"{PS_NAME}: serving {world_size - 1} trainer(s) for {args.epochs} epoch(s)")
        rpc.shutdown()  # graceful: returns once every trainer has shut down too
        if not _SERVER.created():
            raise RuntimeError("no trainer ever created the parameter server")
        _, _, x_test, y_test = load_split()
        acc = accuracy(_SERVER.get().predict(x_test), y_test)
        say(f"{PS_NAME}: done in {time.perf_counter() - started:.1f} s")
        say(f"test accuracy: {acc:.2f}")
    else:
        rpc.init_rpc(f"trainer{rank}", rank=rank, world_size=world_size)
        run_trainer(rank, world_size - 1, args)
        rpc.shutdown()


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, int]:
    """Parse the flags; return them with the world size they imply."""
    parser = _launch.base_parser(__doc__.splitlines()[0], default_timeout=300)
    parser.add_argument("--trainers", type=int, default=2, help="number of trainers (default 2)")
    parser.add_argument("--world-size", "--world_size", type=int, default=None,
                        help="total processes, parameter server included (overrides --trainers)")
    parser.add_argument("--epochs", type=int, default=None, help="default 10, or 5 with --smoke")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.03)
    parser.add_argument("--momentum", type=float, default=0.9)
    args = parser.parse_args(argv)
    _launch.smoke_defaults(parser, args, epochs=(5, 10))
    world_size = args.world_size
    if world_size is None:
        from_torchrun = _launch.torchrun_rank()
        world_size = from_torchrun[1] if from_torchrun else args.trainers + 1
    if world_size < 2:
        parser.error(f"--world-size/--trainers: need at least one trainer, got world size {world_size}")
    return args, world_size


def main(argv: list[str] | None = None) -> int:
    """Parse flags and run every rank; return the exit status."""
    args, world_size = parse_args(argv)
    return _launch.launch(run_rank, world_size, args)


if __name__ == "__main__":
    # Run through the package module so that RPC peers and spawned ranks see the
    # functions and classes under their importable names, not under __main__.
    sys.exit(importlib.import_module("torchrpc.examples.parameter_server").main())
