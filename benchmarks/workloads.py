"""The workloads, as run inside the worker processes.

Everything here runs in a spawned worker with one system's modules in hand. The caller
(rank 0) runs one ``run_*`` function, which returns ``(metrics, details)``; the callee
(rank 1) only serves calls, executing the functions of :mod:`.callees`, which both workers
import by reference when a call is unpickled.

None of this imports an RPC module: the modules arrive in :class:`WorkerContext`
(:mod:`.context`). The echo workloads are in :mod:`.echo`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from .callees import (PSTrainer, add_one, make_ps_table, make_stage, memory_mb, mlp, noop,
                      peak_rss_mb, ps_train, stage_forward, stage_param_rrefs, worker_pid)
from .context import Result, Turns, WorkerContext, percentile
from .echo import run_echo, run_echo_numpy
from .options import BenchOptions

__all__ = ["PAIR_RUNNERS", "PSTrainer", "Turns", "WorkerContext", "memory_mb", "peak_rss_mb",
           "percentile"]


def _small_call(options: BenchOptions) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The function and arguments of the "small call" used by the latency workloads."""
    if options.small_call == "add":
        return torch.add, (torch.ones(2), 1)
    return add_one, (torch.ones(2),)


def _check_small_result(value: Any) -> None:
    """Raise if a small call did not return ``ones(2) + 1``."""
    if not isinstance(value, torch.Tensor) or not torch.equal(value, torch.full((2,), 2.0)):
        raise AssertionError(f"small call returned {value!r}, expected tensor([2., 2.])")


# ----------------------------------------------------------------------------------------
# Workloads, run on the caller


def run_latency(ctx: WorkerContext) -> Result:
    """Small ``rpc_sync`` calls one after the other: p50 and p99 in microseconds; then
    the p50 of a no-op call with an int argument (no tensor at all)."""
    opts = ctx.options
    func, args = _small_call(opts)
    _check_small_result(ctx.rpc.rpc_sync(ctx.peer, func, args=args))
    samples: list[float] = []
    noops: list[float] = []
    numbers = itertools.count()

    def call() -> Any:
        return ctx.rpc.rpc_sync(ctx.peer, func, args=args)

    def noop_call() -> None:
        i = next(numbers)
        if ctx.rpc.rpc_sync(ctx.peer, noop, args=(i,)) != i:
            raise AssertionError(f"no-op call did not return its argument {i}")

    for calls, warmup in _call_turns(ctx, opts.latency_calls, opts.latency_warmup, call):
        samples += _timed(call, calls, warmup)
        noops += _timed(noop_call, calls, warmup)
    metrics = {"rpc_sync_p50_us": percentile(samples, 50),
               "rpc_sync_p99_us": percentile(samples, 99),
               "noop_p50_us": percentile(noops, 50)}
    details = {"calls": len(samples), "min_us": min(samples), "max_us": max(samples),
               "mean_us": sum(samples) / len(samples), "small_call": opts.small_call,
               "turns": _turns_taken(ctx) or 1}
    return metrics, details


def run_throughput(ctx: WorkerContext) -> Result:
    """Issue N ``rpc_async`` calls, then ``wait_all``: the best calls/s over the repeats,
    or, taking turns (each turn times one repeat or more, after an untimed batch), the
    median: the best of many repeats favours the system whose speed scatters most."""
    opts = ctx.options
    func, args = _small_call(opts)

    def warm() -> None:
        torch.futures.wait_all([ctx.rpc.rpc_async(ctx.peer, func, args=args)
                                for _ in range(min(500, opts.throughput_calls))])

    warm()
    parts = _turns_taken(ctx)
    rates = []
    for repeats, untimed in _call_turns(ctx, max(opts.throughput_repeats, parts), 0, warm):
        for _ in range(untimed):
            warm()
        for _ in range(repeats):
            start = time.perf_counter()
            futs = [ctx.rpc.rpc_async(ctx.peer, func, args=args)
                    for _ in range(opts.throughput_calls)]
            results = torch.futures.wait_all(futs)
            elapsed = time.perf_counter() - start
            _check_small_result(results[-1])
            rates.append(opts.throughput_calls / elapsed)
            del futs, results
    rate = percentile(rates, 50) if parts else max(rates)
    return {"rpc_async_calls_per_s": rate}, {"calls": opts.throughput_calls, "rates": rates,
                                             "turns": max(parts, 1)}


