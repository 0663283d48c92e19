"""A model-parallel character RNN: embedding and decoder on a parameter server.

Re-creates the distributed RNN part of the "Getting Started with Distributed RPC
Framework" tutorial:

* rank 0 is ``ps``: it only calls ``init_rpc`` and ``shutdown``.
* rank 1 is ``trainer``. Its model puts the embedding table and the decoder on
  the ps as ``RemoteModule``\\ s and keeps the LSTM in between local. One forward
  pass is therefore two round trips to the ps (embedding lookup, then decoder).
* the optimizer is a ``DistributedOptimizer`` over RRefs to every parameter: the
  ps's, from ``RemoteModule.remote_parameters()``, and the trainer's own LSTM
  parameters wrapped in local ``RRef``\\ s, so it has two owners and makes an RPC
  to its own worker. Each step runs in ``dist_autograd.context()``;
  gradients live in the context, so there is no ``zero_grad`` and ``.grad``
  stays ``None`` (the first step checks this).

The model learns to predict the next character of a text that ships with Python:
by default the Zen of Python (the ``this`` module), or the source of any
standard-library module (``--text-module``). It prints the loss per epoch and
ends with a line of text sampled from the trained model.

Differences from the tutorial: ``RemoteModule`` instead of ``rpc.remote`` plus
hand-written parameter-RRef helpers; a real text instead of random token ids
(vocabulary of about 40 characters instead of 7 to 10 tokens; embedding 16,
one LSTM layer of 64 instead of dimension 2 and 4 layers of 3); SGD with lr 0.5
and momentum 0.9 instead of lr 0.05, so that the loss visibly falls within a
few epochs; no dropout.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import importlib
import inspect
import io
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchrpc.autograd as dist_autograd
import torchrpc.rpc as rpc
from torchrpc.examples import _launch
from torchrpc.examples._launch import say
from torchrpc.nn import RemoteModule
from torchrpc.optim import DistributedOptimizer

PS_NAME = "ps"
TRAINER_NAME = "trainer"
PROMPT = "Beautiful is"


def load_text(module_name: str) -> str:
    """The Zen of Python for ``"this"``, otherwise the source of the named module."""
    if module_name == "this":
        with contextlib.redirect_stdout(io.StringIO()):   # importing `this` prints the Zen
            zen = importlib.import_module("this")
        return codecs.decode(zen.s, "rot13")
    return inspect.getsource(importlib.import_module(module_name))


class Vocabulary:
    """Maps the characters of a text to token ids and back."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)


