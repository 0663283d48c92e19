"""CUDA IPC: how a CUDA tensor travels to a worker on this host without a host copy.

Theory of operation. The encoder asks a message's context how its CUDA tensors travel
(``MessageContext.cuda_share``, the one place the way is chosen): to a peer on this host
that sees the same GPUs (:func:`ipc_possible`), through CUDA IPC; to any other, as bytes
(``_wire.pickler``). Through CUDA IPC:

1. The sender (:meth:`Shares.share`) copies the tensor, on its current stream, into a
   *snapshot* of its own (RPC has copy semantics: the caller may change its tensor as soon
   as ``rpc_async`` returns, on the same stream, after the snapshot), and shares the
   snapshot's storage through torch's IPC handle (what ``torch.multiprocessing`` uses),
   with an interprocess event recorded on that stream after the copy. The message carries
   the handle, the event's handle, a share id and the tensor's metadata, and the
   snapshot stays in the sender's table of shares (:class:`ShareTable`) until the
   receiver says it has copied it.
2. The receiver (:func:`_receive`, a global the envelope names) opens the handle, makes
   its current stream wait on the event (no host wait), copies the data device-to-device
   into a tensor of its own on the mapped device, on that stream, records an event after
   the copy and notes the share in its table of receipts (:class:`Receipts`). A request's
   callee then runs on the same thread and stream, after the copy, with no wait on the
   host; a reply is waited for on the host until its copy is done (only that copy), since
   the caller's stream is not known where the reply is read.
3. Once a receipt's event has completed (:meth:`Receipts.completed`, on the timer), the
   receiver lets go of the opened storage and tells the sender, in one ``CUDA_RELEASE``
   message per sender, which shares it has copied; the sender drops them from its table
   and the snapshot's memory returns to its allocator.
4. A receiver that is lost never says so: the sender drops every share it holds for it
   (:meth:`ShareTable.peer_lost`), as it does all of them at shutdown. torch's own
   reference count of a shared block is given back by the sender as soon as it shares
   (the sender's table alone keeps the snapshot alive), so no block waits forever in
   torch's limbo for a consumer that died.

Everything but the few CUDA calls (:class:`CudaCalls`) is bookkeeping tested on the CPU
with fake calls; ``tests/rpc/test_cuda.py`` runs the real thing on a GPU.

Across hosts (planned, not built): a CUDA tensor to a worker of another host travels as
the bytes of its CPU copy, made on the encoding thread. The plan, as TensorPipe does it:
per peer and device a few pinned host chunks; the sender copies chunk *i* of the tensor
into a pinned chunk on a side stream that waited for the current stream, while the
transport sends chunk *i-1*; the receiver receives into pinned chunks and copies each to
the device on a side stream as it arrives, and the callee's stream waits for the last
copy's event. It needs the transport to send an out-of-band buffer that is produced in
pieces (and to receive one into pieces), which it cannot yet; the encoder's
``reduce_mapped`` is where it would be chosen, with a rebuild tag of its own.
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import (Any, Callable, Dict, List, NamedTuple, Optional, Protocol, Sequence,
                    Tuple)

import torch

from .._wire import Kind, register_rebuilder
from .hooks import CUDA_IPC
from .worker import WorkerInfo

log = logging.getLogger(__name__)

RELEASE_TIMEOUT = 30.0  # seconds for a CUDA_RELEASE message to reach the sender

Share = Callable[[torch.Tensor, str], Tuple[Any, Tuple[Any, ...]]]
"""What the encoder calls with a CUDA tensor and the device it lands on: the global and
arguments that rebuild it on the receiver."""


def ipc_possible(same_host: bool, mine: Any, theirs: Any) -> bool:
    """Whether CUDA tensors may travel to a peer through CUDA IPC: it runs on this host
    (same machine and namespaces) and published the same visible GPUs (``mine`` and
    ``theirs``: the ``gpus`` fact of each, ``devices.facts``; a missing one never
    matches). Two workers that see the same GPUs number them alike, so a device index in
    a share means the same GPU to both."""
    return same_host and mine is not None and theirs is not None and mine == theirs


class ShareInfo(NamedTuple):
    """The wire representation of one shared tensor: what its receiver needs to open,
    wait for and copy it. Plain values only (bytes, ints, a dtype, tuples)."""

    share_id: int
    device: int  # the sender's CUDA device index of the snapshot
    handle: bytes  # the IPC handle of the snapshot's memory block
    size_bytes: int  # of the snapshot's storage
    offset_bytes: int  # of the storage in its memory block
    ref_counter: bytes  # torch's reference-count file and slot of the block
    ref_counter_offset: int
    event: bytes  # the IPC handle of the event recorded after the snapshot
    dtype: torch.dtype
    shape: Tuple[int, ...]


KEEP = 3  # where a receipt keeps what it opened (see Receipts.pending)


class CudaCalls:
    """The CUDA calls of IPC, in one place (the rest is bookkeeping). Tests replace them."""

    def __init__(self) -> None:
        self._idle: Dict[int, Any] = {}  # device -> a stream with no work (let_go)

    def snapshot(self, t: torch.Tensor) -> Tuple[torch.Tensor, Tuple[Any, ...], Any]:
        """A contiguous copy of ``t`` made on the current stream, its storage's IPC share
        (torch's ``_share_cuda_`` tuple) and an interprocess event recorded after the copy."""
        snap = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        snap.copy_(t.detach())  # contiguous, with a conjugate or negative view resolved
        info = snap.untyped_storage()._share_cuda_()
        # The table alone keeps the snapshot alive: give torch's count back at once (see
        # the module docs).
        torch.UntypedStorage._release_ipc_counter_cuda(info[4], info[5])
        event = torch.cuda.Event(interprocess=True)
        event.record(torch.cuda.current_stream(snap.device))
        return snap, info, event

    def event_handle(self, event: Any) -> bytes:
        return event.ipc_handle()

    def open_copy(self, info: ShareInfo, target: torch.device) -> Tuple[torch.Tensor, Any, Any]:
        """Open ``info``'s memory, make the current stream of ``target`` wait on its event,
        copy it into a new tensor on ``target`` there; (the copy, what must live until the
        copy is done, an event recorded after it)."""
        source = torch.device("cuda", info.device)
        storage = torch.UntypedStorage._new_shared_cuda(
            info.device, info.handle, info.size_bytes, info.offset_bytes, info.ref_counter,
            info.ref_counter_offset, info.event, False)
        stream = torch.cuda.current_stream(target)
        stream.wait_event(torch.cuda.Event.from_ipc_handle(source, info.event))
        src = torch.empty((0,), dtype=info.dtype, device=source).set_(storage, 0, info.shape)
        with torch.cuda.stream(stream):
            out = torch.empty(info.shape, dtype=info.dtype, device=target)
            out.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return out, (storage, src), done

    def done(self, event: Any) -> bool:
        return bool(event.query())

    def wait(self, event: Any) -> None:
        event.synchronize()  # this copy only: not the device, not the stream

    def let_go(self, receipt: List[Any], device: int) -> None:
        """Drop what a receipt opened (its last reference, ``receipt[KEEP]``), its copy
        being done. torch's deleter of an opened storage synchronizes the current stream
        of its device: make that an idle one."""
        stream = self._idle.get(device)
        if stream is None:
            stream = self._idle.setdefault(device, torch.cuda.Stream(device))
        with torch.cuda.stream(stream):
            receipt[KEEP] = None


class ShareTable:
    """The sender's side: the snapshots shared with each peer, kept until the peer says it
    has copied them, or is lost. Thread-safe; each share is dropped once."""

    def __init__(self, calls: CudaCalls) -> None:
        self._calls = calls
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        # share id -> (peer rank, the snapshot and the event that must outlive the copy)
        self.outstanding: Dict[int, Tuple[int, Any]] = {}
        self.released = 0  # shares dropped, by acknowledgement or loss

    def share(self, peer: int, t: torch.Tensor) -> ShareInfo:
        """Share a snapshot of CUDA tensor ``t`` with worker ``peer``."""
        snap, info, event = self._calls.snapshot(t)
        with self._lock:
            share_id = next(self._ids)
            self.outstanding[share_id] = (peer, (snap, event))
        return ShareInfo(share_id, int(info[0]), info[1], int(info[2]), int(info[3]), info[4],
                         int(info[5]), self._calls.event_handle(event), t.dtype, tuple(t.shape))

    def acknowledged(self, peer: int, share_ids: Sequence[int]) -> int:
        """Worker ``peer`` has copied ``share_ids``: drop them; how many were ours to drop
        (an id of another peer's share, or one dropped already, is ignored)."""
        dropped = []
        with self._lock:
            for share_id in share_ids:
                entry = self.outstanding.get(share_id)
                if entry is not None and entry[0] == peer:
                    dropped.append(self.outstanding.pop(share_id))
            self.released += len(dropped)
        return len(dropped)

    def peer_lost(self, peer: int) -> int:
        """Worker ``peer`` is gone: drop every share it held; how many."""
        with self._lock:
            ids = [i for i, (rank, _) in self.outstanding.items() if rank == peer]
            for share_id in ids:
                del self.outstanding[share_id]
            self.released += len(ids)
        return len(ids)

    def clear(self) -> int:
        """Drop every share (the agent stops); how many."""
        with self._lock:
            n = len(self.outstanding)
            self.outstanding.clear()
            self.released += n
        return n

    def held_for(self, peer: int) -> int:
        """How many shares worker ``peer`` has not acknowledged."""
        with self._lock:
            return sum(1 for rank, _ in self.outstanding.values() if rank == peer)


class Receipts:
    """The receiver's side: copies of shares in flight, until their events complete.
    Thread-safe."""

    def __init__(self, calls: CudaCalls) -> None:
        self._calls = calls
        self._lock = threading.Lock()
        # [sender rank, share id, event after the copy, what lives until then (KEEP), device]
        self.pending: List[List[Any]] = []

    def receive(self, sender: int, info: ShareInfo, target: torch.device,
                reply: bool) -> torch.Tensor:
        """The tensor of share ``info`` from ``sender``, copied onto ``target``. A reply's
        copy is waited for here (see the module docs)."""
        out, keep, done = self._calls.open_copy(info, target)
        if reply:
            self._calls.wait(done)
        with self._lock:
            self.pending.append([sender, info.share_id, done, keep, info.device])
        return out

    def completed(self) -> Dict[int, List[int]]:
        """Let go of the copies that are done; the ids of their shares by sender."""
        with self._lock:
            if not self.pending:
                return {}
            done = [p for p in self.pending if self._calls.done(p[2])]
            if not done:
                return {}
            finished = {id(p) for p in done}
            self.pending = [p for p in self.pending if id(p) not in finished]
        out: Dict[int, List[int]] = {}
        for receipt in done:
            self._calls.let_go(receipt, receipt[4])
            out.setdefault(receipt[0], []).append(receipt[1])
        return out


class Hosts(Protocol):
    """What CUDA IPC reads of the registry (registry.py): who shares this host and GPUs."""

    gpus: Dict[int, Optional[str]]

    def same_host(self, rank: int) -> bool: ...

    @property
    def worker_info(self) -> WorkerInfo: ...


class CudaIpc:
    """CUDA IPC on one agent: its shares, its receipts, and the messages between them.
    ``release(rank, share_ids)`` sends worker ``rank`` a ``CUDA_RELEASE``."""

    def __init__(self, name: str, hosts: Hosts,
                 release: Callable[[int, Tuple[int, ...]], None],
                 calls: Optional[CudaCalls] = None) -> None:
        self._name = name
        self._hosts = hosts
        self._release = release
        calls = calls or CudaCalls()
        self.shares = ShareTable(calls)
        self.receipts = Receipts(calls)
        self.acks_sent = 0

    def sharing(self, peer: WorkerInfo) -> Optional[Share]:
        """How CUDA tensors to ``peer`` are shared (what the encoder calls with each tensor
        and the device it lands on, see ``_wire.pickler``), or None where they travel as
        bytes."""
        hosts = self._hosts
        me = hosts.worker_info.id
        if peer.id == me or not ipc_possible(hosts.same_host(peer.id), hosts.gpus.get(me),
                                             hosts.gpus.get(peer.id)):
            return None
        share = self.shares.share
        return lambda t, target: (_receive, (share(peer.id, t), target))

    def on_release(self, src: WorkerInfo, share_ids: Any) -> None:
        """``CUDA_RELEASE`` from ``src``: it has copied ``share_ids``."""
        if not isinstance(share_ids, tuple) or not all(type(i) is int for i in share_ids):
            raise ValueError(f"malformed CUDA_RELEASE from {src.name}: {share_ids!r}")
        self.shares.acknowledged(src.id, share_ids)

    def tick(self) -> None:
        """On the timer: acknowledge the copies that are done, one message per sender."""
        for sender, ids in self.receipts.completed().items():
            self.acknowledge(sender, ids)

    def acknowledge(self, sender: int, share_ids: List[int]) -> None:
        """Tell worker ``sender`` that its ``share_ids`` are copied."""
        try:
            self._release(sender, tuple(share_ids))
            self.acks_sent += 1
        except Exception as exc:  # noqa: BLE001 - the sender drops them when it loses us
            log.info("%s could not tell worker %s it copied %d CUDA shares: %s",
                     self._name, sender, len(share_ids), exc)

    def lost(self, worker: WorkerInfo, error: Any) -> None:
        dropped = self.shares.peer_lost(worker.id)
        if dropped:
            log.info("%s dropped %d CUDA IPC shares held for lost worker %s",
                     self._name, dropped, worker.name)

    def debug_info(self) -> Dict[str, Any]:
        return {"cuda_ipc_shares_held": len(self.shares.outstanding),
                "cuda_ipc_shares_released": self.shares.released,
                "cuda_ipc_copies_pending": len(self.receipts.pending)}


def _receive(info: ShareInfo, target: str, context: Any = None) -> torch.Tensor:
    """The tensor of CUDA IPC share ``info``, copied onto ``target`` (the one global a
    shared tensor's envelope names; decode binds its ``context``)."""
    if type(info) is not ShareInfo or context is None:
        raise ValueError("a CUDA IPC share arrived outside an RPC message between workers")
    device = torch.device(target)
    ipc = context.agent.extensions.get(CUDA_IPC)
    if device.type != "cuda" or ipc is None:
        raise ValueError(f"malformed CUDA IPC share: target {target!r}")
    if not _fits(info):
        raise ValueError(f"malformed CUDA IPC share: {info.size_bytes} bytes for "
                         f"{info.dtype} of shape {info.shape}")
    return ipc.receipts.receive(context.peer.id, info, device, context.kind == Kind.RESPONSE)


def _fits(info: ShareInfo) -> bool:
    """Whether the share's storage holds a contiguous tensor of its dtype and shape."""
    n = 1
    for d in info.shape:
        if type(d) is not int or d < 0:
            return False
        n *= d
    return (isinstance(info.dtype, torch.dtype) and info.size_bytes >= 0
            and n * info.dtype.itemsize <= info.size_bytes)


register_rebuilder(_receive)


def install(agent: Any, calls: Optional[CudaCalls] = None) -> CudaIpc:
    """Put CUDA IPC on ``agent`` (called by ``init_rpc``): the release messages, the loss
    and stop hooks, and, where CUDA is available, the timer's acknowledgements."""
    def release(rank: int, share_ids: Tuple[int, ...]) -> None:
        agent.request(agent.resolve(rank), Kind.CUDA_RELEASE, share_ids, RELEASE_TIMEOUT,
                      what="CUDA IPC release", oneway=True)

    ipc = agent.extensions.install(CUDA_IPC, CudaIpc(agent.name, agent.registry, release,
                                                     calls))
    agent.register_handler(Kind.CUDA_RELEASE, ipc.on_release)
    agent.add_loss_hook(ipc.lost)
    agent.add_stop_hook(lambda until: ipc.shares.clear())
    agent.add_debug_source("cuda_ipc", ipc.debug_info)
    if calls is not None or torch.cuda.is_available():
        agent.add_tick_hook(ipc.tick, lambda: bool(ipc.receipts.pending))
    return ipc
