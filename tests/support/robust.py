"""Functions that the robustness tests run remotely (importable on every worker)."""

from __future__ import annotations

import os
import random
import threading
import time
from typing import Any, Dict, List, Tuple

import torch

import torchrpc.rpc as rpc
from torchrpc._wire import Kind

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


def async_call_outcome(to: str, timeout: float) -> Tuple[str, float]:
    """``rpc_async(to, whoami).wait()`` from here: the name it returns or its error's type
    and text, and the seconds it took."""
    from .helpers import whoami
    start = time.monotonic()
    try:
        outcome = rpc.rpc_async(to, whoami, timeout=timeout).wait()
    except Exception as exc:  # noqa: BLE001 - returned to the test
        outcome = f"{type(exc).__name__}: {exc}"
    return outcome, time.monotonic() - start


_outcomes: Dict[str, Tuple[str, float]] = {}


def start_async_call_outcome(key: str, to: str, timeout: float, after: float) -> bool:
    """In a thread, ``after`` seconds from now: :func:`async_call_outcome`, kept under
    ``key`` for :func:`outcome_of` (so that the call that starts it is answered first)."""
    def run() -> None:
        time.sleep(after)
        _outcomes[key] = async_call_outcome(to, timeout)
    _outcomes.pop(key, None)
    threading.Thread(target=run, name="test-outcome", daemon=True).start()
    return True


def outcome_of(key: str) -> Any:
    return _outcomes.get(key)


@rpc.functions.idempotent(max_attempts=3, initial_backoff=0.2, backoff_multiplier=2.0)
def bump_idempotent(key: str) -> int:
    return bump(key)


@rpc.functions.idempotent
def bump_then_fail(key: str) -> None:
    bump(key)
    raise ValueError(f"failed on purpose ({key})")


@rpc.functions.idempotent
def slow_bump(key: str, seconds: float) -> int:
    """Count the start under ``started:key``, run for ``seconds``, then count ``key``."""
    bump(f"started:{key}")
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


# -- connection churn (tests/agent/test_churn.py) --------------------------------------------------

_churn: Dict[str, Any] = {}
_FAULT_KINDS = ("CALL", "RESPONSE", "RREF_REMOTE_CALL", "RREF_FETCH", "RREF_USER_DELETE",
                "RREF_FORK_REQUEST")


def start_churn(start_at: float, seconds: float, seed: int) -> bool:
    """From ``start_at`` (wall clock) for ``seconds``: call every peer from three threads
    while a fourth closes connections of this worker at random and, on a fault-injecting
    agent, a fifth keeps injecting send failures and delays. Returns at once; the counts
    come from :func:`churn_result`. Asked again for the same ``start_at`` (a retry), it
    starts nothing more."""
    if _churn.get("start_at") == start_at:
        return True
    thread = threading.Thread(target=_churn_drive, args=(start_at, seconds, seed),
                              name="test-churn", daemon=True)
    _churn.clear()
    _churn.update(thread=thread, start_at=start_at)
    thread.start()
    return True


def churn_result(timeout: float) -> Dict[str, Any]:
    _churn["thread"].join(timeout)
    return _churn.get("result", {"unexpected": ["the churn did not finish"]})


