"""Shared plumbing for the example programs: arguments, ports, and process launch.

Every example is a function ``entry(rank, world_size, args)`` that plays one
rank. :func:`launch` runs it in one of two ways:

* Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` are in the environment) this
  process *is* that rank: the entry runs here and nothing is spawned.
* Otherwise it spawns ``world_size`` local processes with the ``spawn`` start
  method, on a free loopback port (``MASTER_ADDR=127.0.0.1``).

Either way each rank gets a hard wall-clock limit. A watchdog thread ends a rank
that runs past it, or whose launching parent has gone away, so that no worker
outlives the program. The launcher ends the remaining ranks as soon as one fails
and returns a non-zero exit status.
"""

from __future__ import annotations

import argparse
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable

import torch

Entry = Callable[[int, int, argparse.Namespace], None]

LOOPBACK = "127.0.0.1"
EXIT_TIMEOUT = 124
EXIT_ORPHANED = 125
_POLL_S = 0.2
_GRACE_S = 5.0


def free_ports(count: int) -> list[int]:
    """Return ``count`` distinct TCP ports on 127.0.0.1 that were free a moment ago."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in socks:   # all bound at once, so the ports differ
            sock.bind((LOOPBACK, 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    return free_ports(1)[0]


def base_parser(description: str, *, default_timeout: float = 300.0) -> argparse.ArgumentParser:
    """Return a parser with the flags every example shares: ``--smoke`` and ``--timeout``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--smoke", action="store_true",
        help="short run (a few seconds) used by the test suite",
    )
    parser.add_argument(
        "--timeout", type=float, default=default_timeout, metavar="SECONDS",
        help="hard wall-clock limit for the whole run (default: %(default)s)",
    )
    return parser


def smoke_defaults(parser: argparse.ArgumentParser, args: argparse.Namespace,
                   **defaults: tuple[int, int]) -> None:
    """Give each count flag left unset its ``(smoke, full)`` default; refuse one below 1."""
    for name, (smoke, full) in defaults.items():
        value = getattr(args, name)
        if value is None:
            setattr(args, name, smoke if args.smoke else full)
        elif value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def say(text: str) -> None:
    """Print ``text`` and a newline in one write, then flush.

    Ranks share one stdout; with ``PYTHONUNBUFFERED`` a plain ``print`` writes
    the text and the newline separately, and lines of different ranks mix.
    """
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def torchrun_rank() -> tuple[int, int] | None:
    """Return ``(rank, world_size)`` when started by torchrun, else ``None``."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def launch(entry: Entry, world_size: int, args: argparse.Namespace) -> int:
    """Run ``entry`` as every rank of a world of ``world_size``; return an exit status.

    Under torchrun the world size comes from the environment and must match.
    """
    deadline = time.monotonic() + args.timeout
    given = torchrun_rank()
    if given is not None:
        rank, env_world = given
        if env_world != world_size:
            print(
                f"error: torchrun started WORLD_SIZE={env_world} but the flags ask for "
                f"{world_size}; pass matching --nproc-per-node and flags",
                file=sys.stderr,
            )
            return 2
        status = _run_rank(entry, rank, world_size, args, args.timeout, parent_pid=None)
        if status != 0:
            _exit_now(status)
        return status
    return _spawn_world(entry, world_size, args, deadline)


def _spawn_world(entry: Entry, world_size: int, args: argparse.Namespace, deadline: float) -> int:
    env = {"MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(free_port())}
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(
            target=_child_main,
            args=(entry, rank, world_size, args, env, args.timeout, os.getpid()),
            name=f"rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    try:
        # A rank that hits the limit reports its stacks itself; give it time to.
        return _wait_all(procs, deadline + _GRACE_S, args.timeout)
    finally:
        _end_all(procs)


def _wait_all(procs: list[multiprocessing.Process], deadline: float, limit: float) -> int:
    """Wait until every rank exits 0, one fails, or the deadline passes."""
    running = list(procs)
    while running:
        left = deadline - time.monotonic()
        if left <= 0:
            print(f"error: wall-clock limit of {limit:.0f} s exceeded; stopping all ranks",
                  file=sys.stderr, flush=True)
            return EXIT_TIMEOUT
        multiprocessing.connection.wait([p.sentinel for p in running], timeout=min(left, 1.0))
        for proc in list(running):
            if proc.exitcode is None:
                continue
            running.remove(proc)
            if proc.exitcode != 0:
                print(f"error: {proc.name} exited with status {proc.exitcode}; stopping the others",
                      file=sys.stderr, flush=True)
                return proc.exitcode if proc.exitcode > 0 else 1
    return 0


def _end_all(procs: list[multiprocessing.Process]) -> None:
    """Terminate, then kill, any rank that is still alive, and reap them all."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=3)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=3)


def _child_main(entry: Entry, rank: int, world_size: int, args: argparse.Namespace,
                env: dict[str, str], limit: float, parent_pid: int) -> None:
    """Body of a spawned rank: set the rendezvous environment and run the entry."""
    os.environ.update(env)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    status = _run_rank(entry, rank, world_size, args, limit, parent_pid)
    if status != 0:
        _exit_now(status)


def _exit_now(status: int) -> None:
    """Exit at once: after a failure, RPC threads may still be alive; do not wait on them."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _run_rank(entry: Entry, rank: int, world_size: int, args: argparse.Namespace,
              limit: float, parent_pid: int | None) -> int:
    """Run one rank under a watchdog; return 0 on success and 1 on an exception."""
    torch.set_num_threads(1)
    torch.manual_seed(rank)
    _start_watchdog(rank, time.monotonic() + limit, limit, parent_pid)
    try:
        entry(rank, world_size, args)
    except BaseException:  # noqa: BLE001 - report whatever ended the rank, then fail
        print(f"rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        return 1
    return 0


def _start_watchdog(rank: int, deadline: float, limit: float, parent_pid: int | None) -> None:
    """End this process at the deadline, or as soon as its launching parent is gone."""

    def watch() -> None:
        while True:
            time.sleep(_POLL_S)
            if time.monotonic() > deadline:
                print(f"rank {rank}: wall-clock limit of {limit:.0f} s exceeded; "
                      "stacks of its threads follow", file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                os._exit(EXIT_TIMEOUT)
            if parent_pid is not None and os.getppid() != parent_pid:
                os._exit(EXIT_ORPHANED)

    threading.Thread(target=watch, name="example-watchdog", daemon=True).start()