def run_remote(ctx: WorkerContext) -> Result:
    """``remote()`` followed by ``to_here()``: p50 and p99 in microseconds; then the p50
    of the same with a no-op (an int argument, no tensor: what the latency workload's
    no-op call is to its small call)."""
    opts = ctx.options
    func, args = _small_call(opts)
    _check_small_result(ctx.rpc.remote(ctx.peer, func, args=args).to_here())
    samples: list[float] = []
    noops: list[float] = []
    numbers = itertools.count()

    def call() -> Any:
        return ctx.rpc.remote(ctx.peer, func, args=args).to_here()

    def noop_call() -> None:
        i = next(numbers)
        if ctx.rpc.remote(ctx.peer, noop, args=(i,)).to_here() != i:
            raise AssertionError(f"no-op remote() did not hold its argument {i}")

    for calls, warmup in _call_turns(ctx, opts.remote_calls, opts.remote_warmup, call):
        samples += _timed(call, calls, warmup)
        noops += _timed(noop_call, calls, warmup)
    metrics = {"remote_to_here_p50_us": percentile(samples, 50),
               "remote_to_here_p99_us": percentile(samples, 99),
               "remote_noop_p50_us": percentile(noops, 50)}
    return metrics, {"calls": len(samples), "min_us": min(samples),
                     "turns": _turns_taken(ctx) or 1}


