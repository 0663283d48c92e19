"""Heartbeats, and the decision that a peer is lost.

Theory of operation. A worker that dies closes its sockets, so its peers read EOF and
fail its pending calls at once (``Connections.on_close``). A worker whose host died, or whose
network is cut, or that hangs, sends nothing. So a worker sends each peer a HEARTBEAT
frame when it has sent that peer nothing for heartbeat_interval, and the timer closes
every connection of a peer from which nothing at all came in for heartbeat_timeout,
which fails the calls pending on it. Liveness is per peer, not per connection: any frame
on any of its connections counts, private ones included (a callee's reply, a caller's
request), and a lost peer's private connections close with its shared ones, which ends
their readers on the callee's side and wakes a caller blocked on one.

A peer is watched once this worker knows that it sends heartbeats: it announced a
heartbeat interval at rendezvous, or a heartbeat came from it. Knowing it from
rendezvous matters: a peer kept busy sending replies never needs to send a heartbeat,
and once stopped it would hang its callers forever if it were not watched. A peer
configured without heartbeats is never timed out, so it is not mistaken for a dead one
while it runs a long call.

A broken last connection is a suspicion: a pool thread connects again, and only if that
fails is the peer lost (declared) and the loss hooks told; a cut link to a live worker
heals, and its RRefs and contexts must survive that. Silence for heartbeat_timeout is
evidence enough on its own. Graceful shutdown checks again (``Agent.check_peers``):
losses are shared through the store, and workers missing from a barrier are probed, so a
worker that died unseen by this one is found too.

Heartbeats go where the far end reads: on a shared connection, or (when none is open) on
a private one this worker opened as the caller, whose callee has a reader; never on one a
caller opened to this worker, which its caller reads only while it waits for a reply.

A silent peer on this host whose process the kernel shows running (not stopped, not a
zombie) is starved of CPU, not dead: with dozens of workers on a few cores, a worker's
heartbeat thread may not run for seconds. Such a peer is timed out only after _STARVED
times heartbeat_timeout; one that died closes its sockets anyway.
"""

from __future__ import annotations

import logging
import select
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from .. import _threads, _wire
from .._threads import Guard, StartThread
from .._transport import Connection, shm
from .._wire import Kind
from ..errors import ClosedError, ConnectionLostError, RpcError
from .._rendezvous import membership
from .lifecycle import RUNNING, Lifecycle
from .pool import WorkerPool
from .worker import WorkerInfo

if TYPE_CHECKING:
    from .connections import Connections
    from .private import PrivateConnections
    from .registry import Registry
    from .requests import Requests

log = logging.getLogger(__name__)

_STARVED = 10  # a silent peer that runs on this host gets this many heartbeat timeouts


