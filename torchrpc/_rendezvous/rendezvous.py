"""Rendezvous: agree on the group through torch's stores, before any socket of ours opens.

Each worker learns or creates the job secret (see :mod:`.secret`; before it is known,
only the locator of the secret is read from the store, and what it names is checked),
claims its rank and name in the store (compare-and-set of a sealed claim, so a duplicate
is detected by the claimer, which aborts the group through a sealed error record),
publishes where it listens and waits until every rank has published. Nothing here talks
to peers directly.

The store is untrusted: anyone who reaches it may write there. Every record the group
acts on is sealed under a key derived from the job secret (:mod:`.records`), written and
read through :class:`Records`; a record that fails its check is ignored and logged once.
Counters (``store.add``) only say when to look. The shutdown barriers are in
:mod:`.barriers`.
"""

from __future__ import annotations

import datetime
import fcntl
import ipaddress
import logging
import os
import secrets as random_tokens
import socket
import struct
import time
import urllib.parse
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch.distributed as dist

from .._transport.shm import pid_namespace
from . import secret
from .group_store import Records
from .names import check_worker_name
from ..errors import RendezvousError

log = logging.getLogger(__name__)

PREFIX = "torchrpc"  # the store prefix of a static group, the job its records are sealed for
_ERROR_KEY = "error"
_ERROR_SEEN_KEY = "error_seen"

_WORKER_FIELDS = {"name": str, "host": str, "port": int, "hostid": str}
_ABORT_FIELDS = {"message": str, "rank": int}


def rendezvous_timeout(rpc_timeout: float, configured: Optional[float] = None) -> float:
    """Seconds to wait for the group to form: ``configured`` when set, else the RPC
    timeout but at least 60 s (workers of a big job start slowly)."""
    if configured is not None:
        return float(configured)
    return max(rpc_timeout, 60.0)


class Deadline:
    """The moment by which the group must have formed: set once where ``init_rpc``
    starts, so that every later step (opening the store, claiming, the secret, waiting
    for the others) gets the time left, not a fresh timeout of its own."""

    __slots__ = ("at", "timeout")

    def __init__(self, timeout: float) -> None:
        self.timeout = float(timeout)
        self.at = time.monotonic() + self.timeout

    def left(self) -> float:
        """Seconds left; at least a millisecond, so that a store given the time left fails
        at once once it has passed (a zero timeout would mean none to some stores)."""
        return max(0.001, self.at - time.monotonic())

    def __repr__(self) -> str:
        return f"Deadline({self.timeout:g} s, {self.at - time.monotonic():.3f} s left)"


class Plan:
    """What ``init_rpc`` settled for this worker's rendezvous: the deadline of all its
    steps and where the job secret comes from. The agent hands it through unopened."""

    __slots__ = ("deadline", "secret")

    def __init__(self, deadline: Deadline, source: Optional[secret.Source] = None) -> None:
        self.deadline = deadline
        self.secret = source or secret.Source()

    @staticmethod
    def of(limit: Union[float, "Plan"]) -> "Plan":
        """``limit`` itself when it is a plan, else one whose deadline is ``limit`` seconds
        away and whose secret comes from rank 0."""
        return limit if isinstance(limit, Plan) else Plan(Deadline(limit))

    def __repr__(self) -> str:
        return f"Plan({self.deadline!r}, {self.secret!r})"


def validate_name(name: Any) -> str:
    """Check a worker name as torch documents it; return it."""
    return check_worker_name(name)


def open_store(init_method: str, rank: int, world_size: Optional[int],
               timeout: Union[float, Plan]) -> Tuple[Any, int, int]:
    """Open torch's rendezvous store for ``init_method`` within ``timeout`` (seconds, or
    the plan of the whole rendezvous); return (store, rank, world_size)."""
    ws = -1 if world_size is None else world_size
    deadline = Plan.of(timeout).deadline
    timeout = deadline.timeout
    try:
        it = dist.rendezvous(init_method, rank=rank, world_size=ws,
                             timeout=datetime.timedelta(seconds=deadline.left()))
        store, rank, world_size = next(it)
    except ValueError as exc:
        raise ValueError(f"rendezvous through {describe_init_method(init_method)} failed: "
                         f"{exc}") from exc
    except (RuntimeError, OSError) as exc:
        raise RendezvousError(f"rendezvous through {describe_init_method(init_method)} failed "
                              f"(timeout {timeout:g} s): {exc}") from exc
    claim_membership(store, "static")
    return dist.PrefixStore(PREFIX, store), rank, world_size