def _churn_drive(start_at: float, seconds: float, seed: int) -> None:
    from torchrpc._agent.current import current_agent
    from torchrpc._testing.faulty import FaultyAgent
    from torchrpc.errors import ConnectionLostError, RpcTimeoutError

    from . import helpers

    agent = current_agent()
    me = rpc.get_worker_info()
    peers = [w.name for w in rpc.get_worker_infos() if w.name != me.name]
    time.sleep(max(0.0, start_at - time.time()))
    stop = time.monotonic() + seconds
    counts: Dict[str, int] = {}
    unexpected: List[str] = []
    lock = threading.Lock()

    def note(key: str) -> None:
        with lock:
            counts[key] = counts.get(key, 0) + 1

    def one_call(rng: random.Random, i: int) -> None:
        peer = rng.choice(peers)
        pick = rng.random()
        if pick < 0.35:
            assert rpc.rpc_sync(peer, helpers.add, args=(i, 1), timeout=10) == i + 1
        elif pick < 0.6:
            futs = [rpc.rpc_async(rng.choice(peers), helpers.add, args=(i, k), timeout=10)
                    for k in range(3)]
            assert [f.wait() for f in futs] == [i, i + 1, i + 2]
        elif pick < 0.75:
            x = torch.full((rng.choice((4, 1 << 18)),), float(i))
            assert torch.equal(rpc.rpc_sync(peer, helpers.echo, args=(x,), timeout=10), x)
        elif pick < 0.9:
            rref = rpc.remote(peer, helpers.add, args=(i, 2), timeout=10)
            assert rref.to_here(timeout=10) == i + 2
        else:  # the timer fails this one
            try:
                rpc.rpc_sync(peer, helpers.sleep_then, args=(0.3, i), timeout=0.05)
            except RpcTimeoutError:
                note("timed_out_on_purpose")
                return
            raise AssertionError("a call with a 0.05 s timeout to a 0.3 s function returned")

    def caller(t: int) -> None:
        rng = random.Random(seed * 100 + t)
        i = 0
        while time.monotonic() < stop:
            i += 1
            try:
                one_call(rng, i)
                note("ok")
            except (ConnectionLostError, RpcTimeoutError) as exc:  # churn and injected faults
                note(type(exc).__name__)
            except Exception as exc:  # noqa: BLE001 - reported to the test
                with lock:
                    unexpected.append(f"{me.name}: {type(exc).__name__}: {exc}"[:400])

    def churner() -> None:
        rng = random.Random(seed * 100 + 50)
        while time.monotonic() < stop:
            time.sleep(rng.uniform(0.03, 0.12))
            conns = agent._transport.connections()
            if not conns:
                continue
            conn = rng.choice(conns)
            how = rng.random()
            if how < 0.4:
                conn.close()  # this side closes it
            elif how < 0.7:
                conn.close(ConnectionLostError("closed by the churn test"))
            else:
                try:
                    conn.sock.shutdown(2)  # broken under both readers: each side sees EOF
                except OSError:
                    pass
            note("closed")

    def injector() -> None:
        rng = random.Random(seed * 100 + 60)
        while time.monotonic() < stop:
            agent.inject(fail=[rng.choice(_FAULT_KINDS)], num_fail_sends=rng.randint(1, 3),
                         delay={"CALL": rng.choice((0.0, 0.02, 0.2))})
            time.sleep(rng.uniform(0.1, 0.4))
        agent.inject()

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(3)]
    threads.append(threading.Thread(target=churner))
    if isinstance(agent, FaultyAgent):
        threads.append(threading.Thread(target=injector))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _churn["result"] = {"worker": me.name, "counts": counts, "unexpected": unexpected,
                        "heartbeat_timeouts":
                            rpc.get_debug_info()["agent.num_heartbeat_timeouts"]}


# -- soak with a worker killed and replaced (tests/system/test_soak_churn.py) -------------------------

def census() -> Dict[str, Any]:
    """This worker's threads (apart from its pool's, which it keeps up to the pool size),
    its pool threads, and its open descriptors."""
    import gc
    gc.collect()
    pool = f"torchrpc-{rpc.get_worker_info().name}-"
    names = [t.name for t in threading.enumerate()]
    others = sorted(n for n in names if not (n.startswith(pool) and n[len(pool):].isdigit()))
    from torchrpc._agent.current import current_agent
    peers = sorted(c.peer_rank for c in current_agent()._transport.connections())
    return {"threads": len(others), "pool": len(names) - len(others), "names": others,
            "fds": len(os.listdir("/proc/self/fd")), "peers": peers}


def _mixed_call(rng: random.Random, tag: int, peer: str) -> bool:
    """One call of a random kind to ``peer``; whether its reply matches the request."""
    import torchrpc.autograd as dist_autograd
    kind = rng.random()
    if kind < 0.6:
        nbytes = SIZES["1MB"] if rng.random() < 0.1 else 0
        got_tag, value = rpc.rpc_sync(peer, echo_tagged, args=(tag, make_payload(tag, nbytes)))
        return got_tag == tag and check_payload(tag, nbytes, value)
    if kind < 0.8:
        ref = rpc.remote(peer, echo_tagged, args=(tag, ("tiny", tag)))
        return ref.to_here() == (tag, ("tiny", tag))
    with dist_autograd.context() as ctx:
        x = torch.full((4,), float(tag % 1000), requires_grad=True)
        y = rpc.rpc_sync(peer, torch.mul, args=(x, 3.0))
        dist_autograd.backward(ctx, [y.sum()])
        grad = dist_autograd.get_gradients(ctx)[x]
        return torch.equal(y, x.detach() * 3.0) and torch.equal(grad, torch.full((4,), 3.0))


