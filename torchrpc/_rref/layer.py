"""The RRef layer: runs the Remote Reference Protocol on one agent.

:class:`RRefLayer` creates RRefs (``rpc.remote``), forks them into messages and adopts
the forks that arrive, serves the protocol's messages on the owner, fails the RRefs of
lost workers, and settles forks at shutdown. The book (:mod:`torchrpc._rref.book`) keeps
the protocol's state; the layer's :class:`~torchrpc._rref.control.ControlMessages` sends
the control messages the book asks for.
"""

from __future__ import annotations

import functools
import gc
import logging
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .._agent import (Agent, AsyncResult, Expect, MessageContext, WorkerInfo, error_of,
                      run_callable)
from .._wire import Kind
from ..errors import ConnectionLostError, RpcError
from .book import GloballyUniqueId, Msg, OwnerEntry, RRefBook
from .control import ControlMessages
from .rref import RREF_LAYER, RRef, _creation_error, _gid, _layer_of, _rebuild_rref

log = logging.getLogger(__name__)

_REMOTE_CALL = int(Kind.RREF_REMOTE_CALL)  # an int: an enum lookup is slow on the hot path


def _agent_rpc_async(agent: Agent, to: WorkerInfo, func: Any, args: Tuple[Any, ...],
                     timeout: float) -> torch.futures.Future:
    return agent.call(to, func, args, {}, timeout)