_MEMBERSHIP_KEY = "torchrpc-membership"


def claim_membership(store: Any, kind: str) -> None:
    """Mark the rendezvous store as serving a ``static`` (fixed world size) or ``dynamic``
    group; a worker of the other kind is refused, since the two protocols cannot meet.
    The mark is read before the job secret is known, so it cannot be sealed: a value that
    is neither kind (junk an outsider wrote first) is taken over."""
    value = store.compare_set(_MEMBERSHIP_KEY, "", kind)
    for _ in range(5):
        if value in (b"static", b"dynamic"):
            break
        log.warning("took over the rendezvous store's group mark %r, which names no kind of "
                    "group (written by another process)", value[:40])
        value = store.compare_set(_MEMBERSHIP_KEY, value, kind)
    held = value.decode(errors="replace")
    if held != kind:
        raise RuntimeError(
            f"RPC group mixes statically and dynamically initialized members which is not "
            f"supported. This worker asked for a {kind} group (world_size="
            f"{'None' if kind == 'dynamic' else 'N'}), but its rendezvous store serves a "
            f"{held} group; give every member the same world_size argument, or use another "
            f"init_method for the other group")


def missing_rank_error(init_method: str) -> ValueError:
    """torch's error for ``init_rpc`` without a rank, for the scheme of ``init_method``."""
    scheme = urllib.parse.urlparse(init_method).scheme
    if scheme == "env":
        what = "environment variable RANK expected, but not set"
    else:
        what = "rank parameter missing"
    return ValueError(f"Error initializing torch.distributed using {scheme}:// rendezvous: "
                      f"{what}; pass rank= to init_rpc (or set RANK, as torchrun does)")


def describe_init_method(init_method: str) -> str:
    """The init method with the address it resolves to, for error messages."""
    if init_method.startswith("env://"):
        return (f"env:// (MASTER_ADDR={os.environ.get('MASTER_ADDR')!r}, "
                f"MASTER_PORT={os.environ.get('MASTER_PORT')!r})")
    return repr(init_method)


def master_host(init_method: str) -> Optional[str]:
    """The host of the rendezvous address, or None for file://."""
    url = urllib.parse.urlparse(init_method)
    if url.scheme == "env":
        return os.environ.get("MASTER_ADDR")
    if url.scheme == "tcp":
        return url.hostname
    return None