def soak_churn_drive(survivors: List[str], threads: int, seconds: float, seed: int,
                     victim_prefix: str) -> Dict[str, Any]:
    """From ``threads`` threads for ``seconds``: mixed calls (echoes, remote() and
    to_here(), backward passes) to the ``survivors`` and now and then to the current
    victims (members whose name starts with ``victim_prefix``). Calls among survivors
    must all succeed with matching replies; calls to victims may fail only because the
    victim is gone. Returns counts and what went wrong."""
    from torchrpc.errors import ConnectionLostError
    me = rpc.get_worker_info()
    stop = time.monotonic() + seconds
    out: Dict[str, Any] = {"calls": 0, "victim_calls": 0, "victim_failures": 0, "bad": 0,
                           "errors": []}
    lock = threading.Lock()

    def run(t: int) -> None:
        rng = random.Random(seed * 1000 + t)
        seq = calls = victim_calls = victim_failures = bad = 0
        errors: List[str] = []
        while time.monotonic() < stop and len(errors) < 5:
            seq += 1
            tag = (me.id << 40) | (t << 32) | seq
            victims = [w.name for w in rpc.get_worker_infos()
                       if w.name.startswith(victim_prefix)]
            if victims and rng.random() < 0.1:
                victim_calls += 1
                try:
                    got_tag, _ = rpc.rpc_sync(rng.choice(victims), echo_tagged,
                                              args=(tag, ("tiny", tag)), timeout=20)
                    bad += got_tag != tag
                except (ConnectionLostError, ValueError):
                    victim_failures += 1  # killed, or left the table meanwhile
                except Exception as exc:  # noqa: BLE001 - reported to the test
                    errors.append(f"{me.name}->victim: {type(exc).__name__}: {exc}"[:400])
                continue
            peer = rng.choice(survivors)
            try:
                ok = _mixed_call(rng, tag, peer)
            except Exception as exc:  # noqa: BLE001 - reported to the test
                errors.append(f"{me.name}->{peer}: {type(exc).__name__}: {exc}"[:400])
                continue
            calls += 1
            bad += not ok
        with lock:
            out["calls"] += calls
            out["victim_calls"] += victim_calls
            out["victim_failures"] += victim_failures
            out["bad"] += bad
            out["errors"].extend(errors)

    workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(seconds + 120)
    out["hung"] = sum(w.is_alive() for w in workers)
    out["worker"] = me.name
    return out


# A stand-in for the internal kinds sent with a retry policy (so with the ONCE flag): the
# at-most-once tests send it with agent.request; it runs nothing but a count by key.
ONCE_KIND = Kind.PROFILED_CALL  # which no layer serves
_once_results: Dict[str, Any] = {}


def serve_once_kind() -> None:
    """Serve ONCE_KIND here: ``bump(payload)``."""
    from torchrpc._agent.current import current_agent
    current_agent().register_handler(ONCE_KIND, _serve_once)


def _serve_once(src: Any, key: str) -> int:
    """ONCE_KIND's handler: a key that starts with "slow" runs for a second first."""
    if key.startswith("slow"):
        bump(f"started:{key}")  # so a test can see it running
        time.sleep(1.0)
    return bump(key)


def start_once_request(to: str, key: str, timeout: float) -> None:
    """Send ``key`` as ONCE_KIND to ``to`` with a retry policy, from a thread; return at
    once (see :func:`once_result`)."""
    from torchrpc._agent.current import current_agent
    from torchrpc._agent.retry import RetryPolicy
    agent = current_agent()
    fut = agent.request(agent.resolve(to), ONCE_KIND, key, timeout, what="once request",
                        retry=RetryPolicy(max_attempts=5, initial_backoff=0.05))

    def done(f: Any) -> None:
        try:
            _once_results[key] = f.value()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            _once_results[key] = repr(exc)
    fut.add_done_callback(done)


def once_result(key: str) -> Any:
    """The reply to :func:`start_once_request` of ``key``; None while it waits."""
    return _once_results.get(key)


_black_holes: List[Any] = []


def black_hole_current_connection(rank: int) -> bool:
    """Open one more shared connection to ``rank`` and make it this worker's current one,
    with writes that vanish: the state of a link that broke while this side has not
    noticed yet."""
    from torchrpc._agent.current import current_agent
    agent = current_agent()
    host, port = agent.registry.addresses[rank]
    conn = agent.connections._open(agent.registry.workers[rank], host, port, 10.0)
    conn.send = lambda *args, **kwargs: None
    agent.connections.shared[rank] = conn
    _black_holes.append(conn)
    return True


def close_black_holes() -> int:
    from torchrpc.errors import ConnectionLostError
    n = len(_black_holes)
    while _black_holes:
        _black_holes.pop().close(ConnectionLostError("black hole closed by the test"))
    return n


_backward_results: Dict[str, Any] = {}


def start_backward_through(to: str, key: str) -> bool:
    """Start, in a thread, a distributed backward pass rooted here whose one part runs
    on ``to`` and ends there (at a weight of ``to``: its credit comes back in a report);
    :func:`backward_result` gives the weight's gradient (or the error) and how long it
    took."""
    import torchrpc.autograd as dist_autograd
    from . import helpers

    def run() -> None:
        start = time.monotonic()
        try:
            with dist_autograd.context() as ctx:
                y = rpc.rpc_sync(to, helpers.times_weight, args=(torch.full((4,), 2.0),))
                dist_autograd.backward(ctx, [y.sum()])
                out: Any = rpc.rpc_sync(to, helpers.weight_gradient, args=(ctx,))
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            out = exc
        _backward_results[key] = (out, time.monotonic() - start)
    threading.Thread(target=run, daemon=True).start()
    return True


def backward_result(key: str) -> Any:
    return _backward_results.get(key)