class Liveness:
    """One agent's heartbeats and lost-peer decisions.

    Its sets and tables are guarded by the agent's lock, which also guards the agent's
    connection and membership tables they are read with.
    """

    def __init__(self, name: str, elastic: bool, interval: float, timeout: float,
                 lock: "threading.Lock", start_thread: StartThread, lifecycle: Lifecycle,
                 registry: "Registry", connections: "Connections", requests: "Requests",
                 private: "PrivateConnections", pool: WorkerPool,
                 store: Callable[[], Any], failure: Callable[[], Optional[BaseException]]
                 ) -> None:
        self._name = name
        self._elastic = elastic  # a dynamic group: a lost member is removed from it
        self._lock = lock  # the agent's: it guards the connection tables read with these
        self._start_thread = start_thread
        self._lifecycle = lifecycle
        self._registry = registry
        self._connections = connections
        self._requests = requests
        self._private = private  # the idle private connections (private.py)
        self._pool = pool
        self._store = store  # the agent's sealed store, once it has started
        self._failure = failure  # why the agent failed, if it did
        self.interval = interval  # heartbeat_interval (0: send none)
        self.timeout = timeout  # heartbeat_timeout (0: never time a peer out)
        # Told of every worker found lost (see suspect).
        self.loss_hooks: List[Callable[[WorkerInfo, RpcError], None]] = []
        self._confirming: set[int] = set()  # ranks whose loss is being confirmed
        self._silent: Dict[int, BaseException] = {}  # lost for silence: no need to confirm
        # Ranks declared lost (silent, or unreachable after a loss): never retried, and
        # told to the loss hooks once, until a connection with them is made again.
        self.declared: set[int] = set()
        self.beating: set[int] = set()  # ranks that sent a heartbeat (so may be timed out)
        # rank -> the heartbeat interval it announced at rendezvous (0: it sends none)
        self.beats_every: Dict[int, float] = {}
        self.heartbeat_timeouts = 0  # peers closed for silence (agent.num_heartbeat_timeouts)
        self._last_check = 0.0
        self._stopped = threading.Event()
        self.thread: Optional[threading.Thread] = None

    # -- the agent's calls -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the heartbeat thread, if this worker sends heartbeats."""
        if self.interval > 0:
            self.thread = self._start_thread("heartbeat", self._heartbeat_loop)

    def stop(self) -> None:
        """Tell the heartbeat thread to stop (:meth:`join` waits for it)."""
        self._stopped.set()

    def join(self, timeout: float) -> List[str]:
        """Wait ``timeout`` seconds at most for the thread to end; its name if it runs on."""
        return _threads.join([self.thread], time.monotonic() + timeout)

    def joined(self, rank: int, interval: float) -> None:
        """Under the agent's lock: a worker took ``rank`` (it beats every ``interval``
        seconds; 0: never). Whatever was lost under the rank before is not lost now."""
        self.declared.discard(rank)
        self.beats_every[rank] = interval

    def declare(self, rank: int) -> None:
        """Under the agent's lock: ``rank`` is lost for good; its calls fail, unretried."""
        self.declared.add(rank)

    def heard_beat(self, rank: int) -> None:
        """A heartbeat came from ``rank``: it sends them, so it may be timed out."""
        self.beating.add(rank)

    def reconnected(self, rank: int) -> None:
        """Under the agent's lock: a shared connection with ``rank`` opened."""
        self._silent.pop(rank, None)
        self.declared.discard(rank)

    # -- heartbeats ------------------------------------------------------------------------------

    def _connections_by_peer(self) -> Dict[int, Tuple[List[Connection], List[Connection]]]:
        """The open shared and private connections of each peer that has one (never two
        empty lists: a connection may close meanwhile, but each is tested once)."""
        out = {}
        with self._lock:
            for rank in set(self._connections.all) | set(self._connections.private):
                shared = [c for c in self._connections.all.get(rank, ()) if not c.closed]
                private = [c for c in self._connections.private.get(rank, ()) if not c.closed]
                if shared or private:
                    out[rank] = (shared, private)
        return out

    def _heartbeat_loop(self, guard: Guard) -> None:
        interval = self.interval
        envelope = _wire.encode(None)[0]
        while guard.ok and not self._stopped.wait(interval / 2):
            with guard:
                now = time.monotonic()
                for rank, (shared, private) in self._connections_by_peer().items():
                    try:
                        self._beat(rank, shared, private, now, interval, envelope)
                    except Exception as exc:  # noqa: BLE001 - the other peers still get theirs
                        guard.failed(exc)

    def _beat(self, rank: int, shared: List[Connection], private: List[Connection], now: float,
              interval: float, envelope: bytes) -> None:
        """Send peer ``rank`` a heartbeat unless it had traffic from us within ``interval``."""
        conns = shared + private
        if now - max(c.last_send for c in conns) < interval:
            return  # traffic to this peer is proof enough
        conn = self._connections.shared.get(rank)
        if conn is None or conn.closed:
            # Only where the far end reads (see the theory of operation above).
            conn = next(iter(shared or [c for c in private if c.outbound]), None)
            if conn is None:
                return
        try:
            conn.send(Kind.HEARTBEAT, _wire.FLAG_ONEWAY, 0, envelope, [])
        except RpcError:
            pass  # closed meanwhile; its reader reports why

    # -- silence ---------------------------------------------------------------------------------

    def runs_here(self, rank: int) -> bool:
        """Whether worker ``rank`` is a process of this host (same pid namespace) that the
        kernel shows alive and not stopped."""
        registry = self._registry
        proc = registry.procs.get(rank)
        if proc is None or proc[1] != registry.pidns or not proc[1] or not registry.same_host(rank):
            return False
        return shm.process_state(proc[0]) not in (None, "T", "t", "Z", "X")

    def _silence_limit(self, rank: int, timeout: float) -> Optional[float]:
        """How long peer ``rank`` may stay silent before it is lost; None if it is not
        watched (it sends no heartbeats). Three of its own heartbeat intervals at least,
        should it beat more slowly than this worker's heartbeat_timeout expects."""
        every = self.beats_every.get(rank, 0.0)
        if every <= 0 and rank not in self.beating:
            return None
        return max(timeout, 3 * every)

    def check(self, now: float) -> None:
        """Timer: lose every watched peer silent for longer than its limit."""
        timeout = self.timeout
        if timeout <= 0 or self._lifecycle.state is not RUNNING:
            return
        stalled = now - self._last_check > timeout / 2
        self._last_check = now
        if stalled:
            return  # this process did not run for a while: let its readers catch up first
        left = self._registry.left
        for rank, (shared, private) in self._connections_by_peer().items():
            if rank in left:
                continue
            limit = self._silence_limit(rank, timeout)
            if limit is None:
                continue
            conns = shared + private
            silent = now - max(c.last_recv for c in conns)
            if silent <= limit:
                continue
            # Connections with a reader of their own (a caller's private connection is
            # read only while a call waits on it, so bytes may lie there unread).
            read = shared + [c for c in private if not c.outbound]
            try:
                if read and select.select([c.sock for c in read], [], [], 0)[0]:
                    continue  # bytes are waiting: the peer spoke, our readers are behind
            except (OSError, ValueError):
                pass
            if silent <= limit * _STARVED and self.runs_here(rank):
                continue  # alive on this host: starved of CPU, not dead (see above)
            self._lose_silent(rank, conns, silent, limit)

    def _lose_silent(self, rank: int, conns: List[Connection], silent: float,
                     limit: float) -> None:
        """Peer ``rank`` said nothing for ``silent`` seconds: close all its connections and
        fail every call pending on it."""
        w = self._registry.workers.get(rank)
        name = w.name if w else f"rank{rank}"
        error = ConnectionLostError(
            f"no heartbeat from worker {name} (rank {rank}) for {silent:.1f} s "
            f"(heartbeat_timeout is {limit:g} s): it is dead, hung or unreachable",
            worker=name)
        self.heartbeat_timeouts += 1
        with self._lock:
            self._connections.note_lost(rank, str(error))
            self._silent[rank] = error
        self.suspect(rank, error)  # the loss hooks hear of it (first: see declared)
        with self._lock:
            self.declared.add(rank)  # its calls fail now, with no retry
        for conn in conns:
            conn.close(error)
        self._private.close_idle(rank, error)
        self._requests.fail_peer(rank, error)  # also those no connection carried (a failed send)

    # -- losses ----------------------------------------------------------------------------------

    def suspect(self, rank: int, reason: BaseException) -> None:
        """Peer ``rank`` lost its last connection without a GOODBYE: on the pool, try to
        connect again, and if that fails tell the loss hooks (a cut link to a live
        worker heals, and its RRefs and contexts must survive that). A peer lost for
        silence (_lose_silent) is lost without trying: heartbeat_timeout of silence is
        the evidence, and a stopped process would hold the handshake up as long again."""
        with self._lock:
            if rank in self._confirming or rank in self.declared or rank in self._registry.left \
                    or self._lifecycle.state is not RUNNING:
                return
            self._confirming.add(rank)
        try:
            self._pool.submit(self._confirm_loss, rank, reason)
        except ClosedError:  # shutting down: nothing to clean up for
            with self._lock:
                self._confirming.discard(rank)

    def _confirm_loss(self, rank: int, reason: BaseException) -> None:
        try:
            w = self._registry.workers.get(rank)
            if w is None or rank in self._registry.left or self._lifecycle.state is not RUNNING:
                return
            with self._lock:
                silent = self._silent.pop(rank, None)
                # the process that was lost
                incarnation = self._registry.incarnations.get(rank, 0)
            if silent is not None:
                error = ConnectionLostError(f"worker {w.name} (rank {rank}) was lost: {silent}",
                                            worker=w.name)
            else:
                try:
                    self._connections.to(w)
                except RpcError as exc:
                    cause = exc
                else:
                    return  # it answered: alive, the link healed
                error = ConnectionLostError(
                    f"worker {w.name} (rank {rank}) was lost: {reason}; connecting to it "
                    f"again failed: {cause}", worker=w.name)
            with self._lock:
                self.declared.add(rank)
            log.warning("%s: %s", self._name, error)
            self.run_loss_hooks(w, error)
            if self._elastic:
                self._remove_lost(w, incarnation, error)
        finally:
            with self._lock:
                self._confirming.discard(rank)

    def run_loss_hooks(self, w: WorkerInfo, error: RpcError) -> None:
        for hook in self.loss_hooks:
            try:
                hook(w, error)
            except Exception:  # noqa: BLE001 - one layer must not stop the others' cleanup
                log.exception("a loss hook of %s failed for %s", self._name, w.name)

    def _remove_lost(self, w: WorkerInfo, incarnation: int, error: RpcError) -> None:
        """Dynamic group: free the name and rank of lost member ``w`` (process
        ``incarnation``) for a new process.
        Not if this worker was removed itself: a stopped process that is continued finds
        every peer silent, and must learn of its own removal before it removes them."""
        try:
            self._registry.refresh()
        except Exception as exc:  # noqa: BLE001 - the store host may be gone
            log.warning("%s cannot read the membership log: %s", self._name, exc)
            return
        if self._failure() is not None:
            return
        try:
            if membership.remove_lost(self._store(), w.name, w.id, incarnation, str(error)):
                log.warning("%s removed lost worker %s (rank %d) from the group; "
                            "its name and rank are free", self._name, w.name, w.id)
        except Exception as exc:  # noqa: BLE001 - the store host may be gone
            log.warning("%s could not remove lost worker %s from the group: %s",
                        self._name, w.name, exc)