def _is_loopback(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def interface_address(ifname: str) -> str:
    """The IPv4 address of network interface ``ifname``."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname.encode()[:15]))
    except OSError as exc:
        raise RendezvousError(f"cannot read the address of interface {ifname!r}: {exc}") from exc
    finally:
        s.close()
    return socket.inet_ntoa(packed[20:24])


def listen_host(init_method: str, configured: Optional[str]) -> str:
    """The address to listen on: configured (``init_rpc`` turns a configured interface
    into its address), else the interface that reaches the master."""
    if configured:
        return configured
    host = master_host(init_method)
    if host is None or _is_loopback(host):
        return "127.0.0.1"
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        probe = socket.socket(family, socket.SOCK_DGRAM)
        try:
            probe.connect((host, 9))  # UDP connect sends nothing; it only picks a route
            return probe.getsockname()[0]
        finally:
            probe.close()
    except OSError as exc:
        raise RendezvousError(f"no route to the rendezvous host {host!r}: {exc}") from exc


def process_identity() -> Dict[str, int]:
    """This worker's pid and pid namespace, so that a peer on the same host can ask the
    kernel whether it runs (see Liveness.runs_here)."""
    return {"pid": os.getpid(), "pidns": pid_namespace()}


def host_identity() -> str:
    """Same string on two workers means same machine and same shared-memory namespace."""
    parts = []
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        parts.append(socket.gethostname())
    for ns in ("ipc", "mnt", "net"):
        try:
            parts.append(str(os.stat(f"/proc/self/ns/{ns}").st_ino))
        except OSError:
            parts.append("?")
    try:
        parts.append(str(os.stat("/dev/shm").st_dev))
    except OSError:
        parts.append("-")
    return "/".join(parts)


def _abort_of(store: Any) -> Optional[str]:
    """The message of the group's sealed abort, if a rank has written one (only a holder
    of the secret can: an unsealed value at the key is ignored and logged once)."""
    if not isinstance(store, Records) or not store.check([_ERROR_KEY]):
        return None
    fields = store.read(_ERROR_KEY, _ABORT_FIELDS, "an abort of the group")
    return None if fields is None else fields["message"]


def _unready(store: Any, keys: List[str], required: Optional[Dict[str, Any]]) -> List[str]:
    """The keys of ``keys`` that do not hold a good record yet (without ``required``:
    that do not exist)."""
    if store.check(keys) and required is None:
        return []
    if required is None:
        return [k for k in keys if not store.check([k])]
    return [k for k in keys if store.read(k, required, "a record waited for") is None]


def _poll(store: Any, keys: List[str], deadline: float, what: str, rank: Optional[int] = None,
          world_size: Optional[int] = None, required: Optional[Dict[str, Any]] = None) -> None:
    """Wait until ``deadline`` for ``keys`` (with ``required``: to hold good sealed records
    with those fields). A sealed abort of the group ends the wait with its message."""
    delay = 0.002
    while True:
        try:
            message = _abort_of(store)
            if message is not None:
                store.add(_ERROR_SEEN_KEY, 1)
                if rank == 0 and world_size:
                    _linger(store, world_size)
                raise RendezvousError(message)
            # cheap first: every key there at all (junk included)?
            if store.check(keys) and not _unready(store, keys, required):
                return
        except RendezvousError:
            raise
        except Exception as exc:  # noqa: BLE001 - the store's own errors are cryptic
            raise RendezvousError(f"lost the rendezvous store while waiting for {what} (the "
                                  f"worker hosting it, rank 0, probably failed): {exc}") from exc
        if time.monotonic() > deadline:
            missing = _unready(store, keys, required)
            raise RendezvousError(f"timed out waiting for {what}: missing {missing[:8]} (a key "
                                  f"that holds a record which failed its check counts as "
                                  f"missing; see the warnings logged)")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def _linger(store: Any, world_size: int) -> None:
    """Rank 0 hosts the store: keep it up until the others have read the error (<= 5 s)."""
    deadline = time.monotonic() + 5.0
    while int(store.add(_ERROR_SEEN_KEY, 0)) < world_size - 1 and time.monotonic() < deadline:
        time.sleep(0.02)


def abort(store: Records, message: str, rank: int,
          world_size: Optional[int] = None) -> RendezvousError:
    """Tell every worker of a static group still forming that its rendezvous failed (a
    sealed abort record: only a rank that holds the job secret can abort the group);
    return the error to raise.

    Rank 0 hosts the store, so it lingers (a few seconds at most) until the others
    have read the error, instead of leaving them with a dead store.
    """
    try:
        store.put(_ERROR_KEY, {"message": message, "rank": rank})
        if rank == 0 and world_size:
            _linger(store, world_size)
    except Exception:  # noqa: BLE001 - best effort, the local error is what matters
        pass
    return RendezvousError(message)


def take_claim(store: Records, key: str, mine: bytes,
               holding: Callable[[bytes], Optional[Dict[str, Any]]]) -> Optional[Dict[str, Any]]:
    """Claim ``key`` with the sealed value ``mine`` by compare-and-set; None if this worker
    holds it now, else the fields of the claim that holds it. ``holding(value)`` reads
    another value found there: the fields of a claim that holds the key, or None for one
    to take over (an outsider's junk, logged once; a released or expired claim)."""
    current = b""
    for _ in range(100):
        held = store.compare_set(key, current, mine)
        if held == mine:
            return None
        if held == current:  # the key vanished under the compare: claim it from empty
            current = b""
            continue
        other = holding(held)
        if other is not None:
            return other
        current = held
    raise RendezvousError(f"cannot claim {key!r} in the rendezvous store: its value keeps "
                          f"changing under this worker (another process writes it)")


def _take_static(store: Records, key: str, fields: Dict[str, Any],
                 required: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Claim ``key`` with a sealed record of ``fields`` (see :func:`take_claim`); any good
    sealed claim holds it."""
    return take_claim(store, key, store.sealed(key, fields),
                      lambda held: store.open(key, held, required, "a claim"))


def claim(store: Records, name: str, rank: int, world_size: int,
          timeout: Union[float, Plan]) -> None:
    """Claim ``rank`` and ``name`` in a static group's store with sealed claims.
    ``timeout``: seconds, or the plan of the whole rendezvous.

    A duplicate is reported to the whole group through a sealed abort, so the other
    workers fail at once instead of waiting for a rank that never comes. Only claims
    sealed with the job secret count: an outsider's value is taken over.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is out of range for world_size {world_size}")
    nonce = random_tokens.token_hex(8)
    if _take_static(store, f"rank/{rank}", {"name": name, "nonce": nonce},
                    {"name": str, "nonce": str}) is not None:
        raise abort(store, f"duplicate rank {rank}: two workers were started with rank {rank} "
                           f"(this one is named {name!r}); give every worker its own rank",
                    rank, world_size)
    owner = _take_static(store, f"name/{name}", {"rank": rank, "nonce": nonce},
                         {"rank": int, "nonce": str})
    if owner is not None:
        raise abort(store, f"RPC worker name {name} is not unique. Workers {owner['rank']} and "
                           f"{rank} share the same name; give every worker its own name",
                    rank, world_size)


def job_secret(store: Any, rank: int, timeout: Union[float, Plan],
               world_size: Optional[int] = None, keep: bool = False) -> bytes:
    """The job secret (see :mod:`.secret`: never through the store unless opted in),
    waited for until ``timeout`` (seconds, or the rendezvous plan, whose secret source
    applies); ``keep``: a secret file made here outlives this process.

    A failure here is this worker's own: nothing is written to the store (a process
    that cannot read the secret must not be able to fail the group)."""
    plan = Plan.of(timeout)

    def wait(keys: list, what: str) -> None:
        _poll(store, keys, plan.deadline.at, what, rank, world_size)

    return secret.job_secret(store, rank, host_identity(), wait, keep, plan.secret,
                             plan.deadline.at)


def publish(store: Records, name: str, rank: int, world_size: int, address: Tuple[str, int],
            timeout: Union[float, Plan], extra: Optional[Dict[str, Any]] = None
            ) -> Dict[int, Dict[str, Any]]:
    """Publish where this worker listens (and the JSON-able ``extra`` facts about it), in a
    sealed record; wait for every rank's until ``timeout`` (seconds, or the rendezvous
    plan); return all infos by rank."""
    info = {"name": name, "host": address[0], "port": address[1], "hostid": host_identity(),
            **process_identity(), **(extra or {})}
    store.put(f"worker/{rank}", info)
    keys = [f"worker/{r}" for r in range(world_size)]
    _poll(store, keys, Plan.of(timeout).deadline.at, f"all {world_size} workers to join", rank,
          world_size, _WORKER_FIELDS)
    infos = {}
    for r, key in enumerate(keys):
        fields = store.read(key, _WORKER_FIELDS, "where a worker listens")
        if fields is None:  # replaced by junk since the poll saw it: the store was tampered with
            raise RendezvousError(f"the record of rank {r} ({key}) in the rendezvous store "
                                  f"was replaced by one that fails its check")
        infos[r] = fields
    return infos
