"""The RRef protocol's control messages: one sender thread, and deletions batched per owner.

The book (:mod:`torchrpc._rref.book`) says which control messages to send; the
:class:`~torchrpc._rref.layer.RRefLayer` posts them here, and the sender thread sends them.
User RRefs that are garbage collected only append their ForkId to :attr:`ControlMessages.deferred`
(safe from ``__del__``); the next REMOTE_CALL or FETCH to the owner carries the deletion, or the
sender sends it at the agent timer's next tick.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .. import _threads
from .._agent import Agent
from .._agent.retry import RetryPolicy
from .._threads import Guard
from .._wire import Kind
from ..errors import RpcError
from .book import GloballyUniqueId, Msg, RRefBook

log = logging.getLogger(__name__)
# Control messages are idempotent on the receiver (sets and tombstones), so they are
# retried on connection failures, as the protocol prescribes.
_CONTROL_RETRY = RetryPolicy(max_attempts=5, initial_backoff=0.05, max_backoff=1.0)


class ControlMessages:
    """Sends an RRef layer's control messages from its sender thread, and owes deletions."""

    def __init__(self, agent: Agent, book: RRefBook,
                 on_fork_sent: Callable[[GloballyUniqueId, torch.futures.Future], None]) -> None:
        self.agent = agent
        self.book = book
        # Called with the ForkId and the request future of every RREF_FORK_REQUEST sent.
        self._on_fork_sent = on_fork_sent
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        # Deletions: user RRefs garbage collected here (ForkIds, appended by __del__) and
        # the USER_DELETE pairs they became, by owner rank, not sent yet. A REMOTE_CALL or
        # FETCH to an owner takes that owner's along; the timer's tick flushes the rest.
        self.deferred: "collections.deque[GloballyUniqueId]" = collections.deque()
        self._ready: Dict[int, List[Tuple[GloballyUniqueId, GloballyUniqueId]]] = {}
        self._del_lock = threading.Lock()
        self._guard = Guard(f"the RRef sender thread of {agent.name}", agent.fail)
        self._sender: Optional[threading.Thread] = None

    def start(self) -> None:
        """Start the sender thread."""
        self._sender = _threads.start(f"torchrpc-rref-{self.agent.name}", self._guard,
                                      self._send_loop)

    def stop(self, until: float) -> None:
        """Stop the sender thread and join it (unless this is it), waiting no later than
        ``until`` (a ``time.monotonic()``)."""
        self._queue.put(None)
        sender = self._sender
        if sender is not None and sender is not threading.current_thread():
            sender.join(max(until - time.monotonic(), 0.0))

    def post(self, msgs: List[Msg]) -> None:
        """Send ``msgs`` from the sender thread; deletions wait to travel with others."""
        if not msgs:
            return
        other = [m for m in msgs if m.kind != Kind.RREF_USER_DELETE]
        if len(other) < len(msgs):
            with self._del_lock:
                self._owe([m for m in msgs if m.kind == Kind.RREF_USER_DELETE])
        if other:
            self._queue.put(("msgs", other))

    def _owe(self, deletes: List[Msg]) -> None:
        # Under _del_lock: the USER_DELETE messages become pairs owed to their owners.
        for m in deletes:
            self._ready.setdefault(m.dst, []).extend(m.payload)

    def _collect(self) -> None:
        # Under _del_lock: turn the garbage collected forks into USER_DELETE pairs.
        deferred = self.deferred
        while deferred:
            self._owe(self.book.user_deleted(deferred.popleft()))

    def take_deletes(self, owner: int) -> Tuple[Tuple[GloballyUniqueId, GloballyUniqueId], ...]:
        """The deletions owed to ``owner``, for a request to it to carry."""
        if not self.deferred and not self._ready:
            return ()
        with self._del_lock:
            self._collect()
            return tuple(self._ready.pop(owner, ()))

    def return_deletes(self, owner: int,
                       deletes: Tuple[Tuple[GloballyUniqueId, GloballyUniqueId], ...]) -> None:
        """The request that carried ``deletes`` failed: send them again (removing a fork
        twice is harmless)."""
        if deletes:
            with self._del_lock:
                self._ready.setdefault(owner, []).extend(deletes)

    def tick(self) -> None:
        # Timer thread: deletions no request took along go out by themselves.
        if self.deferred or self._ready:
            self._queue.put(("deletes", None))

    def _send_deletes(self) -> None:
        with self._del_lock:
            self._collect()
            ready, self._ready = self._ready, {}
        for dst, pairs in ready.items():
            self._send(Msg(dst, Kind.RREF_USER_DELETE, tuple(pairs)))

    def _send_loop(self) -> None:
        q, guard = self._queue, self._guard
        while guard.ok:
            item = q.get()
            if item is None:
                return
            with guard:
                self._handle(*item)

    def _handle(self, what: str, arg: Any) -> None:
        """Sender thread: act on one item of the queue."""
        if what == "deletes":
            self._send_deletes()
        elif what == "flush":
            try:
                self._send_deletes()
            finally:
                arg.set()  # shutdown waits for it, whatever happened
        else:
            for msg in arg:
                try:
                    self._send(msg)
                except Exception as exc:  # noqa: BLE001 - the other messages still go
                    self._guard.failed(exc)

    def _send(self, msg: Msg) -> None:
        agent = self.agent
        try:
            dst = agent.resolve(msg.dst)
            fut = agent.request(dst, msg.kind, msg.payload, agent.default_timeout,
                                what=f"RRef control message {msg.kind.name}",
                                retry=_CONTROL_RETRY)
        except Exception as exc:  # noqa: BLE001 - control messages are best effort past here
            log.debug("%s to rank %d failed: %s", msg.kind.name, msg.dst, exc)
            return
        if msg.kind == Kind.RREF_FORK_REQUEST:
            fork_id = msg.payload[1]
            fut.add_done_callback(lambda f: self._on_fork_sent(fork_id, f))

    def flush(self, deadline: Optional[float]) -> None:
        """Send the deletions owed, and wait until the sender thread has done so."""
        done = threading.Event()
        self._queue.put(("flush", done))
        while not done.wait(0.05):
            self.check_deadline(deadline, "RRef control messages to be sent")

    def check_deadline(self, deadline: Optional[float], what: str) -> None:
        """Raise, while shutdown waits for ``what``, if a worker is gone or ``deadline`` passed."""
        self.agent.check_peers()
        if deadline is not None and time.monotonic() > deadline:
            raise RpcError(f"shutdown timed out waiting for {what}: {self.book.counts()}")

    def drop(self, owner: int) -> None:
        """Forget the deletions owed to ``owner``, a lost worker: nobody can receive them."""
        with self._del_lock:
            self._ready.pop(owner, None)

    def pending(self) -> bool:
        """Whether deletions wait to be sent (they pin values on their owners until then)."""
        return bool(self.deferred or self._ready)
