"""Functions that the robustness tests run remotely (importable on every worker)."""

from __future__ import annotations

import os
import random
import threading
import time
from typing import Any, Dict, List

import torch

import torchrpc.rpc as rpc

_counts: Dict[str, int] = {}
_counts_lock = threading.Lock()


def bump(key: str) -> int:
    """Count one call under ``key``; return the new count."""
    with _counts_lock:
        _counts[key] = _counts.get(key, 0) + 1
        return _counts[key]


def count(key: str) -> int:
    with _counts_lock:
        return _counts.get(key, 0)


@rpc.functions.idempotent(max_attempts=3, initial_backoff=0.2, backoff_multiplier=2.0)
def bump_idempotent(key: str) -> int:
    return bump(key)


@rpc.functions.idempotent
def bump_then_fail(key: str) -> None:
    bump(key)
    raise ValueError(f"failed on purpose ({key})")


@rpc.functions.idempotent
def slow_bump(key: str, seconds: float) -> int:
    time.sleep(seconds)
    return bump(key)


def rss_kib() -> int:
    """Resident memory of this process, KiB."""
    return _status_kib("VmRSS")


def peak_rss_kib() -> int:
    """Peak resident memory of this process, KiB."""
    return _status_kib("VmHWM")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


# -- soak --------------------------------------------------------------------------------------

SIZES = {"tiny": 0, "1MB": 1 << 20, "16MB": 16 << 20}


def make_payload(tag: int, nbytes: int) -> Any:
    """A request whose content follows from ``tag``: an int, or a tensor of that many bytes."""
    if nbytes == 0:
        return ("tiny", tag)
    n = nbytes // 4
    t = torch.empty(n, dtype=torch.int32)
    t.fill_(tag & 0x7FFFFFFF)
    t[0] = n
    t[-1] = -(tag & 0x7FFFFFFF)
    return t


def check_payload(tag: int, nbytes: int, value: Any) -> bool:
    if nbytes == 0:
        return value == ("tiny", tag)
    n = nbytes // 4
    if not isinstance(value, torch.Tensor) or value.dtype != torch.int32 or value.numel() != n:
        return False
    v = tag & 0x7FFFFFFF
    return (int(value[0]) == n and int(value[-1]) == -v and int(value[1]) == v
            and bool((value[1:-1] == v).all()))


def echo_tagged(tag: int, payload: Any) -> Any:
    return tag, payload


def soak_drive(peers: List[str], threads: int, seconds: float, mix: Dict[str, float],
               seed: int) -> Dict[str, Any]:
    """Call ``peers`` from ``threads`` threads for ``seconds``; check every reply.

    Each request carries a tag unique to this worker, thread and sequence number, and a
    payload made from the tag; the reply must carry the same tag and payload, so lost,
    duplicated or swapped replies are caught. Returns counts, calls/s and peak RSS.
    """
    me = rpc.get_worker_info()
    names = list(mix)
    weights = [mix[k] for k in names]
    stop = time.monotonic() + seconds
    stats = {"calls": 0, "bytes": 0, "errors": [], "bad": 0, "by_size": {k: 0 for k in names}}
    lock = threading.Lock()

    def run(t: int) -> None:
        rng = random.Random(seed * 1000 + me.id * 100 + t)
        seq = 0
        calls = nbytes_total = bad = 0
        by_size = {k: 0 for k in names}
        errors: List[str] = []
        while time.monotonic() < stop and len(errors) < 5:
            size_name = rng.choices(names, weights)[0]
            nbytes = SIZES[size_name]
            tag = (me.id << 40) | (t << 32) | seq
            seq += 1
            peer = rng.choice(peers)
            try:
                got_tag, value = rpc.rpc_sync(peer, echo_tagged, args=(tag, make_payload(tag, nbytes)))
            except Exception as exc:  # noqa: BLE001 - reported to the test
                errors.append(f"{me.name}->{peer}: {type(exc).__name__}: {exc}"[:500])
                continue
            if got_tag != tag or not check_payload(tag, nbytes, value):
                bad += 1
            calls += 1
            by_size[size_name] += 1
            nbytes_total += 2 * nbytes
        with lock:
            stats["calls"] += calls
            stats["bytes"] += nbytes_total
            stats["bad"] += bad
            stats["errors"].extend(errors)
            for k, v in by_size.items():
                stats["by_size"][k] += v

    start = time.monotonic()
    workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    stats["seconds"] = time.monotonic() - start
    stats["peak_rss_kib"] = peak_rss_kib()
    stats["worker"] = me.name
    return stats


def pid() -> int:
    return os.getpid()