class CharRNN(nn.Module):
    """Embedding and decoder live on the ps as RemoteModules; the LSTM is local."""

    def __init__(self, ntoken: int, embedding_dim: int, hidden: int) -> None:
        super().__init__()
        self.embedding = RemoteModule(f"{PS_NAME}/cpu", nn.Embedding, args=(ntoken, embedding_dim))
        self.lstm = nn.LSTM(embedding_dim, hidden, batch_first=True)
        self.decoder = RemoteModule(f"{PS_NAME}/cpu", nn.Linear, args=(hidden, ntoken))

    def forward(self, tokens: torch.Tensor,
                state: tuple[torch.Tensor, torch.Tensor] | None = None,
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Return next-token logits (batch x seq x ntoken) and the LSTM state."""
        embedded = self.embedding.forward(tokens)      # RPC to the ps
        output, state = self.lstm(embedded, state)      # local
        return self.decoder.forward(output), state      # RPC to the ps

    def parameter_rrefs(self) -> list[rpc.RRef]:
        """RRefs to every parameter: remote ones owned by the ps, local ones by us."""
        return (self.embedding.remote_parameters()
                + [rpc.RRef(p) for p in self.lstm.parameters()]
                + self.decoder.remote_parameters())


def random_windows(data: torch.Tensor, batch: int, length: int,
                   gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random windows of the text and the same windows shifted by one."""
    starts = torch.randint(0, len(data) - length - 1, (batch,), generator=gen)
    inputs = torch.stack([data[s:s + length] for s in starts])
    targets = torch.stack([data[s + 1:s + length + 1] for s in starts])
    return inputs, targets


def check_local_gradients(model: CharRNN, context_id: int) -> None:
    """The trainer's context holds exactly the LSTM's gradients, and ``.grad`` is unused."""
    grads = dist_autograd.get_gradients(context_id)
    mine = {id(p) for p in model.lstm.parameters()}
    if {id(t) for t in grads} != mine:
        raise RuntimeError(f"trainer's autograd context holds {len(grads)} gradients, "
                           f"expected the {len(mine)} LSTM parameters")
    if any(p.grad is not None for p in model.lstm.parameters()):
        raise RuntimeError("distributed backward wrote .grad; gradients belong in the context")


def sample(model: CharRNN, vocab: Vocabulary, prompt: str, length: int) -> str:
    """Continue ``prompt`` by sampling from the model (two RPCs per character)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        logits, state = model(vocab.encode(prompt).unsqueeze(0))
        ids: list[int] = []
        for _ in range(length):
            probs = F.softmax(logits[0, -1] / 0.5, dim=-1)
            ids.append(int(torch.multinomial(probs, 1, generator=gen)))
            logits, state = model(torch.tensor([[ids[-1]]]), state)
    return prompt + vocab.decode(ids)


def run_trainer(args: argparse.Namespace) -> None:
    """Train the model and print the loss per epoch and a sample."""
    text = load_text(args.text_module)
    vocab = Vocabulary(text)
    data = vocab.encode(text)
    torch.manual_seed(0)
    model = CharRNN(len(vocab), embedding_dim=16, hidden=64)
    opt = DistributedOptimizer(torch.optim.SGD, model.parameter_rrefs(), lr=0.5, momentum=0.9)
    say(f"{TRAINER_NAME}: {len(text)} characters of `{args.text_module}`, "
        f"{len(vocab)} distinct; {args.epochs} epochs of {args.batches} batches")
    gen = torch.Generator().manual_seed(0)
    for epoch in range(1, args.epochs + 1):
        started = time.perf_counter()
        total = 0.0
        for step in range(args.batches):
            inputs, targets = random_windows(data, args.batch_size, args.seq_len, gen)
            with dist_autograd.context() as context_id:
                logits, _ = model(inputs)
                loss = F.cross_entropy(logits.reshape(-1, len(vocab)), targets.reshape(-1))
                dist_autograd.backward(context_id, [loss])
                if epoch == 1 and step == 0:
                    check_local_gradients(model, context_id)
                opt.step(context_id)
            total += loss.item()
        say(f"{TRAINER_NAME}: epoch {epoch}/{args.epochs}  loss {total / args.batches:.4f}  "
            f"({time.perf_counter() - started:.1f} s)")
    say(f"sample: {sample(model, vocab, PROMPT, args.sample_len)!r}")


def run_rank(rank: int, world_size: int, args: argparse.Namespace) -> None:
    """Entry point of one rank: 0 is the parameter server, 1 the trainer."""
    if rank == 0:
        rpc.init_rpc(PS_NAME, rank=rank, world_size=world_size)
    else:
        rpc.init_rpc(TRAINER_NAME, rank=rank, world_size=world_size)
        run_trainer(args)
    rpc.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Parse flags and run the ps and the trainer; return the exit status."""
    parser = _launch.base_parser(__doc__.splitlines()[0], default_timeout=300)
    parser.add_argument("--epochs", type=int, default=None, help="default 30, or 10 with --smoke")
    parser.add_argument("--batches", type=int, default=10, help="batches per epoch (default 10)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--sample-len", type=int, default=None, help="default 120, or 40 with --smoke")
    parser.add_argument("--text-module", default="this",
                        help="train on this module's text: `this` (the Zen of Python, default) "
                             "or any standard-library module's source, e.g. `json.decoder`")
    args = parser.parse_args(argv)
    _launch.smoke_defaults(parser, args, epochs=(10, 30), sample_len=(40, 120))
    return _launch.launch(run_rank, 2, args)


if __name__ == "__main__":
    # Run through the package module so that RPC peers and spawned ranks see the
    # functions and classes under their importable names, not under __main__.
    sys.exit(importlib.import_module("torchrpc.examples.rnn").main())