def run_train(ctx: WorkerContext) -> Result:
    """One MLP split over caller and callee; time forward + dist backward + optimizer step."""
    opts = ctx.options
    rpc, dist_autograd = ctx.rpc, ctx.autograd
    dims = list(opts.train_dims)
    split = max(1, (len(dims) - 1) // 2)
    torch.manual_seed(0)
    local_stage = mlp(dims[:split + 1], final_relu=True)
    remote_stage = rpc.remote(ctx.peer, make_stage, args=(dims[split:], 1))
    params = [rpc.RRef(p) for p in local_stage.parameters()]
    params += rpc.rpc_sync(ctx.peer, stage_param_rrefs,
                           args=(remote_stage, ctx.rpc_module_name))
    optimizer = ctx.optim.DistributedOptimizer(torch.optim.SGD, params, lr=opts.train_lr)
    inputs = torch.randn(opts.train_batch, dims[0])
    targets = torch.randint(0, dims[-1], (opts.train_batch,))

    def step() -> float:
        with dist_autograd.context() as context_id:
            hidden = local_stage(inputs)
            out = rpc.rpc_sync(ctx.peer, stage_forward, args=(remote_stage, hidden))
            loss = F.cross_entropy(out, targets)
            dist_autograd.backward(context_id, [loss])
            optimizer.step(context_id)
        return float(loss)

    # The same model and step in this process alone, no RPC: the least any system's step
    # can take (both halves computed here, one after the other, as the split does).
    local_model = torch.nn.Sequential(mlp(dims[:split + 1], final_relu=True),
                                      make_stage(dims[split:], 1))
    local_optimizer = torch.optim.SGD(local_model.parameters(), lr=opts.train_lr)

    def local_step() -> None:
        local_optimizer.zero_grad()
        F.cross_entropy(local_model(inputs), targets).backward()
        local_optimizer.step()

    losses = [step() for _ in range(opts.train_warmup)]
    for _ in range(opts.train_warmup):
        local_step()
    times: list[float] = []
    local_times: list[float] = []
    turn_medians = []

    def logged_step() -> None:
        losses.append(step())

    # Taking turns, each turn starts with one untimed step: the other systems ran last.
    for steps, untimed in _call_turns(ctx, opts.train_steps, 0, step):
        turn = [us / 1e3 for us in _timed(logged_step, steps, untimed)]
        local_times += [us / 1e3 for us in _timed(local_step, steps, 0)]
        times += turn
        turn_medians.append(percentile(turn, 50))
    if len(losses) >= 3 and not losses[-1] < losses[0]:
        raise AssertionError(f"training did not reduce the loss: {losses[0]:.4f} -> "
                             f"{losses[-1]:.4f}")
    details = {"steps": len(times), "min_ms": min(times), "first_loss": losses[0],
               "last_loss": losses[-1], "split": [dims[:split + 1], dims[split:]],
               "turns": len(turn_medians), "turn_medians_ms": turn_medians}
    return {"train_step_ms": percentile(times, 50),
            "train_local_step_ms": percentile(local_times, 50)}, details


def run_fanout(ctx: WorkerContext) -> Result:
    """Rounds of one small call to every callee, each waited for before the next: calls/s
    and the p50 of a round. A system with ``rpc_async_many`` makes each round with it;
    others with a loop of ``rpc_async`` and ``torch.futures.wait_all``."""
    opts = ctx.options
    func, args = _small_call(opts)
    peers = list(ctx.peers)
    if len(peers) < 1:
        raise AssertionError("the fanout workload needs callees")
    many = getattr(ctx.rpc, "rpc_async_many", None)
    rpc_async = ctx.rpc.rpc_async

    def loop() -> list[Any]:
        return torch.futures.wait_all([rpc_async(peer, func, args=args) for peer in peers])

    def fan_out() -> list[Any]:
        if many is not None:
            return many(peers, func, args=args).wait()
        return loop()

    def rate(round_fn: Callable[[], Any]) -> tuple[float, list[float]]:
        samples = []
        clock = time.perf_counter_ns
        start = time.perf_counter()
        for _ in range(opts.fanout_rounds):
            begin = clock()
            round_fn()
            samples.append((clock() - begin) / 1e3)
        return opts.fanout_rounds * len(peers) / (time.perf_counter() - start), samples

    results = fan_out()
    if len(results) != len(peers):
        raise AssertionError(f"fan-out to {len(peers)} callees returned {len(results)} results")
    for value in results:
        _check_small_result(value)
    for _ in range(opts.fanout_warmup):
        fan_out()
    calls_per_s, samples = rate(fan_out)
    metrics = {"fanout_calls_per_s": calls_per_s,
               "fanout_round_p50_us": percentile(samples, 50)}
    details: dict[str, Any] = {
        "callees": len(peers), "rounds": opts.fanout_rounds,
        "group_call": "rpc_async_many" if many is not None else "rpc_async + wait_all",
        "round_p99_us": percentile(samples, 99)}
    if many is not None:  # the same system with the loop, to show what the group call buys
        details["loop_calls_per_s"] = rate(loop)[0]
    return metrics, details


def run_ps(ctx: WorkerContext) -> Result:
    """A parameter server (this worker) and one trainer on every callee, all training at
    once: steps/s of all trainers together and the p50 of one trainer's step.

    The server owns the embedding table; each trainer is an object built on its worker
    with ``rpc.remote`` (see :class:`PSTrainer`). The server starts every trainer's warmup
    steps and waits for all of them, then their timed steps, timing from the first start
    to the last finish.
    """
    opts = ctx.options
    rpc = ctx.rpc
    trainers = list(ctx.peers)
    if not trainers:
        raise AssertionError("the ps workload needs trainers")
    dims = list(opts.ps_dims)
    begin = time.perf_counter()
    table = rpc.RRef(make_ps_table(dims[0], dims[1], 0))
    handles = [rpc.remote(peer, PSTrainer,
                          args=(table, ctx.module_names, dims, opts.ps_bag, opts.ps_batch,
                                opts.ps_lr, rank + 1))
               for rank, peer in enumerate(trainers)]
    limit = opts.time_limit

    def all_train(steps: int) -> list[dict[str, list[float]]]:
        futs = [rpc.rpc_async(peer, ps_train, args=(handle, steps), timeout=limit)
                for peer, handle in zip(trainers, handles)]
        return [fut.wait() for fut in futs]

    warm = all_train(opts.ps_warmup) if opts.ps_warmup else []
    start = time.perf_counter()
    setup_s = start - begin  # building the trainers (their optimizers) and the warmup
    timed = all_train(opts.ps_steps)
    elapsed = time.perf_counter() - start
    times = [ms for run in timed for ms in run["ms"]]
    first = [run["losses"][0] for run in warm or timed]
    last = [run["losses"][-1] for run in timed]
    if not sum(last) < sum(first):
        raise AssertionError(f"training did not reduce the trainers' mean loss: "
                             f"{sum(first) / len(first):.4f} -> {sum(last) / len(last):.4f}")
    metrics = {"ps_steps_per_s": len(times) / elapsed, "ps_step_p50_ms": percentile(times, 50)}
    details = {"trainers": len(trainers), "steps_per_trainer": opts.ps_steps,
               "warmup_steps": opts.ps_warmup, "setup_and_warmup_s": setup_s,
               "elapsed_s": elapsed,
               "step_p99_ms": percentile(times, 99), "min_ms": min(times),
               "trainer_p50_ms": [percentile(run["ms"], 50) for run in timed],
               "first_loss_mean": sum(first) / len(first),
               "last_loss_mean": sum(last) / len(last),
               "table": dims[:2], "trainer_mlp": dims[1:]}
    return metrics, details


def _timed(call: Callable[[], Any], calls: int, warmup: int) -> list[float]:
    """Make ``warmup`` untimed calls, then ``calls`` timed ones: their times in us."""
    for _ in range(warmup):
        call()
    clock = time.perf_counter_ns
    times = []
    for _ in range(calls):
        start = clock()
        call()
        times.append((clock() - start) / 1e3)
    return times


def _call_turns(ctx: WorkerContext, calls: int, warmup: int,
                warm: Callable[[], Any]) -> Iterator[tuple[int, int]]:
    """How many calls to time and, first, not to time in each turn: all of them in one
    go without turns.

    Taking turns (see :class:`Turns`), this system first makes ``warmup`` calls of
    ``warm`` and says it is ready; then the calls are split among its turns, each
    starting with its share of the untimed ones, at least one (the other systems ran
    last).
    """
    turns = ctx.turns
    if turns is None:
        yield calls, warmup
        return
    parts = len(turns.slots)
    for _ in range(warmup):
        warm()
    turns.ready(ctx.rpc.rpc_sync(ctx.peer, worker_pid))
    for k, (n, w) in enumerate(zip(_split(calls, parts), _split(max(warmup, parts), parts))):
        turns.start(turns.slots[k])
        yield n, w
        turns.end(turns.slots[k])


def _turns_taken(ctx: WorkerContext) -> int:
    """How many turns this system takes (0: it runs without turns)."""
    return len(ctx.turns.slots) if ctx.turns else 0


def _split(total: int, parts: int) -> list[int]:
    """``total`` as ``parts`` near-equal positive counts."""
    return [total // parts + (k < total % parts) for k in range(parts)]


PAIR_RUNNERS: dict[str, Callable[[WorkerContext], Result]] = {
    "latency": run_latency,
    "throughput": run_throughput,
    "remote": run_remote,
    "echo": run_echo,
    "echo_numpy": run_echo_numpy,
    "train": run_train,
    "fanout": run_fanout,
    "ps": run_ps,
}
"""Caller-side entry point of each workload with one caller (two workers; ``fanout``:
one caller and ``fanout_callees`` callees; ``ps``: the parameter server and
``ps_trainers`` trainers)."""
