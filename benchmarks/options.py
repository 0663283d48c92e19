"""Benchmark settings: one validated object, sent as JSON to every worker process."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["ALL_WORKLOADS", "DEFAULT_WORKLOADS", "PAIR_WORKLOADS", "QUICK_OVERRIDES",
           "BenchOptions"]

PAIR_WORKLOADS = ("latency", "throughput", "remote", "echo", "echo_numpy", "train")
"""Workloads that run on a caller (rank 0) and a callee (rank 1)."""

DEFAULT_WORKLOADS = (*PAIR_WORKLOADS, "ps")
"""What runs when ``--workloads`` is not given: the pair workloads and ``ps`` (a parameter
server and ``ps_trainers`` trainers, in a session of its own)."""

ALL_WORKLOADS = (*DEFAULT_WORKLOADS, "fanout", "scale")
"""Every workload; ``fanout`` (a caller and ``fanout_callees`` callees) and ``scale`` (4 to
32 workers) spawn more processes and only run when asked for."""


@dataclasses.dataclass
class BenchOptions:
    """Sizes, iteration counts and limits for every workload.

    Sizes of echoed tensors are in MiB (2**20 bytes); throughput in GB/s uses 10**9 bytes.
    """

    # backend options, passed as TensorPipeRpcBackendOptions(...)
    num_worker_threads: int = 16
    rpc_timeout: float = 60.0
    # torch's intra-op threads in every worker (torch.set_num_threads); 0: torch's default
    torch_threads: int = 1
    # 1. small rpc_sync latency
    small_call: str = "add"
    latency_calls: int = 2000
    latency_warmup: int = 200
    # 2. throughput of concurrent rpc_async
    throughput_calls: int = 20_000
    throughput_repeats: int = 3
    # 3. remote() + to_here()
    remote_calls: int = 1000
    remote_warmup: int = 100
    # With two or more systems, the latency and remote workloads run side by side and take
    # turns (see runner.py): their timed calls are split into this many turns per system.
    # 0: they run one system after the other.
    call_turns: int = 8
    # 4./5. echo and peak RSS
    echo_sizes_mb: tuple[float, ...] = (1.0, 64.0, 256.0)
    echo_iters: int = 5
    echo_warmup: int = 1
    # 4b. echo of a numpy array (echo_iters and echo_warmup apply)
    echo_numpy_mb: float = 64.0
    # 6. distributed training step. The warmup covers the first steps after the
    # optimizers are made (torch.optim's first optimizer imports ~800 modules, and
    # steps run slower for a while after that); the median is of the steady state.
    train_dims: tuple[int, ...] = (256, 512, 512, 10)
    train_batch: int = 64
    train_steps: int = 200
    train_warmup: int = 50
    train_lr: float = 0.05
    # With two or more systems, their training sessions run side by side and take turns
    # (see runner.py): the timed steps are split into this many turns per system.
    train_turns: int = 8
    # 7. fan-out: one caller, this many callees; sequential rounds of one small call to each
    fanout_callees: int = 8
    fanout_rounds: int = 2000
    fanout_warmup: int = 100
    # 8. parameter server: rank 0 holds an embedding table (nn.EmbeddingBag, mean of
    # ps_bag rows per sample), each of ps_trainers trainers an MLP on top of it. The
    # first two ps_dims are the table (rows, width), the rest the trainers' layers.
    ps_trainers: int = 4
    ps_dims: tuple[int, ...] = (1024, 32, 64, 10)
    ps_bag: int = 8
    ps_batch: int = 32
    ps_steps: int = 100
    ps_warmup: int = 10
    ps_lr: float = 0.05
    # 9. scale mode
    scale_sizes: tuple[int, ...] = (4, 8, 16, 32)
    scale_threads: int = 2
    scale_time_limit: float = 150.0
    # A session is stopped when the machine's available memory falls below this (GiB).
    min_available_gib: float = 3.0
    # hard limit on one pair session (spawn, init, workload, shutdown)
    time_limit: float = 300.0

    def validate(self) -> None:
        """Raise ValueError naming the first setting that makes no sense."""
        positive_ints = ("num_worker_threads", "latency_calls", "throughput_calls",
                         "throughput_repeats", "remote_calls", "echo_iters", "train_batch",
                         "train_steps", "train_turns", "scale_threads", "fanout_callees",
                         "fanout_rounds", "ps_trainers", "ps_bag", "ps_batch", "ps_steps")
        for name in positive_ints:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, "
                                 f"got {getattr(self, name)}")
        for name in ("latency_warmup", "remote_warmup", "call_turns", "echo_warmup",
                     "train_warmup", "fanout_warmup", "ps_warmup"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, "
                                 f"got {getattr(self, name)}")
        if self.min_available_gib < 0:
            raise ValueError(f"--min-available-gib must be >= 0 (0: never stop), "
                             f"got {self.min_available_gib}")
        for name in ("rpc_timeout", "time_limit", "scale_time_limit", "train_lr",
                     "ps_lr"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, "
                                 f"got {getattr(self, name)}")
        if self.small_call not in ("add", "python"):
            raise ValueError(f"--small-call must be 'add' or 'python', got {self.small_call!r}")
        if self.echo_numpy_mb <= 0:
            raise ValueError(f"--echo-numpy-mb must be positive, got {self.echo_numpy_mb}")
        if not self.echo_sizes_mb or any(s <= 0 for s in self.echo_sizes_mb):
            raise ValueError(f"--echo-sizes-mb needs positive sizes, got {self.echo_sizes_mb}")
        if len(set(self.echo_sizes_mb)) != len(self.echo_sizes_mb):
            raise ValueError(f"--echo-sizes-mb lists a size twice: {self.echo_sizes_mb}")
        if len(self.train_dims) < 3 or any(d < 1 for d in self.train_dims):
            raise ValueError(f"--train-dims needs at least 3 positive sizes (two layers), "
                             f"got {self.train_dims}")
        if len(self.ps_dims) < 3 or any(d < 1 for d in self.ps_dims):
            raise ValueError(f"--ps-dims needs at least 3 positive sizes (table rows, table "
                             f"width, classes), got {self.ps_dims}")
        if self.torch_threads < 0:
            raise ValueError(f"--torch-threads must be >= 0 (0: torch's default), "
                             f"got {self.torch_threads}")
        if self.call_turns > min(self.latency_calls, self.remote_calls):
            raise ValueError(f"--call-turns ({self.call_turns}) can't exceed --latency-calls "
                             f"({self.latency_calls}) or --remote-calls "
                             f"({self.remote_calls}): each turn times at least one call")
        if self.train_turns > self.train_steps:
            raise ValueError(f"--train-turns ({self.train_turns}) can't exceed --train-steps "
                             f"({self.train_steps}): each turn times at least one step")
        if not self.scale_sizes or any(n < 2 for n in self.scale_sizes):
            raise ValueError(f"--scale-sizes needs worker counts >= 2, got {self.scale_sizes}")
        if len(set(self.scale_sizes)) != len(self.scale_sizes):
            raise ValueError(f"--scale-sizes lists a count twice: {self.scale_sizes}")

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-ready dict (tuples become lists)."""
        return {k: list(v) if isinstance(v, tuple) else v
                for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BenchOptions:
        """Inverse of :meth:`to_json`."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                                  for k, v in data.items() if k in fields}
        return cls(**kwargs)


QUICK_OVERRIDES: dict[str, Any] = {
    "latency_calls": 200,
    "latency_warmup": 20,
    "throughput_calls": 2000,
    "throughput_repeats": 1,
    "remote_calls": 100,
    "remote_warmup": 10,
    "call_turns": 2,
    "echo_sizes_mb": (1.0, 4.0),
    "echo_iters": 3,
    "echo_warmup": 1,
    "echo_numpy_mb": 4.0,
    "train_dims": (32, 64, 64, 10),
    "train_batch": 16,
    "train_steps": 6,
    "train_turns": 2,
    "train_warmup": 1,
    "fanout_callees": 3,
    "fanout_rounds": 100,
    "fanout_warmup": 10,
    "ps_dims": (256, 16, 16, 4),
    "ps_batch": 8,
    "ps_steps": 5,
    "ps_warmup": 1,
    "scale_sizes": (3, 4),
    "scale_time_limit": 60.0,
    "time_limit": 60.0,
}
"""What ``--quick`` changes: tiny sizes and few iterations, for a smoke run in seconds."""
