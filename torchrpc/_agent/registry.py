"""The workers of the group, as one agent knows them: membership, addresses, hosts,
processes and device maps.

Theory of operation. A worker is known by rank (:attr:`Registry.workers`) and by name
(:attr:`Registry.by_name`), with the facts it published when it joined: the address it
listens on, its host and process (which decide whether shared memory and the local socket
can reach it, and whether a silent one still runs), its heartbeat interval (for liveness)
and the device maps it set for other workers (the inverse of its map for this worker is
where this worker's replies to it send their CUDA tensors: ``devices.target_device``).

A fixed group (``world_size`` given) learns all its members at once from the rendezvous
and never changes, except that a worker that says GOODBYE has left (:attr:`Registry.left`;
its calls fail at once, and it cannot be called again).

A dynamic group (``world_size=None``) follows the membership log in the store
(membership.py) on the members thread, and reads it at once where a worker it does not
know is named or calls (:meth:`Registry.refresh`). A join adds a worker, under a rank that
may have been another's: whatever the other parts kept of its predecessor is forgotten
(:meth:`Registry.add`). A leave removes one, and a leave marked ``lost`` (another
survivor declared it lost) makes this worker drop what it has of it too: its
connections close, its calls fail, the loss hooks run. Each event carries the
*incarnation* of the process it is about: an event about an earlier process under a rank
is ignored, and a leave that removed this very process means that the group declared it
lost (it was stopped or cut off, say): the agent then fails. The transport asks
:meth:`Registry.admit` about every peer that proved it holds the job secret: a process
removed as lost that comes back, and one under a rank that another process holds now,
are refused.

A worker that left (or was removed) is still known by name (:attr:`Registry.departed`),
so a call to it fails with :class:`WorkerLeftError` saying why, not with an unknown name.

The tables are guarded by the agent's lock, which also guards the tables of the other
parts they are changed with; they are read without it where a single lookup suffices
(the request path). The registry knows the other parts only by what it tells them (see
:meth:`Registry.attach`): that a new worker holds a rank, and that a member was lost.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from .._threads import Guard, StartThread
from .._transport import Connection, Transport, shm
from ..errors import (DestinationTypeError, InvalidArgumentError, RpcError,
                      ThreadFailedError, WorkerLeftError)
from . import devices
from .._rendezvous import membership
from .lifecycle import RUNNING, STOPPING, Lifecycle
from .worker import WorkerInfo

log = logging.getLogger(__name__)


def left_error(dst: WorkerInfo) -> WorkerLeftError:
    """The error of a request to ``dst``, which said GOODBYE."""
    return WorkerLeftError(f"worker {dst.name} (rank {dst.id}) has shut down and left the "
                           f"group", worker=dst.name)


class Losses(Protocol):
    """What the registry tells liveness (liveness.py): a worker joined, with the heartbeat
    interval it announced; a member another survivor declared lost is lost here too."""

    declared: "set[int]"

    def joined(self, rank: int, interval: float) -> None: ...

    def declare(self, rank: int) -> None: ...

    def run_loss_hooks(self, w: WorkerInfo, error: RpcError) -> None: ...


class Registry:
    """One agent's table of workers and its part in the group's membership. Handed what
    it uses (see the constructor's comments); the parts it tells of changes are built
    after it, and handed to :meth:`attach`."""

    _losses: Losses  # set by attach, as are the four below
    _fail_peer: Callable[[int, RpcError], None]
    _connections_of: Callable[[int], List[Connection]]
    _forget_locked: Sequence[Callable[[int], None]]
    _forget: Sequence[Callable[[int], None]]

    def __init__(self, name: str, rank: int, elastic: bool,
                 device_maps: Dict[str, Dict[torch.device, torch.device]],
                 lock: "threading.Lock", start_thread: StartThread, lifecycle: Lifecycle,
                 store: Callable[[], Any], forget_stats: Callable[[int], None],
                 fail: Callable[[ThreadFailedError], None],
                 transport: Callable[[], Optional[Transport]]) -> None:
        self._name, self._rank = name, rank  # this worker's
        self._lock = lock  # the agent's: the request path reads these tables under it
        self._start_thread = start_thread
        self._lifecycle = lifecycle
        self._store = store  # the agent's store (sealed once started)
        self._forget_stats = forget_stats  # the traffic counters of a rank, under the lock
        self._fail = fail  # the agent's: this worker was removed from the group
        self._transport = transport  # the agent's, once started
        self.elastic = elastic
        self.workers: Dict[int, WorkerInfo] = {}
        self.by_name: Dict[str, WorkerInfo] = {}
        self.addresses: Dict[int, Tuple[str, int]] = {}
        self.hostids: Dict[int, str] = {}
        self.gpus: Dict[int, Optional[str]] = {}  # rank -> the GPUs it sees (for CUDA IPC)
        self.procs: Dict[int, Tuple[int, int]] = {}  # rank -> (pid, pid namespace)
        self.pidns = shm.pid_namespace()  # this process's
        self.left: set[int] = set()  # ranks that said GOODBYE, or left the group
        self.departed: Dict[str, int] = {}  # name -> rank, of workers that left the group
        # This process's membership, and the members' (a lost member is removed by it).
        self.incarnation = membership.new_incarnation() if self.elastic else 0
        self.incarnations: Dict[int, int] = {}
        self.removed: Dict[int, str] = {}  # rank -> why it was removed as lost
        self.log: Optional[membership.EventLog] = None  # dynamic groups: the membership log
        self._members_lock = threading.Lock()  # one reader of the log at a time
        self._members_stop = threading.Event()
        self._members_thread: Optional[threading.Thread] = None
        # device maps: this worker's, by callee name, and by caller rank the inverse of the
        # map that caller published for this worker (where its replies' tensors go)
        self.device_maps = device_maps
        devices.watch(*device_maps.values())
        self.reply_maps: Dict[int, Dict[torch.device, torch.device]] = {}

    def attach(self, losses: Losses, fail_peer: Callable[[int, RpcError], None],
               connections_of: Callable[[int], List[Connection]],
               forget_locked: Sequence[Callable[[int], None]],
               forget: Sequence[Callable[[int], None]]) -> None:
        """Hand the registry the parts built after it: liveness (``losses``);
        ``fail_peer(rank, error)``, which fails the requests pending on a worker;
        ``connections_of(rank)``, its open connections; and what a new worker under a rank
        makes the other parts forget of the earlier one: ``forget_locked`` under the
        agent's lock, ``forget`` after it."""
        self._losses = losses
        self._fail_peer = fail_peer
        self._connections_of = connections_of
        self._forget_locked = forget_locked
        self._forget = forget

    # -- the table ---------------------------------------------------------------------------------

    def add(self, rank: int, info: Dict[str, Any]) -> None:
        """Worker ``info`` (as published when it joined) holds ``rank``; what the agent
        kept of an earlier worker under the rank is forgotten."""
        w = WorkerInfo(info["name"], rank)
        with self._lock:
            old = self.workers.get(rank)
            if old is not None and old.name != w.name:
                self._forget_stats(rank)  # another worker under a rank: new counters
            self.workers[rank] = w
            self.by_name[w.name] = w
            self.departed.pop(w.name, None)
            self.removed.pop(rank, None)
            self.incarnations[rank] = int(info.get("incarnation") or 0)
            self.left.discard(rank)
            for forget in self._forget_locked:  # a new worker under a rank that was lost
                forget(rank)
            self.addresses[rank] = (info["host"], info["port"])
            self.hostids[rank], self.gpus[rank] = info["hostid"], info.get("gpus")
            if "pid" in info and "pidns" in info:
                self.procs[rank] = (int(info["pid"]), int(info["pidns"]))
            self._losses.joined(rank, float(info.get("heartbeat_interval") or 0.0))
            maps = info.get("device_maps")
            mine = maps.get(self._name) if isinstance(maps, dict) else None
            if isinstance(mine, dict) and mine:
                self.reply_maps[rank] = {torch.device(dst): torch.device(src)
                                         for src, dst in mine.items()}
                devices.watch(self.reply_maps[rank])
            else:
                self.reply_maps.pop(rank, None)
        for forget in self._forget:
            forget(rank)

    @property
    def worker_info(self) -> WorkerInfo:
        """This worker's."""
        return self.workers[self._rank]

    def said_goodbye(self, rank: int) -> None:
        """Worker ``rank`` said GOODBYE: it has left, and its calls fail at once."""
        self.left.add(rank)

    def has_left(self, rank: int) -> bool:
        """Whether worker ``rank`` has shut down and told this worker so."""
        with self._lock:
            return rank in self.left

    def worker_infos(self) -> List[WorkerInfo]:
        with self._lock:
            return [self.workers[r] for r in sorted(self.workers)]

    def resolve(self, to: Any) -> WorkerInfo:
        """A WorkerInfo from a name, a rank or a WorkerInfo; ValueError naming an unknown one."""
        if isinstance(to, WorkerInfo):
            w = self.workers.get(to.id)
            if w is None and to.name in self.departed:
                raise WorkerLeftError(self._departure(to.name, to.id), worker=to.name)
            if w is None or w.name != to.name:
                raise InvalidArgumentError(f"name:{to.name},rank:{to.id} could not find "
                                           f"destination: {to!r} is not a member of this group")
            return w
        if isinstance(to, str):
            w = self.by_name.get(to)
            if w is None and self.log is not None and self._lifecycle.state is RUNNING:
                # A dynamic group: the worker may have joined since the log was last read.
                self.refresh()
                w = self.by_name.get(to)
            if w is None and to in self.departed:
                raise WorkerLeftError(self._departure(to, self.departed[to]), worker=to)
            if w is None:
                raise InvalidArgumentError(f"name:{to} could not find destination; known "
                                           f"workers: {sorted(self.by_name)[:16]}")
            return w
        if isinstance(to, int) and not isinstance(to, bool):
            w = self.workers.get(to)
            if w is None and self.log is not None and self._lifecycle.state is RUNNING:
                self.refresh()  # as for names above
                w = self.workers.get(to)
            if w is None:
                if to in self.left:
                    raise WorkerLeftError(f"worker of rank {to} has shut down and left the group")
                raise InvalidArgumentError(f"rank:{to} could not find destination; known ranks: "
                                           f"{sorted(self.workers)[:16]}")
            return w
        raise DestinationTypeError(f"Cannot get WorkerInfo from name {to!r}: 'to' must be a "
                                   f"worker name, rank or WorkerInfo, got {type(to).__name__}")

    def _departure(self, name: str, rank: int) -> str:
        """Why worker ``name`` (rank ``rank``), no longer a member, is gone."""
        why = self.removed.get(rank)
        if why is not None:
            return f"worker {name} (rank {rank}) was lost and removed from the group: {why}"
        return f"worker {name} (rank {rank}) has shut down and left the group"

    # -- hosts and processes -----------------------------------------------------------------------

    def same_host(self, rank: int) -> bool:
        """Whether worker ``rank`` shares this machine and its shared-memory namespace."""
        mine = self.hostids.get(self._rank)
        return mine is not None and self.hostids.get(rank) == mine

    def same_pids(self, rank: int) -> bool:
        """Whether worker ``rank`` is in this process's pid namespace."""
        proc = self.procs.get(rank)
        return proc is not None and bool(self.pidns) and proc[1] == self.pidns

    def workers_on_this_host(self) -> int:
        """How many workers (this one included) run on this host; 1 if unknown."""
        mine = self.hostids.get(self._rank)
        with self._lock:
            return sum(1 for h in self.hostids.values() if h == mine) if mine is not None else 1

    # -- dynamic membership ------------------------------------------------------------------------

    def follow(self) -> None:
        """Start the members thread (dynamic groups): it follows the log until the end."""
        self._members_thread = self._start_thread("members", self._follow)

    def leave(self, timeout: float = 10.0) -> None:
        """Dynamic group, stopping: stop following the log (waiting ``timeout`` seconds at
        most for the members thread) and announce the departure."""
        self._members_stop.set()
        if self._members_thread is not None:
            self._members_thread.join(timeout)
        try:
            membership.leave(self._store(), self._name, self._rank, self.incarnation)
        except Exception as exc:  # noqa: BLE001 - the store host may be gone already
            log.warning("%s could not announce its departure: %s", self._name, exc)

    def refresh(self) -> None:
        """Read the membership log now (a worker not known yet is named, or calls)."""
        with self._members_lock:
            self._apply_events(self.log.poll())

    def _follow(self, guard: Guard) -> None:
        """The members thread: follow the membership log until the agent stops."""
        lifecycle = self._lifecycle
        failures = 0
        while guard.ok and (lifecycle.state is RUNNING or lifecycle.state is STOPPING) \
                and not self._members_stop.wait(0.05):
            with self._members_lock:
                try:
                    events = self.log.poll()
                except Exception as exc:  # noqa: BLE001 - the store host may be gone
                    events = None
                    failures += 1
                    if failures == 1:
                        log.warning("%s cannot read the membership log: %s",
                                    self._name, exc)
                if events is not None:
                    failures = 0
                    with guard:
                        self._apply_events(events)
            if failures and self._members_stop.wait(min(1.0, 0.1 * failures)):
                return

    def _apply_events(self, events: List[Dict[str, Any]]) -> None:
        for event in events:
            rank = event["rank"]
            if event["op"] == "join":
                if rank != self._rank:
                    self.add(rank, event)
                continue
            incarnation = int(event.get("incarnation") or 0)
            lost = event.get("lost")
            if rank == self._rank:
                if lost and incarnation == self.incarnation:
                    self._was_removed(str(lost))
                continue
            with self._lock:
                if self.incarnations.get(rank, 0) != incarnation:
                    continue  # about an earlier process under this rank
                w = self.workers.pop(rank, None)
                if w is not None:
                    self.by_name.pop(w.name, None)
                    self.departed[w.name] = rank
                self.left.add(rank)
                if lost:
                    self.removed[rank] = str(lost)
                declared = rank in self._losses.declared
            name = w.name if w is not None else event["name"]
            if not lost:
                self._fail_peer(rank, WorkerLeftError(
                    f"worker {name} (rank {rank}) has shut down and left the group",
                    worker=name))
                continue
            # Declared lost by another survivor: drop what this worker has of it too.
            error = WorkerLeftError(f"worker {name} (rank {rank}) was lost and removed from "
                                    f"the group: {lost}", worker=name)
            for conn in self._connections_of(rank):  # its private ones, idle or not, too
                conn.close(error)
            self._fail_peer(rank, error)
            if not declared and w is not None:
                with self._lock:
                    self._losses.declare(rank)
                self._losses.run_loss_hooks(w, error)

    def _was_removed(self, why: str) -> None:
        """The group declared this worker lost and removed it (it was stopped or cut off
        for heartbeat_timeout, say): it is no member any more, and says so."""
        error = ThreadFailedError(f"worker {self._name} (rank {self._rank}) was declared lost "
                                  f"by the group and removed from it: {why}")
        log.error("%s", error)
        self._fail(error)
        transport = self._transport()
        for conn in transport.connections() if transport is not None else ():
            conn.close(error)

    def admit(self, rank: int, incarnation: int) -> Optional[str]:
        """Transport: None to accept a peer that proved it holds the job secret, else why
        not. Refused: a process removed from the group as lost that came back, and one
        whose rank another process holds now (looked up in the log first, in case that is
        the newer one). Others are accepted, members that left included (they may still
        be shutting down)."""
        why = self._stale(rank, incarnation)
        if why is not None and self.log is not None:
            try:
                self.refresh()
            except Exception as exc:  # noqa: BLE001 - the store host may be gone: refuse
                return f"{why} (the membership log cannot be read: {exc})"
            why = self._stale(rank, incarnation)
        return why

    def _stale(self, rank: int, incarnation: int) -> Optional[str]:
        with self._lock:
            current = self.incarnations.get(rank)
            removed = current == incarnation and rank in self.removed
        if removed:
            return (f"rank {rank} (incarnation {incarnation}) was declared lost and removed "
                    f"from the group")
        if current is not None and current != incarnation:
            return (f"rank {rank} (incarnation {incarnation}) is not a member of the group: "
                    f"another process (incarnation {current}) holds the rank now")
        return None