class RRefLayer:
    """Runs the RRef protocol on one agent: creation and forking, the owner's handlers, lost
    workers and shutdown settling; its ``control`` sends the control messages."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.book = RRefBook(agent.rank)
        self._users: "weakref.WeakValueDictionary[GloballyUniqueId, RRef]" = weakref.WeakValueDictionary()
        self._users_lock = threading.Lock()  # adding and snapshotting _users (see _stop)
        self._phase = 0
        # Control messages and the deletions owed to owners, sent from one thread.
        self.control = ControlMessages(agent, self.book, self._fork_confirmed)
        self.delete_messages = 0  # USER_DELETE messages received (not counting carried ones)
        # Futures of user forks a request waits on until the owner confirms them.
        self._confirmations: Dict[GloballyUniqueId, torch.futures.Future] = {}
        # The public rpc_async, set by the RPC layer, so calls RRefs make themselves (for
        # _get_type) are seen as user calls are (profiling).
        self.public_rpc_async: Callable[..., torch.futures.Future] = functools.partial(
            _agent_rpc_async, agent)
        # Distributed autograd's backward of an RRef's tensor, set by its engine.
        self.backward: Optional[Callable[[int, List[torch.Tensor], bool], None]] = None
        agent.extensions.install(RREF_LAYER, self)
        agent.register_handler(Kind.RREF_REMOTE_CALL, self._on_remote_call)
        agent.register_handler(Kind.RREF_FETCH, self._on_fetch)
        agent.register_handler(Kind.RREF_USER_DELETE, self._on_user_delete)
        agent.register_handler(Kind.RREF_FORK_REQUEST, self._on_fork_request)
        agent.register_handler(Kind.RREF_CHILD_ACCEPT, self._on_child_accept)
        agent.add_debug_source("rref", self._counts)
        agent.add_shutdown_hook(self._settle)
        agent.add_stop_hook(self._stop)
        agent.add_loss_hook(self._worker_lost)
        # Deleted RRefs pin their values on the owners until the deletion arrives.
        agent.add_tick_hook(self.control.tick, pending=self.control.pending)
        self.control.start()

    def _counts(self) -> Dict[str, int]:
        counts = self.book.counts()
        counts["num_delete_messages_received"] = self.delete_messages
        return counts

    # -- creating and forking ------------------------------------------------------------------

    def remote(self, dst: WorkerInfo, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any],
               timeout: float) -> RRef:
        """Start ``func`` on ``dst`` and return an RRef to its result at once."""
        agent = self.agent
        rref_id = self.book.new_id()
        if dst.id == agent.rank:
            return _remote_here(self, rref_id, func, args, kwargs, timeout)
        fork_id = self.book.new_id()
        rref = RRef._make(self, rref_id, fork_id, dst, None, confirmed=False)
        self.book.user_created(rref_id, fork_id, dst.id, confirmed=False, parent=None)
        with self._users_lock:
            self._users[fork_id] = rref
        deletes = self.control.take_deletes(dst.id)
        ref = weakref.ref(rref)
        try:
            # A to_here() usually follows: its request may read this reply with its own
            # (after=). The future may be a SyncFuture; _get_future() makes a torch one.
            rref._creation = agent.request(
                dst, _REMOTE_CALL, (func, args, kwargs, rref_id, fork_id, deletes),
                timeout, what=func, expect=Expect.FOLLOWED,
                on_done=lambda f: self._created(ref, fork_id, f, dst.id, deletes))
        except BaseException:
            self.control.return_deletes(dst.id, deletes)
            self._users.pop(fork_id, None)
            self.book.user_abandoned(fork_id)
            rref._deleted = True
            raise
        return rref

    def _created(self, ref: "weakref.ref[RRef]", fork_id: GloballyUniqueId, fut: Any,
                 owner: int, deletes: Tuple[Tuple[GloballyUniqueId, GloballyUniqueId], ...]
                 ) -> None:
        rref = ref()
        error = error_of(fut)
        if error is not None:
            if rref is not None:
                rref._record_error(_creation_error(error))
            self.control.return_deletes(owner, deletes)  # they may not have arrived
        if rref is not None:
            rref._confirmed = True
        self.control.post(self.book.user_confirmed(fork_id))

    def fork(self, rref: RRef, ctx: MessageContext) -> Tuple[Any, ...]:
        """Pickle ``rref`` for the message of ``ctx``: register the fork as the protocol
        requires."""
        ctx.per_peer = True  # the fork is this peer's: the message is for it alone
        if rref._entry is not None:  # owner -> anyone: the owner counts the fork itself
            fork_id = self.book.new_id()
            self.book.adopt(rref._entry)
            self.book.add_fork(rref._rref_id, fork_id, ctx.peer.id)
            return _rebuild_rref, (rref._rref_id, fork_id, rref._owner.id, True)
        # G2: keep the parent until the child is accepted
        fork_id = self.book.fork_child(rref, ctx.peer.id, rref._owner.id)
        if ctx.replied and ctx.peer.id == rref._owner.id:
            # To the owner, in a request that gets a reply: the reply (or the request's
            # failure) accepts the child, with no RREF_CHILD_ACCEPT message.
            ctx.when_settled(functools.partial(self._child_accepted, fork_id))
        return _rebuild_rref, (rref._rref_id, fork_id, rref._owner.id, False)

    def adopt_fork(self, rref_id: GloballyUniqueId, fork_id: GloballyUniqueId, owner: int,
                   by_owner: bool, sender: WorkerInfo, replied: bool = False) -> RRef:
        """Unpickle a fork that ``sender`` sent here (in a request that gets a reply, if
        ``replied``)."""
        agent = self.agent
        if owner == agent.rank:
            entry = self.book.owner_entry(rref_id)
            if by_owner:
                self.book.remove_fork(rref_id, fork_id)  # our own fork came back to us
            elif not replied:  # otherwise our reply accepts the child (see fork)
                self.control.post([Msg(sender.id, Kind.RREF_CHILD_ACCEPT, (fork_id,))])
            return RRef._make(self, rref_id, None, agent.worker_info, entry)
        owner_info = agent.resolve(owner)
        rref = RRef._make(self, rref_id, fork_id, owner_info, None, confirmed=by_owner)
        with self._users_lock:
            self._users[fork_id] = rref
        msgs = self.book.user_created(rref_id, fork_id, owner, confirmed=by_owner,
                                      parent=None if by_owner else sender.id)
        self.control.post(msgs)
        return rref

    def _run_into(self, entry: OwnerEntry, func: Any, args: Tuple[Any, ...],
                  kwargs: Dict[str, Any]) -> Optional[AsyncResult]:
        """Run ``func`` and store its value (or error) in ``entry``."""
        def settle(value: Any = None, error: Optional[BaseException] = None) -> None:
            if error is not None:
                entry.set_error(error)
            else:
                entry.set_value(value)
            self.book.value_settled(entry.rref_id)

        try:
            result = run_callable(func, args, kwargs, self.agent.coroutines)
        except BaseException as exc:  # noqa: BLE001 - stored on the entry
            settle(error=exc)
            raise
        if not isinstance(result, AsyncResult):
            settle(result)
            return None
        done: torch.futures.Future = torch.futures.Future()

        def finish(f: torch.futures.Future) -> None:
            try:
                value = f.wait()
            except BaseException as exc:  # noqa: BLE001
                settle(error=exc)
                done.set_exception(exc)
            else:
                settle(value)
                done.set_result(None)
        result.future.add_done_callback(finish)
        return AsyncResult(done)

    # -- handlers (owner side unless noted) ----------------------------------------------------

    def _on_remote_call(self, src: WorkerInfo, payload: Tuple[Any, ...]) -> Any:
        func, args, kwargs, rref_id, fork_id, deletes = payload
        self._remove_forks(deletes)
        if fork_id is not None:  # None: a remote() of this worker to itself, no fork
            self.book.add_fork(rref_id, fork_id, src.id)
        entry = self.book.owner_entry(rref_id)
        return self._run_into(entry, func, args, kwargs)

    def _on_fetch(self, src: WorkerInfo, payload: Tuple[Any, ...]) -> Any:
        rref_id, deletes = payload
        if deletes:
            self._remove_forks(deletes)
        entry = self.book.owner_entry(rref_id)
        if entry.has_value:  # usually: the value was made before its fetch arrived
            return entry.future.value()
        return AsyncResult(entry.future)

    def _on_user_delete(self, src: WorkerInfo, payload: Tuple[Any, ...]) -> None:
        self.delete_messages += 1
        self._remove_forks(payload)

    def _remove_forks(self, pairs: Tuple[Tuple[GloballyUniqueId, GloballyUniqueId], ...]) -> None:
        for rref_id, fork_id in pairs:
            self.book.remove_fork(rref_id, fork_id)

    def _on_fork_request(self, src: WorkerInfo, payload: Tuple[Any, ...]) -> None:
        rref_id, fork_id = payload
        self.book.add_fork(rref_id, fork_id, src.id)

    def _on_child_accept(self, src: WorkerInfo, payload: Tuple[Any, ...]) -> None:
        (fork_id,) = payload
        self._child_accepted(fork_id)

    def _child_accepted(self, fork_id: GloballyUniqueId) -> None:
        self.control.post(self.book.child_accepted(fork_id))

    # -- fork confirmations --------------------------------------------------------------------

    def _fork_confirmed(self, fork_id: GloballyUniqueId, fut: torch.futures.Future) -> None:
        try:
            fut.wait()
        except BaseException as exc:  # noqa: BLE001 - the owner is unreachable
            rref = self._users.get(fork_id)
            if rref is not None:
                rref._record_error(exc)
            log.warning("owner did not confirm RRef fork %s: %s", fork_id, exc)
        rref = self._users.get(fork_id)
        if rref is not None:
            rref._confirmed = True
        self.control.post(self.book.user_confirmed(fork_id))
        gate = self._confirmations.pop(fork_id, None)
        if gate is not None:
            gate.set_result(None)

    def confirmation(self, fork_id: GloballyUniqueId) -> torch.futures.Future:
        """A future that completes when the owner has confirmed the user fork ``fork_id``
        (or could not be reached)."""
        gate = self._confirmations.setdefault(fork_id, torch.futures.Future())
        rref = self._users.get(fork_id)
        if (rref is None or rref._confirmed) and self._confirmations.pop(fork_id, None):
            gate.set_result(None)
        return gate

    # -- lost workers --------------------------------------------------------------------------

    def _worker_lost(self, worker: WorkerInfo, error: RpcError) -> None:
        """``worker`` is gone: release the forks it held here, and make the RRefs it owned
        fail at once, naming it."""
        orphans, deletes = self.book.worker_lost(worker.id)
        self.control.post(deletes)
        self.control.drop(worker.id)
        failure = ConnectionLostError(
            f"the owner of this RRef, worker {worker.name} (rank {worker.id}), is lost, and "
            f"the value with it: {error}", worker=worker.name)
        for fork_id in orphans:
            rref = self._users.get(fork_id)
            if rref is not None:
                rref._record_error(failure)
                rref._confirmed = True
                rref._deleted = True  # nothing to tell its owner when it is collected
            gate = self._confirmations.pop(fork_id, None)
            if gate is not None:
                gate.set_result(None)
        if orphans:
            log.info("%s dropped %d RRefs owned by lost worker %s", self.agent.name,
                     len(orphans), worker.name)

    # -- shutdown ------------------------------------------------------------------------------

    def _settle(self, deadline: Optional[float]) -> None:
        """Graceful shutdown: phase 1 settles forks in flight; phase 2 (after every worker
        stopped calling) deletes all user RRefs left here."""
        self._phase += 1
        if self._phase == 1:
            gc.collect(0)  # cheap: young garbage RRefs send their deletes now; phase 2 gets the rest
        if self._phase >= 2:
            self._delete_users()
        self.control.flush(deadline)
        delay = 0.001
        while not self.book.settled():
            self.control.check_deadline(deadline, "RRef forks to be confirmed")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        self.control.flush(deadline)

    def _delete_users(self) -> None:
        """Mark every live user RRef here deleted and queue its USER_DELETE."""
        for fork_id in self.book.live_user_forks():
            rref = self._users.get(fork_id)
            if rref is not None:
                rref._deleted = True
            self.control.deferred.append(fork_id)

    def delete_all_users(self, timeout: float) -> None:
        """Release every user RRef held here and wait until the deletes are sent."""
        self._delete_users()
        self.control.flush(time.monotonic() + timeout if timeout > 0 else None)

    def _stop(self, until: float) -> None:
        self.control.stop(until)
        with self._users_lock:
            users = list(self._users.values())
        for rref in users:
            rref._deleted = True
        self.book.clear()


def _remote_here(layer: RRefLayer, rref_id: GloballyUniqueId, func: Any,
                 args: Tuple[Any, ...], kwargs: Dict[str, Any], timeout: float) -> RRef:
    """``rpc.remote()`` to this worker itself: a message all the same, as in torch. Its
    arguments are copies, and it runs with what a peer's would (the caller's distributed
    autograd context and its send/recv records, the profiler's scopes), under the call's
    deadline and the fault plan of a sent request. The RRef is the owner's, no fork."""
    agent = layer.agent
    entry = layer.book.owner_entry(rref_id)
    rref = RRef._make(layer, rref_id, None, agent.worker_info, entry)
    try:
        fut = agent.request(agent.worker_info, _REMOTE_CALL,
                            (func, args, kwargs, rref_id, None, ()), timeout, what=func)
    except BaseException as exc:  # not sent (its arguments did not pickle)
        entry.set_error(exc)
        layer.book.value_settled(rref_id)
        raise
    rref._creation = fut
    ref = weakref.ref(rref)

    def created(f: torch.futures.Future) -> None:
        # As in torch, a creation that timed out or never started marks the owner RRef,
        # whose value may still come.
        try:
            f.wait()
        except BaseException as exc:  # noqa: BLE001 - recorded on the RRef
            error = _creation_error(exc)
            if isinstance(exc, ConnectionLostError):  # never started: no value will come
                entry.set_error(error)
                layer.book.value_settled(entry.rref_id)
            held = ref()
            if held is not None:
                held._record_error(error)
    fut.add_done_callback(created)
    return rref


def install(agent: Agent) -> None:
    """Put the RRef protocol on ``agent`` (called by ``init_rpc`` for every new agent)."""
    RRefLayer(agent)


def remote(agent: Agent, dst: WorkerInfo, func: Any, args: Tuple[Any, ...],
           kwargs: Dict[str, Any], timeout: float) -> RRef:
    return _layer_of(agent).remote(dst, func, args, kwargs, timeout)


def delete_all_users(agent: Agent, timeout: float) -> None:
    _layer_of(agent).delete_all_users(timeout)


def live_users(agent: Agent) -> List[str]:
    """The user RRefs ``agent`` still holds, each as torch names it in a leak report."""
    return [f"{_gid(state.rref_id)} with fork Id {_gid(fork_id)}"
            for fork_id, state in _layer_of(agent).book.user_states()]


__all__ = ["RRefLayer", "delete_all_users", "install", "live_users", "remote"]
